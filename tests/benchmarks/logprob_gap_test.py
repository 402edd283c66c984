"""`benchmarks/logprob_gap.py`: a tiny CPU run (float32: the sampler's and the learner's
log-probs of the same tokens agree) and its option checks."""
import pytest

from benchmarks import logprob_gap


def test_a_tiny_float32_run_scores_every_sampled_token_alike(run_main):
  rows = run_main(logprob_gap, "--model", "tiny-llama", "--prompts", "3", "--prompt-len", "8",
                  "--gen", "8", "--pack-len", "32", "--dtypes", "float32",
                  "--impls", "xla,cudnn")
  [r] = rows  # cuDNN is missing on a CPU: a line saying so, no RESULT
  assert "float32 cudnn auto: failed" in run_main.out
  assert r["attention"] == "xla" and r["tokens"] == 3 * 8
  assert r["max_abs_gap"] < 1e-4 and r["mean_abs_gap"] <= r["max_abs_gap"]


@pytest.mark.parametrize("flags, message", [
    # Packing dropped the longer trajectories (the gap of the rest was printed), or all of
    # them (ValueError: zero-size array, after sampling).
    (["--prompt-len", "16", "--gen", "16", "--pack-len", "28"], "--pack-len 28 must hold"),
    (["--gen", "0"], "--gen >= 1"),
])
def test_options_that_cannot_measure_every_token_are_refused(run_main, flags, message):
  with pytest.raises(SystemExit):
    run_main(logprob_gap, "--model", "tiny-llama", "--dtypes", "float32", *flags)
  assert message in run_main.err
