"""Qwen3's per-head RMS norm followed by RoPE as one Pallas kernel each way (GPU; interpret
mode elsewhere). Gemma 3's (1 + w) q / k norms do not use them (`decoder.norm_rope_path`).

`decoder.norm_rope` normalises each query / key head over its `hd` values, scales it by the
norm's weight and rotates it (rotate-half RoPE). As XLA fusions that is several passes over
the heads each way: a float32 copy of the normed heads between the norm's reduction and the
rotation in the forward pass, and in the backward pass the rotation's transpose, the norm's
row sums, its weight gradient and the rematerialised forward each in a kernel of their own
(about 45 ms of a 375 ms Qwen3-0.6B update on an H100, benchmarks/RESULTS.md). Here:

  * `forward`: one program per block of `block_t` tokens reads their heads once, normalises,
    rotates and writes them, the per-token cos / sin read from small tables;
  * `backward`: reads the heads and their cotangent once and writes the heads' cotangent and
    the block's share of the weight gradient (XLA sums the blocks' shares).

The heads are `[tokens, heads, hd]` blocks, so the head count and `hd` must be powers of two
(`tileable`). The arithmetic is float32, with the normed heads rounded to the input dtype
before the rotation exactly as `decoder.rms_norm` then `decoder.apply_rope` write it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxagent.models import decode_attention
from jaxagent.models import packed_attention

# `block_t` tokens a program; rows (tokens x heads) a program are kept near `ROWS` so that a
# program's float32 working set stays in registers. Override with
# JAXAGENT_NORM_ROPE_KERNEL="rows=64,num_warps=8".
DEFAULT_TUNING = dict(rows=32, num_warps=4, num_stages=1)


def tuning() -> dict:
  return decode_attention.env_tuning("JAXAGENT_NORM_ROPE_KERNEL", DEFAULT_TUNING)


def tileable(heads: int, hd: int) -> bool:
  """Whether the kernels' blocks fit `heads` heads of `hd` values (powers of two; hd >= 16)."""
  return heads > 0 and not heads & (heads - 1) and packed_attention.tileable(hd)


def _block_t(tokens: int, heads: int, t) -> int:
  bt = max(1, t["rows"] // heads)
  while bt > 1 and bt > tokens:
    bt //= 2
  return bt


def _halves(ref, half):
  return (ref[:, :, pl.ds(0, half)].astype(jnp.float32),
          ref[:, :, pl.ds(half, half)].astype(jnp.float32))


def _weight_halves(w_ref, half):
  return (w_ref[pl.ds(0, half)].astype(jnp.float32)[None, None, :],
          w_ref[pl.ds(half, half)].astype(jnp.float32)[None, None, :])


def _tables(cos_ref, sin_ref):
  """The block's per-token cos / sin, broadcast over its heads."""
  return cos_ref[...][:, None, :], sin_ref[...][:, None, :]


def _scale(x1, x2, hd, eps):
  ms = (jnp.sum(x1 * x1, axis=-1) + jnp.sum(x2 * x2, axis=-1)) / hd
  return jax.lax.rsqrt(ms + eps)[:, :, None]


def _fwd_kernel(x_ref, w_ref, cos_ref, sin_ref, o_ref, *, eps):
  half = x_ref.shape[-1] // 2
  x1, x2 = _halves(x_ref, half)
  r = _scale(x1, x2, 2 * half, eps)
  w1, w2 = _weight_halves(w_ref, half)
  dt = o_ref.dtype
  n1 = (x1 * r * w1).astype(dt).astype(jnp.float32)
  n2 = (x2 * r * w2).astype(dt).astype(jnp.float32)
  cos, sin = _tables(cos_ref, sin_ref)
  o_ref[:, :, pl.ds(0, half)] = (n1 * cos - n2 * sin).astype(dt)
  o_ref[:, :, pl.ds(half, half)] = (n2 * cos + n1 * sin).astype(dt)


def _bwd_kernel(x_ref, w_ref, cos_ref, sin_ref, g_ref, dx_ref, dw_ref, *, eps):
  half = x_ref.shape[-1] // 2
  x1, x2 = _halves(x_ref, half)
  g1, g2 = _halves(g_ref, half)
  cos, sin = _tables(cos_ref, sin_ref)
  dn1 = g1 * cos + g2 * sin  # the rotation's transpose
  dn2 = g2 * cos - g1 * sin
  r = _scale(x1, x2, 2 * half, eps)
  xh1, xh2 = x1 * r, x2 * r
  w1, w2 = _weight_halves(w_ref, half)
  d1, d2 = dn1 * w1, dn2 * w2
  c = ((jnp.sum(d1 * xh1, axis=-1) + jnp.sum(d2 * xh2, axis=-1)) / (2 * half))[:, :, None]
  dx_ref[:, :, pl.ds(0, half)] = (r * (d1 - xh1 * c)).astype(dx_ref.dtype)
  dx_ref[:, :, pl.ds(half, half)] = (r * (d2 - xh2 * c)).astype(dx_ref.dtype)
  dw_ref[0, pl.ds(0, half)] = jnp.sum(jnp.sum(dn1 * xh1, axis=0), axis=0)
  dw_ref[0, pl.ds(half, half)] = jnp.sum(jnp.sum(dn2 * xh2, axis=0), axis=0)


def _prepare(x, cos, sin, t):
  """Flattened tokens padded to whole blocks: x [n, heads, hd], cos / sin [n, hd/2]."""
  *lead, heads, hd = x.shape
  x = x.reshape(-1, heads, hd)
  cos = cos.reshape(-1, hd // 2).astype(jnp.float32)
  sin = sin.reshape(-1, hd // 2).astype(jnp.float32)
  n = x.shape[0]
  bt = _block_t(n, heads, t)
  pad = (-n) % bt
  if pad:
    x = jnp.pad(x, ((0, pad), (0, 0), (0, 0)))
    cos = jnp.pad(cos, ((0, pad), (0, 0)))
    sin = jnp.pad(sin, ((0, pad), (0, 0)))
  return x, cos, sin, bt, n


def _specs(bt, heads, hd):
  rows = pl.BlockSpec((bt, heads, hd), lambda i: (i, 0, 0))
  w = pl.BlockSpec((hd,), lambda i: (0,))
  table = pl.BlockSpec((bt, hd // 2), lambda i: (i, 0))
  return rows, w, table


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "launch"))
def forward(x, w, cos, sin, *, eps: float, interpret: bool = False, launch: tuple | None = None):
  """`apply_rope(rms_norm(x, w, eps))` for x `[..., heads, hd]` with the per-token `cos` /
  `sin` tables `[..., hd/2]` (`decoder.rope_tables`, one row per token of x's leading dims).
  `launch`: (key, value) pairs over `tuning()`."""
  t = {**tuning(), **dict(launch or ())}
  shape = x.shape
  heads, hd = shape[-2:]
  xp, cp, sp, bt, n = _prepare(x, cos, sin, t)
  rows, w_spec, table = _specs(bt, heads, hd)
  out = pl.pallas_call(
      functools.partial(_fwd_kernel, eps=eps),
      grid=(xp.shape[0] // bt,),
      in_specs=[rows, w_spec, table, table],
      out_specs=rows,
      out_shape=jax.ShapeDtypeStruct(xp.shape, x.dtype),
      interpret=interpret, name="norm_rope_fwd",
      **decode_attention._compiler_params(interpret, t["num_warps"], t["num_stages"]),
  )(xp, w, cp, sp)
  return out[:n].reshape(shape)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "launch"))
def backward(x, w, cos, sin, g, *, eps: float, interpret: bool = False,
             launch: tuple | None = None):
  """(dx in x's dtype, float32 per-block shares of dw `[blocks, hd]`) of `forward` for the
  output cotangent `g`; dw is the sum of the shares over blocks."""
  t = {**tuning(), **dict(launch or ())}
  shape = x.shape
  heads, hd = shape[-2:]
  xp, cp, sp, bt, n = _prepare(x, cos, sin, t)
  gp = g.reshape(-1, heads, hd)
  if gp.shape[0] != xp.shape[0]:
    gp = jnp.pad(gp, ((0, xp.shape[0] - gp.shape[0]), (0, 0), (0, 0)))
  rows, w_spec, table = _specs(bt, heads, hd)
  blocks = xp.shape[0] // bt
  dx, dw = pl.pallas_call(
      functools.partial(_bwd_kernel, eps=eps),
      grid=(blocks,),
      in_specs=[rows, w_spec, table, table, rows],
      out_specs=[rows, pl.BlockSpec((1, hd), lambda i: (i, 0))],
      out_shape=[jax.ShapeDtypeStruct(xp.shape, x.dtype),
                 jax.ShapeDtypeStruct((blocks, hd), jnp.float32)],
      interpret=interpret, name="norm_rope_bwd",
      **decode_attention._compiler_params(interpret, t["num_warps"], t["num_stages"]),
  )(xp, w, cp, sp, gp)
  return dx[:n].reshape(shape), dw
