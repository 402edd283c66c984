"""`benchmarks/forward.py`: its FLOP count by hand and a tiny CPU run."""
from benchmarks import forward
from jaxagent import models


def test_useful_flops_is_6n_per_token_plus_causal_attention_per_segment():
  cfg = models.get_config("tiny-llama")
  seg_lens = [3, 5]
  # Hand count: 6 x the matmul parameters (all but the input embedding when untied) per
  # token, plus 3 x (forward + backward) the causal QK and PV matmuls within each segment:
  # forward 2 x 2 x L x H x hd x n^2 / 2.
  d, h, kv, hd, f, v, layers = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                                cfg.ffn_dim, cfg.vocab_size, cfg.n_layers)
  per_layer = d * hd * (h + 2 * kv) + h * hd * d + 3 * d * f + 2 * d
  matmul_params = layers * per_layer + v * d + d  # output projection (tied or not) + final norm
  want = 6 * matmul_params * 8 + 3 * sum(2 * layers * h * hd * n * n for n in seg_lens)
  assert forward.useful_flops(cfg, seg_lens) == want


def test_packed_rows_cover_every_token_with_segments_in_order():
  toks, seg, lens = forward.packed_rows(2, 700, 512)
  assert toks.shape == seg.shape == (2, 700)
  assert (seg > 0).all() and sum(lens) == 2 * 700


def test_a_tiny_run_reports_mfu_from_the_flop_count(run_main, unit_clock_and_peak):
  unit_clock_and_peak(forward)
  rows = run_main(forward, "--models", "tiny-llama", "--rows", "1", "--len", "64")
  [r] = rows
  cfg = models.get_config("tiny-llama")
  _, _, lens = forward.packed_rows(1, 64, cfg.vocab_size)
  assert r["bench"] == "forward_backward" and r["tokens_per_s"] == 64.0
  assert r["mfu"] == forward.useful_flops(cfg, lens) / 1e12
  assert r["tflops"] == forward.useful_flops(cfg, lens) / 1e12
