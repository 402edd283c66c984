"""`Trainer.run` again after a stop (a Ctrl-C in a notebook, `request_stop`): it trains on."""
import os
import signal
import types

import ml_collections
import pytest

from jaxagent.trainer import Trainer


def _trainer(tmp_path, events, *, ctrl_c_in):
  """A trainer without model or checkpoints whose warm start and RL steps are stand-ins that
  record themselves; a Ctrl-C arrives once, in the phase `ctrl_c_in` ("warm start" or an RL
  step)."""
  t = Trainer.__new__(Trainer)
  t.config = ml_collections.ConfigDict({"total_steps": 3, "eval": {"every": 0}, "export": False})
  t.writer = types.SimpleNamespace(message=lambda msg: None, write=lambda step, m: None,
                                   progress=lambda *a, **k: None, plot=lambda: None, history=[],
                                   set_aside_earlier_run=lambda: None)
  t.workdir, t.ckpt, t.summary, t.step, t.time_limit_s = tmp_path, None, {}, 0, 0.0
  t.ckpt_cfg = types.SimpleNamespace(path=lambda workdir: tmp_path / "no_checkpoints")
  t._stop_reason, t._stop_honoured, t._interrupted = None, False, None
  t._restore_done, t._resumed, t.warm_started = False, None, False
  t._out_of_time = lambda t_rl: False
  t._save = lambda step: None
  t._inflight = {}  # no rollouts ahead
  t.evaluate = lambda: {}
  pending = [ctrl_c_in]

  def interrupt(phase):
    if pending == [phase]:
      pending.clear()
      os.kill(os.getpid(), signal.SIGINT)

  def pre_rl():
    events.append("warm start")
    interrupt("warm start")
    if t._stop_requested():  # as the warm start does between its steps
      t._interrupted = "SFT warm-start step 1 of 2"
      return
    t.warm_started = True

  def rl_step(step):
    events.append(step)
    interrupt(step)
    return {"reward/mean": 0.5}
  t._pre_rl, t.rl_step = pre_rl, rl_step
  return t


def _run_twice(t):
  before = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    return dict(t.run()), dict(t.run())  # (`run` returns the trainer's summary itself)
  finally:
    signal.signal(signal.SIGINT, before)


def test_run_after_a_ctrl_c_trains_on(tmp_path):
  """The stop request stayed set: every later `run` stopped at once ("stopping after step 1")
  and a notebook could not continue its run after an interrupt."""
  events = []
  t = _trainer(tmp_path, events, ctrl_c_in=1)
  first, second = _run_twice(t)
  assert first["stopped_at_step"] == 1
  # The second run goes on from step 2: no second warm start, no step done twice.
  assert events == ["warm start", 1, 2, 3] and t.step == 3
  assert "stopped_at_step" not in second


def test_run_after_a_ctrl_c_in_the_warm_start_starts_it_over(tmp_path):
  events = []
  t = _trainer(tmp_path, events, ctrl_c_in="warm start")
  first, second = _run_twice(t)
  assert first["stopped_at_step"] == 0 and first["stopped_in"] == "SFT warm-start step 1 of 2"
  assert events == ["warm start", "warm start", 1, 2, 3]
  assert "stopped_in" not in second


def test_a_stop_requested_before_run_still_stops_it(tmp_path):
  # (the launcher's stop for a notice that came while the trainer was built)
  events = []
  t = _trainer(tmp_path, events, ctrl_c_in=None)
  t.request_stop("received SIGTERM")
  assert t.run()["stopped_in"] == "SFT warm-start step 1 of 2" and events == ["warm start"]


def test_an_ignored_ctrl_c_stays_ignored(tmp_path):
  """A process whose SIGINT is ignored (started in the background by a shell script) took the
  terminal's Ctrl-C, meant for the script, as a stop."""
  events = []
  t = _trainer(tmp_path, events, ctrl_c_in=1)
  before = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    summary = t.run()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
  finally:
    signal.signal(signal.SIGINT, before)
  assert events == ["warm start", 1, 2, 3] and "stopped_at_step" not in summary


def test_a_run_that_raised_in_a_step_does_not_go_on_past_that_step(tmp_path):
  # A second Ctrl-C (or an error) in the middle of step 1: step 1 was never done, so a later
  # run must not take it as the step to go on from.
  events = []
  t = _trainer(tmp_path, events, ctrl_c_in=None)
  rl_step = t.rl_step

  def failing(step):
    t.request_stop("received SIGINT (Ctrl-C)")
    raise KeyboardInterrupt
  t.rl_step = failing
  try:
    t.run()
  except KeyboardInterrupt:
    pass
  t.rl_step = rl_step
  assert t.run()["stopped_at_step"] == 0 and 2 not in events  # the stop still stands


def test_close_closes_the_env_and_a_mixture_s_member_envs_once_each():
  """Trainer.close closed the samplers and writers but not the task's env, so an `mcp_tools`
  env's MCP servers lived until the interpreter exited. Each env with a `close` is closed once
  (a member that is also the env itself too), a failing one does not keep the others open,
  and its error is raised after."""
  from jaxagent.agent import Env

  closed = []

  class Plain(Env):
    def reward(self, trajectory, example, tokenizer, step):
      return 0.0

  class Closing(Plain):
    def __init__(self, name, fail=False):
      super().__init__()
      self.label, self.fail = name, fail

    def close(self):
      closed.append(self.label)
      if self.fail:
        raise RuntimeError(f"{self.label} failed to close")

  class Mixture(Closing):
    def __init__(self, members):
      super().__init__("mixture")
      self.members = members

    @property
    def member_envs(self):
      return (*self.members, self)

  plain = Plain()  # no close: skipped
  t = Trainer.__new__(Trainer)
  t.env = Mixture([Closing("a", fail=True), plain, Closing("b")])
  with pytest.raises(RuntimeError, match="a failed to close"):
    t._close_envs()
  assert closed == ["a", "b", "mixture"]
  closed.clear()
  t.env = Closing("single")
  t._close_envs()
  assert closed == ["single"]
