"""`benchmarks/generate.py`: its options (the decode measurements are GPU runs)."""
import sys

import pytest

from benchmarks import generate


@pytest.mark.parametrize("args, message", [
    (["--share", "yes"], "--share: unknown value(s) ['yes']"),
    (["--prepare", "on,of"], "--prepare: unknown value(s) ['of']"),
])
def test_a_misspelt_switch_is_refused_before_anything_runs(monkeypatch, args, message):
  # Any value but "on" used to run the "off" setting without a word.
  monkeypatch.setattr(sys, "argv", ["generate.py", "--models", "tiny-qwen3", *args])
  monkeypatch.setattr(generate, "run", lambda *a, **k: pytest.fail("a measurement ran"))
  with pytest.raises(SystemExit) as e:
    generate.main()
  assert message in str(e.value)
