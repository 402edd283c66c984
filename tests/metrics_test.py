"""MetricsWriter: JSONL records and TensorBoard events, and the rewind of a resumed run."""
import json
import struct

from tensorboardX.proto import event_pb2

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
