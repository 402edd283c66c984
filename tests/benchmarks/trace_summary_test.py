"""The trace summariser counts device stream kernels only, per step, by kind."""
import gzip
import json

from benchmarks import trace_summary


def _write(tmp_path, events):
  d = tmp_path / "plugins" / "profile" / "run"
  d.mkdir(parents=True)
  with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  return str(tmp_path)


def test_summary_counts_device_streams_per_step(tmp_path):
  meta = [
      {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
      {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #7(Compute)"}},
      {"ph": "M", "name": "thread_name", "pid": 2, "tid": 9, "args": {"name": "XLA Ops"}},
  ]
  x = lambda pid, tid, name, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "dur": dur,
                                   "ts": 0}
  events = meta + [
      x(2, 7, "nvjet_tst_128x64_64x4", 300.0), x(2, 7, "nvjet_tst_128x64_64x4", 100.0),
      x(2, 7, "_kernel", 1000.0), x(2, 7, "loop_add_fusion_3", 50.0),
      x(2, 7, "input_reduce_fusion", 40.0), x(2, 7, "memcpy128", 10.0),
      x(2, 9, "dot.3", 9999.0),  # an op-level track: would double count
      x(1, 3, "ThunkExecute", 5000.0),  # host
  ]
  s = trace_summary.summarize(_write(tmp_path, events), steps=2)
  assert s["total_ms_per_step"] == 0.75
  assert s["by_kind_ms_per_step"] == {"attention": 0.5, "gemm": 0.2, "fusion": 0.025,
                                      "reduce": 0.02, "copy": 0.005}
  top = s["top_kernels"][0]
  assert (top["name"], top["calls_per_step"]) == ("_kernel", 0.5)


def test_traced_kernel_us_averages_the_matching_kernels(tmp_path, monkeypatch):
  """Mean device time of the kernels whose names match, over the calls made under the
  profiler; kernels on other tracks or of other names do not count."""
  meta = [
      {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #7"}},
  ]
  x = lambda name, dur: {"ph": "X", "pid": 2, "tid": 7, "name": name, "dur": dur, "ts": 0}
  events = meta + [x("_write_kernel", 40.0), x("_write_kernel", 50.0),
                   x("_write_kernel_helper_fusion", 999.0), x("nvjet_x", 7.0)]
  monkeypatch.setattr(trace_summary, "find_trace", lambda d: d)
  monkeypatch.setattr(trace_summary, "load_events", lambda path: events)
  calls = []
  got = trace_summary.traced_kernel_us(lambda: calls.append(1), r"^_write_kernel$", iters=3)
  assert calls == [1, 1, 1]
  assert got == (45.0, 2)
  assert trace_summary.traced_kernel_us(lambda: None, r"^_read_kernel", iters=1) is None


def test_traced_kernel_us_is_none_without_a_device_stream():
  """On a CPU the trace has no device stream: nothing to time, reported as None."""
  import jax.numpy as jnp
  x = jnp.ones((8,))
  assert trace_summary.traced_kernel_us(lambda: (x + 1).block_until_ready(), r".",
                                        iters=1) is None
