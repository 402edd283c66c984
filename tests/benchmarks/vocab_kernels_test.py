"""`benchmarks/vocab_kernels.py`: a CPU run in Pallas interpret mode."""
import json
import sys

import pytest

from benchmarks import vocab_kernels


def test_interpret_run_reports_both_paths_and_each_launch(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", [
      "vocab_kernels.py", "--models", "tiny-qwen3", "--tokens", "48", "--iters", "1",
      "--interpret", "--sweep", "block_n=128,256,384"])
  vocab_kernels.main()
  rows = [json.loads(line[len("RESULT "):]) for line in capsys.readouterr().out.splitlines()
          if line.startswith("RESULT ")]
  assert [r["bench"] for r in rows] == ["vocab_chunk", "vocab_kernels_xla_matmul"] + [
      "vocab_kernels"] * 3
  chunk = rows[0]
  assert all(chunk[p]["forward_ms"] > 0 and chunk[p]["forward_backward_ms"] > 0
             for p in ("xla", "fused"))
  assert chunk["logprob_max_abs_diff"] < 1e-4
  assert 0 <= chunk["grad_rel_diff"]["h"] < 2e-2 and 0 <= chunk["grad_rel_diff"]["w"] < 2e-2
  assert [r["launch"] for r in rows[2:]] == [{"block_n": n} for n in (128, 256, 384)]
  assert rows[2]["cotangent_ms"] > 0 and rows[3]["logsumexp_ms"] > 0
  assert "do not tile" in rows[4]["error"]  # 512 is not a multiple of 384


def test_a_misspelt_part_is_refused(monkeypatch, capsys):
  # `--parts chunks` used to measure nothing and exit 0.
  monkeypatch.setattr(sys, "argv", ["vocab_kernels.py", "--models", "tiny-qwen3",
                                    "--parts", "chunks"])
  with pytest.raises(SystemExit, match=r"--parts: unknown value\(s\) \['chunks'\]"):
    vocab_kernels.main()
  assert "RESULT" not in capsys.readouterr().out
