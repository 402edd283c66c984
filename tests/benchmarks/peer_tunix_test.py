"""`benchmarks/peer_tunix.py`: its options (the measurements need a GPU and the peer's wheels)."""
import sys

import pytest

from benchmarks import peer_tunix


@pytest.mark.parametrize("args, message", [
    (["--only", "updates"], "--only: unknown value(s) ['updates']"),
    (["--only", "e2e", "--e2e-share", "yes"], "--e2e-share: unknown value(s) ['yes']"),
])
def test_a_misspelt_section_or_switch_is_refused_before_anything_runs(monkeypatch, capsys,
                                                                      args, message):
  # A misspelt section used to skip its measurement (and still run the peer's harness), a
  # misspelt switch to run the other setting; both exited 0.
  monkeypatch.setattr(sys, "argv", ["peer_tunix.py", "--tiny", "--tunix-bench",
                                    "/no/such/tunix_bench.py", *args])
  monkeypatch.setattr(peer_tunix, "run_tunix", lambda *a: pytest.fail("the peer ran"))
  with pytest.raises(SystemExit) as e:
    peer_tunix.main()
  assert message in str(e.value)
  assert "RESULT" not in capsys.readouterr().out
