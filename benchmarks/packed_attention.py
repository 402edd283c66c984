"""Packed-segment cuDNN attention vs the dense-mask cuDNN path: equality and speed (GPU).

    python benchmarks/packed_attention.py --model qwen2.5-1.5b --rows 8 --len 2048

Random q, k, v of the model's head layout (bf16) over packed rows with a multi-turn length mix
(some padding at each row's end), and one row with more segments than
`decoder.PACKED_MAX_SEGMENTS` (the dense fallback): output and q/k/v gradients of
`attention_impl="cudnn_packed"` against `"cudnn"` on every non-padding position, and the time of
forward + backward of each.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import emit, timeit
from jaxagent import models
from jaxagent.models import decoder


def segments(rows, length, rng, many=False):
  out = np.zeros((rows, length), np.int32)
  for r in range(rows):
    pos, sid = 0, 1
    while pos < length - 64:
      n = int(rng.integers(8, 40)) if many and r == 0 else int(rng.integers(200, 1300))
      n = min(n, length - 64 - pos)
      out[r, pos:pos + n] = sid
      pos, sid = pos + n, sid + 1
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default="qwen2.5-1.5b")
  ap.add_argument("--rows", type=int, default=8)
  ap.add_argument("--len", type=int, default=2048)
  args = ap.parse_args()
  base = models.get_config(args.model, param_dtype="bfloat16", dtype="bfloat16")
  rng = np.random.default_rng(0)
  b, t, h, kv, hd = args.rows, args.len, base.n_heads, base.n_kv_heads, base.head_dim
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (b, t, h, hd), jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, t, kv, hd), jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, t, kv, hd), jnp.bfloat16)
  do = jax.random.normal(ks[3], (b, t, h, hd), jnp.bfloat16)
  for many in (False, True):
    seg = jnp.asarray(segments(b, t, rng, many))
    real = (seg > 0)[:, :, None, None]
    res = {}
    for impl in ("cudnn", "cudnn_packed"):
      cfg = base.replace(attention_impl=impl)

      def loss(q, k, v, cfg=cfg):
        o = decoder.segment_attention(q, k, v, seg, cfg)
        return jnp.sum(jnp.where(real, o * do, 0).astype(jnp.float32)), o

      f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
      (_, o), g = f(q, k, v)
      res[impl] = (o, g, timeit(lambda: jax.block_until_ready(f(q, k, v)), iters=10)["median_s"])
    (o0, g0, t0), (o1, g1, t1) = res["cudnn"], res["cudnn_packed"]
    err = lambda a, c: float(jnp.max(jnp.abs(jnp.where(real if a.shape[2] == h else (seg > 0)[:, :, None, None], a.astype(jnp.float32) - c.astype(jnp.float32), 0))))
    scale = float(jnp.max(jnp.abs(o0.astype(jnp.float32))))
    emit("packed_attention", model=args.model, rows=b, len=t, over_max_segments=many,
         runs_max=int(decoder.segment_runs(seg, decoder.PACKED_MAX_SEGMENTS)[2]),
         out_max_abs_err=err(o1, o0), out_max_abs=scale,
         dq_err=err(g1[0], g0[0]), dk_err=err(g1[1], g0[1]), dv_err=err(g1[2], g0[2]),
         grad_max_abs=float(max(jnp.max(jnp.abs(x.astype(jnp.float32))) for x in g0)),
         nonfinite=int(sum(int(jnp.sum(~jnp.isfinite(x.astype(jnp.float32)))) for x in (o1, *g1))),
         dense_fwd_bwd_ms=t0 * 1e3, packed_fwd_bwd_ms=t1 * 1e3, speedup=t0 / t1)


if __name__ == "__main__":
  main()
