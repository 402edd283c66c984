"""Multi-process JAX on one machine: 2 CPU processes x 2 devices (gloo collectives) against one
process x 4 devices with the same global batch.

* `test_learner_two_processes_match_one` (slow): `Learner.train_step` on identical packed
  batches for three steps gives the same losses and params (up to the all-reduce order) as one
  process, and the checkpoint both processes write together restores onto the one-process mesh.
* `test_trainer_two_processes_match_one` (slow): the whole tiny quickstart through
  `python -m jaxagent.launch --num_processes=2 ...` (process 0 rolls out and broadcasts) logs the
  same rewards and losses as one process, and only process 0 writes metrics; parametrized by
  `train.off_policy_steps` (1: process 0's collector thread gathers the next step's rollouts
  during the update, checkpoints keep them, and a two-process resume from step 1 trains on them).
* `test_trainer_two_processes_stop_and_resume_with_rollouts_ahead` (slow): SIGTERM on process 1
  with rollouts collected ahead: both stop at one step, and the resume repeats one process's run.

This file is also the worker those tests start (`python tests/multihost_test.py learner ...`).
"""
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
STEPS = 3


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _env(devices: int, cache=None) -> dict:
  from tests.conftest import CPU_TEST_XLA_FLAGS  # here: this file also runs as a worker script
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {CPU_TEST_XLA_FLAGS}")
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(k, None)
  if cache is not None:
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return env


def _wait_all(procs, timeout=400) -> list[str]:
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=timeout)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-4000:]
  return outs


# ----------------------------------------------------------------------------- learner
def _train_learner(mesh):
  """Three train steps of a tiny model on `mesh` over packed batches that every process builds
  identically (same seeds): (losses, final state, learner)."""
  import jax
  import optax
  from jaxagent import models
  from jaxagent.rl import packing, step as step_lib
  cfg = models.get_config("tiny-llama", vocab_size=256)
  # Plain SGD: Adam's first steps turn rounding-level gradient differences (the all-reduce
  # order differs between the two layouts) into +-lr updates, which would hide real errors.
  learner = step_lib.Learner(cfg, step_lib.StepConfig(micro_batches=2), optax.sgd(0.5), mesh)
  state = learner.init(jax.device_get(models.init_params(cfg, jax.random.key(0), std=0.1)))
  rng = np.random.default_rng(0)
  pcfg = packing.PackingConfig(max_len=32, row_multiple=8)
  losses = []
  for _ in range(STEPS):
    items = []
    for _ in range(14):
      n = int(rng.integers(6, 16))
      mask = (rng.random(n) < 0.6).astype(np.float32)
      mask[0] = 0.0  # position 0 has no log-prob
      items.append(packing.PackItem(tokens=rng.integers(0, 256, n).astype(np.int32),
                                    loss_mask=mask, old_logps=-5.0 * mask,
                                    advantages=float(rng.normal())))
    state, m = learner.train_step(state, packing.pack(items, pcfg).arrays())
    losses.append(m["loss"])
  return np.array(losses), state, learner


def _learner_worker(out_dir: str, num_processes: int, process_id: int, coordinator: str):
  """`_train_learner` on the global mesh of a multi-process run, then a checkpoint that all
  processes write together; process 0 saves the losses and gathered params."""
  from jaxagent.launch import init_runtime
  init_runtime(coordinator, num_processes, process_id)
  import jax
  from jax.experimental import multihost_utils
  from jaxagent import checkpoint, sharding
  assert jax.process_count() == num_processes and jax.device_count() == 4, jax.devices()
  losses, state, _ = _train_learner(sharding.make_mesh(1, -1, 1))
  mgr = checkpoint.CheckpointManager(pathlib.Path(out_dir) / "checkpoints",
                                     checkpoint.CheckpointConfig(every=1))
  mgr.save(STEPS, state, meta={"config": {}, "warm_started": True})
  mgr.close()
  host = multihost_utils.process_allgather(state.params, tiled=True)
  if jax.process_index() == 0:
    leaves = {str(i): np.asarray(x) for i, x in enumerate(jax.tree.leaves(host))}
    np.savez(pathlib.Path(out_dir) / "result.npz", losses=losses, **leaves)


@pytest.mark.slow  # default-run time budget: two processes of their own, 20-39 s on 2 cores
def test_learner_two_processes_match_one(tmp_path):
  port = _free_port()
  procs = [subprocess.Popen(
      [sys.executable, __file__, "learner", str(tmp_path), "2", str(i), f"localhost:{port}"],
      cwd=REPO, env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  # Meanwhile the reference: one process (this one), 4 devices, the same global batches.
  import jax
  from jaxagent import checkpoint, sharding
  mesh = sharding.make_mesh(1, -1, 1, devices=jax.devices()[:4])
  try:
    want_losses, want_state, learner = _train_learner(mesh)
  finally:
    _wait_all(procs)
  got = np.load(tmp_path / "result.npz")
  assert np.all(np.isfinite(want_losses)) and len(want_losses) == STEPS
  np.testing.assert_allclose(got["losses"], want_losses, rtol=1e-5, atol=1e-6)
  want_params = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(want_state.params))]
  assert len(want_params) == len(got.files) - 1
  for i, want in enumerate(want_params):
    np.testing.assert_allclose(got[str(i)], want, rtol=1e-5, atol=1e-6, err_msg=f"param {i}")

  # The checkpoint the two processes wrote together restores here, onto the one-process mesh.
  r = checkpoint.CheckpointManager(tmp_path / "checkpoints").restore_latest(
      checkpoint.state_target(want_state, mesh))
  assert r.step == STEPS and int(r.state.step) == STEPS
  for i, x in enumerate(jax.tree.leaves(jax.device_get(r.state.params))):
    np.testing.assert_array_equal(np.asarray(x), got[str(i)])


# ----------------------------------------------------------------------------- trainer
TRAINER_FLAGS = ("--config=configs/quickstart.py:tiny", "--config.total_steps=3",
                 "--config.log.tensorboard=False", "--config.loss.entropy_coef=0.01",
                 "--config.loss.kl_coef=0.01", "--config.train.zero_variance=keep",
                 "--config.eval.size=2", "--config.eval.every=0", "--config.log.dump_every=1",
                 "--config.checkpoint_every=1")


def _trainer_runs(workdir, n, cache, tok_dir, extra=()):
  port = _free_port()
  dist = (lambda i: [f"--coordinator_address=localhost:{port}", f"--num_processes={n}",
                     f"--process_id={i}"]) if n > 1 else (lambda i: [])
  return [subprocess.Popen(
      [sys.executable, "-m", "jaxagent.launch", *TRAINER_FLAGS, *extra,
       f"--config.workdir={workdir}", f"--config.model.tokenizer={tok_dir}", *dist(i)],
      cwd=REPO, env=_env(4 // n, cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True) for i in range(n)]


def _records(workdir) -> dict[int, dict]:
  """The RL steps' metric records of a run: step -> record."""
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return {r["step"]: r for r in map(json.loads, lines) if r["step"] > 0}


def _logged(workdir, step: int) -> bool:
  """Whether a running job has logged `step` yet."""
  try:
    return step in _records(workdir)
  except (OSError, ValueError):  # no file yet, or a line being written
    return False


def _samples(workdir, step: int) -> list:
  return [json.loads(l)["tokens"] for l in (workdir / "samples" / f"step_{step:06d}.jsonl").open()]


def _assert_same_steps(want: dict, got: dict, steps, label: str) -> None:
  """Two runs' records of `steps`: the same rollouts, rewards and packing, and losses equal up to
  the all-reduce order."""
  for step in steps:
    a, b = want[step], got[step]
    for k in ("reward/mean", "rollout/policy_tokens", "pack/rows", "adv/kept_frac",
              "rollout/staleness"):
      assert b.get(k) == a.get(k), (label, step, k, a.get(k), b.get(k))
    for k in ("train/loss", "train/entropy", "train/grad_norm"):
      np.testing.assert_allclose(b[k], a[k], rtol=1e-4, err_msg=f"{label}: step {step} {k}")


def _ahead_steps(workdir, step: int) -> list[int] | None:
  """The steps whose rollouts checkpoint `step` holds (its `rollouts_ahead` item), or None."""
  item = workdir / "checkpoints" / str(step) / "rollouts_ahead"
  if not item.exists():
    return None
  # The JSON written once, by process 0 (and the checkpointer's mark that the item is complete).
  files = sorted(str(f.relative_to(item)) for f in item.rglob("*") if f.is_file())
  assert files in (["metadata"], ["commit_success.txt", "metadata"]), files
  return sorted(int(s) for s in json.loads((item / "metadata").read_text())["steps"])


@pytest.mark.slow
@pytest.mark.parametrize("off_policy_steps", [0, 1])
def test_trainer_two_processes_match_one(tmp_path, off_policy_steps):
  """With `train.off_policy_steps=1` process 0's collector thread gathers step s + 1's rollouts
  during step s and every process takes them from process 0's broadcast: the same records as
  one process, staleness [0, 1, 1]; checkpoints 1 and 2 hold the next step's rollouts, and a
  two-process resume from checkpoint 1 trains on them and repeats steps 2 and 3."""
  from jaxagent import models
  one, two = tmp_path / "one", tmp_path / "two"
  extra = (f"--config.train.off_policy_steps={off_policy_steps}",)
  tok_dir = models.load_tokenizer("smollm2-135m-instruct").save(tmp_path / "tokenizer")
  outs = _wait_all(_trainer_runs(two, 2, tmp_path / "cache2", tok_dir, extra))
  _wait_all(_trainer_runs(one, 1, tmp_path / "cache1", tok_dir, extra))
  assert "summary:" in outs[0] and "summary:" not in outs[1]  # only process 0 reports
  recs = {d: _records(d) for d in (one, two)}
  for d in (one, two):
    assert sorted(recs[d]) == [1, 2, 3]  # each step logged once, by process 0 only
  _assert_same_steps(recs[one], recs[two], (1, 2, 3), "one vs two processes")
  for step in (1, 2, 3):
    assert _samples(one, step) == _samples(two, step), f"rollouts differ at step {step}"
  assert sorted(int(p.name) for p in (two / "checkpoints").iterdir() if p.name.isdigit())[-1] == 3
  staleness = [recs[two][s]["rollout/staleness"] for s in (1, 2, 3)]
  if off_policy_steps == 0:
    assert staleness == [0, 0, 0]
    assert [_ahead_steps(two, s) for s in (1, 2, 3)] == [None, None, None]
    return
  assert staleness == [0, 1, 1]
  # Each checkpoint keeps the rollouts collected for the step after it (none after the last).
  assert [_ahead_steps(two, s) for s in (1, 2, 3)] == [[2], [3], None]

  # A stop after step 1, then a resume on two processes: it trains step 2 on the rollouts
  # checkpoint 1 holds (collected from the params after step 0) and repeats the straight run.
  straight = {s: _samples(two, s) for s in (2, 3)}
  for s in (2, 3):
    shutil.rmtree(two / "checkpoints" / str(s))
  outs = _wait_all(_trainer_runs(two, 2, tmp_path / "cache2", tok_dir, extra))
  assert "resuming with the rollouts of steps 2, collected before checkpoint" in outs[0], (
      outs[0][-4000:])
  resumed = _records(two)
  assert sorted(resumed) == [1, 2, 3]
  _assert_same_steps(recs[two], resumed, (2, 3), "straight vs resumed")
  for s in (2, 3):
    assert _samples(two, s) == straight[s], f"resumed rollouts differ at step {s}"


@pytest.mark.slow
def test_trainer_two_processes_stop_and_resume_with_rollouts_ahead(tmp_path):
  """A preemption notice on process 1 only, with `train.off_policy_steps=1` and no periodic
  checkpoints: both processes stop at the same step s, the checkpoint written at the stop holds
  step s + 1's rollouts (taken from process 0's collector), and a two-process resume trains on
  them and logs what one process logs straight through."""
  from jaxagent import models
  one, two = tmp_path / "one", tmp_path / "two"
  extra = ("--config.train.off_policy_steps=1", "--config.total_steps=6",
           "--config.checkpoint_every=100")
  tok_dir = models.load_tokenizer("smollm2-135m-instruct").save(tmp_path / "tokenizer")
  _wait_all(_trainer_runs(one, 1, tmp_path / "cache1", tok_dir, extra))
  procs = _trainer_runs(two, 2, tmp_path / "cache2", tok_dir, extra)
  try:
    deadline = time.time() + 400
    while not _logged(two, 1):
      assert all(p.poll() is None for p in procs), "a process ended before step 1 was logged"
      assert time.time() < deadline, "step 1 not logged after 400 s"
      time.sleep(0.1)
    procs[1].send_signal(signal.SIGTERM)
  finally:
    outs = _wait_all(procs)
  stops = [l for l in outs[0].splitlines()
           if l.startswith("stop requested on another process: saved checkpoint")]
  assert len(stops) == 1, outs[0][-4000:]
  saved = sorted(int(p.name) for p in (two / "checkpoints").iterdir() if p.name.isdigit())
  stop = saved[-1]
  assert saved == [0, stop] and 1 <= stop < 6 and stops[0].endswith(f"at step {stop}; rerun the "
                                                                   "same command to resume")
  assert _ahead_steps(two, stop) == [stop + 1]

  outs = _wait_all(_trainer_runs(two, 2, tmp_path / "cache2", tok_dir, extra))
  assert f"resuming with the rollouts of steps {stop + 1}, collected" in outs[0], outs[0][-4000:]
  want, got = _records(one), _records(two)
  assert sorted(want) == sorted(got) == [1, 2, 3, 4, 5, 6]
  assert [got[s]["rollout/staleness"] for s in sorted(got)] == [0, 1, 1, 1, 1, 1]
  _assert_same_steps(want, got, range(1, 7), "one process straight vs two stopped and resumed")
  for step in range(1, 7):
    assert _samples(one, step) == _samples(two, step), f"rollouts differ at step {step}"


if __name__ == "__main__":
  if sys.argv[1] == "learner":
    _learner_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
  else:
    raise SystemExit(f"unknown worker {sys.argv[1]!r}")
