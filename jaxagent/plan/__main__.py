"""`python -m jaxagent.plan --config=configs/<name>.py[:variant] --topology=v5p:4x4x4 [--config.key=value ...]`.

Compiles every program of the run for the topology (TPU topologies through libtpu, on any
machine; `--topology=local` for this machine's devices) and prints memory per chip, estimated
times and collectives per program, the verdict and the knobs to turn. Exit status 1 when the run
does not fit, when a program it uses fails to compile, or on bad input (an unknown topology, a
mesh that does not divide the devices, a misspelt config key: one line saying which).
`--json=PATH` also writes the report as JSON.
"""
import json
import logging
import os
import pathlib
import sys

from absl import app, flags

from jaxagent import config_files

_CONFIG = config_files.define_config_flag("Run config file (`path.py[:variant]`).")
_TOPOLOGY = flags.DEFINE_string(
    "topology", "local", "TPU topology ('v5e:4x4', 'v5p:4x4x4', 'v6e:4x4', 'v4:2x2x1', "
    "'tpu7x:2x2x1', ...), a Cloud TPU accelerator type ('v5litepod-16', 'v5p-8', 'v6e-8', 'v4-8') "
    "or 'local' for this machine's devices.")
_ROWS = flags.DEFINE_integer("rows", None, "Update-batch rows (default: one trajectory per row).")
_PROMPT_LEN = flags.DEFINE_integer(
    "prompt_len", None, "Longest prompt to prefill (default: rollout.max_prompt_tokens, else "
    "the cache length - 1).")
_APPEND_LEN = flags.DEFINE_integer("append_len", 256, "Tokens appended into a slot at once.")
_PROGRAMS = flags.DEFINE_list("programs", [], "Only these program kinds (update, sft, score, "
                              "prefill, insert, generate, append).")
_JSON = flags.DEFINE_string("json", None, "Also write the report as JSON to this path.")


def main(argv):
  del argv
  logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
  # Bad input is one line and exit status 1 (absl's UsageError would print every flag's help).
  if _CONFIG.value is None:
    raise SystemExit("bad plan input: --config is required, e.g. --config=configs/quickstart.py")
  import jax
  if _TOPOLOGY.value not in ("", "local") and not os.environ.get("JAX_PLATFORMS"):
    # Compiling for a described topology needs no local accelerator: keep JAX on the CPU so it
    # does not also open (and lock) this machine's TPU, if it has one.
    jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_threefry_partitionable", True)
  from jaxagent import plan
  try:
    options = plan.PlanOptions(rows=_ROWS.value, prompt_len=_PROMPT_LEN.value,
                               append_len=_APPEND_LEN.value, programs=tuple(_PROGRAMS.value))
  except ValueError as e:
    raise SystemExit(f"bad plan input: {e}") from None
  from jaxagent.trainer import check_config
  try:
    # What the launcher refuses before its fit check (a misspelt key in the config file, which
    # the plan would otherwise ignore and plan the defaults), the plan refuses too.
    check_config(_CONFIG.value)
  except FileNotFoundError:
    pass  # a data file (sft.data) the plan does not read: it may exist only where the run does
  except ValueError as e:
    raise SystemExit(f"bad plan input: {e}") from None
  try:
    report = plan.plan_run(_CONFIG.value, _TOPOLOGY.value, options=options)
  except (ValueError, FileNotFoundError) as e:  # a bad setting, topology or model path
    raise SystemExit(f"bad plan input: {e}") from None
  except AttributeError as e:
    if not (e.args and isinstance(e.args[0], KeyError)):
      raise
    # A config file without a key the run reads (ConfigDict raises AttributeError(KeyError)).
    key = e.args[0].args[0] if e.args[0].args else e.args[0]
    raise SystemExit(f"bad plan input: the config has no key {key}, which the run reads; "
                     "configs/quickstart.py sets every key a run reads") from None
  except RuntimeError as e:
    if plan.has_libtpu():
      raise
    raise SystemExit(str(e)) from None  # a TPU topology without libtpu: how to install it
  print(report.render())
  if _JSON.value:
    try:
      pathlib.Path(_JSON.value).write_text(json.dumps(report.to_dict(), indent=2, default=str))
    except OSError as e:
      raise SystemExit(f"could not write --json={_JSON.value}: {e}") from None
  failed = [p.name for p in report.programs if p.used and p.error and not p.oom]
  if report.fits is False or failed:
    sys.exit(1)


def _parse_flags(argv: list[str]) -> list[str]:
  return config_files.parse_config_flags(argv, _CONFIG)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
