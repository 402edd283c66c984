"""Flash-decoding attention over a KV cache as a Pallas kernel (GPU; interpret mode elsewhere).

One program per (slot, KV head) walks the slot's cached keys in blocks of `block_k`, only up to
the slot's length, with an online softmax, and returns the normalised output and the
log-sum-exp so the caller can merge in the attention to the new token itself. The XLA einsum
path reads each (slot, head) through small batched matmuls far below HBM bandwidth; this kernel
reads every live key and value once.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_NEG = -1e30


def _kernel(lens_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, block_k: int, scale: float):
  length = lens_ref[0]
  q = q_ref[...].astype(jnp.float32) * scale  # [Gp, hd]
  gp, hd = q.shape

  def body(b, carry):
    o, m, l = carry
    start = pl.multiple_of(b * block_k, block_k)
    k = k_ref[pl.ds(start, block_k), :].astype(jnp.float32)  # [BK, hd]
    v = v_ref[pl.ds(start, block_k), :].astype(jnp.float32)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())))  # [Gp, BK]
    idx = start + jax.lax.broadcasted_iota(jnp.int32, (gp, block_k), 1)
    s = jnp.where(idx < length, s, _NEG)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp(s - m_new[:, None])
    corr = jnp.exp(m - m_new)
    l = corr * l + p.sum(axis=-1)
    o = corr[:, None] * o + jax.lax.dot_general(p, v, (((1,), (0,)), ((), ())))
    return o, m_new, l

  init = (jnp.zeros((gp, hd), jnp.float32), jnp.full((gp,), _NEG, jnp.float32),
          jnp.zeros((gp,), jnp.float32))
  o, m, l = jax.lax.fori_loop(0, (length + block_k - 1) // block_k, body, init)
  safe = jnp.maximum(l, 1e-30)
  o_ref[...] = (o / safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(l > 0, m + jnp.log(safe), _NEG)


@functools.partial(jax.jit, static_argnames=("block_k", "interpret"))
def flash_decode(q, cache_k, cache_v, lengths, *, block_k: int = 64, interpret: bool = False):
  """Attention of one query per (slot, head group) over each slot's first `lengths[s]` keys.

  q: [S, KV, G, hd]; cache_k, cache_v: [S, KV, C, hd] with C a multiple of 16 (blocks are
  the largest power of two up to `block_k` dividing C);
  lengths: [S]. Returns (out [S, KV, G, hd] in q's dtype, lse [S, KV, G] float32); slots of
  length 0 give out 0 and lse -1e30.
  """
  s, kv, g, hd = q.shape
  c = cache_k.shape[2]
  block_k = min(block_k, c & -c)  # the largest power of two dividing C, at most block_k
  if block_k < 16:
    raise ValueError(f"cache length {c} must be a multiple of 16 for the decode kernel")
  gp = max(16, 1 << (g - 1).bit_length())  # matmul tiles need >= 16 rows, a power of two
  qp = jnp.pad(q, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
  lens = jnp.broadcast_to(lengths.astype(jnp.int32)[:, None, None], (s, kv, 1))
  kern = functools.partial(_kernel, block_k=block_k, scale=1.0 / math.sqrt(hd))
  out, lse = pl.pallas_call(
      kern,
      grid=(s, kv),
      in_specs=[
          pl.BlockSpec((None, None, 1), lambda i, j: (i, j, 0)),
          pl.BlockSpec((None, None, gp, hd), lambda i, j: (i, j, 0, 0)),
          pl.BlockSpec((None, None, c, hd), lambda i, j: (i, j, 0, 0)),
          pl.BlockSpec((None, None, c, hd), lambda i, j: (i, j, 0, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, gp, hd), lambda i, j: (i, j, 0, 0)),
          pl.BlockSpec((None, None, gp), lambda i, j: (i, j, 0)),
      ],
      out_shape=[jax.ShapeDtypeStruct((s, kv, gp, hd), q.dtype),
                 jax.ShapeDtypeStruct((s, kv, gp), jnp.float32)],
      interpret=interpret,
  )(lens, qp, cache_k, cache_v)
  return out[:, :, :g], lse[:, :, :g]
