"""`benchmarks/decode_kernel.py`: the sweep spec and a CPU run in Pallas interpret mode."""
import json
import sys

from benchmarks import decode_kernel


def test_parse_sweep_is_the_product_of_the_axes():
  got = decode_kernel.parse_sweep("block_k=16,32; num_warps=2,4,8")
  assert len(got) == 6
  assert {"block_k": 32, "num_warps": 8} in got
  assert decode_kernel.parse_sweep("") == [{}]


def test_interpret_run_prints_one_line_per_setting(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", [
      "decode_kernel.py", "--models", "smollm2-135m", "--batches", "2", "--layers", "1",
      "--cached", "32", "--iters", "1", "--interpret", "--sweep", "block_k=16,32"])
  decode_kernel.main()
  rows = [json.loads(line[len("RESULT "):]) for line in capsys.readouterr().out.splitlines()
          if line.startswith("RESULT ")]
  assert [r["bench"] for r in rows] == ["decode_kernel_ceiling"] + ["decode_kernel"] * 2
  assert [r["launch"] for r in rows[1:]] == [{"block_k": 16}, {"block_k": 32}]
  assert all("error" not in r and r["us_per_layer"] > 0 for r in rows)
