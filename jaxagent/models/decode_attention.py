"""Flash-decoding attention over a KV cache as a Pallas kernel (GPU; interpret mode elsewhere).

One program per (slot, KV head, split) walks its share of the slot's cached keys in blocks of
`block_k`, only up to the slot's length, with an online softmax, and returns the normalised
output and the log-sum-exp so the caller can merge in the attention to the new token itself.
With `splits > 1` the sequence is cut into that many ranges of blocks, one program each, and
the partial results are merged by log-sum-exp (flash-decoding), for launches with too few
(slot, head) programs to keep every SM busy; at 256 slots it measured slower than one pass on
an H100 even with 2-3 KV heads, so the default is one split. The XLA einsum path reads each
(slot, head) through small batched matmuls far below HBM bandwidth; this kernel reads every
live key and value once.

`flash_decode_write` is the one-token form the GPU decode step runs (`decoder.decode_in_place`):
it also writes the new token's key and value into the cache in place and attends to them from
registers, taking q and the new K/V as one array and returning the output unpadded, so that no
scatter, padding or slicing kernel runs around it. `flash_decode_write_qkv` is the same kernel
fed the raw q|k|v projection: it adds the bias, applies Qwen3's q / k norms and RoPE itself, so
that no XLA fusion runs between the projection's GEMM and the attention either.

The kernels scale by head_dim ** -0.5 and see every cached key: models with a sliding window or
another attention scale (Gemma 3) never reach them (`decoder.decode_kernels_fit`; the engine
decodes those on the XLA path, and an explicit `decode_attention="pallas"` is refused).
"""
from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_NEG = -1e30
_ROWS = 64  # query rows per program, at most


# Tuning of the kernel's launch: keys block_k, num_warps, num_stages, low_precision_dot (1:
# the two products take the cache's dtype with float32 accumulation instead of float32
# inputs), splits (sequence ranges per (slot, head); 0 = `auto_splits`). Set by
# `JAXAGENT_DECODE_KERNEL="block_k=128,num_warps=8"` for sweeps (benchmarks/generate.py
# --variants); read when a program is traced.
# Defaults: the fastest of sweeps on an H100 with the write-first decode step (256 slots;
# RESULTS.md): blocks of 32 keys and 2 stages beat the earlier H200-tuned 64 / 3 on all three
# shapes measured (SmolLM2-135M 2.54 -> 2.50 ms per step, Qwen2.5-1.5B 4.61 -> 4.50,
# Qwen3-0.6B 6.86 -> 6.64). One warp per program: with the kernel writing the new K/V
# (`flash_decode_write`) the Qwen3-0.6B step (2048 programs) went 6.23 -> 5.98 ms against 4
# warps, SmolLM2-135M and Qwen2.5-1.5B (768 and 512 programs) within 0.5%; 8 warps were 2-16%
# slower. Programs with a larger accumulator (appends) get more warps (`_warps_for_tile`).
# One split: auto splits (2-4) were 2-3% slower than one pass even for the models with 2-3 KV
# heads (512-768 programs), so the kernel is not short of programs there.
DEFAULT_TUNING = dict(block_k=32, num_warps=1, num_stages=2, low_precision_dot=1, splits=1)
# Launches of at most `FEW_PROGRAMS` (slot, KV head) programs (an H100 has 132 SMs) read each
# sequence in longer blocks with more loads in flight per program: at 64 slots (128-192
# programs) blocks of 64 keys, 2 warps, 3 stages measured 8-14% faster per decode step on an
# H100 (Qwen2.5-1.5B 2.93 -> 2.69 ms, SmolLM2-135M 1.67 -> 1.44 ms), and no faster at 256 slots.
FEW_PROGRAMS = 256
FEW_PROGRAMS_TUNING = dict(DEFAULT_TUNING, block_k=64, num_warps=2, num_stages=3)
# Heads of at most `SMALL_HEAD_DIM` get one more pipeline stage at the default's many
# programs: in the engine's step at 256 slots on an H200 (benchmarks/RESULTS.md) SmolLM2-135M
# (hd 64, chained weights) went 1.511 -> 1.467 ms with 3 stages (1.491 with 4), where 3 stages
# left Qwen2.5-1.5B (hd 128) at 3.250 -> 3.248 ms and made Qwen3-0.6B (hd 128) 0.6% slower.
# Alone, the kernel at SmolLM2-135M's shape was fastest with 3 stages on an H100 and on an
# H200 too. (Measured on the write kernel of the engine's step; `flash_decode` and
# `flash_decode_write` take the same setting.)
SMALL_HEAD_DIM = 64
SMALL_HEAD_TUNING = dict(DEFAULT_TUNING, num_stages=3)
# `decoder.decode_in_place` hands the kernel the raw q|k|v projection
# (`flash_decode_write_qkv`: bias, q / k norms and RoPE in the kernel) for head sizes up to
# this. Measured on an H100, 256 slots, against q, k and v prepared by XLA (benchmarks/
# RESULTS.md): SmolLM2-135M (hd 64) 2.083 -> 1.996-2.007 ms a step, Qwen2.5-1.5B (hd 128)
# 3.842 -> 3.768-3.775 ms, Qwen3-0.6B (hd 128, q / k norms) 5.767 -> 5.452 ms. (The first
# version put the rotated halves side by side with 0/1 products, which made hd 128 slower.)
FUSED_QKV_MAX_HEAD_DIM = 128
# `auto_splits` aims at this many programs per launch (an H100 has 132 SMs).
_TARGET_PROGRAMS = 2048


def auto_splits(slots: int, kv_heads: int, cache_len: int, block_k: int) -> int:
  """Sequence splits per (slot, KV head): a power of two that brings the launch to about
  `_TARGET_PROGRAMS` programs, keeping at least two blocks per split."""
  want = _TARGET_PROGRAMS // max(1, slots * kv_heads)
  cap = max(1, cache_len // (2 * block_k))
  n = max(1, min(want, cap))
  return 1 << (n.bit_length() - 1)


def tuning(programs: int | None = None, head_dim: int | None = None) -> dict:
  """The kernel's launch settings: DEFAULT_TUNING (FEW_PROGRAMS_TUNING for a launch of at most
  FEW_PROGRAMS (slot, KV head) programs, else SMALL_HEAD_TUNING for heads of at most
  SMALL_HEAD_DIM) updated from $JAXAGENT_DECODE_KERNEL."""
  if programs is not None and programs <= FEW_PROGRAMS:
    defaults = FEW_PROGRAMS_TUNING
  elif head_dim is not None and head_dim <= SMALL_HEAD_DIM:
    defaults = SMALL_HEAD_TUNING
  else:
    defaults = DEFAULT_TUNING
  return env_tuning("JAXAGENT_DECODE_KERNEL", defaults)


def env_tuning(var: str, defaults: dict) -> dict:
  """`defaults` (int launch settings of a Pallas kernel) updated from $`var`, a comma-separated
  list of key=value with keys of `defaults` (e.g. "block_k=32,num_warps=8")."""
  out = dict(defaults)
  spec = os.environ.get(var, "").strip()
  for item in filter(None, (x.strip() for x in spec.split(","))):
    key, sep, value = item.partition("=")
    if not sep or key not in out:
      raise ValueError(f"{var}: expected comma-separated key=value with keys "
                       f"{sorted(out)}, got {item!r}")
    out[key] = int(value)
  return out


def _online_block(q, length, dot_dtype, block_k, load, b, carry):
  """One block of keys into the online softmax: carry (o [Gp, hd], m [Gp], l [Gp])."""
  o, m, l = carry
  gp = q.shape[0]
  start = pl.multiple_of(b * block_k, block_k)
  k, v = load(start)
  k, v = k.astype(dot_dtype), v.astype(dot_dtype)  # [BK, hd]
  s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32)  # [Gp, BK]
  idx = start + jax.lax.broadcasted_iota(jnp.int32, (gp, block_k), 1)
  s = jnp.where(idx < length, s, _NEG)
  m_new = jnp.maximum(m, s.max(axis=-1))
  p = jnp.exp(s - m_new[:, None])
  corr = jnp.exp(m - m_new)
  l = corr * l + p.sum(axis=-1)
  o = corr[:, None] * o + jax.lax.dot_general(p.astype(dot_dtype), v, (((1,), (0,)), ((), ())),
                                              preferred_element_type=jnp.float32)
  return o, m_new, l


def _attend(q, length, first, last, own, share, *, block_k, dot_dtype):
  """The online softmax of q over blocks [first, last) of keys (those at or past `length`
  masked): blocks wholly inside the first `share[1]` keys come from `share[0]` (a loader of
  another slot's rows) when `share` is given, the rest from `own`."""
  gp, hd = q.shape
  body = functools.partial(_online_block, q, length, dot_dtype, block_k)
  carry = (jnp.zeros((gp, hd), jnp.float32), jnp.full((gp,), _NEG, jnp.float32),
           jnp.zeros((gp,), jnp.float32))
  if share is not None:
    # The slot's first `shared` keys equal those of another slot (a sample of the same
    # prompt): whole blocks of them are read from that slot's rows, which the programs of the
    # other samples read at about the same time, so that most of those reads come from the
    # L2 cache instead of HBM.
    other, shared = share
    mid = jnp.clip(shared // block_k, first, jnp.maximum(first, last))
    carry = jax.lax.fori_loop(first, mid, functools.partial(body, other), carry)
    first = mid
  return jax.lax.fori_loop(first, jnp.maximum(first, last), functools.partial(body, own), carry)


def _kernel(lens_ref, *refs, block_k: int, scale: float, dot_dtype, split_blocks: int,
            row_blocks: int, shared: bool):
  if shared:
    share_ref, q_ref, k_ref, v_ref, ks_ref, vs_ref, o_ref, lse_ref = refs
  else:
    q_ref, k_ref, v_ref, o_ref, lse_ref = refs
  length = lens_ref[0]
  first = (pl.program_id(2) // row_blocks) * split_blocks  # this program's range of blocks
  last = jnp.minimum((length + block_k - 1) // block_k, first + split_blocks)
  q = (q_ref[...].astype(jnp.float32) * scale).astype(dot_dtype)  # [Gp, hd]
  own = lambda start: (k_ref[pl.ds(start, block_k), :], v_ref[pl.ds(start, block_k), :])
  share = None
  if shared:
    src, head = share_ref[0], pl.program_id(1)
    share = (lambda start: (ks_ref[src, head, pl.ds(start, block_k), :],
                            vs_ref[src, head, pl.ds(start, block_k), :]), share_ref[1])
  o, m, l = _attend(q, length, first, last, own, share, block_k=block_k, dot_dtype=dot_dtype)
  safe = jnp.maximum(l, 1e-30)
  o_ref[...] = (o / safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(l > 0, m + jnp.log(safe), _NEG)


def _launch_settings(fn: str, programs: int, launch: dict, head_dim: int | None = None) -> dict:
  """`tuning(programs, head_dim)` updated by a call's `launch` keywords (unknown ones are an
  error)."""
  t = tuning(programs=programs, head_dim=head_dim)
  unknown = set(launch) - set(t)
  if unknown:
    raise TypeError(f"{fn}: unknown launch settings {sorted(unknown)}")
  t.update(launch)
  return t


def _slot_inputs(lengths, share, s: int, kv: int, index_map):
  """BlockSpecs and arrays of the per-(slot, head) scalars: each slot's length and, with
  `share`, its (source slot, shared rows)."""
  specs = [pl.BlockSpec((None, None, 1), index_map)]
  args = [jnp.broadcast_to(lengths.astype(jnp.int32)[:, None, None], (s, kv, 1))]
  if share is not None:
    src, shared = (jnp.asarray(x, jnp.int32) for x in share)
    specs.append(pl.BlockSpec((None, None, 2), index_map))
    args.append(jnp.broadcast_to(jnp.stack([src, shared], -1)[:, None], (s, kv, 2)))
  return specs, args


def _cache_block(block_k: int, c: int) -> int:
  """The largest power of two dividing the cache length `c`, at most `block_k`."""
  block = min(block_k, c & -c)
  if block < 16:
    raise ValueError(f"cache length {c} must be a multiple of 16 for the decode kernel")
  return block


def _warps_for_tile(num_warps: int, rows: int, hd: int) -> int:
  """At least one warp per 2048 entries of a program's float32 output accumulator `[rows,
  hd]`, i.e. at most 64 of its registers a thread: one warp holds a decode step's 16 rows of
  64-128 lanes (what the one-warp default was measured on), but an append folds its n new
  tokens into up to 64 rows, whose accumulator in one warp would take 256 registers a thread
  (128 lanes) and spill."""
  return max(num_warps, -(-rows * hd // 2048))


def _compiler_params(interpret: bool, num_warps: int, num_stages: int) -> dict:
  if interpret or not (num_warps or num_stages):
    return {}
  from jax.experimental.pallas import triton as plt
  return {"compiler_params": plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)}


def flash_decode(q, cache_k, cache_v, lengths, *, share=None, interpret: bool = False,
                 **launch):
  """Attention of one query per (slot, head group) over each slot's first `lengths[s]` keys.

  q: [S, KV, G, hd]; cache_k, cache_v: [S, KV, C, hd] with C a multiple of 16 (blocks are
  the largest power of two up to `block_k` dividing C);
  lengths: [S]. `share`: None, or (src [S], shared [S]) ints saying that the first `shared[s]`
  keys and values of slot s are equal to those of slot `src[s]` (the samples of one prompt);
  the kernel then reads the whole blocks among them from slot `src[s]`, whose rows the
  programs of the other samples read too (mostly L2 hits instead of HBM reads). The result is
  the same either way. Returns (out [S, KV, G, hd] in q's dtype, lse [S, KV, G] float32); slots of
  length 0 give out 0 and lse -1e30. Launch settings are `tuning(S * KV, hd)` updated by `launch`
  (e.g. `block_k=32`).
  """
  t = _launch_settings("flash_decode", q.shape[0] * q.shape[1], launch, q.shape[-1])
  return _flash_decode(q, cache_k, cache_v, lengths, share, block_k=t["block_k"],
                       num_warps=t["num_warps"], num_stages=t["num_stages"],
                       low_precision_dot=bool(t["low_precision_dot"]), splits=t["splits"],
                       interpret=interpret)


@functools.partial(jax.jit, static_argnames=("block_k", "num_warps", "num_stages",
                                             "low_precision_dot", "splits", "interpret"))
def _flash_decode(q, cache_k, cache_v, lengths, share, *, block_k, num_warps, num_stages,
                  low_precision_dot, splits, interpret):
  s, kv, g, hd = q.shape
  c = cache_k.shape[2]
  block_k = _cache_block(block_k, c)
  n_blocks = c // block_k
  splits = auto_splits(s, kv, c, block_k) if splits <= 0 else min(splits, n_blocks)
  split_blocks = -(-n_blocks // splits)
  # Query rows per program: a power of two >= 16 (matmul tiles), at most _ROWS; more rows (the
  # n new tokens of an append fold into the head group) are split over a third grid axis, so
  # a program's tiles stay within the GPU's shared memory whatever n is.
  if g <= _ROWS:
    bq = gp = max(16, 1 << (g - 1).bit_length())
  else:
    bq, gp = _ROWS, -(-g // _ROWS) * _ROWS
  qp = jnp.pad(q, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
  num_warps = _warps_for_tile(num_warps, bq, hd)
  dot_dtype = cache_k.dtype if low_precision_dot else jnp.float32
  nr = gp // bq
  kern = functools.partial(_kernel, block_k=block_k, scale=1.0 / math.sqrt(hd),
                           dot_dtype=dot_dtype, split_blocks=split_blocks, row_blocks=nr,
                           shared=share is not None)
  cache_spec = pl.BlockSpec((None, None, c, hd), lambda i, j, a: (i, j, 0, 0))
  in_specs, args = _slot_inputs(lengths, share, s, kv, lambda i, j, a: (i, j, 0))
  in_specs += [pl.BlockSpec((None, None, bq, hd), lambda i, j, a: (i, j, a % nr, 0)),
               cache_spec, cache_spec]
  args += [qp, cache_k, cache_v]
  if share is not None:  # the whole caches again, for the reads from other slots' rows
    whole = pl.BlockSpec((s, kv, c, hd), lambda i, j, a: (0, 0, 0, 0))
    in_specs += [whole, whole]
    args += [cache_k, cache_v]
  # Partial outputs of several splits stay float32 until they are merged.
  o_dtype = q.dtype if splits == 1 else jnp.float32
  # Grid axis 2 enumerates (split, query-row block) pairs: a = split * nr + row block.
  out, lse = pl.pallas_call(
      kern,
      grid=(s, kv, splits * nr),
      in_specs=in_specs,
      out_specs=[
          pl.BlockSpec((None, None, None, bq, hd), lambda i, j, a: (i, j, a // nr, a % nr, 0)),
          pl.BlockSpec((None, None, None, bq), lambda i, j, a: (i, j, a // nr, a % nr)),
      ],
      out_shape=[jax.ShapeDtypeStruct((s, kv, splits, gp, hd), o_dtype),
                 jax.ShapeDtypeStruct((s, kv, splits, gp), jnp.float32)],
      interpret=interpret,
      **_compiler_params(interpret, num_warps, num_stages),
  )(*args)
  out, lse = out[:, :, :, :g], lse[:, :, :, :g]
  if splits == 1:
    return out[:, :, 0], lse[:, :, 0]
  # Merge the splits: weights exp(lse_p - lse); an empty split has lse -1e30 and weight 0.
  tot = jax.nn.logsumexp(lse, axis=2)
  w = jnp.exp(lse - tot[:, :, None])
  merged = (w[..., None] * out).sum(axis=2)
  return merged.astype(q.dtype), jnp.maximum(tot, _NEG)


def _prepared_rows(x_ref, b_ref, w_ref, cs_ref, slot, row0, n: int, valid, norm_row: int,
                   eps: float, scale=None, lead: int = 0, layer=()):
  """Rows `row0 ..` of this slot's projections as a float32 `[n, hd]` tile (rows at or past
  `valid` zero): times `scale` (the layer norm's row scale where its weight is folded into the
  projection: `flash_decode_write_qkv`'s `resid`), plus the bias (`b_ref`), RMS-normed with
  weight row `norm_row` of `w_ref` (Qwen3's q / k norms) and rotated by RoPE (`cs_ref`: the
  slot's cos / sin), each step rounded to the projections' dtype where `decoder._qkv` rounds
  it. `lead`: rows of x_ref's slot before its projections (the residual stream, with chained
  weights); row0 counts from past them. Rotate-half RoPE needs each entry's partner half a
  head away: the tile is loaded a second time with its columns rotated by half a head (a
  gather load), so no tile has to be cut and put back together. `layer`: `()`, or `(l,)` where
  b_ref and w_ref hold every layer's rows (`[L, ...]`) and this is layer l's call."""
  dt, hd = x_ref.dtype, x_ref.shape[-1]
  half = hd // 2
  f32 = lambda a: a.astype(jnp.float32)
  row = jax.lax.broadcasted_iota(jnp.int32, (n, hd), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (n, hd), 1)
  # Rows past `valid` read a valid row (no out-of-bounds read) and are zeroed below.
  rows = row0 + jnp.minimum(row, jnp.maximum(valid - 1, 0))
  partner = (col + half) % hd
  col1 = jax.lax.broadcasted_iota(jnp.int32, (1, hd), 1)  # one row's columns
  partner1 = (col1 + half) % hd
  x, xp = x_ref[slot, lead + rows, col], x_ref[slot, lead + rows, partner]
  if scale is not None:
    x, xp = (f32(x) * scale).astype(dt), (f32(xp) * scale).astype(dt)
  if b_ref is not None:
    x = (f32(x) + f32(b_ref[(*layer, rows, col)])).astype(dt)
    xp = (f32(xp) + f32(b_ref[(*layer, rows, partner)])).astype(dt)
  x, xp = f32(x), f32(xp)
  if w_ref is not None:
    r = jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / hd + eps)
    first = col1 * 0 + norm_row
    x = f32((x * r * f32(w_ref[(*layer, first, col1)])).astype(dt))
    xp = f32((xp * r * f32(w_ref[(*layer, first, partner1)])).astype(dt))
  k = col1 % half
  cos, sin = cs_ref[k * 0, k], cs_ref[k * 0 + 1, k]  # [1, hd]: each column's angle
  # First half: x1 cos - x2 sin; second half: x2 cos + x1 sin.
  y = (x * cos + jnp.where(col < half, -xp, xp) * sin).astype(dt)
  return jnp.where(row < valid, f32(y), 0.0)


def row_tile(ref, row0, rows: int, d: int, one_load: bool):
  """Columns `[0, d)` of rows `row0 ..` of a `[S, D]` ref (a kernel's residual-stream rows), as
  one tile. `one_load` (a GPU): one masked load of the next power of two past d, the columns
  past d zero (its start dynamic, so that no static bound check refuses the slice; a Triton
  tile's sides are powers of two). Else (interpret mode, which would clamp such a slice) the
  exact `[rows, d]` slice."""
  if not one_load:
    return ref[pl.ds(row0, rows), pl.ds(0, d)]
  from jax.experimental.pallas import triton as plt
  dp = _pow2_at_least(d)
  col = jax.lax.broadcasted_iota(jnp.int32, (rows, dp), 1)
  return plt.load(ref.at[pl.ds(row0, rows), pl.ds(row0 * 0, dp)], mask=col < d, other=0)


def store_row_tile(ref, x, row0, rows: int, d: int, one_load: bool):
  """Stores a `row_tile` of d columns into rows `row0 ..` of ref (masked as it was loaded)."""
  if not one_load:
    ref[pl.ds(row0, rows), pl.ds(0, d)] = x.astype(ref.dtype)
    return
  from jax.experimental.pallas import triton as plt
  col = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
  plt.store(ref.at[pl.ds(row0, rows), pl.ds(row0 * 0, x.shape[1])], x.astype(ref.dtype),
            mask=col < d)


def rms_scale(x, d: int, eps: float):
  """The RMS norm's scale `rsqrt(mean(x^2) + eps)` (float32 `[rows, 1]`) of a `row_tile` of d
  columns (its zero padding adds nothing to the sums)."""
  xf = x.astype(jnp.float32)
  return jax.lax.rsqrt(jnp.sum(xf * xf, axis=1, keepdims=True) / d + eps)


def row_rms_scale(ref, row0, rows: int, eps: float, one_load: bool, d: int | None = None):
  """`rms_scale` of rows `row0 ..` of a `[S, D]` ref (with `d`, of their first d columns), read
  as one `row_tile`. On a GPU a loop over column chunks instead would be a chain of load
  latencies at the start of every program: SmolLM2-135M's SwiGLU kernel took 5.0 us a call on
  an H200 with such a loop and 48 programs, 3.0 us with one load and 192 programs."""
  d = d or ref.shape[-1]
  return rms_scale(row_tile(ref, row0, rows, d, one_load), d, eps)


def _write_kernel(lens_ref, *refs, block_k: int, scale: float, dot_dtype, shared: bool, g: int,
                  gp: int, kv: int, rope: bool, bias: bool, qk_norm: bool, eps: float,
                  resid: bool, resid_eps: float, one_load: bool, lead: int = 0,
                  stacked: bool = False):
  from jax.experimental.pallas import triton as plt
  refs = list(refs)
  share_ref = refs.pop(0) if shared else None
  x_ref = refs.pop(0)
  cs_ref = refs.pop(0) if rope else None
  # `stacked`: the bias / norm refs hold every layer's rows and this ref says which layer.
  layer = (refs.pop(0)[0],) if stacked else ()
  b_ref = refs.pop(0) if bias else None
  w_ref = refs.pop(0) if qk_norm else None
  r_ref = refs.pop(0) if resid else None
  k_ref, v_ref, o_ref, ko_ref, vo_ref = refs
  slot, head = pl.program_id(0), pl.program_id(1)
  length = lens_ref[0]
  c = k_ref.shape[2]
  heads = g * kv
  # x_ref rows of this slot: `lead` rows of its residual stream (chained weights), the H query
  # heads, then the KV new keys, then the KV new values. This program's G query rows are loaded
  # as a power-of-two tile with the rest masked off.
  qmask = jax.lax.broadcasted_iota(jnp.int32, (gp, x_ref.shape[2]), 0) < g
  if rope:  # raw projections: the layer norm's scale, bias, norms and RoPE here
    # The attention norm's scale of this slot's residual stream, where its weight is folded.
    r = row_rms_scale(r_ref, slot, 1, resid_eps, one_load)[0, 0] if resid else None
    if lead:  # the stream in the slot's first rows: its scale, and the copy into the output
      lp = _pow2_at_least(lead)
      lmask = jax.lax.broadcasted_iota(jnp.int32, (lp, x_ref.shape[2]), 0) < lead
      stream = plt.load(x_ref.at[slot, pl.ds(0, lp), :], mask=lmask, other=0)
      sf = stream.astype(jnp.float32)
      r = jax.lax.rsqrt(jnp.sum(sf * sf) / (lead * x_ref.shape[2]) + resid_eps)

      @pl.when(head == 0)
      def _():
        plt.store(o_ref.at[slot, pl.ds(0, lp), :], stream.astype(o_ref.dtype), mask=lmask)
    q = _prepared_rows(x_ref, b_ref, w_ref, cs_ref, slot, head * g, gp, g, 0, eps, r, lead,
                       layer)
    # The new key as row 0 of a 16-row tile (a product's smallest), the other rows zero.
    k_new = jnp.sum(_prepared_rows(x_ref, b_ref, w_ref, cs_ref, slot, heads + head, 16, 1, 1,
                                   eps, r, lead, layer),
                    axis=0, keepdims=True).astype(x_ref.dtype)
    v_new = x_ref[slot, pl.ds(lead + heads + kv + head, 1), :]
    if resid or lead:
      v_new = (v_new.astype(jnp.float32) * r).astype(x_ref.dtype)
    if bias:
      v_new = (v_new.astype(jnp.float32)
               + b_ref[(*layer, pl.ds(heads + kv + head, 1), slice(None))].astype(jnp.float32)
               ).astype(x_ref.dtype)
  else:
    q = plt.load(x_ref.at[slot, pl.ds(head * g, gp), :], mask=qmask, other=0)
    k_new = x_ref[slot, pl.ds(heads + head, 1), :]  # [1, hd]
    v_new = x_ref[slot, pl.ds(heads + kv + head, 1), :]
  fits = length < c

  # The new token's K/V go to row `length` of this slot and head (dropped when the cache is
  # full); this program attends to them from registers, so it never reads the row it writes.
  @pl.when(fits)
  def _():
    ko_ref[slot, head, pl.ds(length, 1), :] = k_new.astype(ko_ref.dtype)
    vo_ref[slot, head, pl.ds(length, 1), :] = v_new.astype(vo_ref.dtype)

  q = (q.astype(jnp.float32) * scale).astype(dot_dtype)  # [Gp, hd]
  own = lambda start: (k_ref[slot, head, pl.ds(start, block_k), :],
                       v_ref[slot, head, pl.ds(start, block_k), :])
  share = None
  if shared:
    src = share_ref[0]
    share = (lambda start: (k_ref[src, head, pl.ds(start, block_k), :],
                            v_ref[src, head, pl.ds(start, block_k), :]), share_ref[1])
  last = (length + block_k - 1) // block_k
  o, m, l = _attend(q, length, 0, last, own, share, block_k=block_k, dot_dtype=dot_dtype)
  # The new token, rounded to the cache's dtype as the cached keys are.
  kn = k_new.astype(k_ref.dtype).astype(jnp.float32)
  s_new = jnp.sum(q.astype(jnp.float32) * kn, axis=-1)  # [Gp]
  s_new = jnp.where(fits, s_new, _NEG)
  m_new = jnp.maximum(m, s_new)
  corr, p = jnp.exp(m - m_new), jnp.exp(s_new - m_new)
  l = corr * l + p
  vn = v_new.astype(v_ref.dtype).astype(jnp.float32)
  o = corr[:, None] * o + p[:, None] * vn
  o = (o / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)
  plt.store(o_ref.at[slot, pl.ds(lead + head * g, gp), :], o, mask=qmask)


def _pow2_at_least(n: int) -> int:
  return 1 << (n - 1).bit_length()


def flash_decode_write(q, k_new, v_new, cache_k, cache_v, lengths, *, share=None,
                       interpret: bool = False, **launch):
  """One decode step's attention with the new token's K/V written into the cache.

  Writes `k_new`, `v_new` ([S, KV, hd]) at row `lengths[s]` of slot s's cache (dropped when
  `lengths[s] == C`, the cache full) and returns the attention of q ([S, KV, G, hd], G <= 64)
  over the slot's first `lengths[s]` cached keys plus the new one (the C cached keys alone for
  a full cache): the same as writing with `.at[...].set(mode="drop")` and then
  `flash_decode(q, cache_k, cache_v, min(lengths + 1, C))`, without the two scatter kernels
  per layer. q, k_new and v_new go to the kernel as one `[S, H + 2 KV, hd]` array (XLA builds
  it in one fusion with whatever produced them: RoPE, norms, the projection's split), and the
  output comes back unpadded, so no padding or slicing kernels run around it either. The
  caches are updated in place (donate them through the enclosing jit). `share` as in
  `flash_decode`. Launch settings: `tuning(S * KV, hd)` updated by `launch`; one pass per (slot,
  head) (`splits` is ignored). Returns (out [S, KV, G, hd] in q's dtype, cache_k, cache_v).
  """
  if q.shape[2] > _ROWS:
    raise ValueError(f"flash_decode_write: at most {_ROWS} query rows per KV head, got "
                     f"{q.shape[2]}")
  return _flash_decode_write(q, k_new, v_new, cache_k, cache_v, lengths, share,
                             interpret=interpret,
                             **_launch_settings("flash_decode_write", q.shape[0] * q.shape[1],
                                                launch, q.shape[-1]))


def flash_decode_write_qkv(qkv, rope, cache_k, cache_v, lengths, bias=None, qk_norm=None,
                           resid=None, *, eps: float = 1e-6, resid_eps: float = 1e-6,
                           resid_rows: int = 0, layer=None, share=None, interpret: bool = False,
                           **launch):
  """`flash_decode_write` from a decode step's raw q|k|v projections: the bias, Qwen3's q / k
  norms and RoPE are applied inside the kernel, so that nothing runs between the projection's
  GEMM and the kernel (`[S, (H + 2 KV) hd]` to `[S, H + 2 KV, hd]` is a free reshape).

  qkv: `[S, H + 2 KV, hd]`, the H query heads, the KV keys and the KV values of each slot's new
  token as the projection wrote them; rope: `[S, 2, hd / 2]` float32, the cos and sin of each
  slot's new position (`decoder.rope_tables` at `lengths`); bias: None or `[H + 2 KV, hd]`;
  qk_norm: None or `[2, hd]`, the q and k norm weights (RMS norm with `eps` over each head).
  resid: None or `[S, D]`, each slot's residual stream entering the layer, where the layer's
  RMS norm weight is folded into the projection (`param_tree.merge_decode_weights(
  fold_norms=True)`): the projection is then that of the unnormed stream, and each slot's rows
  are first multiplied by the norm's scale `rsqrt(mean(resid^2) + resid_eps)`, computed here,
  so that no XLA norm runs before the projection either.
  resid_rows: with chained weights (`param_tree.chain_decode_weights`), each slot's residual
  stream (R x hd = D entries) rides in the first R rows of qkv, before its projections
  (`[S, R + H + 2 KV, hd]`, resid None): the norm's scale is taken from those rows, and the
  output is `[S, R + H, hd]`, those rows copied, then the H heads' attention (the next GEMM's
  `[x | a]`).
  layer: None, or this call's layer (an int or int32 scalar) where bias and qk_norm hold every
  layer's rows, `[L, H + 2 KV, hd]` and `[L, 2, hd]` (the params' stacked layout): the kernel
  reads that layer's rows itself. A slice of the stacked arrays per call would be a copy
  before each kernel (about a microsecond each on an H200).
  Rounded as `decoder._qkv` rounds them: scaled rows, bias added in qkv's dtype, normed heads
  and rotated heads rounded to it. The cache's KV head count gives H / KV; hd must be even
  (and at least 32 outside interpret mode: no smaller head was run on a GPU). The rest as
  `flash_decode_write`. Returns (out [S, KV, G, hd] in qkv's dtype, cache_k, cache_v).
  """
  s, rows, hd = qkv.shape
  if resid_rows and (resid is not None or not 0 < resid_rows < rows):
    raise ValueError(f"flash_decode_write_qkv: resid_rows={resid_rows} needs resid None and "
                     f"fewer rows than qkv's {rows}")
  rows -= resid_rows
  kv = cache_k.shape[1]
  g = (rows - 2 * kv) // kv
  if rows != (g + 2) * kv or not 0 < g <= _ROWS:
    raise ValueError(f"flash_decode_write_qkv: {rows} projection rows for {kv} KV heads; "
                     f"expected (G + 2) * KV with 1 <= G <= {_ROWS}")
  if hd % 2 or (not interpret and hd < 32):
    raise ValueError(f"flash_decode_write_qkv: head_dim {hd} must be even and, on a GPU, >= 32")
  if rope.shape != (s, 2, hd // 2):
    raise ValueError(f"flash_decode_write_qkv: rope must be [S, 2, hd / 2] = {(s, 2, hd // 2)}"
                     f", got {rope.shape}")
  if resid is not None and (resid.ndim != 2 or resid.shape[0] != s):
    raise ValueError(f"flash_decode_write_qkv: resid must be [S, D] with S = {s}, got "
                     f"{resid.shape}")
  for name, a, n in (("bias", bias, rows), ("qk_norm", qk_norm, 2)):
    if a is None:
      continue
    want = (n, hd) if layer is None else (a.shape[0], n, hd)
    if a.shape != want:
      raise ValueError(f"flash_decode_write_qkv: {name} must be {list(want)}"
                       f"{'' if layer is None else ' (every layer, with layer given)'}, got "
                       f"{list(a.shape)}")
  if layer is not None:  # no per-layer rows to pick without a bias or norms
    layer = (None if bias is None and qk_norm is None
             else jnp.asarray(layer, jnp.int32).reshape(1))
  return _flash_decode_write(qkv, None, None, cache_k, cache_v, lengths, share, rope=rope,
                             bias=bias, qk_norm=qk_norm, resid=resid, layer=layer, eps=float(eps),
                             resid_eps=float(resid_eps), g=g, lead=int(resid_rows),
                             interpret=interpret,
                             **_launch_settings("flash_decode_write_qkv", s * kv, launch, hd))


@functools.partial(jax.jit, static_argnames=("block_k", "num_warps", "num_stages",
                                             "low_precision_dot", "splits", "eps", "resid_eps",
                                             "g", "lead", "interpret"))
def _flash_decode_write(q, k_new, v_new, cache_k, cache_v, lengths, share, rope=None, bias=None,
                        qk_norm=None, resid=None, layer=None, *, block_k, num_warps, num_stages,
                        low_precision_dot, splits, interpret, eps=0.0, resid_eps=0.0, g=0,
                        lead=0):
  """The kernel's launch. With `rope` None, q is `[S, KV, G, hd]` and k_new / v_new the new
  K/V (`flash_decode_write`); otherwise q holds the raw `[S, H + 2 KV, hd]` projections,
  k_new / v_new are None and the kernel prepares them (`flash_decode_write_qkv`; `lead` its
  `resid_rows`)."""
  del splits  # one pass per (slot, head)
  s, kv, c, hd = cache_k.shape
  block_k = _cache_block(block_k, c)
  g = g or q.shape[2]
  gp = max(16, 1 << (g - 1).bit_length())
  num_warps = _warps_for_tile(num_warps, gp, hd)
  heads = kv * g
  # On a GPU the masked tiles of the last head group (and the new key's 16-row tile) reach
  # past the rows (no memory is touched there); interpret mode slices them out of real
  # memory, so it gets `gp` spare rows.
  spare = max(gp, _pow2_at_least(lead) if lead else 0) if interpret else 0
  pad = lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, spare), (0, 0)]) if spare else a
  if rope is None:
    x = pad(jnp.concatenate([q.reshape(s, heads, hd), k_new.astype(q.dtype),
                             v_new.astype(q.dtype)], axis=1))
  else:
    x = pad(q)
  dot_dtype = cache_k.dtype if low_precision_dot else jnp.float32
  kern = functools.partial(_write_kernel, block_k=block_k, scale=1.0 / math.sqrt(hd),
                           dot_dtype=dot_dtype, shared=share is not None, g=g, gp=gp, kv=kv,
                           rope=rope is not None, bias=bias is not None,
                           qk_norm=qk_norm is not None, eps=eps, resid=resid is not None,
                           resid_eps=resid_eps, one_load=not interpret, lead=lead,
                           stacked=layer is not None)
  in_specs, args = _slot_inputs(lengths, share, s, kv, lambda i, j: (i, j, 0))
  # Whole-array refs: each program reads its own rows and, with sharing, its source's; the
  # caches are aliased to the outputs, so the write lands in place (no copy of the cache).
  whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * len(a.shape))
  out_shape = jax.ShapeDtypeStruct((s, lead + heads + spare, hd), x.dtype)
  # The kernel's inputs after the per-slot scalars, in `_write_kernel`'s order.
  inputs = [(x, whole(x))]
  if rope is not None:  # this slot's cos / sin
    inputs.append((rope.astype(jnp.float32),
                   pl.BlockSpec((None, 2, hd // 2), lambda i, j: (i, 0, 0))))
  if layer is not None:
    inputs.append((layer, whole(layer)))
  if bias is not None:
    b = pad(bias.astype(x.dtype))
    inputs.append((b, whole(b)))
  if qk_norm is not None:
    inputs.append((qk_norm, whole(qk_norm)))
  if resid is not None:
    inputs.append((resid, whole(resid)))
  inputs += [(cache_k, whole(cache_k)), (cache_v, whole(cache_v))]
  in_specs += [spec for _, spec in inputs]
  args += [a for a, _ in inputs]
  n_in = len(args)
  out, ck, cv = pl.pallas_call(
      kern,
      grid=(s, kv),
      in_specs=in_specs,
      out_specs=[whole(out_shape), whole(cache_k), whole(cache_v)],
      out_shape=[out_shape, jax.ShapeDtypeStruct(cache_k.shape, cache_k.dtype),
                 jax.ShapeDtypeStruct(cache_v.shape, cache_v.dtype)],
      input_output_aliases={n_in - 2: 1, n_in - 1: 2},
      interpret=interpret,
      **_compiler_params(interpret, num_warps, num_stages),
  )(*args)
  if lead:
    return out[:, :lead + heads], ck, cv
  return out[:, :heads].reshape(s, kv, g, hd), ck, cv
