"""Packed training forward+backward: tokens/s and MFU (bf16) for model shapes, random init.

    python benchmarks/forward.py --models qwen2.5-0.5b,qwen2.5-1.5b --rows 8 --len 2048

Rows are packed with segments of a realistic multi-turn length mix. MFU counts the model's
useful FLOPs (6 N per token plus causal attention within each segment) against the chip's
dense bf16 peak.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import emit, peaks, timeit
from jaxagent import models


def packed_rows(rows, length, vocab, seed=0):
  rng = np.random.default_rng(seed)
  toks = rng.integers(0, vocab, (rows, length)).astype(np.int32)
  seg = np.zeros((rows, length), np.int32)
  seg_lens = []
  for r in range(rows):
    off, s = 0, 1
    while off < length:
      n = int(min(length - off, rng.integers(200, 1500)))
      seg[r, off:off + n] = s
      seg_lens.append(n)
      off, s = off + n, s + 1
  return toks, seg, seg_lens


def useful_flops(cfg, seg_lens):
  n_tok = sum(seg_lens)
  per_tok = cfg.flops_per_token(0, training=True)  # 6N (matmuls), no attention
  attn = 3 * sum(2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * n * n for n in seg_lens)
  return per_tok * n_tok + attn


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
  ap.add_argument("--rows", type=int, default=8)
  ap.add_argument("--len", type=int, default=2048)
  ap.add_argument("--attention", default="auto")
  ap.add_argument("--remat", default="none")
  ap.add_argument("--record", action="store_true")
  args = ap.parse_args()
  for name in args.models.split(","):
    cfg = models.get_config(name, param_dtype="bfloat16", dtype="bfloat16",
                            attention_impl=args.attention, remat=args.remat)
    params = jax.jit(lambda k: models.init_params(cfg, k))(jax.random.key(0))
    toks, seg, seg_lens = packed_rows(args.rows, args.len, cfg.vocab_size)
    toks, seg = jnp.asarray(toks), jnp.asarray(seg)

    def loss(p):
      h = models.hidden_states(p, toks, cfg=cfg, segment_ids=seg)
      nxt = jnp.roll(toks, -1, axis=1)
      lp = models.token_logprobs(p, h, nxt, cfg=cfg)
      return -jnp.mean(lp)

    step = jax.jit(jax.value_and_grad(loss))
    t = timeit(lambda: jax.block_until_ready(step(params)), warmup=2, iters=5)
    n_tok = args.rows * args.len
    flops = useful_flops(cfg, seg_lens)
    mfu = flops / t["median_s"] / peaks()["bf16_flops"]
    emit("forward_backward", args.record, model=name, rows=args.rows, len=args.len,
         attention=args.attention, remat=args.remat, tokens_per_s=n_tok / t["median_s"],
         step_s=t["median_s"], mfu=mfu, tflops=flops / t["median_s"] / 1e12)


if __name__ == "__main__":
  main()
