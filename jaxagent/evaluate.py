"""`python -m jaxagent.evaluate --workdir=runs/quickstart [--step=N] [--size=N] [--pass_k=K]`
or `python -m jaxagent.evaluate --config=configs/<name>.py[:variant] [--config.key=value ...]`.

Evaluates a policy on its task's held-out split without training, as the run's own evals do
(`Trainer.evaluate`): greedy pass@1 with its standard error, pass@k sampled at the run's rollout
temperature when `--pass_k` > 1, per task for a mixture (`eval/task/<label>/pass@1`), and the
error counts. The metrics are printed as one JSON line and written to `<out>/eval.json`; the
first `log.dump_count` greedy trajectories go to `<out>/samples/` with their rewards and
successes.

  * `--workdir`: a run's checkpoint (the newest that reads, or `--step`) under the run config
    saved in it: its policy (a LoRA run's adapter over its base, loaded from `model.path` as the
    run loaded it), its task, its eval split and seed. `--out` defaults to
    `<workdir>/evals/step_<N>` (given a checkpoint directory `<workdir>/checkpoints` itself,
    the same; another checkpoint directory needs `--out`). `--set` changes a setting of that
    config, but not those the evaluation sets itself (the workdir: `--out`; the eval's size
    and k: `--size`, `--pass_k`; checkpoints, the warm start, TensorBoard).
  * `--config`: the config's model as it loads (the baseline of a base model, or an exported
    one: `model.path` an HF directory), no checkpoint. `--out` defaults to
    `<config workdir>/evals/initial`.

Nothing is written to the run's own files (metrics, checkpoints, samples). The trainer it
builds holds no optimizer state (`Trainer(config, eval_only=True)`): the policy's params and the
rollout engines only. With `--workdir`, a full-params checkpoint's weights are restored into
the shapes of its model config (`Trainer(..., architecture=...)`), without reading the
weights at `model.path` first (its tokenizer is read).
"""
import dataclasses
import json
import logging
import os
import pathlib

from absl import app, flags

from jaxagent import config_files

class _Flags:
  """The command line's flags, defined only when this module runs as `python -m
  jaxagent.evaluate`: defined at import, they clashed with those of `jaxagent.launch` and
  `jaxagent.export` (`--config`, `--workdir`, `--step`, `--out`) in a process that imports
  those too (absl's DuplicateFlagError)."""

  def __init__(self):
    self.workdir = flags.DEFINE_string(
        "workdir", None, "A run's workdir (holding checkpoints/) or its checkpoint directory.")
    self.step = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest that "
                                     "reads).")
    self.out = flags.DEFINE_string("out", None, "Output directory (default: "
                                   "<workdir>/evals/step_<N>, or <config workdir>/evals/initial "
                                   "with --config).")
    self.size = flags.DEFINE_integer("size", None, "Held-out examples to evaluate (default: the "
                                     "run's eval.size; 0 for the whole eval split).")
    self.pass_k = flags.DEFINE_integer("pass_k", None, "k > 1 also samples k per example for "
                                       "pass@k (default: the run's eval.pass_k).")
    self.set = flags.DEFINE_multi_string(
        "set", [], "KEY=VALUE: a setting of the checkpoint's run config to change for the "
        "evaluation (with --workdir), e.g. --set=mesh.data=1 --set=rollout.temperature=0.6; "
        "VALUE is read as a Python literal, else as text.")
    self.config = config_files.define_config_flag(
        "Run config file (`path.py[:variant]`) to evaluate its model as loaded, instead of a "
        "--workdir's checkpoint.")


_FLAGS: _Flags | None = None


def parse_flags(argv: list[str]) -> list[str]:
  return config_files.parse_config_flags(argv, _FLAGS.config)


def _for_evaluation(config, out: pathlib.Path, size: int | None, pass_k: int | None):
  """`config` made to evaluate into `out`: no checkpoints, warm start, rollouts ahead or
  TensorBoard; the eval's size and k as asked. A LoRA config's `lora.init_from` stays: the
  adapter that `--config` evaluates over its base (`evaluate_checkpoint` clears it)."""
  config.workdir = str(out)
  config.checkpoint_every = 0
  if "checkpoint_dir" in config:
    config.checkpoint_dir = ""
  config.sft.steps = 0
  if "data" in config.sft:
    config.sft.data = ""
  if "off_policy_steps" in config.train:
    config.train.off_policy_steps = 0
  config.log.tensorboard = False
  config.eval.before = False
  if size is not None:
    if size < 0:
      raise ValueError(f"--size={size} must be >= 0 (0: the whole eval split)")
    config.eval.size = size or 2**31 - 1  # the trainer takes the split's first eval.size
  elif not config.eval.get("size"):
    # Checked before the model loads (a trainer built for nothing to evaluate loaded it first).
    raise ValueError("nothing to evaluate: eval.size is 0 in the run's config: pass --size=N "
                     "(N held-out examples; 0 for the whole eval split)")
  if pass_k is not None:
    if pass_k < 0:
      raise ValueError(f"--pass_k={pass_k} must be >= 0")
    config.eval.pass_k = pass_k
  return config


# Settings the evaluation makes itself (`_for_evaluation`, `--out`, `--size`, `--pass_k`): a
# `--set` of one would undo it (`--set=workdir=<the run's>` wrote the eval's samples over the
# run's own) or be overwritten.
_OWN_SETTINGS = {
    "workdir": "--out", "checkpoint_every": None, "checkpoint_dir": None, "sft.steps": None,
    "sft.data": None, "lora.init_from": None, "train.off_policy_steps": None,
    "log.tensorboard": None, "eval.before": None, "eval.size": "--size", "eval.pass_k": "--pass_k"}


def _apply_settings(config, settings) -> None:
  """`KEY=VALUE` overrides of existing keys of `config` (dotted paths). VALUE is read as a
  Python literal, else (and for a text setting, always) as text."""
  import ast
  for item in settings:
    key, eq, text = item.partition("=")
    if not eq or not key:
      raise ValueError(f"--set={item!r}: expected KEY=VALUE, e.g. --set=mesh.data=1")
    if key in _OWN_SETTINGS:
      flag = _OWN_SETTINGS[key]
      raise ValueError(f"--set={item!r}: the evaluation sets {key} itself (it trains, "
                       "checkpoints and logs nothing, and writes into --out)"
                       + (f"; use {flag}" if flag else ""))
    *path, last = key.split(".")
    node = config
    for part in path:
      if not (hasattr(node, "keys") and part in node.keys()):
        node = None
        break
      node = node[part]
    if node is None or not (hasattr(node, "keys") and last in node.keys()):
      from jaxagent.run_config import KNOWN_CONFIG_KEYS
      raise ValueError(f"--set={item!r}: the run config has no key "
                       f"{config_files.did_you_mean(key, KNOWN_CONFIG_KEYS)}")
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = text
    if isinstance(node[last], str) and not isinstance(value, str):
      value = text  # a path or name that reads as a number (--set=model.path=2024)
    try:
      node[last] = value
    except (TypeError, ValueError) as e:  # ConfigDict keeps a field's type
      raise ValueError(f"--set={item!r}: {e}") from None


def _checkpoints(workdir: str):
  from jaxagent import checkpoint
  root = checkpoint.checkpoint_root(workdir)
  return root, checkpoint.CheckpointManager(root, read_only=True)


def _default_out(workdir: str, root, step: int) -> pathlib.Path:
  """`<run workdir>/evals/step_<step>`; `root` is the checkpoint directory found in `workdir`
  (`_checkpoints`). Never inside the checkpoint directory, whose folders are the run's."""
  if "://" in workdir:
    raise ValueError(f"--workdir={workdir} is a bucket URL: pass --out=<a local directory>")
  run = pathlib.Path(workdir).expanduser()
  if pathlib.Path(str(root)) == pathlib.Path(os.path.abspath(run)):  # a checkpoint dir given
    if run.name != "checkpoints":
      raise ValueError(f"--workdir={workdir} is a checkpoint directory, not a run's workdir: "
                       "pass --out=<a directory for the eval's files>")
    run = run.parent
  return run / "evals" / f"step_{step}"


def evaluate_checkpoint(workdir: str, *, step: int | None = None, out: str | None = None,
                        size: int | None = None, pass_k: int | None = None,
                        settings: tuple[str, ...] = ()) -> dict:
  """The eval metrics of a run's checkpoint (see the module docstring); also written to
  `<out>/eval.json`. `settings`: `KEY=VALUE` changes to the run config (`--set`)."""
  import ml_collections

  from jaxagent import checkpoint
  from jaxagent.models import lora as lora_lib
  from jaxagent.trainer import Trainer
  root, mgr = _checkpoints(workdir)
  steps = mgr.steps()
  if not steps:
    raise checkpoint.CheckpointError(f"no complete checkpoint in {root}")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise checkpoint.CheckpointError(f"no checkpoint for step {step} in {root}; available: "
                                     f"{steps}")
  meta = mgr.read_meta(step)
  mgr.check(meta, step=step)
  path = mgr.step_path(step)
  if not isinstance(meta.get("config"), dict):
    raise checkpoint.CheckpointError(f"checkpoint {path} holds no run config")
  out_dir = (pathlib.Path(out).expanduser() if out is not None
             else _default_out(workdir, root, step))
  config = _for_evaluation(ml_collections.ConfigDict(meta["config"]), out_dir, size, pass_k)
  if "init_from" in config.get("lora", {}):
    config.lora.init_from = ""  # the checkpoint holds the adapter
  _apply_settings(config, settings)
  # Full params: the trainer holds their shapes only (the weights at model.path are not read),
  # and the checkpoint's are restored into them, so the params are never held twice. A LoRA
  # run's base is read from model.path, as the run read it; a checkpoint written without its
  # model config loads model.path as before.
  architecture = None
  if lora_lib.from_config(config.get("lora")) is None and isinstance(
      meta.get("model_config"), dict):
    try:
      architecture = checkpoint.model_config_from_meta(meta)
    except (KeyError, TypeError, ValueError) as e:
      raise checkpoint.IncompatibleCheckpointError(
          f"checkpoint {path} holds a model config this jaxagent cannot read "
          f"({type(e).__name__}: {e}); evaluate it with the jaxagent version that wrote it"
          ) from e
  trainer = Trainer(config, eval_only=True, architecture=architecture)
  try:
    checkpoint.check_model_config(meta, trainer.cfg, path)
    if trainer._base_digest is not None:
      checkpoint.check_lora_base(meta, trainer._base_digest, path)
    target = checkpoint.params_target(trainer.state.params, trainer.mesh)
    mgr.check(meta, step=step, items={"params": target})
    params = mgr.restore_params(step, target)
    checkpoint.check_finite(params, f"not evaluating checkpoint {path}")
    trainer.state = dataclasses.replace(trainer.state, params=params)
    trainer.step = step
    return _run(trainer, out_dir, {"checkpoint": str(path), "step": step})
  finally:
    trainer.close()


def evaluate_config(config, *, out: str | None = None, size: int | None = None,
                    pass_k: int | None = None) -> dict:
  """The eval metrics of `config`'s model as it loads (no checkpoint)."""
  from jaxagent.trainer import Trainer
  out_dir = (pathlib.Path(out).expanduser() if out is not None
             else pathlib.Path(os.path.expanduser(config.workdir)) / "evals" / "initial")
  trainer = Trainer(_for_evaluation(config, out_dir, size, pass_k), eval_only=True)
  try:
    return _run(trainer, out_dir, {"model": config.model.path})
  finally:
    trainer.close()


def _run(trainer, out_dir: pathlib.Path, source: dict) -> dict:
  import jax
  if not trainer.eval_examples:
    raise ValueError("nothing to evaluate: the task's eval split is empty")
  metrics = trainer.evaluate(tag="eval", phase=(f"step_{trainer.step:06d}" if "step" in source
                                                else "initial"))
  record = {**source, "env": trainer.config.env.name, **metrics}
  if jax.process_index() == 0:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
  return record


def main(argv):
  del argv
  f = _FLAGS
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
  logging.getLogger("absl").setLevel(logging.WARNING)
  if (f.workdir.value is None) == (f.config.value is None):
    raise SystemExit("bad flags: pass either --workdir=<a run's workdir> (its checkpoint) or "
                     "--config=<config file> (its model as it loads)")
  if f.config.value is not None and (f.step.value is not None or f.set.value):
    raise SystemExit("bad flags: --step and --set go with --workdir; with --config, change "
                     "settings as --config.KEY=VALUE")
  from jaxagent.runtime import init_runtime
  init_runtime()
  from jaxagent.checkpoint import CheckpointError
  try:
    if f.workdir.value is not None:
      record = evaluate_checkpoint(os.path.expanduser(f.workdir.value), step=f.step.value,
                                   out=f.out.value, size=f.size.value, pass_k=f.pass_k.value,
                                   settings=tuple(f.set.value))
    else:
      record = evaluate_config(f.config.value, out=f.out.value, size=f.size.value,
                               pass_k=f.pass_k.value)
  except (CheckpointError, FileNotFoundError, ValueError) as e:
    raise SystemExit(f"evaluate failed: {e}") from None
  print(json.dumps(record, sort_keys=True), flush=True)


if __name__ == "__main__":
  _FLAGS = _Flags()
  app.run(main, flags_parser=parse_flags)
