"""`benchmarks/plot_runs.py`: draws runs' curves; bad input is named, a torn line skipped."""
import json

import pytest

from benchmarks import plot_runs


def _metrics(path, lines):
  path.write_text("\n".join(lines))
  return str(path)


def test_draws_the_runs_and_skips_a_torn_last_line(tmp_path, run_main):
  # A run killed mid-write leaves half a record; loading raised JSONDecodeError and no plot
  # came out, for any of the runs.
  a = _metrics(tmp_path / "a.jsonl", [json.dumps({"step": 0, "reward/mean": 9.0}), "",
                                      json.dumps({"step": 1, "reward/mean": 0.5}),
                                      json.dumps({"step": 2, "reward/mean": 0.7}),
                                      '{"step": 3, "rew'])
  assert plot_runs.load(a, "reward/mean") == ([1, 2], [0.5, 0.7])
  out = tmp_path / "p.png"
  run_main(plot_runs, "--runs", f"a={a}", "--out", str(out))
  assert out.stat().st_size > 1000
  assert "a.jsonl:5 is not a JSON record" in run_main.err


def test_a_key_no_run_has_is_warned_about(tmp_path, run_main):
  a = _metrics(tmp_path / "a.jsonl", [json.dumps({"step": 1, "reward/mean": 0.5})])
  run_main(plot_runs, "--runs", f"a={a}", "--keys", "reward/maen",
           "--out", str(tmp_path / "p.png"))
  assert "has no RL step with 'reward/maen'" in run_main.err


@pytest.mark.parametrize("runs, message", [
    ("runs/a/metrics.jsonl", "each entry is name=path"),  # was: ValueError: not enough values
    ("a=/no/such/metrics.jsonl", "no such file"),
])
def test_bad_runs_are_refused_with_what_to_write(tmp_path, run_main, runs, message):
  with pytest.raises(SystemExit):
    run_main(plot_runs, "--runs", runs, "--out", str(tmp_path / "p.png"))
  assert message in run_main.err
