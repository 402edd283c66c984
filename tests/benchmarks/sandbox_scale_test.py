"""`benchmarks/sandbox_scale.py`: a small run on this machine and its option checks."""
import pytest

from benchmarks import sandbox_scale


def test_a_small_round_sleeps_in_every_session_at_once(run_main):
  [r] = run_main(sandbox_scale, "--sessions", "2", "--background", "2", "--cell-s", "1")
  assert r["ok"] == 2 and r["sessions"] == 2 and r["background"] == 2
  assert 1.0 <= r["wall_s"] < 1.9  # the two cells slept at the same time, not one by one
  assert r["probe_iters_per_s"] > 0


def test_bad_counts_are_refused(run_main):
  with pytest.raises(SystemExit):
    run_main(sandbox_scale, "--sessions", "0")
  assert "need --sessions >= 1" in run_main.err
