"""MetricsWriter: JSONL records and TensorBoard events, and the rewind of a resumed run."""
import json
import struct

import pytest
from tensorboardX.proto import event_pb2

from jaxagent import metrics
from jaxagent.metrics import MetricsWriter


def _events(directory):
  """Every Event of the TensorBoard files in `directory`, oldest file first (TFRecord framing:
  length, its CRC, the record, its CRC)."""
  out = []
  for path in sorted(directory.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns):
    data, pos = path.read_bytes(), 0
    while pos < len(data):
      (n,) = struct.unpack("<Q", data[pos:pos + 8])
      ev = event_pb2.Event()
      ev.ParseFromString(data[pos + 12:pos + 12 + n])
      out.append((path.name, ev))
      pos += 12 + n + 4
  return out


def test_jsonl_and_tensorboard_and_the_rewind_purges_later_steps(tmp_path):
  w = MetricsWriter(tmp_path, progress=False)
  for step in (1, 2, 3):
    w.write(step, {"reward/mean": float(step), "eval/pass@1": 0.5, "bad": float("nan")})
  recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in recs] == [1, 2, 3] and recs[0]["bad"] is None
  # A run resumed from step 1 redoes steps 2 and 3: TensorBoard must hide the old ones.
  w.rewind_tensorboard(1)
  w.write(2, {"reward/mean": 20.0})
  w.close()
  events = _events(tmp_path / "tensorboard")
  starts = [ev for _, ev in events if ev.HasField("session_log")
            and ev.session_log.status == event_pb2.SessionLog.START]
  assert [ev.step for ev in starts] == [2]  # events at steps >= 2 before this are purged on load
  tags = {v.tag for _, ev in events for v in ev.summary.value}
  assert {"reward/mean", "eval/pass_at_1"} <= tags


def test_a_non_finite_metric_is_named_once_and_logged(tmp_path, caplog):
  # tensorboardX logged "NaN or Inf found in input tensor." at every such value, naming no
  # metric; tags with characters TensorBoard refuses are still cleaned.
  w = MetricsWriter(tmp_path, progress=False)
  with caplog.at_level("INFO"):
    for step in (1, 2):
      w.write(step, {"loss": float("nan"), "kl": float("inf"), "a b": 1.0, "/lead": 2.0})
  w.close()
  said = [r.getMessage() for r in caplog.records]
  assert said == ["metric 'loss' is nan at step 1 (null in metrics.jsonl); said once per metric",
                  "metric 'kl' is inf at step 1 (null in metrics.jsonl); said once per metric"]
  logged = [(ev.step, v.tag, v.simple_value) for _, ev in _events(tmp_path / "tensorboard")
            for v in ev.summary.value]
  assert logged[:4] == [(1, "loss", pytest.approx(float("nan"), nan_ok=True)),
                        (1, "kl", float("inf")), (1, "a_b", 1.0), (1, "lead", 2.0)]
  assert len(logged) == 8


def test_each_record_is_on_disk_when_write_returns(tmp_path):
  """A run killed (-9, out of memory) between steps keeps every step it logged: the JSONL line
  and the TensorBoard events are written through before `write` returns, not at `close`."""
  w = MetricsWriter(tmp_path, progress=False)
  try:
    for step in (1, 2):
      w.write(step, {"reward/mean": float(step)})
      recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
      assert [r["step"] for r in recs] == list(range(1, step + 1))
      logged = [(ev.step, v.simple_value) for _, ev in _events(tmp_path / "tensorboard")
                for v in ev.summary.value if v.tag == "reward/mean"]
      assert logged == [(s, float(s)) for s in range(1, step + 1)]
  finally:
    w.close()


def test_progress_bar_shows_this_steps_values(tmp_path, capsys):
  # The postfix was set after the update that redraws the bar: each step showed the last one's.
  w = MetricsWriter(tmp_path, tensorboard=False, progress_total=3)
  w._bar.mininterval = 0  # redraw on every update
  w.progress(1, reward=0.5)
  first = capsys.readouterr().err.rsplit("\r", 1)[-1]
  w.progress(1, reward=0.75)
  second = capsys.readouterr().err.rsplit("\r", 1)[-1]
  w.close()
  assert "1/3" in first and "reward=0.5" in first, first
  assert "2/3" in second and "reward=0.75" in second, second
  MetricsWriter(tmp_path / "none", tensorboard=False, progress_total=0).progress(1, reward=1.0)


def test_set_aside_moves_an_earlier_runs_outputs(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
  (tmp_path / "summary.json").write_text("{}")
  w = MetricsWriter(tmp_path, progress=False)
  dest = w.set_aside_earlier_run()
  w.write(1, {"reward/mean": 0.25})
  assert w.set_aside_earlier_run() is None  # once: this run's own records stay
  w.close()
  assert dest == tmp_path / "previous" / "1"
  assert json.loads((dest / "metrics.jsonl").read_text())["reward/mean"] == 0.5
  assert (dest / "summary.json").exists() and not (tmp_path / "summary.json").exists()
  recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [(r["step"], r["reward/mean"]) for r in recs] == [(1, 0.25)]
  assert [v.tag for _, ev in _events(tmp_path / "tensorboard") for v in ev.summary.value] == [
      "reward/mean"]
  # A third run goes to previous/2; a fresh workdir has nothing to move.
  w = MetricsWriter(tmp_path, progress=False)
  assert w.set_aside_earlier_run() == tmp_path / "previous" / "2"
  w.close()
  assert MetricsWriter(tmp_path / "new", progress=False).set_aside_earlier_run() is None


def test_a_run_from_scratch_does_not_append_to_an_earlier_runs_metrics(tmp_path):
  """Rerunning into a workdir with nothing to resume (checkpointing off, or a run that died
  before its first checkpoint) appended a second step 0, 1, ... to metrics.jsonl and drew both
  runs on the same TensorBoard curves."""
  from jaxagent.trainer import Trainer
  from configs.quickstart import get_config
  c = get_config("tiny")
  c.workdir = str(tmp_path / "run")
  c.total_steps, c.sft.steps = 0, 0
  for value in (0.25, 0.75):
    trainer = Trainer(c)
    trainer.evaluate = lambda tag="eval", phase=None, v=value: {"eval/pass@1": v}
    try:
      trainer.run()
    finally:
      trainer.close()
  run = tmp_path / "run"
  recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
  assert [(r["step"], r["before/pass@1"]) for r in recs] == [(0, 0.75)]
  assert json.loads((run / "summary.json").read_text())["pass@1/before"] == 0.75
  old = [json.loads(x) for x in (run / "previous" / "1" / "metrics.jsonl").read_text().splitlines()]
  assert [(r["step"], r["before/pass@1"]) for r in old] == [(0, 0.25)]
  tb = [(ev.step, v.simple_value) for _, ev in _events(run / "tensorboard")
        for v in ev.summary.value if v.tag == "before/pass_at_1"]
  assert tb == [(0, 0.75)]


def test_finite_json_writes_non_finite_floats_as_null():
  import math
  from jaxagent.metrics import finite_json
  text = finite_json({"a": math.nan, "b": -math.inf, "c": 1.5, "d": "x"}, indent=2)
  assert json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")) == {
      "a": None, "b": None, "c": 1.5, "d": "x"}


def test_a_metric_that_is_not_one_number_is_named_once(tmp_path, caplog):
  """An array of several values (or a text) was left out of metrics.jsonl without a word."""
  import logging
  import numpy as np
  w = MetricsWriter(tmp_path, progress=False, tensorboard=False)
  with caplog.at_level(logging.WARNING, logger="jaxagent.metrics"):
    for step in (1, 2):
      w.write(step, {"a": np.float32(1.5), "hist": np.array([1.0, 2.0]), "name": "x",
                     "absent": None, "one": np.array([3.0])})
  w.close()
  recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [{k: v for k, v in r.items() if k != "time"} for r in recs] == [
      {"step": 1, "a": 1.5, "one": 3.0}, {"step": 2, "a": 1.5, "one": 3.0}]
  warned = [r.getMessage() for r in caplog.records]
  assert warned == [  # once each, in the order of the record
      "metric 'hist' is not a single number (shape (2,), from step 1 on): not logged",
      "metric 'name' is not a single number (str, from step 1 on): not logged"], warned


class _FullDiskAfter:
  """A file whose writes stop with ENOSPC once `room` more bytes (or characters) are in."""

  def __init__(self, f, room):
    self._f, self._room = f, room

  def write(self, data):
    if len(data) > self._room:
      self._f.write(data[:self._room])
      self._room = 0
      raise OSError(28, "No space left on device")
    self._room -= len(data)
    return self._f.write(data)

  def __getattr__(self, name):
    return getattr(self._f, name)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._f.close()


def test_a_record_cut_by_a_full_disk_is_not_left_in_the_file(tmp_path):
  # The part of the record written before the disk filled stayed as a last line that does not
  # parse, and the next record (once there was room again) was glued onto it.
  w = MetricsWriter(tmp_path, tensorboard=False, progress=False)
  w.write(1, {"loss": 1.0})
  real = w._jsonl
  w._jsonl = _FullDiskAfter(real, room=7)
  with pytest.raises(OSError, match="No space left"):
    w.write(2, {"loss": 2.0})
  w._jsonl = real
  w.write(3, {"loss": 3.0})
  w.close()
  recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in recs] == [1, 3]


def test_append_line_appends_whole_lines_or_nothing(tmp_path, monkeypatch):
  path = tmp_path / "compiles.jsonl"
  metrics.append_line(path, '{"step": 1}')
  real_open = open
  monkeypatch.setattr(metrics, "open", lambda *a, **k: _FullDiskAfter(real_open(*a, **k), 3),
                      raising=False)
  with pytest.raises(OSError, match="No space left"):
    metrics.append_line(path, '{"step": 2}')
  monkeypatch.undo()
  metrics.append_line(path, '{"step": 3}')
  assert path.read_text() == '{"step": 1}\n{"step": 3}\n'


def test_close_twice_is_a_no_op(tmp_path):
  # The second close flushed the closed TensorBoard file: "ValueError: flush of closed file".
  w = MetricsWriter(tmp_path, progress_total=2)
  w.write(1, {"reward/mean": 0.5})
  w.close()
  w.close()
  assert [ev.step for _, ev in _events(tmp_path / "tensorboard") if ev.summary.value] == [1]
