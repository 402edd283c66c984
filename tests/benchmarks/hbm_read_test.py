"""`benchmarks/hbm_read.py`: the Pallas and TMA read kernels read every row, and the script runs
(CPU, Pallas interpret modes)."""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import hbm_read


def test_pallas_read_sums_each_programs_rows_plus_the_chained_row():
  x = jax.random.normal(jax.random.key(0), (256, 16), jnp.float32)
  dep = jax.random.normal(jax.random.key(1), (1, 16), jnp.float32)
  got = hbm_read.pallas_read_once(x, dep, rows_per_prog=64, warps=1, stages=2, block=16,
                                  interpret=True)
  want = np.asarray(x).reshape(4, 64, 16).sum(1) + np.asarray(dep)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_tma_read_sums_each_ctas_rows():
  x = jax.random.normal(jax.random.key(0), (512, 128), jnp.bfloat16)
  dep = jnp.zeros((1, 128), jnp.float32)
  got = hbm_read.tma_read_once(x, dep, ctas=4, stages=2, block=32, interpret=True)
  want = np.asarray(x, np.float32).reshape(4, 4, 32, 128).sum(1)  # [CTA, block row, column]
  assert got.shape == (4, 32, 128)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


def _tma_runs(mb):
  n = mb * 2**20 // 256
  return [(c, st, b) for c, st, b in hbm_read.TMA_SETTINGS if n % (c * b) == 0]


@pytest.mark.slow  # a script run of tens of seconds on a 2-core CPU (the default run's time budget)
def test_interpret_run_prints_one_line_per_kernel(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", ["hbm_read.py", "--sizes-mb", "1", "--reps", "1",
                                    "--min-total-mb", "2", "--interpret"])
  hbm_read.main()
  rows = [json.loads(line[len("RESULT "):]) for line in capsys.readouterr().out.splitlines()
          if line.startswith("RESULT ")]
  assert [r["kernel"] for r in rows] == ["xla sum to rows"] + [
      f"pallas read rows/prog={r} w={w} st={st} blk={b}"
      for r, w, st, b in hbm_read.PALLAS_SETTINGS] + [
      f"tma read ctas={c} st={st} blk={b}" for c, st, b in _tma_runs(1)]
  assert _tma_runs(1)  # the TMA kernel runs too
  assert all(r["size_mb"] == 1 and r["us"] > 0 for r in rows)


@pytest.mark.slow  # a script run of tens of seconds on a 2-core CPU (the default run's time budget)
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
  assert patterns == (["reduce"] + ["^kern"] * len(hbm_read.PALLAS_SETTINGS)
                      + ["tma_read"] * len(_tma_runs(1)))
  peak = hbm_read.peaks()["hbm_bytes_s"]
  for r in rows:
    assert r["kernel_us"] == 10.0
    np.testing.assert_allclose(r["kernel_hbm_fraction"], 2**20 / 10e-6 / peak, rtol=1e-9)
