"""The main job end to end on a tiny config: golden first-step metrics and clear config errors.

If a change is meant to alter the tiny run's numbers (a new seed derivation, a different loss
default), rerun `python -m pytest tests/trainer_test.py -k golden -s`, check that the printed
metrics make sense, and paste them into GOLDEN.
"""
import json
import pathlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.quickstart import get_config
from jaxagent import run_config
from jaxagent.rl import step as step_lib
from jaxagent.trainer import Trainer, sft_items_from_chat_jsonl

# First RL step of `configs/quickstart.py:tiny` with the overrides in `_tiny`.
GOLDEN = {
    "reward/mean": 0.0,
    "rollout/num_trajectories": 8.0,
    "rollout/policy_tokens": 12.0,
    "pack/efficiency": 0.654296875,
    "train/loss": -0.0952531024813652,
    "train/grad_norm": 0.00416631530970335,
    "train/num_policy_tokens": 96.0,
}


def _tiny(tmp_path, **overrides):
  c = get_config("tiny")
  c.workdir = str(tmp_path / "run")
  c.total_steps = 1
  c.eval.before = False
  c.sft.steps = 0
  c.log.tensorboard = False
  # A random tiny model earns no reward, so advantages are zero: keep those groups, and give
  # the update a gradient through the entropy bonus so the golden covers the whole step.
  c.train.zero_variance = "keep"
  c.loss.entropy_coef = 0.01
  for k, v in overrides.items():
    obj = c
    *path, last = k.split(".")
    for p in path:
      obj = obj[p]
    obj[last] = v
  return c


def test_golden_first_step_metrics(tmp_path):
  trainer = Trainer(_tiny(tmp_path))
  try:
    summary = trainer.run()
  finally:
    trainer.close()
  rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  first = next(r for r in rows if r["step"] == 1 and "reward/mean" in r)
  print({k: first.get(k) for k in GOLDEN})
  for key, want in GOLDEN.items():
    assert key in first, f"metric {key} missing from metrics.jsonl"
    if want is not None:
      np.testing.assert_allclose(first[key], want, rtol=2e-3, atol=1e-6, err_msg=(
          f"{key} changed: if intended, update GOLDEN in tests/trainer_test.py (see docstring)"))
  assert np.isfinite(first["train/loss"]) and first["train/num_policy_tokens"] > 0
  assert "pass@1/after_rl" in summary
  assert (tmp_path / "run" / "curves.png").exists()
  assert list((tmp_path / "run" / "samples").glob("step_*.txt"))
  # The final eval's greedy samples, with their rewards and successes (the RL dumps hold
  # training samples only: which eval problems ran, and what the model answered, was unseen).
  evals = [json.loads(l) for l in (tmp_path / "run" / "samples" / "eval_step_000001.jsonl").open()]
  assert len(evals) == min(trainer.config.log.dump_count, len(trainer.eval_examples))
  assert [r["example_id"] for r in evals] == [ex.id for ex in trainer.eval_examples[:len(evals)]]
  assert all(r["success"] is False and r["reward"] == 0.0 for r in evals)  # a random model
  assert [r["gold"] for r in evals] == [ex.gold for ex in trainer.eval_examples[:len(evals)]]
  gold = json.dumps(trainer.eval_examples[0].gold)
  assert f"gold={gold} success=no reward=0" in (
      tmp_path / "run" / "samples" / "eval_step_000001.txt").read_text()
  # The RL dumps name each trajectory's gold too.
  rl = [json.loads(l) for l in (tmp_path / "run" / "samples" / "step_000001.jsonl").open()]
  by_id = {ex.id: ex.gold for ex in trainer.train_examples}
  assert rl and all(r["gold"] == by_id[r["example_id"]] for r in rl)
  # The first RL step compiles the update among others, and says so by program name.
  comp = [json.loads(l) for l in (tmp_path / "run" / "compiles.jsonl").read_text().splitlines()]
  rl = next(r for r in comp if r["phase"] == "rl" and r["step"] == 1)
  assert rl["count"] == first["compile/count"] == sum(p["count"] for p in rl["programs"].values())
  assert any("train_step" in name for name in rl["programs"]), rl["programs"]


def test_unknown_env_and_bad_loss_settings_are_named(tmp_path):
  with pytest.raises(ValueError, match="unknown env 'nope'"):
    Trainer(_tiny(tmp_path, **{"env.name": "nope"}))
  with pytest.raises(ValueError, match="algo"):
    Trainer(_tiny(tmp_path, **{"loss.algo": "ppo2"}))
  with pytest.raises(ValueError, match="learning_rate"):
    Trainer(_tiny(tmp_path, **{"optimizer.lr": -1.0}))


def test_config_keys_are_checked_against_the_quickstart():
  import pathlib
  from jaxagent.config_files import load_config_module
  from jaxagent.trainer import KNOWN_CONFIG_KEYS, check_config, config_keys
  # The quickstart sets every key a run reads, so the two lists cannot drift apart.
  assert set(config_keys(get_config())) == KNOWN_CONFIG_KEYS
  configs = pathlib.Path(__file__).resolve().parent.parent / "configs"
  for path in sorted(configs.glob("*.py")):
    check_config(load_config_module(path).get_config(None))


@pytest.mark.parametrize("key,value,match", [
    ("checkpoint_evry", 1, r"unknown config key\(s\): checkpoint_evry \(did you mean checkpoint_every\?\)"),
    ("train.time_limit", 5, r"train.time_limit \(did you mean train.time_limit_s\?\)"),
    ("train.prompts_per_step", 0, "train.prompts_per_step must be an int >= 1, got 0"),
    ("train.samples_per_prompt", 0, "train.samples_per_prompt must be an int >= 1"),
    ("train.samples_per_prompt", 1, "samples_per_prompt=1 gives every group one member"),
    ("train.epochs", 0, "train.epochs must be an int >= 1"),
    ("train.mini_batches", 0, "train.mini_batches must be an int >= 1, got 0"),
    ("train.mini_batches", None, "train.mini_batches must be an int >= 1, got None"),
    ("total_steps", -1, "total_steps must be an int >= 0"),
    ("seed", -1, "seed must be an int >= 0, got -1"),
    ("rollout.slots", 0, "rollout.slots must be an int >= 1"),
    ("optimizer.lr", float("nan"), "learning_rate must be a finite number > 0"),
    ("sft.lr", float("nan"), "learning_rate must be a finite number > 0"),
    ("optimizer.max_grad_norm", -1.0, "max_grad_norm must be a finite number >= 0"),
    # Read only after the first step's rollouts: they used to fail after the warm start.
    ("train.advantage", "ppo", r"train.advantage must be one of \('grpo', 'dr_grpo', 'rloo'\), got 'ppo'"),
    ("train.zero_variance", "skip", r"train.zero_variance must be one of \('keep', 'drop'\)"),
    # Set to None (not left out): accepted, then a TypeError or an unnamed ValueError at the
    # first eval or RL step, after the warm start.
    ("train.zero_variance", None, r"train.zero_variance must be one of \('keep', 'drop'\), got None"),
    ("eval.pass_k", None, "eval.pass_k must be an int >= 0, got None"),
    ("train.prompts_per_step", None, "train.prompts_per_step must be an int >= 1, got None"),
    ("train.max_sampling_rounds", 0, "train.max_sampling_rounds must be an int >= 1, got 0"),
    # Negative counts were taken as slices or ranges: eval.size=-1 evaluated all but the last
    # example; sft.steps=-1 crashed with an IndexError after the evals before RL.
    ("eval.size", -1, "eval.size must be an int >= 0, got -1"),
    ("eval.every", -2, "eval.every must be an int >= 0"),
    ("eval.pass_k", -1, "eval.pass_k must be an int >= 0"),
    ("sft.steps", -1, "sft.steps must be an int >= 0, got -1"),
    ("sft.batch_size", 0, "sft.batch_size must be an int >= 1, got 0"),
    ("sft.num_examples", -1, "sft.num_examples must be an int >= 0"),
    ("log.dump_every", -1, "log.dump_every must be an int >= 0"),
    ("log.dump_count", -1, "log.dump_count must be an int >= 0"),
    ("lora.rank", -4, "lora.rank must be an int >= 1, got -4"),
    ("lora.alpha", 0.0, "lora.alpha must be a finite number > 0"),
    ("lora.targets", "qkv", "unknown LoRA target 'qkv'"),
    ("lora.init_from", "/nonexistent/adapter", "lora.init_from='/nonexistent/adapter' starts the "
     "run from a LoRA adapter, but lora.rank=0 trains every weight"),
])
def test_bad_or_misspelt_settings_fail_before_any_work(tmp_path, key, value, match):
  c = _tiny(tmp_path)
  with c.unlocked():
    obj = c
    *path, last = key.split(".")
    for part in path:
      obj = obj[part]
    obj[last] = value
  with pytest.raises(ValueError, match=match):
    Trainer(c)
  assert not (tmp_path / "run").exists()  # nothing was started or written


@pytest.mark.parametrize("seed", [0, 1, 7, 2**32 - 1, 2**40 + 3])
def test_eval_seed_is_no_rollout_seed_and_fits_the_sampler(seed):
  # At seed 0 the pass@k eval took seed + 1, the seed of step 1's rollouts: both drew the same
  # noise for the same request ids. Seeds of 2**32 - 1 and above ended a run at its first eval.
  from jaxagent.trainer import _eval_seed, _rollout_seed, check_config
  e = _eval_seed(seed)
  assert 0 <= e < 2**32
  assert e not in {_rollout_seed(seed, step) for step in range(100_000)}
  c = get_config()
  with c.unlocked():
    c.seed = seed
  check_config(c)  # any non-negative seed is accepted


@pytest.mark.parametrize("key,value,match", [
    ("checkpoint_keep", 0, "checkpoint_keep must be an int >= 1, got 0"),
    ("checkpoint_keep_every", -2, "checkpoint_keep_every must be an int >= 0"),
    ("rollout.max_turns", 0, "RolloutConfig.max_turns must be an int >= 1"),
    ("rollout.tool_timeout_s", -1.0, "RolloutConfig.tool_timeout_s"),
    ("rollout.top_p", 2.0, r"SamplingConfig.top_p must be in \(0, 1\]"),
    ("rollout.top_k", -1, "SamplingConfig.top_k must be >= 0"),
    ("rollout.max_len", 0, "EngineConfig.max_len must be an int > 1, got 0"),
    ("rollout.temperature", 0.0, r"rollout.temperature=0.0, rollout.top_k=0 samples greedily"),
    ("rollout.top_k", 1, r"rollout.temperature=1.0, rollout.top_k=1 samples greedily"),
    ("rollout.mesh", "foo", r"rollout.mesh must be one of \('learner', 'data'\), got 'foo'"),
    ("train.time_limit_s", -5.0, r"train.time_limit_s must be a number of seconds >= 0"),
    ("train.row_rounding", "x", "PackingConfig.row_rounding='x' is not supported"),
    # PackingConfig's own error named PackingConfig.row_buckets, which no config key sets.
    ("train.row_rounding", "buckets", r"train.row_rounding='buckets' needs a list of row "
                                      r"counts, which the run config does not take: use "
                                      r"'multiple' or 'pow2'"),
    ("train.len_buckets", (64,), "must end with train.pack_len=128"),
    # `--config.checkpoint_dir=None` is the string "None": checkpoints went to ./None.
    ("checkpoint_dir", "None", r"checkpoint_dir='None' is the text 'None', not a directory: "
                               r"set --config.checkpoint_dir='' for <workdir>/checkpoints"),
    ("checkpoint_dir", "null", r"checkpoint_dir='null' is the text 'null'"),
    # The run wrote to ./None; Python None made ./None, then raised a TypeError traceback.
    ("workdir", "None", r"workdir='None' is not a directory: the run writes its metrics"),
    ("workdir", None, r"workdir=None is not a directory"),
    # The losses and optimizers were built only in `Trainer`: after the fit check.
    ("optimizer.b1", 1.5, r"config section optimizer: b1 must be a finite number in \[0, 1\)"),
    ("optimizer.warmup_steps", -1, "config section optimizer: warmup_steps must be an int >= 0"),
    ("sft.lr", -1.0, r"config section sft \(lr, warmup_steps; optimizer.max_grad_norm\): "
                     "learning_rate must be a finite number > 0"),
    ("loss.clip_low", -0.2, r"LossConfig.clip_low=-0.2 must be in \[0, 1\)"),
    ("loss.kl_coef", -1.0, "LossConfig.kl_coef=-1.0 must be finite and >= 0"),
    # (`_tiny` keeps zero-variance groups) Dynamic sampling trained on informative groups only,
    # and the run said nothing of the "keep" it did not do.
    ("train.dynamic_sampling", True, r"train.dynamic_sampling=True trains only on groups whose "
                                     r"rewards differ .* train.zero_variance='keep' would not keep"),
])
def test_settings_read_after_the_model_loads_are_checked_before_it(tmp_path, monkeypatch, key,
                                                                   value, match):
  # They were checked only once the model was loaded (minutes for a large one) and, through
  # `python -m jaxagent.launch`, after the fit check had compiled every program.
  from jaxagent import trainer as trainer_lib
  c = _tiny(tmp_path)
  obj = c
  *path, last = key.split(".")
  for part in path:
    obj = obj[part]
  obj[last] = value
  with pytest.raises(ValueError, match=match):
    trainer_lib.check_config(c)  # what the launcher runs before the fit check
  monkeypatch.setattr(trainer_lib, "load_model", lambda m, **_: pytest.fail("the model was loaded"))
  with pytest.raises(ValueError, match=match):
    Trainer(c)


def test_a_warm_start_on_no_demonstrations_is_named_before_any_work(tmp_path, monkeypatch):
  """sft.num_examples=0 with sft.steps > 0 failed in the warm start, after the eval before
  training, with "task 'quickstart' gave no demonstrations" (it has 16)."""
  from jaxagent import trainer as trainer_lib
  c = _tiny(tmp_path, **{"sft.steps": 2, "sft.num_examples": 0})
  match = r"sft.num_examples=0 leaves the SFT warm start \(sft.steps=2\) no demonstrations"
  with pytest.raises(ValueError, match=match):
    trainer_lib.check_config(c)
  monkeypatch.setattr(trainer_lib, "load_model", lambda m, **_: pytest.fail("the model was loaded"))
  with pytest.raises(ValueError, match=match):
    Trainer(c)
  # Without a warm start, or warm-starting on a chat JSONL file, it is not read.
  trainer_lib.check_config(_tiny(tmp_path, **{"sft.steps": 0, "sft.num_examples": 0}))
  data = tmp_path / "sft.jsonl"
  data.write_text("")
  trainer_lib.check_config(_tiny(tmp_path, **{"sft.steps": 2, "sft.num_examples": 0,
                                              "sft.data": str(data)}))


@pytest.mark.parametrize("section, key", [("eval", "pass_k"), ("rollout", "traj_tool_timeout_s"),
                                          ("model", "remat"), (None, "seed")])
def test_a_config_without_a_key_the_run_reads_is_named_before_any_work(tmp_path, monkeypatch,
                                                                       section, key):
  """A config file without a key that the run reads as an attribute failed with an
  AttributeError traceback from wherever it was first read: eval.pass_k at the first eval."""
  from jaxagent import trainer as trainer_lib
  c = _tiny(tmp_path)
  del (c[section] if section else c)[key]
  dotted = f"{section}.{key}" if section else key
  match = (rf"the config has no key '{key}'" + (rf" \({dotted}\)" if section else "")
           + ", which a run reads")
  with pytest.raises(ValueError, match=match):
    trainer_lib.check_config(c)
  monkeypatch.setattr(trainer_lib, "load_model", lambda m, **_: pytest.fail("the model was loaded"))
  with pytest.raises(ValueError, match=match):
    Trainer(c)
  del c["model"]
  with pytest.raises(ValueError, match="the config names no model: set model.path"):
    trainer_lib.check_config(c)


@pytest.mark.slow  # a whole tiny run: about a minute on a loaded 2-core CPU
def test_a_config_without_the_optional_keys_runs(tmp_path):
  """Every key of OPTIONAL_CONFIG_KEYS is read with a default: a config without any of them
  trains (an RL step and its eval). (model.tokenizer stays: the random tiny-llama preset takes
  its vocabulary; a model directory or .gguf file brings its own.)"""
  from jaxagent.trainer import KNOWN_CONFIG_KEYS, OPTIONAL_CONFIG_KEYS
  assert OPTIONAL_CONFIG_KEYS < KNOWN_CONFIG_KEYS
  c = _tiny(tmp_path, **{"eval.size": 1})
  for k in OPTIONAL_CONFIG_KEYS - {"model.tokenizer"}:
    section, _, name = k.rpartition(".")
    del (c[section] if section else c)[name]
  t = Trainer(c)
  try:
    summary = t.run()
  finally:
    t.close()
  assert "pass@1/after_rl" in summary and (tmp_path / "run" / "metrics.jsonl").exists()


def test_close_closes_every_part_when_one_of_them_fails(tmp_path):
  # A checkpoint manager that raised on close (a full disk, a lost bucket) left the samplers'
  # tool threads and the metrics file open.
  trainer = Trainer(_tiny(tmp_path, checkpoint_every=1))
  assert trainer.ckpt is not None
  closed, real_ckpt_close = [], trainer.ckpt.close

  def failing_close():
    real_ckpt_close()
    raise OSError("the checkpoint directory is gone")

  trainer.ckpt.close = failing_close
  for name in ("sampler", "greedy"):
    part = getattr(trainer, name)
    part.close = (lambda name=name, close=part.close: (closed.append(name), close()))
  with pytest.raises(OSError, match="the checkpoint directory is gone"):
    trainer.close()
  assert closed == ["sampler", "greedy"] and trainer.writer._jsonl is None


def test_a_mesh_that_does_not_fit_the_devices_fails_before_the_model_loads(tmp_path,
                                                                           monkeypatch):
  from jaxagent import trainer as trainer_lib
  monkeypatch.setattr(trainer_lib, "load_model", lambda m, **_: pytest.fail("the model was loaded"))
  with pytest.raises(ValueError, match="not divisible"):
    Trainer(_tiny(tmp_path, **{"mesh.data": 3}))


def test_a_warmup_the_run_never_finishes_is_warned_once(tmp_path, monkeypatch, caplog):
  """A constant-schedule warmup of at least the run's updates (total_steps x train.epochs; the
  warm start's sft.steps) never reaches the configured learning rate; it passed silently."""
  from jaxagent import trainer as trainer_lib
  monkeypatch.setattr(run_config, "_CONFIG_WARNINGS", set())
  c = _tiny(tmp_path, **{"total_steps": 4, "train.epochs": 2, "optimizer.warmup_steps": 10,
                         "sft.steps": 3, "sft.warmup_steps": 3})
  with caplog.at_level("WARNING", logger="jaxagent.trainer"):
    trainer_lib.check_config(c)
    trainer_lib.check_config(c)  # the launcher's check, then the trainer's: one warning each
  said = [r.getMessage() for r in caplog.records if r.name == "jaxagent.trainer"]
  assert said == [
      "optimizer.warmup_steps=10 is not shorter than the run's total_steps=4 x train.epochs=2 "
      "RL updates: the learning rate never reaches optimizer.lr (the last update runs at 0.7 "
      "of it); lower optimizer.warmup_steps below 8 if the full rate is meant",
      "sft.warmup_steps=3 is not shorter than the run's sft.steps=3 warm-start updates: the "
      "learning rate never reaches sft.lr (the last update runs at 0.667 of it); lower "
      "sft.warmup_steps below 3 if the full rate is meant"]
  # The rate the message says: update 7 (the last of 8) of a 10-step warmup.
  opt = step_lib.make_optimizer(1.0, warmup_steps=10, max_grad_norm=None)
  state = opt.init({"w": jnp.zeros(())})
  lrs = []
  for _ in range(8):
    upd, state = opt.update({"w": jnp.ones(())}, state, {"w": jnp.zeros(())})
    lrs.append(-float(upd["w"]))  # Adam moves a constant gradient of 1 by the rate itself
  assert lrs == pytest.approx([i / 10 for i in range(8)], abs=1e-4)
  # Warmups shorter than the updates, and runs without one, say nothing.
  caplog.clear()
  with caplog.at_level("WARNING", logger="jaxagent.trainer"):
    trainer_lib.check_config(_tiny(tmp_path, **{"total_steps": 4, "train.epochs": 2,
                                                "optimizer.warmup_steps": 7, "sft.steps": 3,
                                                "sft.warmup_steps": 2}))
    trainer_lib.check_config(_tiny(tmp_path, **{"total_steps": 0, "optimizer.warmup_steps": 5,
                                                "sft.steps": 0, "sft.warmup_steps": 5}))
  assert not [r for r in caplog.records if r.name == "jaxagent.trainer"]


def test_loss_settings_that_do_nothing_or_look_swapped_are_warned_once(tmp_path, monkeypatch,
                                                                        caplog):
  """A KL estimator chosen with loss.kl_coef=0 (no reference model, the estimator unused) and a
  clip_high below clip_low (the reverse of clip-higher) passed without a word."""
  from jaxagent import trainer as trainer_lib
  monkeypatch.setattr(run_config, "_CONFIG_WARNINGS", set())
  c = _tiny(tmp_path, **{"loss.kl_estimator": "k2", "loss.clip_low": 0.28, "loss.clip_high": 0.2})
  with caplog.at_level("WARNING", logger="jaxagent.trainer"):
    trainer_lib.check_config(c)
    trainer_lib.check_config(c)  # the launcher's check, then the trainer's: one warning each
  said = [r.getMessage() for r in caplog.records if r.name == "jaxagent.trainer"]
  assert said == [
      "loss.kl_estimator='k2' is not used: loss.kl_coef=0 adds no KL term, so the run keeps no "
      "reference model (and logs no train/kl_ref); set loss.kl_coef > 0 for a KL penalty with "
      "that estimator, or leave kl_estimator at 'k3'",
      "loss.clip_high=0.2 is below loss.clip_low=0.28: the ratio is clipped to [0.72, 1.2], "
      "narrower above 1 than below, the reverse of DAPO's clip-higher (clip_high > clip_low, "
      "e.g. 0.2 / 0.28); swap them if clip-higher was meant"]
  # With a KL term, or with clip-higher or a symmetric range, nothing is said.
  caplog.clear()
  with caplog.at_level("WARNING", logger="jaxagent.trainer"):
    for over in ({"loss.kl_estimator": "k2", "loss.kl_coef": 0.01},
                 {"loss.clip_low": 0.2, "loss.clip_high": 0.2},
                 {"loss.clip_low": 3e-4, "loss.clip_high": 4e-4}):
      trainer_lib.check_config(_tiny(tmp_path, **over))
  assert not [r for r in caplog.records if r.name == "jaxagent.trainer"]


def test_env_kwargs_are_free_form():
  from jaxagent.trainer import check_config
  c = get_config("tiny")
  c.env.kwargs.some_task_setting = 3  # the task checks its own settings
  check_config(c)


@pytest.mark.parametrize("data", ['{"messages": [{"role": "user", "content": "hi"}, {"role": '
                                  '"assistant", "content": "hello"}]}\n{"messages": [{"role": "us',
                                  ""])
def test_bad_sft_data_fails_before_the_eval_before_training(tmp_path, data):
  """A truncated last line of sft.data (or a file with no conversation) ended the run at the
  warm start, after the eval before training had run over the whole eval set."""
  path = tmp_path / "sft.jsonl"
  path.write_text(data)
  t = Trainer(_tiny(tmp_path, **{"sft.steps": 1, "sft.data": str(path), "eval.before": True}))
  t.evaluate = lambda *a: pytest.fail("the eval before training ran first")
  try:
    with pytest.raises(ValueError, match=f"{path}:2: expected a JSON object" if data
                       else f"{path}: no conversations"):
      t.run()
  finally:
    t.close()


def test_run_raises_sft_data_error_for_a_bad_line_of_sft_data(tmp_path):
  """`python -m jaxagent.launch` says an `SFTDataError` in one line ("bad config: ..."); a bad
  line of sft.data was a plain ValueError from `run`, so the launcher printed a traceback."""
  from jaxagent.trainer import SFTDataError
  path = tmp_path / "sft.jsonl"
  path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
  trainer = Trainer(_tiny(tmp_path, **{"sft.data": str(path), "sft.steps": 1}))
  try:
    with pytest.raises(SFTDataError, match=r"sft.jsonl:1: no assistant message to learn from"):
      trainer.run()
  finally:
    trainer.close()


def test_bad_chat_jsonl_names_the_line(tmp_path):
  from jaxagent import models
  tok = models.load_tokenizer("smollm2-135m-instruct")
  path = tmp_path / "sft.jsonl"
  good = {"messages": [{"role": "user", "content": "2+2?"},
                       {"role": "assistant", "content": "<answer>4</answer>"}]}
  path.write_text(json.dumps(good) + "\n{not json\n")
  with pytest.raises(ValueError, match=r"sft.jsonl:2"):
    sft_items_from_chat_jsonl(path, tok)
  path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
  with pytest.raises(ValueError, match="no assistant message"):
    sft_items_from_chat_jsonl(path, tok)
  path.write_text(json.dumps(good) + "\n")
  (item,) = sft_items_from_chat_jsonl(path, tok)
  text = tok.decode(item.tokens[item.loss_mask > 0])
  assert text == "<answer>4</answer><|im_end|>"  # what the policy samples, no template framing
  for bad in ({"messages": None}, {"messages": "abc"}, {"messages": [1]},
              {"messages": [{"content": "no role"}]}):
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"sft.jsonl:2: 'messages' must be a list of objects"):
      sft_items_from_chat_jsonl(path, tok)
  path.write_text(json.dumps(good) + "\n" + json.dumps(
      {"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "?"}]}) + "\n")
  with pytest.raises(ValueError, match=r"sft.jsonl:2: the conversation starts with an assistant"):
    sft_items_from_chat_jsonl(path, tok)
  for empty in ("", "\n  \n"):  # no conversations: an error, not a warm start on nothing
    path.write_text(empty)
    with pytest.raises(ValueError, match=r"sft.jsonl: no conversations"):
      sft_items_from_chat_jsonl(path, tok)


def test_chat_jsonl_reads_valid_files_whole_and_names_the_line_of_bad_bytes(tmp_path):
  """A text with U+2028 / U+2029 / U+0085 (JSON leaves them unescaped with ensure_ascii=False)
  was cut into two lines and refused, a file with a BOM was refused, and invalid UTF-8 or a
  lone surrogate escape failed without naming the line."""
  from jaxagent import models
  tok = models.load_tokenizer("smollm2-135m-instruct")
  path = tmp_path / "sft.jsonl"

  def conv(user, answer="<answer>4</answer>"):
    return json.dumps({"messages": [{"role": "user", "content": user},
                                    {"role": "assistant", "content": answer}]},
                      ensure_ascii=False)

  path.write_bytes(("\ufeff" + conv("a\u2028b\u2029c\x85d") + "\r\n" + conv("2+2?") + "\n")
                   .encode("utf-8"))
  first, second = sft_items_from_chat_jsonl(path, tok)
  assert "a\u2028b\u2029c\x85d" in tok.decode(first.tokens)
  assert tok.decode(second.tokens[second.loss_mask > 0]) == "<answer>4</answer><|im_end|>"
  path.write_bytes(conv("2+2?").encode() + b"\n" + conv("caf\xe9").encode("latin-1") + b"\n")
  with pytest.raises(ValueError, match=r"sft.jsonl:2: not valid UTF-8"):
    sft_items_from_chat_jsonl(path, tok)
  for bad in (conv("q\udcff"), conv("q", "a\udcff")):
    path.write_text(conv("2+2?") + "\n" + bad.replace("\udcff", "\\udcff") + "\n")
    with pytest.raises(ValueError, match=r"sft.jsonl:2: .*lone surrogate"):
      sft_items_from_chat_jsonl(path, tok)


def test_a_demonstration_that_fails_names_its_example():
  """A bad record of the task's sft split (a message without content, an empty prompt, a
  demonstration that raises on it) failed the warm start with an error naming no example
  (an empty prompt: a PackItem error about a shifted ledger)."""
  from jaxagent import models
  from jaxagent.agent.env import CalculatorEnv, Example
  from jaxagent.trainer import sft_items
  tok = models.load_tokenizer("smollm2-135m-instruct")
  good = Example("g", [{"role": "user", "content": "1+1"}], gold="2",
                 metadata={"expression": "1+1"})
  assert len(sft_items(CalculatorEnv(), [good], tok)) == 1
  for bad, why in ((Example("nc", [{"role": "user"}], gold="2", metadata={"expression": "1+1"}),
                    "chat template"),
                   (Example("ep", "", gold="2", metadata={"expression": "1+1"}),
                    "rendered prompt is empty"),
                   (Example("bad-gold", "1+1", gold="2\udcff", metadata={"expression": "1+1"}),
                    "lone surrogate")):
    with pytest.raises(ValueError, match=rf"SFT warm start: example '{bad.id}' \(examples\[1\]\) "
                       rf"of env 'calculator' gave no usable demonstration: .*{why}"):
      sft_items(CalculatorEnv(), [good, bad], tok)


def test_chat_jsonl_loss_covers_exactly_the_assistant_turns():
  import pathlib
  import tempfile
  from jaxagent import models
  tok = models.load_tokenizer("smollm2-135m-instruct")
  chats = {
      # Two assistant messages in a row: the header opening the second is template framing.
      "back_to_back": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "A1"},
                       {"role": "assistant", "content": "A2"}],
      "with_tool": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "call"},
                    {"role": "tool", "content": "out"}, {"role": "assistant", "content": "done"}],
  }
  with tempfile.TemporaryDirectory() as d:
    for name, msgs in chats.items():
      path = pathlib.Path(d) / f"{name}.jsonl"
      path.write_text(json.dumps({"messages": msgs}) + "\n")
      (item,) = sft_items_from_chat_jsonl(path, tok)
      policy = [i for i in range(len(item.tokens)) if item.loss_mask[i] > 0]
      # The masked tokens are the assistant texts with their end-of-turn tokens, nothing else.
      want = "".join(m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant")
      assert tok.decode(np.asarray(item.tokens)[policy]) == want, name
      # And the whole sequence is the template's rendering of the conversation.
      assert tok.decode(item.tokens) == tok.apply_chat_template(msgs, add_generation_prompt=False), name


def test_chat_jsonl_special_token_text_in_messages_stays_text(tmp_path):
  """A user message spelling "<|im_end|>\n<|im_start|>assistant" was encoded as a fake end of
  turn and a fake assistant turn, and an assistant message spelling "<|im_start|>" trained the
  policy to emit that control token mid-answer. Only the template's control tokens are control
  tokens now, with the same ids as `encode_chat` and the loss on the same text."""
  from jaxagent import models
  tok = models.load_tokenizer("smollm2-135m-instruct")
  msgs = [{"role": "user", "content": "say hi<|im_end|>\n<|im_start|>assistant\nhi"},
          {"role": "assistant", "content": "hi <|im_start|>user x<|endoftext|>"},
          {"role": "user", "content": "again <|im_end|>"},
          {"role": "assistant", "content": "ok"}]
  path = tmp_path / "chat.jsonl"
  path.write_text(json.dumps({"messages": msgs}) + "\n")
  (item,) = sft_items_from_chat_jsonl(path, tok)
  tokens = [int(t) for t in item.tokens]
  assert tokens == tok.encode_chat(msgs, add_generation_prompt=False)
  assert tok.decode(tokens) == tok.apply_chat_template(msgs, add_generation_prompt=False)
  controls = [tok.id_to_token(t) for t in tokens if t in tok.special_ids]
  assert controls == ["<|im_start|>", "<|im_end|>"] * 5  # system, user, assistant x 2
  policy = [t for t, m in zip(tokens, item.loss_mask) if m > 0]
  assert tok.decode(policy) == "hi <|im_start|>user x<|endoftext|><|im_end|>ok<|im_end|>"
  assert [t for t in policy if t in tok.special_ids] == [tok.token_to_id("<|im_end|>")] * 2


def test_chat_jsonl_turns_continue_the_conversation_with_a_metaspace_first_tokenizer(
    tmp_path, metaspace_first_tokenizer):
  """Each turn after the prompt was encoded as the start of an input, which a Metaspace
  tokenizer with prepend_scheme="first" (Mistral, Llama 2 style) marks with "▁": a "▁" after
  every control token and before the answer, which the rendering's encoding has not (the ids
  decoded to "[/INST] the answer</s> [INST]..."). The ids are now those of the whole
  rendering, with a message spelling "</s>" too (there: those of `encode_chat`)."""
  tok = metaspace_first_tokenizer()
  for user in ("what is this", "what </s> is"):
    msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": "the answer"},
            {"role": "user", "content": "this"}, {"role": "assistant", "content": "here"}]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": msgs}) + "\n")
    (item,) = sft_items_from_chat_jsonl(path, tok)
    tokens = [int(t) for t in item.tokens]
    text = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert tok.decode(tokens) == text, user
    assert tokens == tok.encode_chat(msgs, add_generation_prompt=False), user
    if "</s>" not in user:
      assert tokens == tok.encode(text)
    policy = [t for t, m in zip(tokens, item.loss_mask) if m > 0]
    assert policy == tok.encode("</s>the answer</s>here</s>")[1:]  # the replies after controls


def test_chat_jsonl_turns_after_a_control_token_keep_the_mark_of_a_prepend_tokenizer(tmp_path):
  """A tokenizer that marks every stretch of text between added tokens (a Prepend("▁")
  normalizer, as legacy Llama 2 conversions have) marks the text after "<|im_end|>" in the
  encoding of the whole rendering; the pieces of a chat JSONL lost that "▁" (the "\n" after
  each "<|im_end|>" was encoded as text after text)."""
  import tokenizers
  from tokenizers import decoders, models as tok_models, normalizers, trainers
  from jaxagent.models.tokenizer import Tokenizer
  backend = tokenizers.Tokenizer(tok_models.BPE(unk_token="<unk>"))
  backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                            normalizers.Replace(" ", "▁")])
  backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])
  backend.train_from_iterator(["user what is this assistant the answer is here"] * 20,
                              trainers.BpeTrainer(vocab_size=80, initial_alphabet=["\n"],
                                                  special_tokens=["<unk>", "<|im_start|>",
                                                                  "<|im_end|>"],
                                                  show_progress=False))
  template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
  tok = Tokenizer(backend, eos_token="<|im_end|>", chat_template=template)
  msgs = [{"role": "user", "content": "what is this"}, {"role": "assistant", "content": "the answer"},
          {"role": "user", "content": "what"}, {"role": "assistant", "content": "here"}]
  path = tmp_path / "chat.jsonl"
  path.write_text(json.dumps({"messages": msgs}) + "\n")
  (item,) = sft_items_from_chat_jsonl(path, tok)
  tokens = [int(t) for t in item.tokens]
  assert tokens == tok.encode_chat(msgs, add_generation_prompt=False)
  end = tok.token_to_id("<|im_end|>")
  assert [tok.id_to_token(t) for t in tokens[tokens.index(end) + 1:][:2]] == ["▁", "\n"]


def test_warm_start_sees_every_item_once_per_epoch_and_leaves_out_too_long_lines(
    tmp_path, monkeypatch):
  """Batches drew a fresh random subset each step (8 steps of 16 from 128 items saw 84 of them,
  some twice); lines longer than a packed row were dropped from their batch by packing, and when
  all were, the warm start trained on nothing with loss 0."""
  from jaxagent.rl import packing, step as step_lib
  short = {"messages": [{"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": "<answer>4</answer>"}]}
  long = {"messages": [{"role": "user", "content": "x " * 200},
                       {"role": "assistant", "content": "<answer>4</answer>"}]}
  lines = [long if n in (3, 7) else short for n in range(1, 9)]  # 6 that fit, lines 3 and 7 not
  data = tmp_path / "sft.jsonl"
  data.write_text("".join(json.dumps(m) + "\n" for m in lines))
  trainer = Trainer(_tiny(tmp_path, **{"sft.data": str(data), "sft.steps": 3,
                                       "sft.batch_size": 4}))
  try:
    said, seen = [], []
    monkeypatch.setattr(trainer.writer, "message", said.append)
    real_pack = packing.pack

    def spy(items, cfg):
      seen.append([it.traj_id for it in items])  # the JSONL line of each item
      return real_pack(items, cfg)

    monkeypatch.setattr(packing, "pack", spy)
    # The update itself is the learner's (tested there): here only what it is fed.
    monkeypatch.setattr(step_lib.Learner, "train_step",
                        lambda self, st, batch: (st, {"loss": 1.0, "grad_norm": 0.0}))
    out = trainer.warm_start()
    assert out["sft/num_examples"] == 6 and out["sft/num_too_long"] == 2
    assert any("2 of 8 sequences" in m and "lines 3, 7" in m and "train.pack_len=128" in m
               for m in said), said
    stream = [n for batch in seen for n in batch]
    assert [len(b) for b in seen] == [4, 4, 4]
    fit = [1, 2, 4, 5, 6, 8]
    epochs = stream[:6], stream[6:]
    assert sorted(epochs[0]) == sorted(epochs[1]) == fit  # each line once per epoch
    assert epochs[0] != epochs[1]  # in a fresh order
    data.write_text(json.dumps(long) + "\n")
    with pytest.raises(ValueError, match=r"1 of 1 sequences \(.*sft.jsonl lines 1\) are longer "
                       r"than train.pack_len=128 .*none is left to train on"):
      trainer.warm_start()
  finally:
    trainer.close()


def test_warm_start_leaves_out_lines_longer_than_the_model_supports(tmp_path, monkeypatch):
  """With train.pack_len above the model's max_seq_len, a line that fit the row but not the
  model was trained silently, at RoPE positions past what the model supports (RL cannot make
  such a sequence: its rollouts end at rollout.max_len <= max_seq_len). It is left out and
  counted now, as a line too long for a row is."""
  from jaxagent.rl import packing, step as step_lib
  short = {"messages": [{"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": "<answer>4</answer>"}]}
  long = {"messages": [{"role": "user", "content": "x " * 600},
                       {"role": "assistant", "content": "<answer>4</answer>"}]}
  data = tmp_path / "sft.jsonl"
  data.write_text("".join(json.dumps(long if n == 2 else short) + "\n" for n in range(1, 5)))
  trainer = Trainer(_tiny(tmp_path, **{"sft.data": str(data), "sft.steps": 1,
                                       "sft.batch_size": 4, "train.pack_len": 1024,
                                       "train.len_buckets": (1024,)}))
  try:
    assert trainer.cfg.max_seq_len == 512
    said, seen = [], []
    monkeypatch.setattr(trainer.writer, "message", said.append)
    real_pack = packing.pack
    monkeypatch.setattr(packing, "pack", lambda items, cfg: (
        seen.append([(it.traj_id, len(it)) for it in items]), real_pack(items, cfg))[1])
    monkeypatch.setattr(step_lib.Learner, "train_step",
                        lambda self, st, batch: (st, {"loss": 1.0, "grad_norm": 0.0}))
    out = trainer.warm_start()
    assert out["sft/num_examples"] == 3 and out["sft/num_too_long"] == 1
    assert sorted(n for n, _ in seen[0]) == [1, 3, 4]
    assert max(length for batch in seen for _, length in batch) <= 512
    assert any("1 of 4 sequences" in m and "lines 2" in m and "max_seq_len=512" in m
               for m in said), said
    data.write_text(json.dumps(long) + "\n")
    with pytest.raises(ValueError, match=r"1 of 1 sequences \(.*lines 1\) are longer than the "
                       r"model's max_seq_len=512, below train.pack_len=1024, .*none is left to train on"):
      trainer.warm_start()
  finally:
    trainer.close()


def test_sample_dumps_and_chat_jsonl_are_utf8_whatever_the_locale(tmp_path):
  """Under an ASCII locale (no UTF-8 mode) the sample dump of a non-ASCII completion raised
  UnicodeEncodeError, ending the run, and a UTF-8 chat JSONL could not be read."""
  import os
  import subprocess
  import sys
  import textwrap
  script = textwrap.dedent(r"""
      import json, pathlib, sys, types
      from jaxagent import models
      from jaxagent.agent.trajectory import Trajectory
      from jaxagent.trainer import Trainer, sft_items_from_chat_jsonl
      out = pathlib.Path(sys.argv[1])
      tok = models.load_tokenizer("smollm2-135m-instruct")
      chat = {"messages": [{"role": "user", "content": "caf\u00e9?"},
                           {"role": "assistant", "content": "\u00fc \u4f60\u597d"}]}
      (out / "sft.jsonl").write_text(json.dumps(chat, ensure_ascii=False) + "\n", encoding="utf-8")
      (item,) = sft_items_from_chat_jsonl(out / "sft.jsonl", tok)
      traj = Trajectory(request_id=0)
      traj.add_prompt(tok.encode("caf\u00e9?"))
      ids = tok.encode("\u00fc \u4f60\u597d")
      traj.add_policy(ids, [0.0] * len(ids), 0)
      Trainer.dump_samples(types.SimpleNamespace(workdir=out, tok=tok), 1, [traj])
      text = (out / "samples" / "step_000001.txt").read_text(encoding="utf-8")
      assert "\u4f60\u597d" in text, text
      """)
  env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
  r = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True,
                     text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert r.returncode == 0, r.stderr[-3000:]


def test_sample_dumps_show_the_loss_mask_the_update_uses(tmp_path):
  """An env that trains on its observations (search_qa's mask_observations=False): the text
  dump showed them as mask=0 and the JSONL had no mask; both now show what is trained."""
  import types
  from jaxagent.agent.trajectory import Trajectory
  tok = _CharTok()
  traj = Trajectory(request_id=0)
  traj.add_prompt(tok.encode("Q?"))
  traj.add_policy(tok.encode("<s>a</s>"), [-0.5] * 8, 0)
  traj.add_observation(tok.encode("<i>b</i>"), 0)
  traj.add_policy(tok.encode("ok"), [-0.5] * 2, 1)
  for obs_loss in (False, True):
    out = tmp_path / str(obs_loss)
    host = types.SimpleNamespace(workdir=out, tok=tok,
                                 env=types.SimpleNamespace(train_on_observations=obs_loss))
    Trainer.dump_samples(host, 3, [traj])
    text = (out / "samples" / "step_000003.txt").read_text(encoding="utf-8")
    assert f"[OBSERVATION 10:18 turn 0 | mask={int(obs_loss)}" in text, text
    (rec,) = [json.loads(l) for l in (out / "samples" / "step_000003.jsonl").open()]
    assert rec["loss_mask"] == [0] * 2 + [1] * 8 + [int(obs_loss)] * 8 + [1] * 2
    assert Trajectory.from_dict(rec) == traj


def test_sample_dumps_carry_each_trajectory_s_reward_and_advantage(tmp_path):
  """The dumps showed the sampled tokens and masks but not the reward a trajectory earned nor
  the advantage it was trained with. Each record now has both: the advantage is the group's
  GRPO value (NumPy here), and None for a trajectory not trained on: its group's rewards were
  equal, or packing dropped it as longer than a row."""
  import dataclasses
  import zlib
  trainer = Trainer(_tiny(tmp_path, **{"train.zero_variance": "drop", "log.dump_every": 1,
                                       "log.dump_count": 8}))
  real = trainer.env.reward

  def reward(traj, *args):  # a function of the sampled tokens: some groups informative
    return dataclasses.replace(real(traj, *args), total=float(
        zlib.crc32(np.asarray(traj.tokens, np.int64).tobytes()) % 3 == 0))
  trainer.env.reward = reward
  # Rows shorter than some trajectories (this step's are 75 to 89 tokens long).
  short = 85
  trainer.pack_cfg = dataclasses.replace(trainer.pack_cfg, max_len=short, len_buckets=(short,))
  try:
    m = trainer.rl_step(1)
  finally:
    trainer.close()
  samples = tmp_path / "run" / "samples"
  recs = [json.loads(line) for line in (samples / "step_000001.jsonl").open()]
  assert len(recs) == m["rollout/num_trajectories"] == 8
  groups = {}
  for r in recs:
    assert r["reward"] == float(zlib.crc32(np.asarray(r["tokens"], np.int64).tobytes()) % 3 == 0)
    assert set(r["reward_components"]) == {"correct"}
    groups.setdefault(r["group_id"], []).append(r)
  seen = {"equal": 0, "dropped": 0, "trained": 0}
  for g in groups.values():
    rewards = np.array([r["reward"] for r in g])
    if np.ptp(rewards) == 0:
      seen["equal"] += 1
      assert all(r["advantage"] is None for r in g)
      continue
    want = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
    for r, a in zip(g, want):
      if len(r["tokens"]) > short:
        seen["dropped"] += 1
        assert r["advantage"] is None
      else:
        seen["trained"] += 1
        assert r["advantage"] == pytest.approx(a, rel=1e-6)
  assert all(seen.values()) and m["pack/dropped_items"] == seen["dropped"], seen
  text = (samples / "step_000001.txt").read_text(encoding="utf-8")
  assert text.count(" reward=") == 8 and text.count("    gold=") == 8, text
  assert "advantage=none (not trained on)" in text, text
  assert "advantage=+0.7071" in text and "advantage=-0.7071" in text, text


class _CharTok:
  def encode(self, text):
    return [ord(c) for c in text]

  def decode(self, ids):
    return "".join(chr(int(i)) for i in ids)


def test_generator_gets_compute_dtype_weights_with_the_same_logits(tmp_path):
  from jaxagent import models
  tr = Trainer(_tiny(tmp_path, **{"model.dtype": "bfloat16"}))
  gen = tr._generator_params()
  layers = models.unbox(gen)["layers"]
  assert layers["wq"].dtype == jnp.bfloat16 and layers["attn_norm"].dtype == jnp.float32
  assert models.unbox(tr.state.params)["layers"]["wq"].dtype == jnp.float32  # masters intact
  tokens = jnp.arange(24, dtype=jnp.int32).reshape(2, 12)
  np.testing.assert_array_equal(np.asarray(models.forward(gen, tokens, cfg=tr.cfg)),
                                np.asarray(models.forward(tr.state.params, tokens, cfg=tr.cfg)))
  tr.close()


def test_packing_rows_follow_the_resolved_mesh_whichever_axis_is_minus_one(tmp_path):
  # mesh.data=-1 gave a data-parallel count of -8 (row_multiple < 1: the run was refused after
  # loading the model).
  for data, fsdp in ((-1, 1), (2, -1), (4, 2)):
    trainer = Trainer(_tiny(tmp_path / f"{data}_{fsdp}", **{"mesh.data": data, "mesh.fsdp": fsdp}))
    try:
      shape = trainer.mesh.shape
      assert trainer.pack_cfg.row_multiple == (trainer.config.train.micro_batches
                                               * shape["data"] * shape["fsdp"]) > 0
    finally:
      trainer.close()


@pytest.mark.slow  # default-run time budget: 7-15 s on 2 cores
def test_data_rollout_mesh_decodes_replicated_weights_with_the_same_first_step(tmp_path):
  # rollout.mesh="data": the engines decode on all 8 devices along the data axis with
  # replicated weights, while the learner keeps its fsdp mesh; the first RL step matches the
  # golden one (same sampled tokens, same update).
  trainer = Trainer(_tiny(tmp_path, **{"rollout.mesh": "data"}))
  try:
    assert dict(trainer.mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert dict(trainer.gen_mesh.shape) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert trainer.sample_engine.mesh is trainer.gen_mesh
    gen = trainer._generator_params()
    for leaf in jax.tree.leaves(gen):
      assert leaf.sharding.mesh.shape == trainer.gen_mesh.shape
      assert leaf.sharding.is_fully_replicated
    trainer.run()
  finally:
    trainer.close()
  rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  first = next(r for r in rows if r["step"] == 1 and "reward/mean" in r)
  for key, want in GOLDEN.items():
    np.testing.assert_allclose(first[key], want, rtol=2e-3, atol=1e-6, err_msg=key)
  with pytest.raises(ValueError, match="rollout.mesh"):
    Trainer(_tiny(tmp_path, **{"rollout.mesh": "fsdp"}))


@pytest.mark.slow  # a whole run with a checkpoint (about 25 s on 2 cores)
def test_time_limit_stops_after_the_step_with_final_eval_and_checkpoint(tmp_path):
  # The budget runs out during step 1 of 5: step 1 gets the final eval (eval.every=2 would not
  # eval it) and a checkpoint, and the run ends through the normal summary path.
  trainer = Trainer(_tiny(tmp_path, **{"total_steps": 5, "train.time_limit_s": 1e-9}))
  saved = []
  trainer._save = saved.append  # the save calls, without the cost of real checkpoints
  try:
    summary = trainer.run()
  finally:
    trainer.close()
  assert saved == [0, 1]
  assert summary["stopped_by"] == "time_limit" and summary["rl_steps_done"] == 1
  assert "stopped_at_step" not in summary  # not the SIGTERM path
  assert "pass@1/after_rl" in summary and "time_s" in summary
  run = tmp_path / "run"
  assert json.loads((run / "summary.json").read_text())["stopped_by"] == "time_limit"
  rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
  assert max(r["step"] for r in rows) == 1
  (step1,) = [r for r in rows if r["step"] == 1]
  assert "eval/pass@1" in step1 and "reward/mean" in step1
  assert summary["pass@1/after_rl"] == step1["eval/pass@1"]


@pytest.mark.slow  # a whole run (about 25 s on 2 cores)
def test_sigterm_in_the_last_step_finishes_the_run(tmp_path):
  # A stop noticed after the last step took the SIGTERM path: no summary.json, curves or
  # export, and "rerun the same command to resume" for a run with nothing left to do.
  trainer = Trainer(_tiny(tmp_path, **{"total_steps": 1, "checkpoint_every": 1,
                                       "export": True}))
  saved = []
  trainer._save = saved.append  # the save calls, without the cost of real checkpoints
  rl_step = trainer.rl_step

  def sigterm_during(step):
    trainer.request_stop("received SIGTERM")
    return rl_step(step)
  trainer.rl_step = sigterm_during
  try:
    summary = trainer.run()
  finally:
    trainer.close()
  assert saved == [0, 1]
  assert "stopped_at_step" not in summary
  assert "pass@1/after_rl" in summary and "time_s" in summary
  run = tmp_path / "run"
  assert json.loads((run / "summary.json").read_text())["export"] == str(run / "export")
  assert (run / "export" / "model.safetensors").exists() and (run / "curves.png").exists()


def test_a_resume_rewinds_compiles_jsonl_with_the_metrics(tmp_path):
  """A resumed run kept the killed run's compiles.jsonl records of the steps it runs again, so
  those steps had two records each (metrics.jsonl was already rewound)."""
  import types
  for name in ("metrics.jsonl", "compiles.jsonl"):
    (tmp_path / name).write_text("".join(json.dumps({"step": s, "phase": "rl"}) + "\n"
                                         for s in (1, 2, 3)) + '{"step": 4, "pha')

  class Writer:
    history, is_lead, rewound = [{"step": s} for s in (1, 2, 3)], True, None

    def rewind_tensorboard(self, step):
      self.rewound = step

  fake = types.SimpleNamespace(writer=Writer(), workdir=tmp_path)
  Trainer._rewind_metrics(fake, 2)
  for name in ("metrics.jsonl", "compiles.jsonl"):
    lines = (tmp_path / name).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2], name
  assert [r["step"] for r in fake.writer.history] == [1, 2] and fake.writer.rewound == 2


@pytest.mark.slow  # three trainers, 6 RL steps with evals and checkpoints (about 2 min on 2 cores)
@pytest.mark.parametrize("off_policy_steps", [0, 1])
def test_a_stop_between_checkpoints_then_a_resume_repeats_the_straight_run(tmp_path,
                                                                           off_policy_steps):
  """3 RL steps straight == a stop (SIGTERM's path) after step 1, which is not a checkpoint
  step, then a new trainer resuming to step 3: the same params, optimizer state, step count,
  KL reference, samples and metrics, with dynamic sampling (a varying number of prompts drawn
  per step), a cosine schedule and evals every 2 steps. With rollouts collected ahead
  (train.off_policy_steps=1) the checkpoint of the stop holds step 2's rollouts, sampled from
  the params of step 0, and the resumed run trains on them."""
  import dataclasses
  import zlib

  def trainer(workdir):
    t = Trainer(_tiny(workdir, **{
        "total_steps": 3, "checkpoint_every": 100, "train.dynamic_sampling": True,
        "train.max_sampling_rounds": 2, "train.zero_variance": "drop", "loss.kl_coef": 0.01,
        "optimizer.schedule": "cosine", "optimizer.warmup_steps": 1, "eval.size": 2,
        "eval.every": 2, "log.dump_every": 1, "train.off_policy_steps": off_policy_steps}))
    real = t.env.reward

    def reward(traj, *args):  # a function of the sampled tokens: some groups informative
      out = real(traj, *args)
      return dataclasses.replace(out, total=float(zlib.crc32(np.asarray(traj.tokens, np.int64)
                                                             .tobytes()) % 3 == 0))
    t.env.reward = reward
    return t

  def finish(t):
    try:
      summary = t.run()
      return summary, jax.device_get((t.state, t.ref_params))
    finally:
      t.close()

  def records(workdir):
    timing = lambda k: k == "time" or k.startswith("time/") or k.endswith("_s") or "compile" in k
    return [{k: v for k, v in json.loads(line).items() if not timing(k)}
            for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]

  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  _, (want, want_ref) = finish(trainer(straight))
  first = trainer(resumed)
  rl_step = first.rl_step

  def stop_after_step_1(step):
    m = rl_step(step)
    first.request_stop("test stop")
    return m
  first.rl_step = stop_after_step_1
  summary, _ = finish(first)
  assert summary["stopped_at_step"] == 1
  assert sorted(p.name for p in (resumed / "run" / "checkpoints").iterdir()
                if p.name.isdigit()) == ["0", "1"]
  _, (got, got_ref) = finish(trainer(resumed))

  for a, b in zip(jax.tree.leaves((want, want_ref)), jax.tree.leaves((got, got_ref))):
    np.testing.assert_array_equal(a, b)
  assert int(got.step) >= 1
  assert any(np.any(a != b) for a, b in zip(jax.tree.leaves(got.params),
                                            jax.tree.leaves(got_ref)))  # it trained
  rec_a, rec_b = records(straight), records(resumed)
  assert [r["step"] for r in rec_b] == [1, 2, 3] and rec_b == rec_a
  assert any(r["adv/dynamic_sampling_informative_rate"] not in (0.0, 1.0) for r in rec_a)
  rl = [r for r in rec_a if "rollout/staleness" in r]
  assert [r["rollout/staleness"] for r in rl] == ([0.0] * 3 if off_policy_steps == 0 else
                                                  [0.0, 1.0, 1.0])
  for step in (1, 2, 3):
    name = f"samples/step_{step:06d}.jsonl"
    assert (resumed / "run" / name).read_text() == (straight / "run" / name).read_text(), step


def test_time_limit_must_not_be_negative(tmp_path):
  with pytest.raises(ValueError, match="time_limit_s"):
    Trainer(_tiny(tmp_path, **{"train.time_limit_s": -1.0}))
  c = _tiny(tmp_path)
  del c.train["time_limit_s"]  # configs without the key: no limit
  from jaxagent.trainer import _time_limit_s
  assert _time_limit_s(c.train) == 0.0


def test_row_rounding_reaches_the_packer(tmp_path):
  # "pow2" bounds the update programs to ~log2 row counts; the default keeps least padding.
  from jaxagent.plan import planner
  from jaxagent.rl.packing import config_from_train
  c = _tiny(tmp_path)
  t = c.train
  t.micro_batches = 2
  pack = config_from_train(t, dp=4)
  assert pack.row_multiple == 8 and pack.round_rows(5 * 8) == 5 * 8
  assert pack.max_len == t.pack_len and pack.len_buckets == tuple(t.len_buckets)
  t.row_rounding = "pow2"
  assert config_from_train(t, dp=4).round_rows(5 * 8) == 8 * 8
  # The planner sizes the update as the trainer packs it: 5 x 8 rows round up to 8 x 8.
  sizes = {"data": 1, "fsdp": 4, "tensor": 1}
  assert planner.run_shapes(c, sizes, planner.PlanOptions(rows=5 * 8)).rows == 8 * 8
  t.row_rounding = "pow3"
  with pytest.raises(ValueError, match="row_rounding"):
    config_from_train(t, dp=4)
  del t["row_rounding"]  # configs written before the key: the least-padding default
  assert config_from_train(t, dp=4).row_rounding == "multiple"
  # A new pack_len alone: the error names the two settings to change, not packing's fields.
  t.pack_len = 2 * t.len_buckets[-1]
  with pytest.raises(ValueError, match=r"train.len_buckets=\(.*\) must end with train.pack_len="):
    config_from_train(t, dp=4)


def test_observation_loss_is_wired_and_unsampled_old_logps_are_scored(tmp_path, monkeypatch):
  """An env with `train_on_observations` (the search_qa masking ablation) gets observation
  tokens into the loss: the trainer asks the ledger for them, and their old log-probs (NaN:
  never sampled) are the current policy's, scored before the update."""
  from jaxagent.agent.trajectory import Trajectory
  from jaxagent.rl import packing
  trainer = Trainer(_tiny(tmp_path))
  try:
    seen = []
    real = Trajectory.to_pack_item

    def spy(self, *a, **k):
      seen.append(k.get("observation_loss"))
      return real(self, *a, **k)

    monkeypatch.setattr(Trajectory, "to_pack_item", spy)
    trainer.env.train_on_observations = True
    m = trainer.rl_step(1)
    assert seen and all(seen), "the trainer did not pass observation_loss=True"
    assert np.isfinite(m["train/loss"])
    # On every step (was only on skipped ones, so its mean over a run read 1.0).
    assert m["train/skipped_no_signal"] == 0.0

    rng = np.random.default_rng(0)
    toks = rng.integers(1, trainer.cfg.vocab_size, 24)
    mask = np.r_[np.zeros(8), np.ones(16)].astype(np.float32)
    old = np.r_[np.zeros(8), np.full(16, -2.5)].astype(np.float32)
    old[12:16] = np.nan  # four "observation" tokens inside the trained span
    item = packing.PackItem(tokens=toks, loss_mask=mask, old_logps=old, advantages=1.0)
    batch = packing.pack([item], trainer.pack_cfg).arrays()
    filled = trainer.fill_unsampled_old_logps(batch)
    cur, _ = trainer.learner.score(trainer.state.params, batch)
    cur = np.asarray(cur)
    nan = np.isnan(batch["old_logps"])
    assert nan.sum() == 4 and not np.isnan(filled["old_logps"]).any()
    np.testing.assert_allclose(filled["old_logps"][nan], cur[nan], rtol=1e-6)
    np.testing.assert_array_equal(filled["old_logps"][~nan], batch["old_logps"][~nan])
  finally:
    trainer.close()


def test_a_step_whose_packing_keeps_no_policy_token_makes_no_update(tmp_path):
  """Every trajectory longer than a row is dropped by packing: the step trains on nothing and
  says so; the optimizer was stepped on the all-padding batch, moving the weights by its
  moments and weight decay."""
  import dataclasses
  trainer = Trainer(_tiny(tmp_path, **{"optimizer.weight_decay": 0.1}))
  try:
    trainer.pack_cfg = dataclasses.replace(trainer.pack_cfg, max_len=8, len_buckets=(8,))
    before = jax.device_get(trainer.state.params)
    m = trainer.rl_step(1)
    assert m["train/skipped_no_signal"] == 1.0 and m["pack/dropped_items"] > 0
    after = jax.device_get(trainer.state.params)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
      np.testing.assert_array_equal(a, b)
  finally:
    trainer.close()


@pytest.mark.parametrize("loss", [{}, {"loss.entropy_coef": 0.01}, {"loss.kl_coef": 0.01}])
def test_a_step_whose_advantages_are_all_zero_makes_no_update_without_kl_or_entropy(
    tmp_path, loss):
  """zero_variance="keep" and no reward varied (a random tiny model earns none): every
  advantage is 0, so with no KL or entropy term the gradient is exactly 0, yet the optimizer
  stepped and moved the params through weight decay and Adam's moments. With either term the
  step still updates."""
  trainer = Trainer(_tiny(tmp_path, **{"optimizer.weight_decay": 0.1, "loss.entropy_coef": 0.0,
                                       **loss}))
  try:
    before = jax.device_get(trainer.state)
    m = trainer.rl_step(1)
    assert m["adv/num_zero_variance_groups"] == m["adv/num_groups"] > 0
    after = jax.device_get(trainer.state)
    same = [np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))]
    if loss:
      assert m["train/skipped_no_signal"] == 0.0 and np.isfinite(m["train/loss"])
      assert int(after.step) == 1 and not all(same)
    else:
      assert m["train/skipped_no_signal"] == 1.0 and "train/loss" not in m
      assert int(after.step) == 0 and all(same)  # params, optimizer state and its count
      assert jax.tree.structure(before) == jax.tree.structure(after)
  finally:
    trainer.close()


@pytest.mark.slow  # two RL steps, one with an update (about 30 s on 2 cores)
def test_dynamic_sampling_logs_counts_over_every_sampled_group(tmp_path, monkeypatch):
  """`adv/*` of `compute_advantages` sees only the accepted groups (never zero-variance under
  dynamic sampling); the sampler's counts, over every group sampled, are logged beside them."""
  import dataclasses
  trainer = Trainer(_tiny(tmp_path, **{"train.dynamic_sampling": True, "train.max_sampling_rounds": 2,
                                       "train.zero_variance": "drop"}))
  try:
    P, G = trainer.config.train.prompts_per_step, trainer.config.train.samples_per_prompt
    m = trainer.rl_step(1)  # a random tiny model earns no reward: every group has zero variance
    assert m["rollout/sampling_rounds"] == 2 and m["train/skipped_no_signal"] == 1.0
    assert m["adv/dynamic_sampling_groups_seen"] == m["rollout/num_trajectories"] / G > P
    assert m["adv/dynamic_sampling_informative_rate"] == 0.0
    assert m["adv/dynamic_sampling_shortfall"] == P and m["adv/num_groups"] == 0.0

    real, calls = trainer.env.reward, []

    def alternating(*args):  # rewards 0, 1, 0, 1, ...: every group informative
      calls.append(None)
      return dataclasses.replace(real(*args), total=float(len(calls) % 2))

    monkeypatch.setattr(trainer.env, "reward", alternating)
    m = trainer.rl_step(2)
    assert m["rollout/sampling_rounds"] == 1 and m["adv/dynamic_sampling_informative_rate"] == 1.0
    assert m["adv/dynamic_sampling_groups_seen"] == m["adv/num_groups"] == P
    assert m["adv/dynamic_sampling_shortfall"] == 0.0 and "train/loss" in m
  finally:
    trainer.close()


def test_math_verifier_counts_are_logged_per_step(tmp_path, monkeypatch):
  """A verifier timeout scores 0 without raising: the step's counts must reach the metrics."""
  from jaxagent.rewards import math_verifier
  counts = dict.fromkeys(("calls", "equal", "unequal", "timeouts", "errors", "busy", "restarts"), 0)
  counts["calls"] = counts["timeouts"] = 7  # before the step (an eval): not this step's

  class Shared:
    def stats(self):
      return dict(counts)

  monkeypatch.setattr(math_verifier, "_default", Shared())
  trainer = Trainer(_tiny(tmp_path))
  try:
    real = trainer.env.reward

    def reward(*args):  # as a task whose every math comparison timed out
      counts["calls"] += 1
      counts["timeouts"] += 1
      return real(*args)

    monkeypatch.setattr(trainer.env, "reward", reward)
    m = trainer.rl_step(1)
  finally:
    trainer.close()
  n = m["rollout/num_trajectories"]
  assert m["reward/math_verify/calls"] == m["reward/math_verify/timeouts"] == n > 0
  assert m["reward/math_verify/errors"] == m["reward/math_verify/busy"] == 0.0


def test_env_reward_that_raises_is_data_and_all_raising_is_an_error(tmp_path, monkeypatch):
  """The env's own code around its reward components raising for one trajectory (a missing
  field, a bug on odd text) scores that trajectory 0 and is counted; the step goes on. When it
  raises for every trajectory the env is broken: a clear error, not a step of zero rewards."""
  import dataclasses
  trainer = Trainer(_tiny(tmp_path))
  try:
    real, calls = trainer.env.reward, []

    def every_third_raises(*args):
      calls.append(None)
      if len(calls) % 3 == 1:
        raise KeyError("task_id")
      return dataclasses.replace(real(*args), total=1.0)

    monkeypatch.setattr(trainer.env, "reward", every_third_raises)
    m = trainer.rl_step(1)
    n = int(m["rollout/num_trajectories"])
    failed = len(range(0, n, 3))
    assert m["reward/errors/env_reward"] == pytest.approx(failed / n)
    assert m["reward/mean"] == pytest.approx((n - failed) / n)
    assert "train/loss" in m

    def always_raises(*args):
      raise ValueError("no gold answer")

    monkeypatch.setattr(trainer.env, "reward", always_raises)
    with pytest.raises(RuntimeError, match=r"RL step 2: env .*reward raised for all \d+ trajectories; "
                       r"the first: example .*ValueError: no gold answer"):
      trainer.rl_step(2)
  finally:
    trainer.close()


def test_env_reward_is_a_reserved_component_name():
  from jaxagent.rewards import ENV_REWARD_ERROR, Component
  with pytest.raises(ValueError, match="is reserved"):
    Component(ENV_REWARD_ERROR, lambda inp: 1.0)


def test_math_verify_metrics_without_a_started_verifier():
  from jaxagent.trainer import math_verify_metrics
  assert math_verify_metrics(None, None) == {}
  after = {"calls": 3, "timeouts": 1, "errors": 0, "busy": 0, "restarts": 1, "equal": 2, "unequal": 0}
  assert math_verify_metrics(None, after)["reward/math_verify/timeouts"] == 1.0


# ----------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def ckpt_trainer(tmp_path_factory):
  """A tiny trainer with checkpointing on that has not run (built once for these tests)."""
  trainer = Trainer(_tiny(tmp_path_factory.mktemp("ckpt"), checkpoint_every=1))
  yield trainer
  trainer.close()


def test_nonfinite_update_names_the_rl_step_of_the_metrics(ckpt_trainer, monkeypatch):
  # The learner counts optimizer updates (2 before RL step 3 here); the error must name the
  # step the run logs.
  trainer = ckpt_trainer
  batch = {"old_logps": np.zeros((1, 4), np.float32)}
  monkeypatch.setattr(trainer, "_collect", lambda step, params: ({}, dict(batch)))

  def diverged(state, b):
    raise FloatingPointError("non-finite values at train step 2: ['loss']; params were not "
                             "updated.")
  monkeypatch.setattr(trainer.learner, "train_step", diverged)
  with pytest.raises(FloatingPointError, match=r"^RL step 3: non-finite values at train step 2"
                     r".*The checkpoints already written are unchanged\."):
    trainer.rl_step(3)
  monkeypatch.setitem(trainer.config.train, "epochs", 2)
  with pytest.raises(FloatingPointError, match=r"^RL step 3, epoch 1 of 2: "):
    trainer.rl_step(3)


def test_nonfinite_logits_in_the_rollouts_name_the_rl_step(ckpt_trainer, monkeypatch):
  """The rollout's error for a NaN or inf in the sampling logits names a request id (opaque:
  derived from the step) and no step; the learner's non-finite errors name the RL step."""
  trainer = ckpt_trainer

  def nan_logits(params, examples, **kwargs):
    raise FloatingPointError("rollout: the policy's logits held a NaN or inf while sampling "
                             "turn 0 of request 12 (group 1, sample 0), at token 3 of the turn")

  monkeypatch.setattr(trainer.sampler, "run", nan_logits)
  with pytest.raises(FloatingPointError, match=r"^RL step 4: rollout: the policy's logits held "
                     r"a NaN or inf .*The checkpoints already written are unchanged\.$"):
    trainer.rl_step(4)


def test_a_nonfinite_update_leaves_the_trainer_its_unchanged_state(ckpt_trainer, monkeypatch):
  """The update's state is donated; on a non-finite step the learner's error carries the state
  it was given (`Learner.train_step`, done here without the compile). The trainer kept the
  deleted buffers (its save, export and eval then raised 'Array has been deleted') and
  re-raised without the `state` its message names."""
  trainer = ckpt_trainer
  monkeypatch.setattr(trainer, "_collect",
                      lambda step, params: ({}, {"old_logps": np.zeros((1, 4), np.float32)}))
  before = jax.device_get(trainer.state)

  def diverged(state, batch):
    unchanged = jax.tree.map(jnp.copy, state)
    for x in jax.tree.leaves(state):
      x.delete()  # what donation does to the state passed in
    err = FloatingPointError("non-finite values at train step 0: ['loss']; params were not "
                             "updated (the error's `state` holds the unchanged params).")
    err.state = unchanged
    raise err

  monkeypatch.setattr(trainer.learner, "train_step", diverged)
  with pytest.raises(FloatingPointError, match=r"^RL step 1: non-finite values") as e:
    trainer.rl_step(1)
  assert e.value.state is trainer.state
  after = jax.device_get(trainer.state)  # raised "Array has been deleted" on the old code
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)


def test_a_skipped_nonfinite_update_is_said_with_its_step_and_metrics(ckpt_trainer, monkeypatch):
  """train.nonfinite='skip': the step and the non-finite metrics are named on the console (a
  run skipping every update showed it only as train/nonfinite=1 in metrics.jsonl)."""
  trainer = ckpt_trainer
  monkeypatch.setattr(trainer, "_collect",
                      lambda step, params: ({}, {"old_logps": np.zeros((1, 4), np.float32)}))
  said = []
  monkeypatch.setattr(trainer.writer, "message", said.append)
  skipped = {"loss": float("nan"), "grad_norm": float("inf"), "entropy": 1.0, "nonfinite": 1.0}
  monkeypatch.setattr(trainer.learner, "train_step", lambda state, batch: (state, dict(skipped)))
  m = trainer.rl_step(4)
  assert m["train/nonfinite"] == 1.0
  assert said == ["warning: RL step 4: non-finite loss, grad_norm; the update was skipped "
                  "(train.nonfinite='skip'): params, optimizer state and learning-rate "
                  "schedule are unchanged (train/nonfinite=1)"]
  monkeypatch.setattr(trainer.learner, "train_step",
                      lambda state, batch: (state, {"loss": 0.5, "grad_norm": 1.0,
                                                    "nonfinite": 0.0}))
  trainer.rl_step(5)
  assert len(said) == 1  # an update that was applied says nothing


def test_an_epoch_skipped_before_an_applied_one_stays_in_train_nonfinite(ckpt_trainer,
                                                                         monkeypatch):
  """train.epochs=2 with the first epoch's update skipped (train.nonfinite='skip'): the step's
  train/nonfinite is 1. The second epoch's metrics replaced the first's, so it read 0 and the
  skipped update was missing from metrics.jsonl."""
  trainer = ckpt_trainer
  monkeypatch.setattr(trainer, "_collect",
                      lambda step, params: ({}, {"old_logps": np.zeros((1, 4), np.float32)}))
  monkeypatch.setattr(trainer.writer, "message", lambda msg: None)
  monkeypatch.setitem(trainer.config.train, "epochs", 2)
  skipped = {"loss": float("nan"), "grad_norm": float("inf"), "nonfinite": 1.0}
  applied = {"loss": 0.5, "grad_norm": 1.0, "nonfinite": 0.0}
  for epochs, want in (([skipped, applied], 1.0), ([applied, skipped], 1.0),
                       ([applied, applied], 0.0)):
    it = iter(epochs)
    monkeypatch.setattr(trainer.learner, "train_step", lambda state, batch: (state, dict(next(it))))
    m = trainer.rl_step(6)
    assert m["train/nonfinite"] == want, (epochs, m)
    assert m["train/loss"] == epochs[-1]["loss"] or np.isnan(epochs[-1]["loss"])


def test_train_logprob_gap_is_the_first_epochs_and_the_rest_the_last_epochs(ckpt_trainer,
                                                                            monkeypatch):
  """train.epochs=2: train/logprob_gap (the sampler's disagreement with the learner, measured
  on the params that sampled) is the first epoch's; it was the second epoch's, which adds the
  first update's own change (0.5 here instead of 0.01). The loss and ratio stay the last's."""
  trainer = ckpt_trainer
  monkeypatch.setattr(trainer, "_collect",
                      lambda step, params: ({}, {"old_logps": np.zeros((1, 4), np.float32)}))
  monkeypatch.setitem(trainer.config.train, "epochs", 2)
  epochs = [{"loss": 0.25, "ratio_mean": 1.0, "logprob_gap": 0.01, "nonfinite": 0.0},
            {"loss": 0.75, "ratio_mean": 1.3, "logprob_gap": 0.5, "nonfinite": 0.0}]
  it = iter(epochs)
  monkeypatch.setattr(trainer.learner, "train_step", lambda state, batch: (state, dict(next(it))))
  m = trainer.rl_step(6)
  assert (m["train/logprob_gap"], m["train/loss"], m["train/ratio_mean"]) == (0.01, 0.75, 1.3)
  # An SFT-style learner reports no gap: none is made up.
  it = iter([{"loss": 0.25, "nonfinite": 0.0}, {"loss": 0.75, "nonfinite": 0.0}])
  assert "train/logprob_gap" not in trainer.rl_step(7)


def test_an_rl_step_outside_run_freezes_the_current_params_as_the_kl_reference(ckpt_trainer,
                                                                              monkeypatch):
  """`rl_step` without `run` (a loop of one's own) and loss.kl_coef > 0: the reference is the
  params as RL begins, frozen across steps, as `run` takes it. It was None, and the reference
  scoring raised a TypeError inside the model, after the step's rollouts."""
  import dataclasses
  trainer = ckpt_trainer
  monkeypatch.setattr(trainer, "loss_cfg", dataclasses.replace(trainer.loss_cfg, kl_coef=0.1))
  monkeypatch.setattr(trainer, "ref_params", None)
  monkeypatch.setattr(trainer, "state", trainer.state)
  monkeypatch.setattr(trainer, "_collect",
                      lambda step, params: ({}, {"old_logps": np.zeros((1, 4), np.float32)}))
  scored = []

  def score(params, batch):
    scored.append(jax.device_get(params))
    return jnp.zeros((1, 4)), jnp.zeros((1, 4))

  def update(state, batch):  # moves the params, as an update does
    assert "ref_logps" in batch
    return dataclasses.replace(state, params=jax.tree.map(lambda x: x + 1, state.params)), {}

  monkeypatch.setattr(trainer.learner, "score", score)
  monkeypatch.setattr(trainer.learner, "train_step", update)
  before = jax.device_get(trainer.state.params)
  trainer.rl_step(1)
  trainer.rl_step(2)
  assert len(scored) == 2
  for ref in scored:
    assert jax.tree.structure(ref) == jax.tree.structure(before)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(ref)):
      np.testing.assert_array_equal(a, b)


def test_rewards_reach_the_advantages_in_float64(ckpt_trainer, monkeypatch):
  """Rewards 4e-16 apart (one value computed two ways) are a zero-variance group; rounded to
  float32 first they straddled a rounding point, 1.2e-7 apart, and got advantages of +-0.06."""
  import dataclasses
  trainer = ckpt_trainer
  real, calls = trainer.env.reward, []
  mid = 1.0 + 2.0**-24  # halfway between two float32 values

  def straddling(*args):
    calls.append(None)
    return dataclasses.replace(real(*args), total=mid + (-1) ** len(calls) * 2.0**-52)

  monkeypatch.setattr(trainer.env, "reward", straddling)
  m, _ = trainer._collect(1, trainer._generator_params())  # rollouts and advantages, no update
  assert m["adv/num_groups"] > 0 and len(calls) == m["rollout/num_trajectories"]
  assert m["adv/num_zero_variance_groups"] == m["adv/num_groups"], m


def test_eval_counts_env_rewards_that_raise_and_scores_pass_at_k_per_example(ckpt_trainer,
                                                                             monkeypatch):
  """A reward that raises scores its trajectory a failure: eval counts them, so a broken
  verifier does not read as a model that solves nothing. pass@k groups samples by example."""
  from jaxagent.agent.trajectory import Trajectory
  trainer = ckpt_trainer
  monkeypatch.setitem(trainer.config.eval, "pass_k", 3)
  exs = trainer.eval_examples[:4]
  monkeypatch.setattr(trainer, "eval_examples", exs)

  def fake_run(params, examples, *, num_samples, seed, request_id_offset):
    return [Trajectory(request_id=i * num_samples + g, group_id=i, sample_index=g)
            for i in range(len(examples)) for g in range(num_samples)]

  monkeypatch.setattr(trainer.greedy, "run", fake_run)
  monkeypatch.setattr(trainer.sampler, "run", fake_run)
  solved = {(0, 0), (1, 2), (3, 1), (3, 2)}  # (example, sample): greedy is sample 0

  def reward(traj, ex, tok, step):
    if traj.group_id == 2 and traj.sample_index < 2:
      raise KeyError("gold")  # greedy's and 2 sampled: 3 of the 4 + 4 x 3 trajectories
    v = float((traj.group_id, traj.sample_index) in solved)
    return RewardOutput(v, {"correct": v}, {"correct": 1.0})  # the quickstart's success test

  from jaxagent.rewards import RewardOutput
  monkeypatch.setattr(trainer.env, "reward", reward)
  m = trainer.evaluate()
  assert m["eval/errors/env_reward"] == 3 / 16
  assert m["eval/pass@1"] == 1 / 4  # greedy: only example 0
  assert m["eval/pass@3"] == 3 / 4  # examples 0, 1 and 3 have a solved sample among 3
  assert m["eval/num_examples"] == 4


def test_eval_counts_an_is_success_that_raises_as_a_failed_sample(ckpt_trainer, monkeypatch):
  """A task's is_success that raises for one sample counts that sample as a failure, in its own
  metric; it ended the eval (and with it the run) with the user's exception."""
  from jaxagent.agent.trajectory import Trajectory
  from jaxagent.rewards import RewardOutput
  trainer = ckpt_trainer
  monkeypatch.setitem(trainer.config.eval, "pass_k", 2)
  monkeypatch.setattr(trainer, "eval_examples", trainer.eval_examples[:4])

  def fake_run(params, examples, *, num_samples, seed, request_id_offset):
    return [Trajectory(request_id=i * num_samples + g, group_id=i, sample_index=g)
            for i in range(len(examples)) for g in range(num_samples)]

  monkeypatch.setattr(trainer.greedy, "run", fake_run)
  monkeypatch.setattr(trainer.sampler, "run", fake_run)
  monkeypatch.setattr(trainer.env, "reward", lambda traj, ex, tok, step: RewardOutput(
      float(traj.group_id), {"g": float(traj.group_id)}, {"g": 1.0}))

  def is_success(out):
    if out.total == 1.0:
      raise KeyError("odd")  # example 1: greedy and both samples
    return out.total >= 2.0

  monkeypatch.setattr(trainer.env, "is_success", is_success)
  m = trainer.evaluate()
  assert m["eval/errors/is_success"] == 3 / 12
  assert m["eval/pass@1"] == 2 / 4 and m["eval/pass@2"] == 2 / 4  # examples 2 and 3
  assert m["eval/errors/env_reward"] == 0.0
  m = trainer.evaluate()  # counted per eval, not summed over evals
  assert m["eval/errors/is_success"] == 3 / 12


def test_a_failing_train_and_a_failing_eval_trajectory_are_each_counted_once(ckpt_trainer,
                                                                           monkeypatch):
  """One env.reward raise in an RL step and one in the eval of that step (as `run` does it):
  each counted once, in its own metric, by the same rule. An env whose success test reads a
  component (`out.components["correct"]`) ended the eval with a KeyError on the stand-in
  output of the reward that raised."""
  trainer = ckpt_trainer
  monkeypatch.setattr(trainer, "eval_examples", trainer.eval_examples[:3])
  real, raised = trainer.env.reward, []

  def once_per_split(traj, ex, tok, step):
    split = ex.id.split("-")[0]  # "train" / "eval"
    if split not in raised:
      raised.append(split)
      raise KeyError("gold")
    return real(traj, ex, tok, step)

  monkeypatch.setattr(trainer.env, "reward", once_per_split)
  monkeypatch.setattr(trainer.env, "is_success", lambda out: out.components["correct"] >= 1.0)
  m = trainer.rl_step(1)
  n = m["rollout/num_trajectories"]
  assert raised == ["train"] and m["reward/errors/env_reward"] == 1 / n
  m.update(trainer.evaluate())
  assert raised == ["train", "eval"]
  assert m["eval/errors/env_reward"] == 1 / 3 and m["reward/errors/env_reward"] == 1 / n
  assert m["eval/pass@1"] == 0.0 and m["eval/num_examples"] == 3


def test_late_steps_keep_request_ids_within_int32(ckpt_trainer):
  """Request ids grew with the step: past 2**31 the rollout refused them and the run ended (at
  step 21845 with 512 prompts x 16 samples). They now reuse an early step's block."""
  trainer = ckpt_trainer
  t = trainer.config.train
  per_step = t.max_sampling_rounds * t.prompts_per_step * 4 * t.samples_per_prompt
  late = 2**31 // per_step + 1  # its ids began past 2**31
  runs = []
  real = trainer.sampler.run

  def spy(params, exs, **kw):
    out = real(params, exs, **kw)
    runs.append([tr.request_id for tr in out])
    return out

  trainer.sampler.run = spy
  try:
    m, _ = trainer._collect(late, trainer._generator_params())
  finally:
    del trainer.sampler.run
  ids = [i for run in runs for i in run]
  assert m["rollout/num_trajectories"] == len(ids) > 0
  assert len(set(ids)) == len(ids) and 0 <= min(ids) and max(ids) < 2**31


def test_export_refuses_non_finite_params_and_writes_nothing(ckpt_trainer, tmp_path):
  from jaxagent.checkpoint import NonFiniteParamsError
  trainer = ckpt_trainer
  good = trainer.state
  leaves, tree = jax.tree.flatten(good.params)
  bad = jax.tree.unflatten(tree, [leaves[0] * jnp.nan, *leaves[1:]])
  trainer.state = good.replace(params=bad)
  try:
    with pytest.raises(NonFiniteParamsError, match="not exporting the policy to"):
      trainer.export(tmp_path / "out")
    assert not (tmp_path / "out").exists()
  finally:
    trainer.state = good


def test_export_records_its_own_step_over_an_earlier_exports(ckpt_trainer, tmp_path):
  # `python -m jaxagent.export` writes jaxagent_export.json; the end-of-run export into the
  # same folder replaced the weights and left that record naming the earlier step.
  out = tmp_path / "export"
  out.mkdir()
  (out / "jaxagent_export.json").write_text(json.dumps({"checkpoint": "ckpt/2", "step": 2}))
  ckpt_trainer.export(out)
  assert json.loads((out / "jaxagent_export.json").read_text()) == {
      "checkpoint": None, "step": ckpt_trainer.step}


def test_an_export_whose_record_fails_to_write_leaves_the_earlier_export(ckpt_trainer, tmp_path,
                                                                           monkeypatch):
  # The record was written after the new weights were in place: a full disk there left new
  # weights beside a record naming the earlier export's checkpoint and step.
  out = ckpt_trainer.export(tmp_path / "export")
  (out / "jaxagent_export.json").write_text(json.dumps({"checkpoint": "ckpt/2", "step": 2}))
  (out / "model.safetensors").write_bytes(b"earlier weights")
  before = {p.name: p.read_bytes() for p in out.iterdir()}
  write_text = pathlib.Path.write_text

  def full_disk(self, *args, **kwargs):
    if self.name == "jaxagent_export.json":
      raise OSError(28, "No space left on device")
    return write_text(self, *args, **kwargs)

  monkeypatch.setattr(pathlib.Path, "write_text", full_disk)
  with pytest.raises(OSError, match="No space left"):
    ckpt_trainer.export(out)
  assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_save_checkpoint_before_run_is_refused_and_leaves_the_workdir_resumable(ckpt_trainer):
  # A checkpoint written before the warm start would make every later run of the workdir
  # refuse to resume ("predates the warm start").
  trainer = ckpt_trainer
  with pytest.raises(ValueError, match="save_checkpoint before `run` has reached RL"):
    trainer.save_checkpoint(wait=True)
  trainer.ckpt.wait()
  assert trainer.ckpt.steps() == []
  assert trainer.restore() is None  # a fresh start, not an error


def test_an_error_on_the_lead_process_reaches_every_process(monkeypatch):
  from jaxagent import trainer as trainer_lib
  sent = []
  monkeypatch.setattr(jax, "process_count", lambda: 2)

  def boom():
    raise ValueError("bad example 7")

  # Process 0: its own exception, after broadcasting it in place of a result.
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  monkeypatch.setattr(trainer_lib, "_broadcast_from_lead", lambda obj: sent.append(obj) or obj)
  with pytest.raises(ValueError, match="bad example 7"):
    Trainer._on_lead(boom)
  assert sent == [trainer_lib._LeadError("ValueError: bad example 7")]
  assert Trainer._on_lead(lambda x: x + 1, 1) == 2 and sent[-1] == 2
  # Another process: a RuntimeError naming the failure instead of waiting for a result.
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  monkeypatch.setattr(trainer_lib, "_broadcast_from_lead", lambda obj: sent[0])
  with pytest.raises(RuntimeError, match="process 0 failed in boom: ValueError: bad example 7"):
    Trainer._on_lead(boom)
  monkeypatch.setattr(trainer_lib, "_broadcast_from_lead", lambda obj: {"ok": 1})
  assert Trainer._on_lead(boom) == {"ok": 1}  # not called off the lead


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), None, 1.0, "1"])
def test_env_reward_that_returns_a_non_finite_or_wrong_value_is_data(bad):
  """A user's env.reward returning NaN (or not a RewardOutput) for one trajectory scores it 0 and
  counts it, like a raise; the advantages would otherwise end the run on a NaN reward."""
  from jaxagent.agent import CalculatorEnv, Example, Trajectory
  from jaxagent.rewards import ENV_REWARD_ERROR, RewardOutput

  class Env(CalculatorEnv):
    def reward(self, trajectory, example, tokenizer, step):
      return RewardOutput(bad, {}, {}) if isinstance(bad, float) and bad != 1.0 else bad

  trainer = Trainer.__new__(Trainer)  # only what `_reward` reads
  trainer.env, trainer.tok, trainer._reward_failures = Env(), None, []
  out = trainer._reward(Trajectory(request_id=0), Example("q7", "2+2?", gold="4"), 0)
  assert out.total == 0.0 and out.errors == (ENV_REWARD_ERROR,)
  (msg,) = trainer._reward_failures
  assert "q7" in msg and ("finite" in msg or "not a jaxagent.rewards.RewardOutput" in msg)


def test_bad_records_of_a_users_dataset_are_named_when_the_trainer_starts(tmp_path, monkeypatch,
                                                                           capsys):
  """A task of one's own whose data holds an empty prompt, a message without content or a
  record that is not an Example fails at start, naming each record; it ended the run at the
  first RL step that drew it. An eval prompt that is also a train prompt gets a warning."""
  from jaxagent.agent.env import CalculatorEnv, Example
  import jaxagent.trainer as trainer_lib

  good = [Example(f"q{i}", [{"role": "user", "content": f"What is {i} + 1?"}], gold=str(i + 1))
          for i in range(8)]

  class MyData(CalculatorEnv):
    def __init__(self, train, eval_):
      super().__init__()
      self.splits = {"train": train, "eval": eval_}

    def examples(self, split):
      return self.splits[split]

  bad = good[2:] + [Example("empty", ""), Example("no-content", [{"role": "user"}]),
                    {"id": "raw", "prompt": "hi"}]
  monkeypatch.setattr(trainer_lib, "make_env", lambda name, **kw: MyData(bad, good[:2]))
  with pytest.raises(ValueError, match=r"3 of the 9 'train' examples of env 'calculator' cannot "
                     r"be used; fix or drop them: example 'empty' \(examples\[6\]\): .*empty; "
                     r"example 'no-content' \(examples\[7\]\): .*; examples\[8\] is a dict"):
    Trainer(_tiny(tmp_path))

  monkeypatch.setattr(trainer_lib, "make_env", lambda name, **kw: MyData(good[1:], good[:2]))
  trainer = Trainer(_tiny(tmp_path))
  trainer.close()
  out = capsys.readouterr().out
  assert "1 of the 2 eval examples have the same prompt as a train example" in out
  assert "not held out: 'q1'" in out
  from jaxagent import models
  from jaxagent.trainer import check_examples
  tok = models.load_tokenizer("smollm2-135m-instruct")
  prompts = check_examples(CalculatorEnv(), good, tok, "train")
  assert prompts == [tuple(CalculatorEnv().render_prompt(ex, tok)) for ex in good]


@pytest.mark.slow  # two trainers, a checkpoint saved and restored twice (about 30 s)
def test_resuming_over_changed_train_examples_is_named(tmp_path, monkeypatch, capsys):
  """The checkpoint keeps the prompt stream's position; over a dataset that changed since
  (records added to a task's own data file, same config), that position lands elsewhere in a
  new shuffle and the epoch repeats or skips examples: said, where it was silent."""
  from jaxagent.agent.env import CalculatorEnv, Example
  import jaxagent.trainer as trainer_lib

  class MyData(CalculatorEnv):
    def __init__(self, n):
      super().__init__()
      self.exs = [Example(f"q{i}", f"What is {i} + 1?", gold=str(i + 1)) for i in range(n)]

    def examples(self, split):
      return self.exs[:2] if split == "eval" else self.exs[2:]

  def trainer_over(n):
    monkeypatch.setattr(trainer_lib, "make_env", lambda name, **kw: MyData(n))
    return Trainer(_tiny(tmp_path, checkpoint_every=1, checkpoint_async=False))

  first = trainer_over(20)
  try:
    first.prompts.next(5)
    first.warm_started = True
    first.save_checkpoint(0, wait=True)
    capsys.readouterr()
    first._restore_done = False  # the same examples: resumed without a word about them
    assert first.restore() == 0
    assert "resumed from checkpoint" in (out := capsys.readouterr().out)
    assert "differ" not in out
  finally:
    first.close()
  again = trainer_over(24)
  try:
    assert again.restore() == 0
  finally:
    again.close()
  assert ("train examples differ from those of checkpoint" in (out := capsys.readouterr().out)
          and "(18 -> 22 examples, or their ids or prompts changed): the prompt order goes on "
          "from position 5" in out), out


@pytest.mark.slow  # a Trainer of its own (10 s); checkpoint_test checks the comparison
def test_resuming_with_another_model_architecture_is_refused(tmp_path):
  """The same config and the same array shapes, but a model that computes another function
  (an HF directory's config.json with another rope_theta under the same model.path): the run
  resumed and trained the weights as the other model. Refused now, naming the field; a
  runtime setting of the model (remat) may still change."""
  import dataclasses
  from jaxagent import checkpoint
  trainer = Trainer(_tiny(tmp_path, checkpoint_every=1, checkpoint_async=False))
  try:
    trainer.warm_started = True
    trainer.save_checkpoint(0, wait=True)
    cfg = trainer.cfg
    trainer.cfg = dataclasses.replace(cfg, rope_theta=cfg.rope_theta * 50)
    trainer._restore_done = False
    with pytest.raises(checkpoint.IncompatibleCheckpointError,
                       match=rf"another model .*\n  model rope_theta: {cfg.rope_theta!r} in "
                       rf"the checkpoint, {cfg.rope_theta * 50!r} now"):
      trainer.restore()
    trainer.cfg = dataclasses.replace(cfg, remat="full", max_seq_len=256)
    trainer._restore_done = False
    assert trainer.restore() == 0
  finally:
    trainer.close()


def test_a_task_whose_examples_raise_is_named_and_eval_size_0_reads_no_eval_split(
    tmp_path, monkeypatch):
  """A task of one's own reading a truncated data file reached the launcher as the bare
  "bad config: Unterminated string ..."; one without an eval split could not run even with
  eval.size=0 (no evals)."""
  from jaxagent.agent.env import CalculatorEnv, Example
  import jaxagent.trainer as trainer_lib
  (tmp_path / "train.jsonl").write_text('{"q": "What is 1 + 1?", "a": "2"}\n{"q": "What is 2')

  class FileData(CalculatorEnv):
    def __init__(self, path):
      super().__init__()
      self.path = path

    def examples(self, split):
      if split != "train":
        raise KeyError(split)
      with open(self.path) as f:
        return [Example(str(i), r["q"], gold=r["a"]) for i, r in enumerate(map(json.loads, f))]

  def trainer_over(name, **overrides):
    monkeypatch.setattr(trainer_lib, "make_env", lambda *_, **__: FileData(tmp_path / name))
    return Trainer(_tiny(tmp_path, **overrides))

  real_load = trainer_lib.load_model
  monkeypatch.setattr(trainer_lib, "load_model", lambda m, **_: pytest.fail("the model was loaded"))
  with pytest.raises(ValueError, match=r"env 'calculator' \(FileData\) cannot give its 'train' "
                     r"examples: examples\('train'\) raised JSONDecodeError: Unterminated string"):
    trainer_over("train.jsonl")
  (tmp_path / "fixed.jsonl").write_text('{"q": "What is 1 + 1?", "a": "2"}\n')
  with pytest.raises(ValueError, match=r"cannot give its 'eval' examples: examples\('eval'\) "
                     "raised KeyError: 'eval'"):
    trainer_over("fixed.jsonl")
  monkeypatch.setattr(trainer_lib, "load_model", real_load)
  t = trainer_over("fixed.jsonl", **{"eval.size": 0})
  try:
    assert [e.id for e in t.train_examples] == ["0"] and t.eval_examples == []
  finally:
    t.close()


def test_eval_size_0_runs_no_eval_before_or_after_the_warm_start(tmp_path, capsys):
  """eval.size=0 (no evals) still ran the evals around the warm start, which returned nothing:
  two metrics.jsonl records with no metric, "held-out pass@1 ...: nan" on the console and
  pass@1/before and pass@1/after_sft null in summary.json."""
  trainer = Trainer(_tiny(tmp_path, **{"eval.size": 0, "eval.before": True, "sft.steps": 1,
                                       "total_steps": 0}))
  trainer.warm_start = lambda: {"sft/last_loss": 1.0}  # its steps are not what is tested
  try:
    summary = trainer.run()
  finally:
    trainer.close()
  assert not [k for k in summary if k.startswith("pass@1")], summary
  assert "sft/last_loss" in summary
  rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert all(set(r) - {"step", "time"} for r in rows), rows
  assert "nan" not in capsys.readouterr().out


def test_an_empty_eval_split_with_eval_size_set_is_said_before_the_model_loads(
    tmp_path, monkeypatch, caplog):
  """A task with no eval examples (its own eval_size=0) under eval.size > 0: every eval
  returned nothing, so no eval/pass@1 was ever logged, without a word of why."""
  import logging

  from jaxagent.agent.env import CalculatorEnv, Example
  import jaxagent.trainer as trainer_lib

  class NoEval(CalculatorEnv):
    def examples(self, split):
      return [Example("q0", "What is 1 + 1?", gold="2")] if split == "train" else []

  class Loaded(Exception):
    pass

  def load_model(mcfg, **_):
    raise Loaded

  monkeypatch.setattr(trainer_lib, "make_env", lambda *_, **__: NoEval())
  monkeypatch.setattr(trainer_lib, "load_model", load_model)
  for size, said in ((8, True), (0, False)):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxagent.trainer"), pytest.raises(Loaded):
      Trainer(_tiny(tmp_path, **{"eval.size": size}))
    warned = [r.getMessage() for r in caplog.records if "no 'eval' examples" in r.getMessage()]
    assert bool(warned) == said, warned
    if said:
      assert "eval.size=8, but env 'calculator' has no 'eval' examples" in warned[0]


def test_warm_start_refuses_the_eval_split_and_names_a_missing_sft_split(tmp_path, monkeypatch):
  """A task of one's own whose `examples` returns the eval split for every split but "train"
  warm-started on the held-out examples, silently; one without an "sft" split failed with a
  bare KeyError; one whose "sft" split failed to load was said to have none."""
  from jaxagent.agent.env import CalculatorEnv, Example, NoSplitError
  import jaxagent.trainer as trainer_lib

  exs = [Example(f"q{i}", [{"role": "user", "content": f"What is {i} + {i}?"}], gold=str(2 * i),
                 metadata={"expression": f"{i} + {i}"}) for i in range(12)]

  class MyData(CalculatorEnv):
    def examples(self, split):
      return exs[4:] if split == "train" else exs[:4]

  monkeypatch.setattr(trainer_lib, "make_env", lambda name, **kw: MyData())
  trainer = Trainer(_tiny(tmp_path, **{"sft.steps": 2}))
  try:
    with pytest.raises(ValueError, match=r"the SFT warm start would train on 4 eval examples: env "
                       r"'calculator' returns examples for 'sft' whose prompts are eval prompts "
                       r"\('q0', 'q1', 'q2', 'q3'\)"):
      trainer.warm_start()
    monkeypatch.setattr(trainer.env, "examples", lambda split: {"train": exs[4:],
                                                                "eval": exs[:4]}[split])
    with pytest.raises(ValueError, match=r"sft.steps=2 warm-starts on the task's 'sft' split, and "
                       r"env 'calculator' has none \(examples\('sft'\) raised KeyError: 'sft'\)"):
      trainer.warm_start()

    def sft_raises(error):
      def examples(split):
        if split == "sft":
          raise error
        return {"train": exs[4:], "eval": exs[:4]}[split]
      return examples

    monkeypatch.setattr(trainer.env, "examples", sft_raises(
        NoSplitError("MyData keeps no demonstrations", split="sft")))
    with pytest.raises(ValueError, match=r"env 'calculator' has none \(examples\('sft'\) raised "
                       r"NoSplitError: MyData keeps no demonstrations\): .* or set sft.steps=0"):
      trainer.warm_start()
    # An "sft" split that fails to load (its file) is not a task without one.
    monkeypatch.setattr(trainer.env, "examples", sft_raises(ValueError("file not found")))
    with pytest.raises(ValueError, match=r"env 'calculator' failed to give it \(examples\('sft'\) "
                       r"raised ValueError: file not found\): fix the task's 'sft' data"):
      trainer.warm_start()
  finally:
    trainer.close()


def test_train_prompts_too_long_to_decode_are_counted_at_start(tmp_path, monkeypatch, capsys):
  """Such a prompt ends its trajectories unsampled each time it is drawn (a step of them trains
  nothing); the count was only seen in the rollout metrics, step after step."""
  from jaxagent.agent.env import CalculatorEnv, Example
  import jaxagent.trainer as trainer_lib

  short = [Example(f"s{i}", f"What is {i} + 1?", gold=str(i + 1)) for i in range(6)]
  huge = [Example(f"h{i}", "1 + " * 200 + f"{i}", gold="0") for i in range(2)]

  class MyData(CalculatorEnv):
    def __init__(self, train):
      super().__init__()
      self.train = train

    def examples(self, split):
      return self.train if split == "train" else short[:2]

  monkeypatch.setattr(trainer_lib, "make_env", lambda name, **kw: MyData(short[2:] + huge))
  Trainer(_tiny(tmp_path)).close()
  assert "warning: 2 of the 6 train prompts are too long to decode (longest " in (
      out := capsys.readouterr().out) and "rollout.max_len=128" in out and "'h0', 'h1'" in out
  assert "eval prompts" not in out
  # An eval prompt too long to decode is a failure in every eval: named at the start, once.
  monkeypatch.setattr(MyData, "examples",
                      lambda self, split: self.train if split == "train" else short[:2] + huge[:1])
  Trainer(_tiny(tmp_path)).close()
  assert ("warning: 1 of the 3 eval prompts are too long to decode (longest "
          in (out := capsys.readouterr().out)) and "pass@1" in out and "'h0'" in out
  monkeypatch.setattr(trainer_lib, "make_env", lambda name, **kw: MyData(huge))
  with pytest.raises(ValueError, match=r"2 of the 2 train prompts are too long .*no prompt is "
                     r"left to train on"):
    Trainer(_tiny(tmp_path))


def test_prompt_stream_covers_each_example_once_per_epoch_and_resumes_mid_epoch():
  """The RL prompt order: a seeded shuffle, every example once per epoch (a new order each
  epoch), and a state (JSON, as a checkpoint keeps it) that resumes at the next example."""
  from jaxagent.agent.env import Example
  from jaxagent.trainer import PromptStream
  exs = [Example(f"e{i}", f"p{i}") for i in range(7)]
  ids = [e.id for e in PromptStream(exs, seed=3).next(21)]
  epochs = [ids[k:k + 7] for k in range(0, 21, 7)]
  assert all(sorted(ep) == sorted(e.id for e in exs) for ep in epochs)
  assert len({tuple(ep) for ep in epochs}) > 1  # reshuffled per epoch
  assert [e.id for e in PromptStream(exs, seed=3).next(21)] == ids
  assert [e.id for e in PromptStream(exs, seed=4).next(7)] != ids[:7]
  first = PromptStream(exs, seed=3)
  first.next(10)  # mid-epoch (the second epoch's third example)
  state = json.loads(json.dumps(first.get_state()))
  resumed = PromptStream(exs, seed=3)
  resumed.set_state(state)
  assert [e.id for e in resumed.next(11)] == ids[10:]
  assert [e.id for e in PromptStream(exs[:1], seed=0).next(3)] == ["e0"] * 3  # smaller than a step
  with pytest.raises(ValueError, match="no training examples"):
    PromptStream([], seed=0)


def _scoring_trainer(threads, delay_s=0.0):
  """A Trainer with only what reward scoring reads, and an env whose reward is a deterministic
  function of the trajectory (raising for every fifth), optionally taking `delay_s`."""
  import time

  from jaxagent.agent import CalculatorEnv
  from jaxagent.rewards import RewardOutput

  class Env(CalculatorEnv):
    reward_threads = threads

    def reward(self, trajectory, example, tokenizer, step):
      time.sleep(delay_s * (1 + 0.2 * (trajectory.request_id % 3 == 0)))  # finish out of order
      if trajectory.request_id % 5 == 0:
        raise KeyError(f"bad {trajectory.request_id}")
      i = trajectory.request_id
      return RewardOutput(float(i % 3) + step, {"i": float(i)}, {"i": 1.0})

  trainer = Trainer.__new__(Trainer)
  trainer.env, trainer.tok, trainer._reward_failures = Env(), None, []
  return trainer


def test_concurrent_reward_scoring_matches_sequential_in_values_order_and_failures():
  """An env with reward_threads > 1 is scored on a thread pool: the outputs, their order and the
  recorded failures (first failure named in the step's error) are those of scoring in turn."""
  from jaxagent.agent import Example, Trajectory

  trajs = [Trajectory(request_id=i) for i in range(23)]
  exs = [Example(f"q{i}", "2+2?", gold="4") for i in range(23)]
  seq, par = _scoring_trainer(1), _scoring_trainer(6, delay_s=0.01)
  want = seq._score(trajs, exs, 2)
  assert want == [seq._reward(tr, ex, 2) for tr, ex in zip(trajs, exs)]
  assert par._score(trajs, exs, 2) == want
  assert par._reward_failures == seq._reward_failures[:len(par._reward_failures)]
  assert [f.split(":")[0] for f in par._reward_failures] == [f"example 'q{i}'" for i in range(0, 23, 5)]
  assert par._score([], [], 0) == []


def test_concurrent_reward_scoring_overlaps_slow_rewards():
  """8 rewards that each wait 0.5 s (a hanging unit test, a slow verifier) take about
  0.5 s * 8 / 4 on 4 threads, not 4 s one after another."""
  import time

  from jaxagent.agent import Example, Trajectory

  trajs = [Trajectory(request_id=i) for i in range(1, 9)]
  exs = [Example(f"q{i}", "2+2?", gold="4") for i in range(1, 9)]
  trainer = _scoring_trainer(4, delay_s=0.5)
  t0 = time.monotonic()
  outs = trainer._score(trajs, exs, 0)
  assert time.monotonic() - t0 < 2.5
  assert [o.components["i"] for o in outs if not o.errors] == [float(i) for i in range(1, 9) if i % 5]


def test_rewards_start_as_trajectories_finish_and_match_scoring_after_the_rollout():
  """With reward_threads > 1 each trajectory is scored once the rollout reports it final
  (`RolloutDriver.run(on_finish=...)`), beside the decoding of the others: here 8 trajectories
  finish 0.1 s apart and the first rewards run long before the rollout returns. Outputs, order
  and failures are those of `_score` after the rollout."""
  import time
  import types

  from jaxagent.agent import Example, Trajectory

  starts, returned = [], []

  class Sampler:
    def run(self, params, exs, *, num_samples, seed, request_id_offset, on_finish):
      trajs = [Trajectory(request_id=request_id_offset + i, group_id=i) for i in range(len(exs))]
      for tr in reversed(trajs):  # reported out of the returned order
        time.sleep(0.1)
        tr.finish("eos")
        on_finish(tr)
      returned.append(time.monotonic())
      return trajs

  trainer = _scoring_trainer(4, delay_s=0.05)
  reward = trainer.env.reward
  trainer.env.reward = lambda tr, *a: (starts.append(time.monotonic()), reward(tr, *a))[1]
  trainer.sampler, trainer._reward_wait_s, trainer._inflight = Sampler(), 0.0, {}
  trainer.config = types.SimpleNamespace(seed=0, train=types.SimpleNamespace(samples_per_prompt=1))
  exs = [Example(f"q{i}", "2+2?", gold="4") for i in range(1, 9)]
  trajs, outs = trainer._sample_and_score(None, exs, 3, offset=1)
  assert [t.request_id for t in trajs] == list(range(1, 9))
  seq = _scoring_trainer(1)
  assert outs == seq._score(trajs, exs, 3)
  assert trainer._reward_failures == seq._reward_failures == ["example 'q5': KeyError: 'bad 5'"]
  assert sum(t < returned[0] for t in starts) >= 6, (starts, returned)
  assert trainer._reward_wait_s < 0.5


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4"])
def test_bad_reward_threads_is_a_clear_error(bad):
  from jaxagent.agent import Example, Trajectory

  trainer = _scoring_trainer(bad)
  with pytest.raises(ValueError, match="reward_threads must be an int >= 1"):
    trainer._score([Trajectory(request_id=1)], [Example("q1", "2+2?", gold="4")], 0)


@pytest.mark.slow  # default-run time budget: 6-12 s; SIGTERM during RL stays in the default run
def test_sigterm_during_the_warm_start_stops_after_the_current_sft_step(tmp_path):
  # A preemption notice during a long warm start waited for all of it (and the eval after it)
  # before the run stopped. Now it stops after the SFT step it is in, saves nothing (step 0,
  # the end of the warm start, was not reached) and a rerun starts over.
  trainer = Trainer(_tiny(tmp_path, **{"sft.steps": 4, "sft.batch_size": 2,
                                       "checkpoint_every": 1}))
  saved, stepped = [], []
  trainer._save = saved.append
  evaluate = trainer.evaluate
  trainer.evaluate = lambda *a, **k: pytest.fail("no eval after a stopped warm start")
  train_step = step_lib.Learner.train_step

  def sigterm_in_step_two(self, state, batch):
    stepped.append(1)
    if len(stepped) == 2:
      trainer.request_stop("received SIGTERM")
    return train_step(self, state, batch)
  try:
    with mock.patch.object(step_lib.Learner, "train_step", sigterm_in_step_two):
      summary = trainer.run()
  finally:
    trainer.evaluate = evaluate
    trainer.close()
  assert len(stepped) == 2 and saved == []
  assert summary["stopped_at_step"] == 0
  assert summary["stopped_in"] == "SFT warm-start step 2 of 4"
  assert not trainer.warm_started and "pass@1/after_sft" not in summary


def test_a_skipped_nonfinite_warm_start_step_is_said(ckpt_trainer, monkeypatch, tmp_path):
  """train.nonfinite='skip' in the SFT warm start: a skipped step is named with its metrics, as
  an RL step's is. The console showed only 'sft step 1/2: loss 0.7000' (an infinite gradient
  norm with a finite loss), so a warm start that updated nothing looked like one that trained."""
  trainer = ckpt_trainer
  line = {"messages": [{"role": "user", "content": "2+2?"},
                       {"role": "assistant", "content": "<answer>4</answer>"}]}
  data = tmp_path / "sft.jsonl"
  data.write_text((json.dumps(line) + "\n") * 2)
  for k, v in (("data", str(data)), ("steps", 2), ("batch_size", 2)):
    monkeypatch.setitem(trainer.config.sft, k, v)
  monkeypatch.setattr(trainer, "state", trainer.state)  # (the warm start replaces it)
  said = []
  monkeypatch.setattr(trainer.writer, "message", said.append)
  monkeypatch.setattr(trainer.writer, "write", lambda *a, **k: None)
  results = iter([{"loss": 0.7, "grad_norm": float("inf"), "nonfinite": 1.0},
                  {"loss": 0.6, "grad_norm": 1.0, "nonfinite": 0.0}])
  monkeypatch.setattr(step_lib.Learner, "train_step",
                      lambda self, st, batch: (st, dict(next(results))))
  trainer.warm_start()
  assert [m for m in said if "non-finite" in m] == [
      "warning: SFT warm-start step 1 of 2: non-finite grad_norm; the update was skipped "
      "(train.nonfinite='skip'): params and optimizer state are unchanged"], said


def test_a_sigterm_after_the_last_step_is_caught_until_the_run_returns(ckpt_trainer, monkeypatch):
  """SIGTERM while a finished run exports, writes its summary and waits for the last (async)
  checkpoint: the trainer's handler was already gone, so the signal's default action killed
  the process there, with the final checkpoint possibly half written. Now it is caught (a stop
  request) until `run` returns, and the run finishes its writes."""
  import os
  import signal
  trainer = ckpt_trainer
  monkeypatch.setattr(trainer, "restore", lambda: trainer.config.total_steps)  # a finished run
  monkeypatch.setattr(trainer, "_stop_reason", None)
  monkeypatch.setattr(trainer.writer, "message", lambda msg: None)
  monkeypatch.setattr(trainer.writer, "plot", lambda: None)
  monkeypatch.setitem(trainer.config, "export", True)

  def export():
    os.kill(os.getpid(), signal.SIGTERM)  # the preemption notice, during the export
    return "exported"

  monkeypatch.setattr(trainer, "export", export)
  outside = []  # what the process's own handler (the default: exit) would have received
  previous = signal.signal(signal.SIGTERM, lambda signum, frame: outside.append(signum))
  try:
    summary = trainer.run()
  finally:
    signal.signal(signal.SIGTERM, previous)
  assert outside == [] and trainer._stop_reason == "received SIGTERM"
  assert summary["export"] == "exported"


def _sigint_run(trainer, monkeypatch, interrupts):
  """`trainer.run` from step 0 of 3 with stand-ins for the steps and saves; `interrupts` SIGINTs
  arrive during RL step 1. Returns (the summary, the steps saved, the messages)."""
  import os
  import signal
  monkeypatch.setattr(trainer, "restore", lambda: 0)
  monkeypatch.setattr(trainer, "_stop_reason", None)
  monkeypatch.setitem(trainer.config, "total_steps", 3)
  said, saved = [], []
  monkeypatch.setattr(trainer.writer, "message", said.append)
  monkeypatch.setattr(trainer.writer, "write", lambda step, m: None)
  monkeypatch.setattr(trainer.writer, "progress", lambda *a, **k: None)
  monkeypatch.setattr(trainer.writer, "plot", lambda: None)
  monkeypatch.setattr(trainer, "evaluate", lambda: {})
  monkeypatch.setattr(trainer, "_save", saved.append)
  if trainer.ckpt is not None:
    monkeypatch.setattr(trainer.ckpt, "steps", lambda: list(saved))
    monkeypatch.setattr(trainer.ckpt, "wait", lambda: None)

  def rl_step(step):
    for _ in range(interrupts if step == 1 else 0):
      os.kill(os.getpid(), signal.SIGINT)
    return {"reward/mean": 0.5}

  monkeypatch.setattr(trainer, "rl_step", rl_step)
  # The process's own handler, as in a shell or a notebook: KeyboardInterrupt.
  before = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    return trainer.run(), saved, said
  finally:
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_finishes_the_step_saves_and_returns(ckpt_trainer, monkeypatch):
  """Ctrl-C (SIGINT) raised KeyboardInterrupt wherever the run stood: the steps since the last
  checkpoint were lost, and a notebook's trainer was left mid-step. The first one now stops the
  run as a preemption notice does: the step finishes, a checkpoint is saved, `run` returns."""
  summary, saved, said = _sigint_run(ckpt_trainer, monkeypatch, interrupts=1)
  assert summary["stopped_at_step"] == 1 and saved == [1]
  path = ckpt_trainer.ckpt.step_path(1)
  assert said[-1] == (f"received SIGINT (Ctrl-C): saved checkpoint {path} at step 1; rerun the "
                      "same command to resume"), said


def test_ctrl_c_without_checkpointing_stops_after_the_step(ckpt_trainer, monkeypatch):
  # The run returns with the trained state in the trainer (a notebook can still export it).
  monkeypatch.setattr(ckpt_trainer, "ckpt", None)
  summary, saved, said = _sigint_run(ckpt_trainer, monkeypatch, interrupts=1)
  assert summary["stopped_at_step"] == 1 and saved == []
  assert said[-1] == ("received SIGINT (Ctrl-C): stopping after step 1 without a checkpoint "
                      "(checkpoint_every=0)"), said


def test_a_second_ctrl_c_interrupts_at_once(ckpt_trainer, monkeypatch):
  with pytest.raises(KeyboardInterrupt):
    _sigint_run(ckpt_trainer, monkeypatch, interrupts=2)


def test_a_run_whose_resume_failed_fails_again_instead_of_starting_over(ckpt_trainer,
                                                                       monkeypatch):
  """`run` again after its restore raised (checkpoints of another run, or none that reads): the
  restore counted as done with nothing to resume, so the second `run` started from scratch (warm
  start, step 0 saved) beside those checkpoints."""
  from jaxagent import checkpoint
  trainer = ckpt_trainer
  monkeypatch.setattr(trainer, "_restore_done", False)
  monkeypatch.setattr(trainer, "_resumed", None)

  def restore_latest(*args, **kwargs):
    raise checkpoint.IncompatibleCheckpointError("checkpoint 4 does not match this run")

  monkeypatch.setattr(trainer.ckpt, "restore_latest", restore_latest)
  monkeypatch.setattr(trainer.writer, "set_aside_earlier_run", lambda: None)
  monkeypatch.setattr(trainer, "_pre_rl", lambda: pytest.fail("the run started from scratch"))
  for _ in range(2):
    with pytest.raises(checkpoint.IncompatibleCheckpointError, match="checkpoint 4"):
      trainer.run()


def test_overlong_shaping_settings_are_checked_before_the_model_loads():
  from jaxagent.rewards.shaping import OverlongConfig
  from jaxagent.trainer import check_config, overlong_shaping
  c = get_config("tiny")
  assert overlong_shaping(c) is None  # off by default
  c.reward.overlong_cache_tokens = 8
  # Unset max: the rollout's policy-token budget.
  budget = c.rollout.max_turns * c.rollout.max_tokens_per_turn
  assert overlong_shaping(c) == (OverlongConfig(max_tokens=budget, cache_tokens=8), 1.0)
  c.reward.overlong_max_tokens, c.reward.overlong_coef = 40, 0.5
  assert overlong_shaping(c) == (OverlongConfig(max_tokens=40, cache_tokens=8), 0.5)
  for key, value, match in (
      ("overlong_cache_tokens", -1, "overlong_cache_tokens must be an int >= 0"),
      ("overlong_cache_tokens", 41, r"overlong_cache_tokens=41 must be at most "
                                    r"reward.overlong_max_tokens=40"),
      ("overlong_coef", -1.0, "overlong_coef must be a finite number >= 0"),
      ("overlong_coef", float("nan"), "overlong_coef must be a finite number >= 0")):
    bad = get_config("tiny")
    bad.reward.overlong_cache_tokens, bad.reward.overlong_max_tokens = 8, 40
    bad.reward[key] = value
    with pytest.raises(ValueError, match=match):
      check_config(bad)
  bad = get_config("tiny")
  bad.reward.overlong_cache_tokens = budget + 1
  with pytest.raises(ValueError, match=r"\(unset: rollout.max_turns=\d+ x "
                                       r"rollout.max_tokens_per_turn=\d+\)"):
    check_config(bad)
  # A budget of long turns over a short cache: no trajectory reaches max - cache policy
  # tokens, so the punishment would be 0 on every one.
  short = get_config("tiny")
  short.reward.overlong_cache_tokens = 8
  short.rollout.max_len = budget - 8 + 1  # a prompt token and budget - 8 policy tokens at most
  with pytest.raises(ValueError, match=rf"overlong_max_tokens={budget} \(unset: .*\) less "
                                       rf"reward.overlong_cache_tokens=8 is {budget - 8} policy "
                                       rf"tokens, but rollout.max_len={budget - 7} cuts"):
    check_config(short)
  short.rollout.max_len = budget - 8 + 2  # one policy token past max - cache: it can apply
  assert overlong_shaping(short) == (OverlongConfig(max_tokens=budget, cache_tokens=8), 1.0)
  short.rollout.max_len, short.rollout.max_total_tokens = 64, 20
  short.reward.overlong_max_tokens = 30
  with pytest.raises(ValueError, match=r"rollout.max_total_tokens=20 cuts"):
    overlong_shaping(short)
  # A config without the section (written before it existed) runs without the shaping.
  old = get_config("tiny")
  del old["reward"]
  check_config(old)
  assert overlong_shaping(old) is None


def test_overlong_shaping_is_added_to_the_rl_rewards(tmp_path):
  """`reward.overlong_*` adds DAPO's soft overlong punishment to any task's RL reward, as the
  component reward/overlong: a random tiny model earns 0 from the task, so the step's rewards
  are the punishment alone, a function of each trajectory's policy tokens."""
  from jaxagent.rewards.shaping import OverlongConfig, overlong_penalty
  from jaxagent import trainer as trainer_lib
  trainer = Trainer(_tiny(tmp_path, **{"reward.overlong_cache_tokens": 8,
                                       "reward.overlong_max_tokens": 14,
                                       "reward.overlong_coef": 0.5}))
  seen = []
  real = trainer_lib._with_overlong

  def spy(out, traj, shaping):
    shaped = real(out, traj, shaping)
    seen.append((traj.num_policy_tokens, out.total, shaped))
    return shaped
  try:
    with mock.patch.object(trainer_lib, "_with_overlong", spy):
      m = trainer.rl_step(1)
  finally:
    trainer.close()
  cfg = OverlongConfig(max_tokens=14, cache_tokens=8)
  assert seen
  for n, env_total, shaped in seen:
    assert shaped.components["overlong"] == overlong_penalty(n, cfg)
    assert shaped.weights["overlong"] == 0.5
    assert shaped.total == pytest.approx(env_total + 0.5 * overlong_penalty(n, cfg))
  want = np.mean([overlong_penalty(n, cfg) for n, _, _ in seen])
  assert m["reward/overlong"] == pytest.approx(want)
  assert m["reward/mean"] == pytest.approx(np.mean([s.total for _, _, s in seen]))
  assert any(overlong_penalty(n, cfg) < 0 for n, _, _ in seen)


def test_mini_batches_round_the_packed_rows_and_count_in_the_schedule(tmp_path, monkeypatch,
                                                                      caplog):
  """train.mini_batches: rows round to mini x micro x data-parallel devices (each mini-batch an
  equal, whole number of micro-batches per device, under both row roundings); the planner
  compiles the update for one mini-batch's rows (the warm start's for its own batch); the
  learning-rate schedule and the warmup warning count total_steps x epochs x mini_batches."""
  from jaxagent import trainer as trainer_lib
  from jaxagent.plan import planner
  from jaxagent.rl.packing import config_from_train
  c = _tiny(tmp_path, **{"train.mini_batches": 3, "train.micro_batches": 2})
  t = c.train
  pack = config_from_train(t, dp=4)
  assert pack.row_multiple == 24 and pack.round_rows(1) == 24 and pack.round_rows(25) == 48
  t.row_rounding = "pow2"
  assert config_from_train(t, dp=4).round_rows(25) == 48 and config_from_train(
      t, dp=4).round_rows(49) == 96
  t.row_rounding = "multiple"
  sizes = {"data": 1, "fsdp": 4, "tensor": 1}
  c.sft.steps, c.sft.batch_size = 1, 4
  s = planner.run_shapes(c, sizes, planner.PlanOptions(rows=30))
  assert (s.rows, s.mini_batches, s.update_rows, s.sft_rows) == (48, 3, 16, 8)
  del t["mini_batches"]  # configs written before the key: one update per epoch
  assert config_from_train(t, dp=4).row_multiple == 8
  assert planner.run_shapes(c, sizes, planner.PlanOptions(rows=30)).update_rows == 32
  t.mini_batches = True
  with pytest.raises(ValueError, match="train.mini_batches must be an int >= 1, got True"):
    config_from_train(t, dp=4)

  seen = {}
  real = step_lib.make_optimizer
  def spy(*args, **kwargs):
    seen.update(kwargs)
    return real(*args, **kwargs)
  monkeypatch.setattr(step_lib, "make_optimizer", spy)
  c = _tiny(tmp_path, **{"total_steps": 5, "train.epochs": 2, "train.mini_batches": 3,
                         "optimizer.schedule": "cosine"})
  step_lib.learner_parts(c)
  assert seen["total_steps"] == 5 * 2 * 3
  del c.train["mini_batches"]
  step_lib.learner_parts(c)
  assert seen["total_steps"] == 5 * 2

  monkeypatch.setattr(run_config, "_CONFIG_WARNINGS", set())
  c = _tiny(tmp_path, **{"total_steps": 4, "train.epochs": 2, "train.mini_batches": 2,
                         "optimizer.warmup_steps": 16})
  with caplog.at_level("WARNING", logger="jaxagent.trainer"):
    trainer_lib.check_config(c)
    c.optimizer.warmup_steps = 15  # below the 16 updates: the full rate is reached
    trainer_lib.check_config(c)
  said = [r.getMessage() for r in caplog.records if r.name == "jaxagent.trainer"]
  assert said == [
      "optimizer.warmup_steps=16 is not shorter than the run's total_steps=4 x train.epochs=2 "
      "x train.mini_batches=2 RL updates: the learning rate never reaches optimizer.lr (the "
      "last update runs at 0.938 of it); lower optimizer.warmup_steps below 16 if the full "
      "rate is meant"]


@pytest.mark.slow  # rollouts of 16 trajectories and two update programs: about 40 s on 2 cores
def test_mini_batches_make_one_update_per_mini_batch_per_epoch(ckpt_trainer, monkeypatch):
  """train.mini_batches=2, epochs=2: the step's batch splits into two halves of its rows each
  epoch (`mini_batch_rows`) and makes 4 optimizer updates against the same old log-probs; the
  params then differ from one update per epoch on the whole batch."""
  from jaxagent.rl import packing
  trainer = ckpt_trainer
  saved = jax.tree.map(jnp.copy, trainer.state)
  monkeypatch.setitem(trainer.config.train, "mini_batches", 2)
  monkeypatch.setitem(trainer.config.train, "epochs", 2)
  monkeypatch.setitem(trainer.config.train, "prompts_per_step", 8)  # 16 rows, one trajectory each
  dp = trainer.mesh.shape["data"] * trainer.mesh.shape["fsdp"]
  monkeypatch.setattr(trainer, "pack_cfg", packing.config_from_train(trainer.config.train, dp))
  metrics, batch = trainer._collect(1, trainer._generator_params())
  from jaxagent.trainer import mini_batch_rows
  rows = len(batch["tokens"])
  halves = [idx for epoch in range(2)
            for idx in mini_batch_rows(rows, 2, trainer.config.seed, 1, epoch)]
  assert rows % 2 == 0 and all(batch["loss_mask"][idx].any() for idx in halves)
  monkeypatch.setattr(trainer, "_collect", lambda step, params: (dict(metrics), dict(batch)))
  calls = []
  real = trainer.learner.train_step
  def spy(state, b):
    calls.append({k: np.array(v) for k, v in b.items()})
    state, m = real(state, b)
    m["logprob_gap"] = len(calls)  # which update's metric the step reports
    return state, m
  monkeypatch.setattr(trainer.learner, "train_step", spy)
  try:
    step0 = int(trainer.state.step)
    m = trainer.rl_step(1)
    assert int(trainer.state.step) == step0 + 4 and len(calls) == 4
    for b, half in zip(calls, halves):
      assert set(b) == set(batch)
      for k in batch:
        np.testing.assert_array_equal(b[k], batch[k][half])
    assert m["train/logprob_gap"] == 1  # the very first update's
    assert m["train/nonfinite"] == 0.0 and m["train/skipped_no_signal"] == 0.0
    two = jax.device_get(trainer.state.params)

    trainer.state = jax.tree.map(jnp.copy, saved)
    monkeypatch.setitem(trainer.config.train, "mini_batches", 1)
    calls.clear()
    trainer.rl_step(1)
    assert len(calls) == 2 and all(len(b["tokens"]) == rows for b in calls)
    one = jax.device_get(trainer.state.params)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(one),
                                                        jax.tree.leaves(two)))

  finally:
    trainer.state = saved


def test_mini_batches_split_the_rows_in_order_and_name_the_failing_one(ckpt_trainer,
                                                                       monkeypatch):
  """train.mini_batches=2, epochs=2: updates on the rows `mini_batch_rows` gives each epoch
  (two halves of the step's batch), train/* the last update's but train/logprob_gap the first's and
  train/nonfinite 1 if any was skipped; a mini-batch of padding rows only (no trained token)
  makes no update; a non-finite update names its epoch and mini-batch; a batch whose rows do
  not split into train.mini_batches (packed without `config_from_train`) is refused naming it."""
  trainer = ckpt_trainer
  monkeypatch.setitem(trainer.config.train, "mini_batches", 2)
  monkeypatch.setitem(trainer.config.train, "epochs", 2)
  monkeypatch.setattr(trainer.writer, "message", lambda msg: None)
  full = {"old_logps": np.arange(16, dtype=np.float32).reshape(4, 4) - 20,
          "loss_mask": np.ones((4, 4), np.float32)}
  monkeypatch.setattr(trainer, "_collect", lambda step, params: ({}, dict(full)))
  got = []
  def update(state, b):
    got.append(b)
    return state, {"loss": float(len(got)), "logprob_gap": 0.1 * len(got),
                   "nonfinite": float(len(got) == 2)}
  monkeypatch.setattr(trainer.learner, "train_step", update)
  m = trainer.rl_step(3)
  from jaxagent.trainer import mini_batch_rows
  seed = trainer.config.seed
  want = [full["old_logps"][idx, 0].tolist()
          for epoch in range(2) for idx in mini_batch_rows(4, 2, seed, 3, epoch)]
  assert [b["old_logps"][:, 0].tolist() for b in got] == want
  assert (m["train/loss"], m["train/logprob_gap"], m["train/nonfinite"]) == (4.0, 0.1, 1.0)
  got.clear()
  # Rows 2 and 3 padding only: a mini-batch made of them alone makes no update.
  full["loss_mask"] = np.concatenate([np.ones((2, 4), np.float32), np.zeros((2, 4), np.float32)])
  trainer.rl_step(3)
  want = [full["old_logps"][idx, 0].tolist()
          for epoch in range(2) for idx in mini_batch_rows(4, 2, seed, 3, epoch)
          if full["loss_mask"][idx].any()]
  assert [b["old_logps"][:, 0].tolist() for b in got] == want
  batch = {"old_logps": np.zeros((4, 4), np.float32), "loss_mask": np.ones((4, 4), np.float32)}
  monkeypatch.setattr(trainer, "_collect", lambda step, params: ({}, dict(batch)))
  seen = []
  def diverged(state, b):
    seen.append(len(b["old_logps"]))
    if len(seen) == 3:
      raise FloatingPointError("non-finite values at train step 2: ['loss']")
    return state, {"loss": 0.5, "nonfinite": 0.0}
  monkeypatch.setattr(trainer.learner, "train_step", diverged)
  with pytest.raises(FloatingPointError, match=r"^RL step 3, epoch 2 of 2, mini-batch 1 of 2: "):
    trainer.rl_step(3)
  assert seen == [2, 2, 2]
  batch = {"old_logps": np.zeros((3, 4), np.float32)}
  with pytest.raises(ValueError, match=r"RL step 3: the packed batch has 3 rows, not a multiple "
                     r"of train.mini_batches=2"):
    trainer.rl_step(3)


def test_mini_batch_rows_split_every_row_once_in_a_seeded_order_per_epoch():
  # The packer fills rows longest first: fixed contiguous mini-batches gave every epoch's first
  # update the longest trajectories. Each epoch draws its own split from (seed, step, epoch).
  from jaxagent.trainer import mini_batch_rows
  splits = {(seed, step, epoch): mini_batch_rows(16, 4, seed, step, epoch)
            for seed in (0, 1) for step in (1, 2) for epoch in (0, 1)}
  for parts in splits.values():
    assert [len(p) for p in parts] == [4] * 4
    assert sorted(np.concatenate(parts).tolist()) == list(range(16))
    assert all(np.all(np.diff(p) > 0) for p in parts)
  as_lists = lambda parts: [p.tolist() for p in parts]
  assert as_lists(mini_batch_rows(16, 4, 0, 1, 0)) == as_lists(splits[(0, 1, 0)])  # reproducible
  assert len({str(as_lists(p)) for p in splits.values()}) == len(splits)  # all differ
  assert as_lists(mini_batch_rows(4, 1, 0, 1, 0)) == [[0, 1, 2, 3]]
