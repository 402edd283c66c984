"""`benchmarks/train_step.py`: the packed batch it times and a tiny CPU run's MFU."""
import numpy as np
import pytest

from benchmarks import train_step
from benchmarks.forward import useful_flops
from jaxagent import models
from jaxagent.rl import packing


@pytest.fixture
def packed(monkeypatch):
  """The `PackedBatch`es that `packing.pack` returns while the test runs, in order."""
  out, pack = [], packing.pack

  def keep(*a, **kw):
    out.append(pack(*a, **kw))
    return out[-1]
  monkeypatch.setattr(packing, "pack", keep)
  return out


def fill_of_used_rows(pb):
  """Real tokens over the rows that hold any, by hand from the packed segment ids."""
  real = pb.segment_ids > 0
  return real.sum() / (real.any(1).sum() * real.shape[1])


def test_make_batch_reports_the_segments_and_efficiency_of_the_rows_it_returns(packed):
  arrays, stats, lens = train_step.make_batch(4, 1024, 512, np.random.default_rng(0))
  seg = arrays["segment_ids"]
  assert seg.shape == (4, 1024)
  assert all(v.shape[0] == 4 for v in arrays.values())
  assert sum(lens) == int((seg > 0).sum()) and stats["timed_rows_fill"] == (seg > 0).mean()
  # The packer's numbers are over every row it packed, the rows left out of the step included.
  [pb] = packed
  assert stats["rows_used"] == int((pb.segment_ids > 0).any(1).sum()) > 4
  assert stats["row_fill"] == pytest.approx(fill_of_used_rows(pb))
  assert stats["efficiency"] == pytest.approx((pb.segment_ids > 0).mean())
  assert stats["tokens_left_out"] == int((pb.segment_ids[4:] > 0).sum()) > 0
  # Here the packer's last rows are its emptiest: the timed rows alone look better packed.
  assert stats["row_fill"] < stats["timed_rows_fill"] - 0.05


def test_a_tiny_run_reports_mfu_from_the_flop_count(run_main, unit_clock_and_peak, packed):
  unit_clock_and_peak(train_step)
  [r] = run_main(train_step, "--models", "tiny-llama", "--rows", "4", "--len", "512",
                 "--micro-batches", "1")
  [pb] = packed
  cfg = models.get_config("tiny-llama")
  batch, stats, lens = train_step.make_batch(4, 512, cfg.vocab_size, np.random.default_rng(0))
  assert r["bench"] == "train_step"
  assert r["tokens_per_s"] == int((batch["segment_ids"] > 0).sum())
  assert r["mfu"] == useful_flops(cfg, lens) / 1e12
  # The packing efficiency is the packer's over all the rows it packed (5 of them, 99.49% full),
  # not the fill of the 4 timed rows (100%), which leave out its emptiest row.
  assert r["packing_efficiency"] == pytest.approx(fill_of_used_rows(pb))
  assert r["packing_efficiency"] < r["timed_rows_fill"] == (batch["segment_ids"] > 0).mean()
  assert r["packed_rows"] > 4 and r["tokens_left_out"] == int((pb.segment_ids[4:] > 0).sum())


def test_a_lora_run_times_the_adapter_update(run_main, unit_clock_and_peak, monkeypatch):
  """`--lora-rank` times the learner's adapter update over the frozen params."""
  from jaxagent.rl import step
  unit_clock_and_peak(train_step)
  made = []
  init = step.Learner.init
  monkeypatch.setattr(step.Learner, "init", lambda self, p: made.append(self) or init(self, p))
  [r] = run_main(train_step, "--models", "tiny-llama", "--rows", "4", "--len", "256",
                 "--micro-batches", "1", "--lora-rank", "2", "--lora-targets", "attention")
  [learner] = made
  assert learner.lora.rank == 2 and learner.lora.targets == ("wq", "wk", "wv", "wo")
  assert r["lora_rank"] == 2 and r["lora_targets"] == "attention" and r["step_s"] > 0


def test_lora_forward_list_times_each_forward_in_one_job(run_main, unit_clock_and_peak,
                                                         monkeypatch):
  """`--lora-forward merged,unmerged` times the merged and the unmerged adapter update one
  after the other: a row (step time, MFU) and a printed line each."""
  from jaxagent.rl import step
  unit_clock_and_peak(train_step)
  made = []
  init = step.Learner.init
  monkeypatch.setattr(step.Learner, "init", lambda self, p: made.append(self) or init(self, p))
  rows = run_main(train_step, "--models", "tiny-llama", "--rows", "4", "--len", "128",
                  "--micro-batches", "1", "--lora-rank", "2", "--lora-forward",
                  "merged,unmerged", "--lora-dropout", "0.1")
  assert [(r["lora_forward"], r["lora_dropout"]) for r in rows] == [("merged", 0.0),
                                                                     ("unmerged", 0.1)]
  assert [(x.lora.forward, x.lora.dropout) for x in made] == [("merged", 0.0), ("unmerged", 0.1)]
  assert all(r["step_s"] > 0 and r["mfu"] > 0 for r in rows)
  out = run_main.out
  assert "forward=merged: step" in out and "forward=unmerged: step" in out
  with pytest.raises(SystemExit):
    run_main(train_step, "--models", "tiny-llama", "--lora-rank", "2", "--lora-forward", "fast")
  assert "--lora-forward: 'fast'" in run_main.err
  with pytest.raises(SystemExit):
    run_main(train_step, "--models", "tiny-llama", "--lora-forward", "unmerged")
  assert "--lora-forward needs --lora-rank > 0" in run_main.err
