"""One training attention call over packed rows: forward and forward + backward time per
implementation, its error against a float32 reference, and its share of the bf16 peak.

    python benchmarks/attention.py --models qwen2.5-1.5b --rows 8 --len 2048 \
        --impls cudnn,pallas [--variants "fwd_q=64;dq_q=128,dq_k=32"]

Rows are packed from the train-step benchmark's multi-turn length mix (one micro-batch of
`benchmarks/train_step.py`). Implementations: "cudnn" (fused attention with the dense
`[B, 1, T, T]` segment mask), "cudnn_causal" (causal only, no segment mask: a reference
ceiling, not a correct result), "pallas" (`jaxagent.models.packed_attention`, one line per
`--variants` entry, each a `$JAXAGENT_PACKED_ATTENTION` setting), "xla". `--one-segment`:
one trajectory per row instead (plain causal rows). FLOPs are the useful
ones: 4 hd H n^2 / 2 per segment of n tokens forward, 2.5x that backward.
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import emit, peaks, timeit
from benchmarks.train_step import make_batch
from jaxagent import models
from jaxagent.models import decoder, packed_attention


def reference(q, k, v, seg):
  """float32 causal attention within segments (einsums, dense mask)."""
  b, t, h, d = q.shape
  g = h // k.shape[2]
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
  mask = (seg[:, :, None] == seg[:, None, :]) & jnp.tril(jnp.ones((t, t), bool))[None]
  p = jax.nn.softmax(jnp.where(mask[:, None], s, -1e30), -1)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def impl_fn(impl, cfg):
  if impl == "pallas":
    return lambda q, k, v, seg: packed_attention.packed_attention(q, k, v, seg)
  if impl == "cudnn_causal":
    return lambda q, k, v, seg: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, scale=1.0 / math.sqrt(q.shape[-1]), implementation="cudnn")
  c = cfg.replace(attention_impl=impl)
  return lambda q, k, v, seg: decoder.segment_attention(q, k, v, seg, c)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--models", default="qwen2.5-1.5b")
  ap.add_argument("--rows", type=int, default=8)
  ap.add_argument("--len", type=int, default=2048)
  ap.add_argument("--impls", default="cudnn,cudnn_causal,pallas")
  ap.add_argument("--variants", default="", help="semicolon-separated "
                  "$JAXAGENT_PACKED_ATTENTION settings for the pallas rows ('' = defaults)")
  ap.add_argument("--one-segment", action="store_true", help="one trajectory per row (no "
                  "packing; the peer comparison's rows) instead of the packed length mix")
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--record", action="store_true")
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  for name in args.models.split(","):
    cfg = models.get_config(name, dtype="bfloat16")
    batch, _, _ = make_batch(args.rows, args.len, cfg.vocab_size, rng)
    if args.one_segment:
      batch = {"segment_ids": np.ones((args.rows, args.len), np.int32)}
    seg = jnp.asarray(batch["segment_ids"][:args.rows])
    shape = (args.rows, args.len)
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (*shape, cfg.n_heads, cfg.head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (*shape, cfg.n_kv_heads, cfg.head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (*shape, cfg.n_kv_heads, cfg.head_dim), jnp.bfloat16)
    w = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    real = seg > 0
    ref = jax.jit(reference)(q, k, v, seg)
    ref_grads = jax.jit(jax.grad(lambda q, k, v: (reference(q, k, v, seg) * w).sum(),
                                 (0, 1, 2)))(q, k, v)
    fwd_flops = 2 * cfg.n_heads * cfg.head_dim * sum(
        int(c) ** 2 for r in range(args.rows)
        for i, c in zip(*np.unique(batch["segment_ids"][r], return_counts=True)) if i > 0)
    runs = []
    for impl in args.impls.split(","):
      for variant in (args.variants.split(";") if impl == "pallas" else [""]):
        runs.append((impl, variant))
    for impl, variant in runs:
      os.environ["JAXAGENT_PACKED_ATTENTION"] = variant
      fn = impl_fn(impl, cfg)
      fwd = jax.jit(fn)
      loss = lambda q, k, v: (fn(q, k, v, seg).astype(jnp.float32) * w).sum()
      both = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
      try:
        out = fwd(q, k, v, seg)
        grads = both(q, k, v)[1]
      except Exception as e:  # an implementation this device lacks: say so and go on
        print(f"{name} {impl} {variant!r}: failed: {type(e).__name__}: {str(e)[:300]}")
        continue
      err = float(jnp.where(real[..., None, None], jnp.abs(out.astype(jnp.float32) - ref),
                            0).max())
      gerr = [float(jnp.abs(g.astype(jnp.float32) - r).max() / jnp.abs(r).max())
              for g, r in zip(grads, ref_grads)]
      t_f = timeit(lambda: jax.block_until_ready(fwd(q, k, v, seg)), iters=args.iters)
      t_b = timeit(lambda: jax.block_until_ready(both(q, k, v)), iters=args.iters)
      peak = peaks()["bf16_flops"]
      emit("attention", args.record, model=name, rows=args.rows, len=args.len, impl=impl,
           variant=variant, fwd_ms=t_f["median_s"] * 1e3, fwd_bwd_ms=t_b["median_s"] * 1e3,
           fwd_peak_frac=fwd_flops / t_f["median_s"] / peak,
           fwd_bwd_peak_frac=3.5 * fwd_flops / t_b["median_s"] / peak,
           out_max_err=err, grad_rel_err_qkv=gerr)


if __name__ == "__main__":
  main()
