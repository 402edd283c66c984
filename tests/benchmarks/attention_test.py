"""`benchmarks/attention.py`: a tiny CPU run, its error against the float32 reference and its
share of the peak against a hand FLOP count."""
import numpy as np

from benchmarks import attention
from benchmarks.train_step import make_batch
from jaxagent import models


def test_a_tiny_run_counts_the_useful_flops_of_each_segment(run_main, unit_clock_and_peak):
  unit_clock_and_peak(attention)
  rows = run_main(attention, "--models", "tiny-llama", "--rows", "2", "--len", "128",
                  "--impls", "xla,cudnn", "--iters", "1")
  cfg = models.get_config("tiny-llama")
  batch, _, _ = make_batch(2, 128, cfg.vocab_size, np.random.default_rng(0))
  lens = [int((r == s).sum()) for r in batch["segment_ids"] for s in set(r.tolist()) - {0}]
  # Forward: QK^T and PV of one layer, causal half, 2 FLOPs a multiply-add: 2 H hd n^2.
  fwd = sum(2 * cfg.n_heads * cfg.head_dim * n * n for n in lens)
  [r] = rows  # cuDNN is missing on a CPU: a line saying so, no RESULT
  assert "cudnn" in run_main.out and "failed" in run_main.out
  assert r["impl"] == "xla" and r["fwd_peak_frac"] == fwd / 1e12
  assert r["fwd_bwd_peak_frac"] == 3.5 * fwd / 1e12
  assert r["out_max_err"] < 0.05 and max(r["grad_rel_err_qkv"]) < 0.05


def test_one_segment_rows_are_plain_causal(run_main, unit_clock_and_peak):
  unit_clock_and_peak(attention)
  [r] = run_main(attention, "--models", "tiny-llama", "--rows", "1", "--len", "64",
                 "--impls", "xla", "--iters", "1", "--one-segment")
  cfg = models.get_config("tiny-llama")
  assert r["fwd_peak_frac"] == 2 * cfg.n_heads * cfg.head_dim * 64 * 64 / 1e12
