"""`Trainer.run` again after a stop (a Ctrl-C in a notebook, `request_stop`): it trains on."""
import os
import signal
import types

import ml_collections

from jaxagent.trainer import Trainer


def _trainer(tmp_path, steps_run):
  """A trainer without model or checkpoints whose RL steps are stand-ins that record their
  step; `restore` resumes where the trainer stands, as a checkpointed run's rerun would."""
  t = Trainer.__new__(Trainer)
  t.config = ml_collections.ConfigDict({"total_steps": 3, "eval": {"every": 0}, "export": False})
  t.writer = types.SimpleNamespace(message=lambda msg: None, write=lambda step, m: None,
                                   progress=lambda *a, **k: None, plot=lambda: None, history=[],
                                   set_aside_earlier_run=lambda: None)
  t.workdir, t.ckpt, t.summary, t.step, t.time_limit_s = tmp_path, None, {}, 0, 0.0
  t._stop_reason, t._stop_honoured, t._interrupted = None, False, None
  t.restore = lambda: t.step
  t._out_of_time = lambda t_rl: False
  t._save = lambda step: None
  t._inflight = {}  # no rollouts ahead
  t.evaluate = lambda: {}

  def rl_step(step):
    steps_run.append(step)
    if step == 1:
      os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during the first step
    return {"reward/mean": 0.5}
  t.rl_step = rl_step
  return t


def test_run_after_a_ctrl_c_trains_on(tmp_path):
  """The stop request stayed set: every later `run` stopped at once ("stopping after step 1")
  and a notebook could not continue its run after an interrupt."""
  steps_run = []
  t = _trainer(tmp_path, steps_run)
  before = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    assert t.run()["stopped_at_step"] == 1 and steps_run == [1]
    summary = t.run()
  finally:
    signal.signal(signal.SIGINT, before)
  assert steps_run == [1, 2, 3] and t.step == 3
  assert "stopped_at_step" not in summary


def test_a_stop_requested_before_run_still_stops_it(tmp_path):
  # (the launcher's stop for a notice that came while the trainer was built)
  steps_run = []
  t = _trainer(tmp_path, steps_run)
  t.request_stop("received SIGTERM")
  assert t.run()["stopped_at_step"] == 0 and steps_run == []
  t.request_stop("again")  # requested after the stop was spent, before the next run
  assert t.run()["stopped_at_step"] == 0 and steps_run == []
