"""`benchmarks/hbm_read.py`: the Pallas read kernel reads every row, and the script runs (CPU,
Pallas interpret mode)."""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import hbm_read


def test_pallas_read_sums_each_programs_rows_plus_the_chained_row():
  x = jax.random.normal(jax.random.key(0), (256, 16), jnp.float32)
  dep = jax.random.normal(jax.random.key(1), (1, 16), jnp.float32)
  got = hbm_read.pallas_read_once(x, dep, rows_per_prog=64, warps=1, stages=2, block=16,
                                  interpret=True)
  want = np.asarray(x).reshape(4, 64, 16).sum(1) + np.asarray(dep)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_interpret_run_prints_one_line_per_kernel(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", ["hbm_read.py", "--sizes-mb", "1", "--reps", "1",
                                    "--min-total-mb", "2", "--interpret"])
  hbm_read.main()
  rows = [json.loads(line[len("RESULT "):]) for line in capsys.readouterr().out.splitlines()
          if line.startswith("RESULT ")]
  assert [r["kernel"] for r in rows] == ["xla sum to rows"] + [
      f"pallas read rows/prog={r} w={w} st={st} blk={b}"
      for r, w, st, b in hbm_read.PALLAS_SETTINGS]
  assert all(r["size_mb"] == 1 and r["us"] > 0 for r in rows)


def test_trace_timer_reports_each_read_kernels_device_time(monkeypatch, capsys):
  patterns = []

  def fake(fn, pattern, iters):
    fn()
    patterns.append(pattern)
    return 10.0, 3
  monkeypatch.setattr(hbm_read, "traced_kernel_us", fake)
  monkeypatch.setattr(sys, "argv", ["hbm_read.py", "--sizes-mb", "1", "--reps", "1",
                                    "--min-total-mb", "2", "--interpret", "--timer", "trace"])
  hbm_read.main()
  rows = [json.loads(line[len("RESULT "):]) for line in capsys.readouterr().out.splitlines()
          if line.startswith("RESULT ")]
  assert patterns == ["reduce"] + ["^kern"] * len(hbm_read.PALLAS_SETTINGS)
  peak = hbm_read.peaks()["hbm_bytes_s"]
  for r in rows:
    assert r["kernel_us"] == 10.0
    np.testing.assert_allclose(r["kernel_hbm_fraction"], 2**20 / 10e-6 / peak, rtol=1e-9)
