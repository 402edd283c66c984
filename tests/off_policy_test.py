"""Rollouts collected ahead of the learner (`train.off_policy_steps`): which params sample which
step, what runs before what (with `loss.tis_cap`'s weights), the checkpoint item that carries
collected rollouts, errors, the rollout cancelled when the trainer closes, and the reward wait.
The exact resume with rollouts ahead is `trainer_test.py`'s stop-and-resume test (slow)."""
import json
import threading
import types

import jax
import numpy as np
import pytest

from jaxagent import checkpoint
from jaxagent.trainer import Trainer, _decode_ahead, _encode_ahead, check_config
from tests.trainer_test import _tiny


def _spied(trainer):
  """Record, in order, each step handed to the collector (with the params version it got),
  each collect (with a digest of the params it sampled from) and each update."""
  events, versions = [], {}
  collect, submit, train_step = trainer._collect, trainer._submit, trainer.learner.train_step
  done_decoding = trainer._done_decoding

  def spy_done_decoding(step):
    events.append(("decoded", step))
    return done_decoding(step)

  def spy_collect(step, params):
    events.append(("collect", step, checkpoint.digest(params)))
    return collect(step, params)

  def spy_submit(step, params, version):
    events.append(("submit", step, version))
    return submit(step, params, version)

  def spy_train(state, batch):
    events.append(("train", trainer.step))
    return train_step(state, batch)

  rl_step = trainer.rl_step

  def spy_rl_step(step):
    versions[step - 1] = checkpoint.digest(trainer.state.params)  # the params after step - 1
    return rl_step(step)

  trainer._collect, trainer._submit = spy_collect, spy_submit
  trainer._done_decoding = spy_done_decoding
  trainer.learner.train_step, trainer.rl_step = spy_train, spy_rl_step
  return events, versions


def _run(trainer):
  try:
    trainer.run()
  finally:
    trainer.close()
  return [json.loads(line) for line in
          (trainer.workdir / "metrics.jsonl").read_text().splitlines()]


# (k = 1 runs in the tests below too: staleness [0, 1, ...], its checkpoint, its devices)
@pytest.mark.parametrize("k", [0, 2])
def test_each_step_samples_from_the_params_k_steps_behind(tmp_path, k):
  """Which params sample which step, and what runs before what. With loss.tis_cap (one run
  checks both): the ratio is against the learner's log-probs before the step's update (so
  the only update of a step starts at ratio 1), and the sampler's log-probs give the weights
  (behavior_kl > 0 once the sampler's params are older than the learner's)."""
  n = 4 if k else 3
  trainer = Trainer(_tiny(tmp_path, total_steps=n, **{
      "train.off_policy_steps": k, "loss.tis_cap": 2.0, "optimizer.lr": 1e-2,
      "eval.size": 0, "log.dump_every": 0}))
  events, versions = _spied(trainer)
  rows = _run(trainer)
  collects = {e[1]: e[2] for e in events if e[0] == "collect"}
  assert sorted(collects) == list(range(1, n + 1))  # every step once, none past total_steps
  for s, digest in collects.items():
    # Step s samples from the params after step s - 1 - k (the start's, for the first steps).
    assert digest == versions[max(s - 1 - k, 0)], (s, k)
  # The params did change from step to step, so the check above can tell versions apart.
  assert len(set(versions.values())) == n
  assert [r["rollout/staleness"] for r in rows if "rollout/staleness" in r] == [
      float(min(s - 1, k)) for s in range(1, n + 1)]
  trained = [r for r in rows if "train/loss" in r]
  assert len(trained) == n
  for r in trained:
    assert abs(r["train/ratio_min"] - 1) < 1e-5 and abs(r["train/ratio_max"] - 1) < 1e-5
    assert 0 < r["train/tis_weight_mean"] <= 2.0 and 0 <= r["train/tis_clip_frac"] <= 1
  # Step 1 (and with k = 0 every step) samples from the params it trains: float32 numerics
  # only; the later steps with k = 2 from params one or two updates older.
  same, older = (trained, []) if k == 0 else (trained[:1], trained[1:])
  assert max(r["train/behavior_kl"] for r in same) < 1e-8
  assert max(r["train/logprob_gap"] for r in same) < 1e-4
  if older:
    assert min(r["train/behavior_kl"] for r in older) > 1e-3
    assert min(r["train/logprob_gap"] for r in older) > 1e-4
  order = [e[:2] for e in events if e[0] != "collect"]
  if k == 0:
    order = [e for e in order if e[0] != "decoded"]
  if k == 0:
    assert not any(e[0] == "submit" for e in events)  # no collector thread at all
    assert trainer._ahead_pool is None
  else:
    # Step s + k is handed to the collector before step s's update starts (so the two can
    # overlap), and not earlier than step s begins.
    for s in range(1, n + 1):
      handed = [i for i, e in enumerate(order) if e == ("submit", min(s + k, n))]
      trained = order.index(("train", s))
      assert handed and handed[0] < trained, (s, order)
    main = [e for e in order if e[0] != "decoded"]  # (the collector's thread adds those)
    assert main[:k + 2] == [("submit", s) for s in range(1, k + 2)] + [("train", 1)]
    # The devices are shared (one mesh): each update waits until the rollout in flight has
    # stopped decoding, and overlaps only its host work (rewards, packing).
    for s in range(1, n):
      assert order.index(("decoded", s + 1)) < order.index(("train", s)), order


def test_rollouts_ahead_round_trip_bit_for_bit_and_damage_is_named(tmp_path):
  batch = {"tokens": np.arange(12, dtype=np.int32).reshape(2, 6),
           "old_logps": np.array([[np.nan, -0.5, -1e-30, -np.inf, 0.0, -3.25]] * 2, np.float32),
           "loss_mask": np.array([[0, 1, 1, 0, 1, 1]] * 2, bool)}
  ready = {3: ({"reward/mean": 0.25, "pack/rows": 2, "x": float("nan")}, batch, 1),
           4: ({"reward/mean": 0.0}, None, 2), 2: ({"reward/mean": 1.0}, None, 0)}
  data = json.loads(json.dumps(_encode_ahead(ready)))  # as JSON goes through orbax
  back = _decode_ahead(data, after=2, path="ckpt/2")
  assert sorted(back) == [3, 4]  # only the steps after the checkpoint's
  metrics, got, version = back[3]
  assert version == 1 and metrics["reward/mean"] == 0.25 and metrics["pack/rows"] == 2
  assert np.isnan(metrics["x"])
  assert sorted(got) == sorted(batch)
  for key, want in batch.items():
    assert got[key].dtype == want.dtype
    np.testing.assert_array_equal(got[key], want)
  assert back[4] == ({"reward/mean": 0.0}, None, 2)
  data["steps"]["3"]["npz_base64"] = data["steps"]["3"]["npz_base64"][:40]
  with pytest.raises(checkpoint.CheckpointError, match=r"ckpt/2: its rollouts_ahead item"):
    _decode_ahead(data, after=2, path="ckpt/2")


def test_a_collector_error_names_its_step_and_the_run_closes(tmp_path):
  """Step 2's rollouts, collected during step 1, fail. Step 1's checkpoint waits for them:
  it is still written (the prompt stream's position before step 2, no rollouts ahead), and the
  error is raised at step 2, as without rollouts ahead (it ended the run in step 1's save)."""
  trainer = Trainer(_tiny(tmp_path, total_steps=3, checkpoint_every=1, **{
      "train.off_policy_steps": 1, "eval.size": 0, "log.dump_every": 0}))
  collect, before = trainer._collect, {}

  def broken(step, params):
    before[step] = trainer.prompts.get_state()
    if step == 2:
      trainer.prompts.next(3)  # (a failure after the rollout has drawn its prompts)
      raise FloatingPointError("NaN in the logits of request 5")
    return collect(step, params)
  trainer._collect = broken
  with pytest.raises(FloatingPointError, match=r"^RL step 2: NaN in the logits of request 5"):
    _run(trainer)
  assert trainer.step == 2  # step 1 trained; step 2 found its rollouts failed
  assert trainer._ahead_pool is None and not trainer._inflight
  ckpt = tmp_path / "run" / "checkpoints" / "1"
  meta = json.loads((ckpt / "meta" / "metadata").read_text())
  assert not meta.get("rollouts_ahead") and not (ckpt / "rollouts_ahead").exists()
  assert meta["data"] == json.loads(json.dumps(before[2])) != json.loads(json.dumps(before[1]))


def test_a_collector_error_on_process_0_names_the_step_on_the_others(monkeypatch):
  """Off process 0 there is no collector: `_take` receives process 0's error in place of the
  rollouts, and the RuntimeError it raises names the step they were for."""
  from jaxagent import trainer as trainer_lib
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  sent = trainer_lib._LeadError("RuntimeError: the verifier is gone")
  monkeypatch.setattr(trainer_lib, "_broadcast_from_lead", lambda obj: sent)
  stand_in = types.SimpleNamespace(_inflight={2: (None, 0, None)},
                                   _on_lead=Trainer._on_lead)
  with pytest.raises(RuntimeError, match=r"^process 0 failed in the rollouts of RL step 2 "
                     r"\(collected ahead, train.off_policy_steps\): RuntimeError: the verifier"):
    Trainer._take(stand_in, 2)
  assert not stand_in._inflight  # taken: a later settle does not wait on it again


@pytest.mark.parametrize("bad", [-1])
def test_bad_off_policy_steps_is_refused_by_name(tmp_path, bad):
  with pytest.raises(ValueError, match=r"train.off_policy_steps must be an int >= 0"):
    check_config(_tiny(tmp_path, **{"train.off_policy_steps": bad}))


def test_a_checkpoint_holds_the_rollouts_collected_ahead(tmp_path):
  """The save waits for the rollouts in flight and stores them; a new trainer over the same
  workdir resumes with them instead of collecting them again."""
  trainer = Trainer(_tiny(tmp_path, total_steps=2, checkpoint_every=1, **{
      "train.off_policy_steps": 1, "eval.size": 0, "log.dump_every": 0}))
  rl_step = trainer.rl_step

  def stop_after_step_1(step):
    m = rl_step(step)
    trainer.request_stop("test stop")
    return m
  trainer.rl_step = stop_after_step_1
  _run(trainer)
  meta = json.loads((tmp_path / "run" / "checkpoints" / "1" / "meta" / "metadata").read_text())
  assert meta["rollouts_ahead"] is True
  saved = json.loads((tmp_path / "run" / "checkpoints" / "1" / "rollouts_ahead" /
                      "metadata").read_text())
  assert list(saved["steps"]) == ["2"] and saved["steps"]["2"]["params_version"] == 0

  again = Trainer(_tiny(tmp_path, total_steps=2, checkpoint_every=1, **{
      "train.off_policy_steps": 1, "eval.size": 0, "log.dump_every": 0}))
  events, _ = _spied(again)
  rows = _run(again)
  assert not [e for e in events if e[0] == "collect"]  # step 2's rollouts came from the file
  assert [r["rollout/staleness"] for r in rows if "rollout/staleness" in r] == [0.0, 1.0]
  assert int(jax.device_get(again.state.step)) == 2


def test_split_rollout_devices():
  from jaxagent import sharding
  devs = jax.devices()
  assert len(devs) == 8  # (tests/conftest.py: 8 CPU devices)
  assert sharding.split_rollout_devices(0) == (devs, None)
  assert sharding.split_rollout_devices(3) == (devs[:5], devs[5:])
  for bad, match in ((8, "leaves no device to train on: there are 8"),
                     (-1, "must be an int >= 0"), (1.0, "must be an int >= 0")):
    with pytest.raises(ValueError, match=f"rollout.devices.*{match}"):
      sharding.split_rollout_devices(bad)


def test_rollouts_on_their_own_devices_beside_the_learner(tmp_path, capsys):
  """rollout.devices=2: the learner's mesh is the first 6 devices, the engines decode on the
  last 2 from a copy of the weights placed there, and the run trains with rollouts ahead."""
  trainer = Trainer(_tiny(tmp_path, total_steps=2, **{
      "rollout.devices": 2, "train.off_policy_steps": 1, "eval.size": 0, "log.dump_every": 0}))
  devs = jax.devices()
  assert list(trainer.mesh.devices.flat) == devs[:6]
  assert list(trainer.gen_mesh.devices.flat) == devs[6:]
  assert trainer.sample_engine.mesh is trainer.gen_mesh
  gen = trainer._generator_params(own_buffers=True)
  assert {d for x in jax.tree.leaves(gen) for d in x.devices()} == set(devs[6:])
  events, versions = _spied(trainer)
  rows = [r for r in _run(trainer) if "train/loss" in r]
  assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0]
  assert {d for x in jax.tree.leaves(trainer.state.params) for d in x.devices()} == set(devs[:6])
  collects = {e[1]: e[2] for e in events if e[0] == "collect"}
  assert collects[1] == collects[2] == versions[0]  # both from the start's params
  # Without rollouts ahead the two device sets would take turns: said at the start.
  Trainer(_tiny(tmp_path / "sync", **{"rollout.devices": 2, "eval.size": 0})).close()
  assert "rollout.devices=2 with train.off_policy_steps=0" in capsys.readouterr().out


@pytest.mark.parametrize("threads", [1, 4])
def test_reward_wait_is_the_reward_time_left_after_the_rollout(threads):
  """`time/reward_wait_s` (`_reward_wait_s`): with one reward thread every reward runs after
  the rollout has returned, so the wait is all of their time (it read 0); with several, the
  rewards of trajectories that finished early have run beside the rollout."""
  import time

  from jaxagent.agent import Example, Trajectory
  from tests.trainer_test import _scoring_trainer

  class Sampler:
    def run(self, params, exs, *, num_samples, seed, request_id_offset, on_finish=None):
      trajs = [Trajectory(request_id=request_id_offset + i, group_id=i) for i in range(len(exs))]
      for tr in trajs:
        time.sleep(0.05)
        tr.finish("eos")
        if on_finish is not None:
          on_finish(tr)
      return trajs

  trainer = _scoring_trainer(threads, delay_s=0.05)
  trainer.sampler, trainer._reward_wait_s, trainer._inflight = Sampler(), 0.0, {}
  trainer.config = types.SimpleNamespace(seed=0, train=types.SimpleNamespace(samples_per_prompt=1))
  exs = [Example(f"q{i}", "2+2?", gold="4") for i in range(1, 7)]
  trainer._sample_and_score(None, exs, 1, offset=1)
  if threads == 1:  # six rewards of >= 0.05 s, one after another
    assert trainer._reward_wait_s >= 0.3, trainer._reward_wait_s
  else:  # only the last trajectory's reward (about 0.05 s) was left
    assert trainer._reward_wait_s < 0.2, trainer._reward_wait_s


def test_a_cancelled_rollout_ends_within_a_step_with_its_episodes_closed():
  """`RolloutDriver.run(cancel=event)`: once the event is set (here when the first trajectory
  finishes) the run raises RolloutCancelled before its next decode call, with every episode it
  opened closed, and the trajectories not yet admitted never start."""
  from jaxagent.agent import RolloutConfig, RolloutDriver
  from jaxagent.agent.rollout import RolloutCancelled
  from tests.agent import rollout_test as rt

  opened, closed = [], []

  class Env(rt.ScriptedCalcEnv):
    def new_episode(self, example):
      ep = super().new_episode(example)
      opened.append(example.id)
      close = ep.close
      ep.close = lambda: (closed.append(example.id), close())[1]
      return ep

  # Request 0 answers at once; the others call a tool and would take two more turns.
  texts = {rid: ["<calc>1+1</calc>", "<calc>2+2</calc>", "<answer>4</answer>"]
           for rid in range(8)}
  texts[0] = ["<answer>2</answer>"]
  fake = rt.FakeEngine(rt._script_from_texts(texts), slots=3, max_len=256)
  driver = RolloutDriver(fake, Env(), tokenizer=rt.TOK, cfg=RolloutConfig(decode_steps=4))
  cancel, finished = threading.Event(), []

  def on_finish(tr):
    finished.append(tr.request_id)
    cancel.set()
  try:
    with pytest.raises(RolloutCancelled, match=r"cancelled with 2 trajectories under way and 5 "
                       r"not started"):
      driver.run(None, rt._examples(8), on_finish=on_finish, cancel=cancel)
    assert finished == [0] and len(opened) == 3 and sorted(closed) == sorted(opened)
    with pytest.raises(TypeError, match="cancel must be a threading.Event"):
      driver.run(None, rt._examples(1), cancel=True)
    cancel.clear()  # (an event never set changes nothing)
    assert len(driver.run(None, rt._examples(2), cancel=cancel)) == 2
  finally:
    driver.close()


def test_closing_the_trainer_cancels_the_rollout_collected_ahead():
  """`Trainer.close` (`_close_collector`) with a collection under way on the collector thread:
  its rollout is cancelled and close returns at once; it waited for the whole rollout (and
  its rewards and packing), so a run that failed, or a second Ctrl-C, hung until it ended."""
  import concurrent.futures
  import time

  from jaxagent.agent import Example
  from jaxagent.agent.rollout import RolloutCancelled
  from tests.trainer_test import _scoring_trainer

  started = threading.Event()

  class SlowSampler:  # a rollout of 20 s unless cancelled
    def run(self, params, exs, *, num_samples, seed, request_id_offset, cancel=None):
      started.set()
      t0 = time.monotonic()
      while time.monotonic() - t0 < 20:
        if cancel is not None and cancel.is_set():
          raise RolloutCancelled("cancelled")
        time.sleep(0.01)
      return []

  trainer = _scoring_trainer(1)
  trainer.sampler, trainer._reward_wait_s, trainer._inflight = SlowSampler(), 0.0, {}
  trainer._cancel_ahead = threading.Event()
  trainer.config = types.SimpleNamespace(seed=0, train=types.SimpleNamespace(samples_per_prompt=1))
  trainer._ahead_pool = concurrent.futures.ThreadPoolExecutor(1)
  future = trainer._ahead_pool.submit(trainer._sample_and_score, None, [Example("q", "2+2?")], 2, 0)
  queued = trainer._ahead_pool.submit(pytest.fail, "a step not started must not run")
  assert started.wait(10)
  t0 = time.monotonic()
  trainer._close_collector()
  assert time.monotonic() - t0 < 5
  assert isinstance(future.exception(), RolloutCancelled) and queued.cancelled()
  assert trainer._ahead_pool is None and not trainer._cancel_ahead.is_set()


def test_a_failed_collection_waited_for_by_an_eval_is_raised_at_its_own_step():
  """`_settle_ahead` (before an eval or a checkpoint) keeps a collection's failure and the
  rollouts after it; the failure is raised when its step comes to train, without handing any
  further step to the collector. It was raised from the eval or checkpoint of the step before."""
  import concurrent.futures

  failed, done = concurrent.futures.Future(), concurrent.futures.Future()
  failed.set_exception(ValueError("example 'q7': env 'x' could not render its prompt"))
  done.set_result(({"reward/mean": 0.5}, None))
  trainer = Trainer.__new__(Trainer)
  trainer._inflight = {2: (failed, 0, None), 3: (done, 1, None)}
  trainer._ready, trainer._failed, trainer._prompts_before = {}, {}, {}
  trainer.off_policy_steps, trainer.config = 1, types.SimpleNamespace(total_steps=5)
  trainer._submit = lambda *a: pytest.fail("a step handed to the collector after a failure")
  trainer._settle_ahead()  # (what an eval does first)
  assert not trainer._inflight and list(trainer._failed) == [2]
  assert trainer._ready == {3: ({"reward/mean": 0.5}, None, 1)}
  with pytest.raises(ValueError, match="could not render its prompt"):
    trainer._rollouts(2)
  assert not trainer._failed
