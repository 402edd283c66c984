"""`benchmarks/tool_overlap.py`: a tiny CPU run and its option checks."""
import pytest

from benchmarks import tool_overlap


def test_stripe_tokenizer_ends_a_turn_at_every_period_th_id():
  tok = tool_overlap.StripeTokenizer(512, period=4)
  assert tok.decode([0, 1, 4, 5, 8]) == "|a|a|"
  assert all(1 <= i < 512 for i in tok.encode("ab|"))


@pytest.mark.parametrize("flag", ["--turn-tokens", "--samples", "--slots", "--trajectories"])
def test_a_count_below_one_is_refused(capsys, flag):
  # --turn-tokens 0 divided by zero inside the rollout's tokenizer.
  with pytest.raises(SystemExit):
    tool_overlap.main([flag, "0"])
  assert f"must be >= 1: {flag} 0" in capsys.readouterr().err


@pytest.mark.slow  # a script run of tens of seconds on a 2-core CPU (the default run's time budget)
def test_a_tiny_run_reports_the_ratio_of_its_wall_times():
  r = tool_overlap.main(["--trajectories", "4", "--samples", "2", "--slots", "4",
                         "--tool-ms", "20", "--repeats", "1", "--max-warmup", "1",
                         "--max-len", "256", "--prompt-len", "8"])
  # At most three calls each: a trajectory is cut at its fourth turn (or ends on a turn that
  # reached --tokens-per-turn without a call).
  assert r["trajectories"] == 4 and 1 <= r["tool_calls"] <= 4 * 3
  assert r["ratio"] == pytest.approx(r["wall_s_tools"] / r["wall_s_no_tools"], rel=0.05)
  assert r["same_tokens"] is True
  assert r["serial_tool_s"] == pytest.approx(0.02 * r["tool_calls"], abs=0.05)
