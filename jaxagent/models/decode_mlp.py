"""The decode step's SwiGLU activation with the MLP's RMS norm applied after the projection.

Where the layer's MLP norm weight is folded into the gate|up matrix
(`param_tree.merge_decode_weights(fold_norms=True)`), the projection multiplies the unnormed
residual stream x, and the norm's per-row scale r = rsqrt(mean(x^2) + eps) comes afterwards:
`silu(r g) * (r u)`. `swiglu_rms` does that in one Pallas kernel (each program sums its rows'
squares itself), where XLA would run a reduction and an elementwise fusion; with the attention
side's scale in the decode kernel (`decode_attention.flash_decode_write_qkv(resid=...)`), a
decode layer runs no norm kernel of its own. `swiglu_rms_reference` is the same function in
XLA ops (the path without the kernel, and the tests' reference). With chained weights
(`param_tree.chain_decode_weights`) the stream rides in the first D columns of the projection
and of the activation (`lead`). SwiGLU only: Gemma 3 (GeGLU, post-norms) never folds its
norms (`param_tree.merge_decode_weights` refuses it).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxagent.models.decode_attention import rms_scale, row_rms_scale, row_tile, store_row_tile

# Launch: rows and gate columns per column block (the largest powers of two dividing the
# array's, at most these), and each program takes as many column blocks as keep the programs
# at most `MAX_PROGRAMS` (its rows' scale is computed once a program). Measured on an H200 in
# the engine's step at 256 slots (benchmarks/RESULTS.md): blocks of 8 x 256, one a program,
# took SmolLM2-135M's step to 1.650 ms, 4 x 256 to 1.623 ms (1.687 ms with XLA's norms). One
# program per column block gave Qwen2.5-1.5B's 35 blocks a row block 1120-2240 programs, each
# summing the same rows again, and the step was 1.3-1.5% slower than with XLA's norms; at most
# 512 programs (7 a row block, 5 blocks each) made it 3.215 ms against 3.221, at most 256
# programs 3.554 ms.
BLOCK_ROWS = 4
BLOCK_COLS = 256
MAX_PROGRAMS = 512
NUM_WARPS = 4


def row_scale(x, eps: float):
  """The RMS norm's scale of each row of x (`decoder.rms_norm` without its weight), float32
  with a trailing 1."""
  xf = x.astype(jnp.float32)
  return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def _swiglu(g, u, r, dt):
  """`silu(g) * u` of the scaled gate and up entries, rounded where `decoder._mlp` rounds in
  `dt`: the scaled projections, the sigmoid, the SiLU and the product."""
  f32 = lambda a: a.astype(jnp.float32)
  g = f32((f32(g) * r).astype(dt))
  u = f32((f32(u) * r).astype(dt))
  sg = f32((g * f32(jax.nn.sigmoid(g).astype(dt))).astype(dt))
  return (sg * u).astype(dt)


def swiglu_rms_reference(gu, resid, eps: float, *, lead: int = 0):
  """`silu(r g) * (r u)` in XLA ops: gu `[..., 2 F]` (gate then up, the projection of the
  unnormed `resid` `[..., D]` by the folded gate|up matrix); r the norm's scale of each row of
  `resid`. Returns `[..., F]` in gu's dtype. `lead` (resid None): gu is `[..., D + 2 F]` with
  the stream in its first D = lead columns, and the result `[..., D + F]` starts with them."""
  if lead:
    resid, gu = gu[..., :lead], gu[..., lead:]
  g, u = jnp.split(gu, 2, axis=-1)
  out = _swiglu(g, u, row_scale(resid, eps), gu.dtype)
  return jnp.concatenate([resid, out], axis=-1) if lead else out


def _kernel(r_ref, gu_ref, o_ref, *, eps: float, rows: int, cols: int, per: int,
            one_load: bool, lead: int):
  f = o_ref.shape[-1] - lead  # the activation's columns, after the stream's
  row0 = pl.program_id(0) * rows
  rs = pl.ds(row0, rows)
  first = pl.program_id(1) * per
  if lead:  # the stream in gu's first columns, loaded once: its scale, and its copy
    stream = row_tile(gu_ref, row0, rows, lead, one_load)
    r = rms_scale(stream, lead, eps)

    @pl.when(pl.program_id(1) == 0)  # one column group copies it
    def _():
      store_row_tile(o_ref, stream, row0, rows, lead, one_load)
  else:
    r = row_rms_scale(r_ref, row0, rows, eps, one_load)

  def block(j, carry):  # this program's `per` column blocks, one scale for all
    c0 = pl.multiple_of((first + j) * cols, cols)
    g, u = gu_ref[rs, pl.ds(lead + c0, cols)], gu_ref[rs, pl.ds(lead + c0 + f, cols)]
    o_ref[rs, pl.ds(lead + c0, cols)] = _swiglu(g, u, r, o_ref.dtype)
    return carry
  jax.lax.fori_loop(0, per, block, 0)


def swiglu_rms(gu, resid, eps: float, *, lead: int = 0, interpret: bool = False):
  """`swiglu_rms_reference` as one Pallas kernel: gu `[S, 2 F]`, resid `[S, D]` -> `[S, F]`;
  with `lead` = D (resid None), gu `[S, D + 2 F]` -> `[S, D + F]` (launch: `BLOCK_ROWS`,
  `BLOCK_COLS`, `MAX_PROGRAMS`)."""
  s, f2 = gu.shape
  f2 -= lead
  if lead and (resid is not None or not 0 < lead < gu.shape[1]):
    raise ValueError(f"swiglu_rms: lead={lead} needs resid None and fewer columns than gu's "
                     f"{gu.shape}")
  if f2 % 2 or (not lead and (resid.ndim != 2 or resid.shape[0] != s)):
    raise ValueError(f"swiglu_rms: gu must be [S, {'D + ' if lead else ''}2 F] and resid "
                     f"[S, D], got {gu.shape} and {None if resid is None else resid.shape}")
  f = f2 // 2
  return _swiglu_rms(gu, resid, eps=float(eps), interpret=interpret,
                     rows=min(s & -s, BLOCK_ROWS), cols=min(f & -f, BLOCK_COLS), lead=int(lead))


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "rows", "cols", "lead"))
def _swiglu_rms(gu, resid, *, eps, interpret, rows, cols, lead):
  s, f2 = gu.shape
  f2 -= lead
  blocks = f2 // 2 // cols
  # Column groups: the most (a divisor of `blocks`) within `MAX_PROGRAMS` programs.
  groups = max(g for g in range(1, blocks + 1)
               if blocks % g == 0 and (g == 1 or (s // rows) * g <= MAX_PROGRAMS))
  params = {}
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = dict(compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1))
  whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0, 0))
  out = jax.ShapeDtypeStruct((s, lead + f2 // 2), gu.dtype)
  kern = functools.partial(_kernel, eps=eps, rows=rows, cols=cols, per=blocks // groups,
                           one_load=not interpret, lead=lead)
  args = (gu,) if lead else (resid, gu)
  return pl.pallas_call(
      (lambda *refs: kern(None, *refs)) if lead else kern,
      grid=(s // rows, groups),
      in_specs=[whole(a) for a in args],
      out_specs=whole(out),
      out_shape=out,
      interpret=interpret,
      **params,
  )(*args)
