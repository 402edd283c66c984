"""`benchmarks/decode_profile.py`: a CPU run of the engine's decode program at fixed lengths."""
import json
import sys

from benchmarks import decode_profile


def test_trace_only_run_reports_the_engine_step(monkeypatch, capsys, tmp_path):
  monkeypatch.setattr(sys, "argv", [
      "decode_profile.py", "--model", "tiny-qwen2", "--batch", "4", "--cached", "16",
      "--max-len", "64", "--trace", str(tmp_path / "trace"), "--trace-only"])
  decode_profile.main()
  out = capsys.readouterr().out
  rows = [json.loads(line[len("RESULT "):]) for line in out.splitlines()
          if line.startswith("RESULT ")]
  assert [r["bench"] for r in rows] == ["decode_profile"]
  assert rows[0]["cached"] == 16 and rows[0]["full_step_ms"] > 0
  assert "trace written to" in out and any((tmp_path / "trace").rglob("*.pb*"))
