"""`benchmarks/train_step.py`: the packed batch it times and a tiny CPU run's MFU."""
import numpy as np

from benchmarks import train_step
from benchmarks.forward import useful_flops
from jaxagent import models


def test_make_batch_reports_the_segments_and_efficiency_of_the_rows_it_returns():
  arrays, eff, lens = train_step.make_batch(4, 512, 512, np.random.default_rng(0))
  seg = arrays["segment_ids"]
  assert seg.shape == (4, 512)
  assert sum(lens) == int((seg > 0).sum()) and eff == float((seg > 0).mean())
  assert all(v.shape[0] == 4 for v in arrays.values())


def test_a_tiny_run_reports_mfu_from_the_flop_count(run_main, unit_clock_and_peak):
  unit_clock_and_peak(train_step)
  [r] = run_main(train_step, "--models", "tiny-llama", "--rows", "2", "--len", "128",
                 "--micro-batches", "1")
  cfg = models.get_config("tiny-llama")
  batch, eff, lens = train_step.make_batch(2, 128, cfg.vocab_size, np.random.default_rng(0))
  assert r["bench"] == "train_step" and r["packing_efficiency"] == eff
  assert r["tokens_per_s"] == int((batch["segment_ids"] > 0).sum())
  assert r["mfu"] == useful_flops(cfg, lens) / 1e12
