"""`python -m jaxagent.evaluate`: a checkpoint's (or a config's model's) held-out eval without
training."""
import dataclasses
import json
import pathlib
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

from configs.quickstart import get_config
from jaxagent import evaluate

REPO = pathlib.Path(__file__).resolve().parent.parent


def _cli(*args, timeout=300):
  return subprocess.run([sys.executable, "-m", "jaxagent.evaluate", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, said", [
    ((), "pass either --workdir"),
    (("--workdir=x", "--config=configs/quickstart.py:tiny"), "pass either --workdir"),
    (("--config=configs/quickstart.py:tiny", "--step=3"), "--step and --set go with --workdir"),
])
def test_flags_that_do_not_go_together_are_named(args, said):
  r = _cli(*args)
  assert r.returncode != 0 and said in r.stderr, r.stderr[-2000:]


def test_importing_it_beside_the_other_entry_points_defines_no_flag_twice():
  # Defined at import, its --config / --workdir / --step / --out clashed with launch's and
  # export's in one process (a test worker that imported them all failed every launch test).
  r = subprocess.run([sys.executable, "-c", "import jaxagent.evaluate, jaxagent.launch, "
                      "jaxagent.export"], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]


def test_a_workdir_without_checkpoints_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match=f"no checkpoints at {tmp_path}"):
    evaluate.evaluate_checkpoint(str(tmp_path))


def test_the_config_is_made_to_evaluate_only(tmp_path):
  c = get_config("tiny")
  c.checkpoint_every, c.sft.steps, c.train.off_policy_steps = 5, 8, 1
  out = evaluate._for_evaluation(c, tmp_path / "out", size=0, pass_k=4)
  assert out.workdir == str(tmp_path / "out") and out.checkpoint_every == 0
  assert out.sft.steps == 0 and out.train.off_policy_steps == 0 and not out.log.tensorboard
  assert out.eval.size >= 2**31 - 1 and out.eval.pass_k == 4  # --size=0: the whole split
  with pytest.raises(ValueError, match="--size=-1 must be >= 0"):
    evaluate._for_evaluation(c, tmp_path, size=-1, pass_k=None)


def test_a_config_s_lora_adapter_is_the_one_evaluated(tmp_path, monkeypatch):
  """--config with lora.init_from: the evaluation cleared it (meant for a checkpoint, which
  holds the adapter), so a fresh adapter (B = 0: the base model) was evaluated instead."""
  import jaxagent.trainer
  built = []

  class Built(Exception):
    pass

  def trainer(config, **kw):
    assert kw == {"eval_only": True}  # no optimizer state
    built.append(config)
    raise Built
  monkeypatch.setattr(jaxagent.trainer, "Trainer", trainer)
  c = get_config("tiny")
  c.lora.rank, c.lora.init_from = 4, str(tmp_path / "adapter")
  with pytest.raises(Built):
    evaluate.evaluate_config(c, out=str(tmp_path / "out"))
  assert built[0].lora.init_from == str(tmp_path / "adapter")
  assert built[0].checkpoint_every == 0 and built[0].sft.steps == 0


def test_an_eval_size_of_0_fails_before_the_model_loads(tmp_path, monkeypatch):
  """A run whose eval.size is 0, evaluated without --size, failed only after its model loaded
  (the trainer was built first, for nothing)."""
  import jaxagent.trainer

  def trainer(config, **kw):
    raise AssertionError("the trainer was built")
  monkeypatch.setattr(jaxagent.trainer, "Trainer", trainer)
  c = get_config("tiny")
  c.eval.size = 0
  with pytest.raises(ValueError, match=r"eval.size is 0 in the run's config: pass --size=N"):
    evaluate.evaluate_config(c, out=str(tmp_path / "out"))
  assert evaluate._for_evaluation(c, tmp_path, size=3, pass_k=None).eval.size == 3


def test_an_eval_only_trainer_holds_no_optimizer_state_and_evaluates_the_same(tmp_path):
  """The evaluation built a whole trainer: its Adam moments (twice the params, float32) were
  allocated and never read."""
  from jaxagent.trainer import Trainer
  c = get_config("tiny")
  c.workdir, c.log.tensorboard, c.eval.size, c.eval.pass_k = str(tmp_path / "run"), False, 2, 1
  metrics = {}
  for eval_only in (False, True):
    before = {id(x) for x in jax.live_arrays()}
    trainer = Trainer(c, eval_only=eval_only)
    try:
      owned = sum(x.nbytes for x in jax.live_arrays() if id(x) not in before)
      params = sum(x.nbytes for x in jax.tree.leaves(trainer.state.params))
      metrics[eval_only] = {k: v for k, v in trainer.evaluate(phase="initial").items()
                            if not k.endswith("_s") and "compile" not in k}
      if eval_only:
        assert trainer.state.opt_state is None
        # Its arrays: the params (and small ones of the engines), not 3x the params.
        assert owned < 2 * params, (owned, params)
        for call in (trainer.run, trainer.warm_start, lambda: trainer.rl_step(1),
                     trainer.save_checkpoint, trainer.restore):
          with pytest.raises(RuntimeError, match="eval_only=True"):
            call()
      else:
        assert owned >= 3 * params, (owned, params)  # params and Adam's two moments
    finally:
      trainer.close()
  assert metrics[True] == metrics[False]


def test_a_checkpoint_is_restored_into_shapes_without_reading_the_weights_at_model_path(
    tmp_path, monkeypatch):
  """`--workdir` loaded the weights at model.path and then restored the checkpoint's over them:
  the params were held twice for a moment. Now the trainer holds their shapes only: the
  checkpoint evaluates with model.path's weights gone (its config.json and tokenizer stay)."""
  from jaxagent import models
  from jaxagent.trainer import Trainer, load_model
  c = get_config("tiny")
  cfg, params, _ = load_model(c.model)
  hf = models.save_hf(tmp_path / "hf", cfg, params)
  c.model.path = str(hf)
  c.workdir, c.checkpoint_every, c.log.tensorboard, c.eval.size = (
      str(tmp_path / "run"), 1, False, 2)
  trainer = Trainer(c)
  try:
    trained = jax.tree.map(lambda x: x * 1.5 if x.ndim == 2 else x, trainer.state.params)
    trainer.state = dataclasses.replace(trainer.state, params=trained)
    trainer.warm_started, trainer.step = True, 3
    trainer.save_checkpoint(wait=True)
    saved_cfg = trainer.cfg
  finally:
    trainer.close()
  (hf / "model.safetensors").unlink()
  seen = {}

  def run(trainer, out_dir, source):
    seen.update(params=trainer.state.params, cfg=trainer.cfg, opt=trainer.state.opt_state)
    return source
  monkeypatch.setattr(evaluate, "_run", run)
  assert evaluate.evaluate_checkpoint(str(tmp_path / "run"))["step"] == 3
  assert seen["cfg"] == saved_cfg and seen["opt"] is None
  assert jax.tree.all(jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()),
                                   seen["params"], trained))
  # The trainer that restores: shapes until then, and an evaluate before it is refused.
  shapes = Trainer(c, eval_only=True, architecture=saved_cfg)
  try:
    leaves = jax.tree.leaves(shapes.state.params)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None
                          for x in leaves)
    assert [(x.shape, x.dtype) for x in leaves] == [
        (x.shape, x.dtype) for x in jax.tree.leaves(trained)]
    with pytest.raises(RuntimeError, match="restore a checkpoint's params into trainer.state"):
      shapes.evaluate()
  finally:
    shapes.close()
  with pytest.raises(ValueError, match="pass eval_only=True"):
    Trainer(c, architecture=saved_cfg)
  c.lora.rank = 4  # a LoRA run's base is read from model.path
  with pytest.raises(ValueError, match="is for full params"):
    Trainer(c, eval_only=True, architecture=saved_cfg)


def test_set_changes_existing_keys_and_names_a_typo():
  c = ml_collections.ConfigDict({"mesh": {"data": 8}, "rollout": {"temperature": 1.0,
                                                                  "mesh": "learner"}})
  evaluate._apply_settings(c, ["mesh.data=1", "rollout.temperature=0.6", "rollout.mesh=own"])
  assert (c.mesh.data, c.rollout.temperature, c.rollout.mesh) == (1, 0.6, "own")
  with pytest.raises(ValueError, match=r"no key rollout.temprature \(did you mean "
                     r"rollout.temperature\?\)"):
    evaluate._apply_settings(c, ["rollout.temprature=0.6"])
  with pytest.raises(ValueError, match="expected KEY=VALUE"):
    evaluate._apply_settings(c, ["mesh.data"])


def test_set_refuses_what_the_evaluation_sets_itself_and_keeps_text_settings_text():
  """A `--set` of the workdir pointed the eval's writes at the run's own files (its samples
  overwritten); of the size, it was overwritten by --size's default. A text setting whose
  value reads as a number stays text."""
  c = get_config("tiny")
  for item, said in [("workdir=/runs/mine", "sets workdir itself.*use --out"),
                     ("checkpoint_every=1", "sets checkpoint_every itself"),
                     ("eval.size=8", "use --size"), ("log.tensorboard=True", "itself")]:
    with pytest.raises(ValueError, match=said):
      evaluate._apply_settings(c, [item])
  evaluate._apply_settings(c, ["model.path=2024", "rollout.temperature=0.5"])
  assert c.model.path == "2024" and c.rollout.temperature == 0.5


def test_the_default_out_is_never_inside_the_checkpoint_directory(tmp_path):
  run = tmp_path / "run"
  (run / "checkpoints" / "3").mkdir(parents=True)
  root, _ = evaluate._checkpoints(str(run))
  assert evaluate._default_out(str(run), root, 3) == run / "evals" / "step_3"
  # The checkpoint directory given directly: its run's evals/, not a folder among its steps.
  root, _ = evaluate._checkpoints(str(run / "checkpoints"))
  assert evaluate._default_out(str(run / "checkpoints"), root, 3) == run / "evals" / "step_3"
  other = tmp_path / "ckpts"
  (other / "5").mkdir(parents=True)
  root, _ = evaluate._checkpoints(str(other))
  with pytest.raises(ValueError, match="is a checkpoint directory.*pass --out"):
    evaluate._default_out(str(other), root, 5)
  with pytest.raises(ValueError, match="bucket URL"):
    evaluate._default_out("gs://b/run", root, 5)


@pytest.mark.slow  # two tiny trainers and three evals, about 40 s on 2 cores
def test_a_checkpoint_evaluates_as_the_run_evaluated_it(tmp_path):
  """The greedy eval samples of `evaluate_checkpoint` equal those the run's own eval took with
  the same params, and differ from the initial model's: the checkpoint's params are the ones
  evaluated, under the run's config, eval split and seed."""
  from jaxagent.trainer import Trainer
  c = get_config("tiny")
  c.workdir, c.checkpoint_every, c.log.tensorboard, c.eval.before = (
      str(tmp_path / "run"), 1, False, False)
  trainer = Trainer(c)
  try:
    initial = trainer.evaluate(phase="initial")
    # Params unlike the initial ones, which a fresh trainer loads again.
    trainer.state = dataclasses.replace(trainer.state, params=jax.tree.map(
        lambda x: x * 1.5 if x.ndim == 2 else x, trainer.state.params))
    trainer.warm_started, trainer.step = True, 3
    trainer.save_checkpoint(wait=True)
    own = trainer.evaluate()
  finally:
    trainer.close()
  rec = evaluate.evaluate_checkpoint(str(tmp_path / "run"))
  assert rec["step"] == 3 and rec["checkpoint"] == str(tmp_path / "run" / "checkpoints" / "3")
  assert rec["eval/pass@1"] == own["eval/pass@1"]
  assert rec["eval/num_examples"] == own["eval/num_examples"] == initial["eval/num_examples"]
  run, ev = tmp_path / "run" / "samples", tmp_path / "run" / "evals" / "step_3" / "samples"
  assert (ev / "eval_step_000003.jsonl").read_text() == (run / "eval_step_000003.jsonl").read_text()
  assert (run / "eval_step_000003.jsonl").read_text() != (run / "eval_initial.jsonl").read_text()
  saved = json.loads((tmp_path / "run" / "evals" / "step_3" / "eval.json").read_text())
  assert saved == json.loads(json.dumps(rec))
  # The run's own files are untouched: no metrics of the evaluation in its metrics.jsonl.
  assert not (tmp_path / "run" / "metrics.jsonl").exists() or all(
      json.loads(line).get("step") != 3
      for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
  # The CLI prints the same record as one JSON line.
  r = _cli(f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'cli'}", "--size=4")
  assert r.returncode == 0, r.stderr[-3000:]
  printed = json.loads(r.stdout.strip().splitlines()[-1])
  assert printed["step"] == 3 and printed["eval/num_examples"] == 4
