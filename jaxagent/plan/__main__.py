"""`python -m jaxagent.plan --config=configs/<name>.py[:variant] --topology=v5p:4x4x4 [--config.key=value ...]`.

Compiles every program of the run for the topology (TPU topologies through libtpu, on any
machine; `--topology=local` for this machine's devices) and prints memory per chip, estimated
times and collectives per program, the verdict and the knobs to turn. Exit status 1 when the run
does not fit. `--json=PATH` also writes the report as JSON.
"""
import json
import logging
import os
import pathlib
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (`path.py[:variant]`).")
_TOPOLOGY = flags.DEFINE_string(
    "topology", "local", "TPU topology ('v5e:4x4', 'v5p:4x4x4', 'v6e:4x4', 'v4:2x2x1', ...) or "
    "'local' for this machine's devices.")
_ROWS = flags.DEFINE_integer("rows", None, "Update-batch rows (default: one trajectory per row).")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", None,
                                   "Longest prompt to prefill (default: the cache length - 1).")
_APPEND_LEN = flags.DEFINE_integer("append_len", 256, "Tokens appended into a slot at once.")
_PROGRAMS = flags.DEFINE_list("programs", [], "Only these program kinds (update, sft, score, "
                              "prefill, insert, generate, append).")
_JSON = flags.DEFINE_string("json", None, "Also write the report as JSON to this path.")


def main(argv):
  del argv
  logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config=configs/quickstart.py")
  import jax
  if _TOPOLOGY.value not in ("", "local") and not os.environ.get("JAX_PLATFORMS"):
    # Compiling for a described topology needs no local accelerator: keep JAX on the CPU so it
    # does not also open (and lock) this machine's TPU, if it has one.
    jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_threefry_partitionable", True)
  from jaxagent import plan
  options = plan.PlanOptions(rows=_ROWS.value, prompt_len=_PROMPT_LEN.value,
                             append_len=_APPEND_LEN.value, programs=tuple(_PROGRAMS.value))
  report = plan.plan_run(_CONFIG.value, _TOPOLOGY.value, options=options)
  print(report.render())
  if _JSON.value:
    pathlib.Path(_JSON.value).write_text(json.dumps(report.to_dict(), indent=2, default=str))
  if report.fits is False:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
