"""Causal attention over packed rows as Pallas kernels (GPU; interpret mode elsewhere).

A packed row holds several trajectories one after another; each token attends to the earlier
tokens of its own segment only. A dense `[B, 1, T, T]` mask makes a fused-attention kernel
compute every block under the causal diagonal, although the blocks that lie entirely across
two segments contribute nothing. These kernels visit only the key blocks that can share a
segment with the query block:

* forward and dq: for the query block starting at `qs`, key blocks from the start of the
  segment of token `qs` up to the diagonal;
* dk / dv: for the key block ending at `ke`, query blocks from the diagonal up to the end of
  the segment of token `ke - 1`.

With trajectories of 200-1300 tokens in 2048-token rows that skips most of the causal blocks.
Segments are the contiguous runs of equal `segment_ids` (0, the padding, is a run like any
other), which is what the packing produces; a segment id that reappears after another one
starts a new run, which sees nothing of the earlier one (the decoder's XLA and cuDNN paths,
`decoder.segment_attention`, mask the same runs).

With a sliding window (`window`: a query sees the keys of its run fewer than `window`
positions back), the forward and dq kernels also start at the key block holding the first
query's oldest visible key, and the dk / dv kernel stops after the query block holding the last
query that sees the block's last key: a row's cost then grows with T x window, not T^2.
`scale` replaces head_dim ** -0.5 (Gemma 3's query_pre_attn_scalar ** -0.5). Both are checked
against the XLA path in Pallas interpret mode (tests/models/packed_attention_test.py), not yet
compiled on a GPU: `decoder.attention_path` sends windowed models here only when asked to
("pallas"); its "auto" keeps them on cuDNN.

One forward kernel (online softmax in base 2, the log-sum-exp kept for the backward) and two
backward kernels (dk / dv per key block, summed over the query heads that share the key-value
head inside the program; dq per query block), FlashAttention-2 style. q: `[B, T, H, hd]`,
k / v: `[B, T, KV, hd]` (grouped-query attention: H a multiple of KV), T padded up to a
multiple of the blocks inside.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from jaxagent.models.decode_attention import env_tuning

_NEG = -1e30
_LOG2E = math.log2(math.e)
# Names of the forward's residuals (output and base-2 log-sum-exp) for remat policies: saving
# them keeps the backward from running the forward kernel again.
RESIDUAL_NAMES = ("packed_attention_out", "packed_attention_lse")

# Launch settings: query / key block sizes of the forward (`fwd_q`, `fwd_k`), of the dq kernel
# (`dq_q`, `dq_k`) and of the dk / dv kernel (`dkv_q`, `dkv_k`), and the Triton warps / stages
# of each kernel. Overridden by $JAXAGENT_PACKED_ATTENTION="fwd_q=64,fwd_warps=8" for sweeps
# (benchmarks/attention.py), read when a program is traced.
DEFAULT_TUNING = dict(fwd_q=64, fwd_k=32, fwd_warps=4, fwd_stages=3,
                      dq_q=64, dq_k=64, dq_warps=4, dq_stages=2,
                      dkv_q=64, dkv_k=64, dkv_warps=4, dkv_stages=2)


def tuning(**launch) -> dict:
  """DEFAULT_TUNING updated from $JAXAGENT_PACKED_ATTENTION, then from `launch`."""
  out = env_tuning("JAXAGENT_PACKED_ATTENTION", DEFAULT_TUNING)
  unknown = set(launch) - set(out)
  if unknown:
    raise TypeError(f"packed_attention: unknown launch settings {sorted(unknown)}")
  out.update(launch)
  for key, value in out.items():
    if key.endswith(("_q", "_k")) and not tileable(value):
      raise ValueError(f"packed_attention: block size {key}={value} must be a power of two "
                       f">= 16")
  return out


def tileable(n: int) -> bool:
  """Whether `n` (a block or head size) fits the kernels' tiles: a power of two >= 16."""
  return n >= 16 and not n & (n - 1)


def _runs(segment_ids):
  """Run ids (a new id at every change of segment id), each token's run start and run end
  (exclusive), all [B, T] int32."""
  b, t = segment_ids.shape
  idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  first = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
  runs = jnp.cumsum(first, axis=1, dtype=jnp.int32)
  start = jax.lax.cummax(jnp.where(first, idx, 0), axis=1)
  last = jnp.concatenate([first[:, 1:], jnp.ones((b, 1), bool)], 1)
  end = jax.lax.cummin(jnp.where(last, idx + 1, t), axis=1, reverse=True)
  return runs, start, end


def _mask(q_runs, k_runs, qs, ks, bq, bk, window=None):
  q_pos = qs + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  k_pos = ks + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  mask = (q_runs[:, None] == k_runs[None, :]) & (q_pos >= k_pos)
  if window is not None:  # within a run, index offsets are position offsets
    mask = mask & (q_pos - k_pos < window)
  return mask


def _dot(a, b):
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _fwd_kernel(lo_ref, win_ref, runs_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, bq, bk,
                scale2, group, windowed):
  b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  window = win_ref[0] if windowed else None
  kvh = h // group
  qs = pl.multiple_of(i * bq, bq)
  q = q_ref[b, pl.ds(qs, bq), h, :]
  q_runs = runs_ref[b, pl.ds(qs, bq)]
  hd = q.shape[-1]

  def body(j, carry):
    o, m, l = carry
    ks = pl.multiple_of(j * bk, bk)
    k = k_ref[b, pl.ds(ks, bk), kvh, :]
    v = v_ref[b, pl.ds(ks, bk), kvh, :]
    s = _dot(q, k.T) * scale2
    s = jnp.where(_mask(q_runs, runs_ref[b, pl.ds(ks, bk)], qs, ks, bq, bk, window), s, _NEG)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp2(s - m_new[:, None])
    corr = jnp.exp2(m - m_new)
    # A row whose first visited blocks are all masked sums junk (exp2(0)) into l and o; its
    # own diagonal entry comes later and `corr` = exp2(-1e30 - m) = 0 then clears the junk.
    l = corr * l + p.sum(axis=-1)
    o = corr[:, None] * o + _dot(p.astype(v.dtype), v)
    return o, m_new, l

  init = (jnp.zeros((bq, hd), jnp.float32), jnp.full((bq,), _NEG, jnp.float32),
          jnp.zeros((bq,), jnp.float32))
  hi = (qs + bq + bk - 1) // bk
  o, m, l = jax.lax.fori_loop(lo_ref[0], hi, body, init)
  o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log2(l)


def _dq_kernel(lo_ref, win_ref, runs_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               dq_ref, *, bq, bk, scale2, scale, group, windowed):
  b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  window = win_ref[0] if windowed else None
  kvh = h // group
  qs = pl.multiple_of(i * bq, bq)
  q = q_ref[b, pl.ds(qs, bq), h, :]
  do = do_ref[b, pl.ds(qs, bq), h, :]
  lse = lse_ref[b, h, pl.ds(qs, bq)]
  delta = delta_ref[b, h, pl.ds(qs, bq)]
  q_runs = runs_ref[b, pl.ds(qs, bq)]

  def body(j, dq):
    ks = pl.multiple_of(j * bk, bk)
    k = k_ref[b, pl.ds(ks, bk), kvh, :]
    v = v_ref[b, pl.ds(ks, bk), kvh, :]
    s = _dot(q, k.T) * scale2
    mask = _mask(q_runs, runs_ref[b, pl.ds(ks, bk)], qs, ks, bq, bk, window)
    p = jnp.where(mask, jnp.exp2(s - lse[:, None]), 0.0)
    dp = _dot(do, v.T)
    ds = p * (dp - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k)

  hi = (qs + bq + bk - 1) // bk
  dq = jax.lax.fori_loop(lo_ref[0], hi, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(hi_ref, win_ref, runs_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref, *, bq, bk, scale2, scale, group, windowed):
  b, kvh, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  window = win_ref[0] if windowed else None
  ks = pl.multiple_of(j * bk, bk)
  k = k_ref[b, pl.ds(ks, bk), kvh, :]
  v = v_ref[b, pl.ds(ks, bk), kvh, :]
  k_runs = runs_ref[b, pl.ds(ks, bk)]
  lo = ks // bq  # causal: queries before the key block see none of it

  def head(g, carry):
    h = kvh * group + g

    def body(i, carry):
      dk, dv = carry
      qs = pl.multiple_of(i * bq, bq)
      q = q_ref[b, pl.ds(qs, bq), h, :]
      do = do_ref[b, pl.ds(qs, bq), h, :]
      lse = lse_ref[b, h, pl.ds(qs, bq)]
      delta = delta_ref[b, h, pl.ds(qs, bq)]
      s = _dot(q, k.T) * scale2
      mask = _mask(runs_ref[b, pl.ds(qs, bq)], k_runs, qs, ks, bq, bk, window)
      p = jnp.where(mask, jnp.exp2(s - lse[:, None]), 0.0)  # [bq, bk]
      dv = dv + _dot(p.astype(do.dtype).T, do)
      dp = _dot(do, v.T)
      ds = p * (dp - delta[:, None])
      dk = dk + _dot(ds.astype(q.dtype).T, q)
      return dk, dv

    return jax.lax.fori_loop(lo, hi_ref[0], body, carry)

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = jax.lax.fori_loop(0, group, head, (zeros, zeros))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _params(t, prefix, interpret):
  if interpret:
    return {}
  from jax.experimental.pallas import triton as plt
  return {"compiler_params": plt.CompilerParams(num_warps=t[prefix + "_warps"],
                                                num_stages=t[prefix + "_stages"])}


def _whole():
  return pl.BlockSpec()


def _first_key_block(start, bq, bk):
  """Per query block of `bq`: the first key block of `bk` it can see (the one holding the start
  of its first query's run), [B, T / bq, 1] int32."""
  return (start[:, ::bq] // bk)[..., None]


def _query_block_end(end, bq, bk):
  """Per key block of `bk`: one past the last query block of `bq` that can see it (the end of
  its last key's run), [B, T / bk, 1] int32."""
  return (-(-end[:, bk - 1::bk] // bq))[..., None]


def _window_first_key_block(lo, win, n, bq, bk):
  """`_first_key_block` raised, per query block, to the key block holding the oldest key its
  first query sees within the window `win` ([1] int32)."""
  qs = jnp.arange(n // bq, dtype=jnp.int32) * bq
  return jnp.maximum(lo, (jnp.maximum(qs - win[0] + 1, 0) // bk)[None, :, None])


def _window_query_block_end(hi, win, n, bq, bk):
  """`_query_block_end` lowered, per key block, to one past the query block holding the last
  query that sees the block's last key within the window `win` ([1] int32)."""
  last_key = jnp.arange(n // bk, dtype=jnp.int32) * bk + bk - 1
  return jnp.minimum(hi, (-(-(last_key + win[0]) // bq))[None, :, None])


def _forward(q, k, v, runs, start, win, t, scale, windowed, interpret):
  b, n, h, hd = q.shape
  group = h // k.shape[2]
  bq, bk = t["fwd_q"], t["fwd_k"]
  lo = _first_key_block(start, bq, bk)
  if windowed:
    lo = _window_first_key_block(lo, win, n, bq, bk)
  # (the default scale's constant computed as it always was: unchanged kernels)
  scale2 = _LOG2E / math.sqrt(hd) if scale is None else _LOG2E * scale
  kern = functools.partial(_fwd_kernel, bq=bq, bk=bk, scale2=scale2, group=group,
                           windowed=windowed)
  return pl.pallas_call(
      kern,
      grid=(b, h, n // bq),
      in_specs=[pl.BlockSpec((None, None, 1), lambda i, j, a: (i, a, 0))] + [_whole()] * 5,
      out_specs=[pl.BlockSpec((None, bq, None, hd), lambda i, j, a: (i, a, j, 0)),
                 pl.BlockSpec((None, None, bq), lambda i, j, a: (i, j, a))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, h, n), jnp.float32)],
      interpret=interpret, name="packed_attention_fwd", **_params(t, "fwd", interpret),
  )(lo, win, runs, q, k, v)


def _backward(q, k, v, o, lse, do, runs, start, end, win, t, scale, windowed, interpret):
  b, n, h, hd = q.shape
  kv = k.shape[2]
  group = h // kv
  scale = 1.0 / math.sqrt(hd) if scale is None else scale
  delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
  bq, bk = t["dq_q"], t["dq_k"]
  lo = _first_key_block(start, bq, bk)
  if windowed:
    lo = _window_first_key_block(lo, win, n, bq, bk)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, bq=bq, bk=bk, scale2=scale * _LOG2E, scale=scale,
                        group=group, windowed=windowed),
      grid=(b, h, n // bq),
      in_specs=[pl.BlockSpec((None, None, 1), lambda i, j, a: (i, a, 0))] + [_whole()] * 8,
      out_specs=pl.BlockSpec((None, bq, None, hd), lambda i, j, a: (i, a, j, 0)),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      interpret=interpret, name="packed_attention_dq", **_params(t, "dq", interpret),
  )(lo, win, runs, q, k, v, do, lse, delta)
  bq, bk = t["dkv_q"], t["dkv_k"]
  hi = _query_block_end(end, bq, bk)
  if windowed:
    hi = _window_query_block_end(hi, win, n, bq, bk)
  kv_spec = pl.BlockSpec((None, bk, None, hd), lambda i, j, a: (i, a, j, 0))
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, bq=bq, bk=bk, scale2=scale * _LOG2E, scale=scale,
                        group=group, windowed=windowed),
      grid=(b, kv, n // bk),
      in_specs=[pl.BlockSpec((None, None, 1), lambda i, j, a: (i, a, 0))] + [_whole()] * 8,
      out_specs=[kv_spec, kv_spec],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      interpret=interpret, name="packed_attention_dkv", **_params(t, "dkv", interpret),
  )(hi, win, runs, q, k, v, do, lse, delta)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _attention(q, k, v, runs, start, end, win, t_items, scale, windowed, interpret):
  out, _ = _forward(q, k, v, runs, start, win, dict(t_items), scale, windowed, interpret)
  return out


def _attention_fwd(q, k, v, runs, start, end, win, t_items, scale, windowed, interpret):
  out, lse = _forward(q, k, v, runs, start, win, dict(t_items), scale, windowed, interpret)
  out = checkpoint_name(out, RESIDUAL_NAMES[0])
  lse = checkpoint_name(lse, RESIDUAL_NAMES[1])
  return out, (q, k, v, out, lse, runs, start, end, win)


def _attention_bwd(t_items, scale, windowed, interpret, res, do):
  q, k, v, out, lse, runs, start, end, win = res
  dq, dk, dv = _backward(q, k, v, out, lse, do, runs, start, end, win, dict(t_items), scale,
                         windowed, interpret)
  return dq, dk, dv, None, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def packed_attention(q, k, v, segment_ids, window=None, *, scale: float | None = None,
                     interpret: bool | None = None, **launch):
  """Causal attention within each contiguous run of `segment_ids` (see the module docstring).

  q: [B, T, H, hd]; k, v: [B, T, KV, hd] with H a multiple of KV; segment_ids: [B, T] int.
  Scaled by `scale` (default 1/sqrt(hd)). `window` (None, an int or an int32 scalar, >= 1): a
  query sees only the keys of its run fewer than `window` positions back, itself included.
  Returns [B, T, H, hd] in q's dtype. Differentiable in q, k, v.
  `interpret` defaults to True off GPU (Pallas interpret mode: exact, slow; for tests).
  `launch` overrides `tuning()` (block sizes, warps, stages).
  """
  if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or q.shape[:2] != k.shape[:2]:
    raise ValueError(f"packed_attention: expected q [B, T, H, hd] and k, v [B, T, KV, hd], "
                     f"got {q.shape}, {k.shape}, {v.shape}")
  if q.shape[2] % k.shape[2] or q.shape[3] != k.shape[3]:
    raise ValueError(f"packed_attention: {q.shape[2]} query heads are not a multiple of "
                     f"{k.shape[2]} key-value heads, or head sizes differ")
  if segment_ids.shape != q.shape[:2]:
    raise ValueError(f"packed_attention: segment_ids {segment_ids.shape} must be [B, T] = "
                     f"{q.shape[:2]}")
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  hd = q.shape[3]
  if not interpret and not tileable(hd):
    raise ValueError(f"packed_attention: head size {hd} is not a power of two >= 16, which the "
                     f"kernels' tiles need on a GPU; use attention_impl='cudnn' or 'xla'")
  t = tuning(**launch)
  n = q.shape[1]
  mult = max(t[key] for key in t if key.endswith(("_q", "_k")))
  pad = -n % mult
  seg = segment_ids.astype(jnp.int32)
  if pad:
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
    # Padded positions come after every real token, so causality keeps them out of the real
    # tokens' attention whatever run they join; their outputs are cut off below.
    seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=-1)
  runs, start, end = _runs(seg)
  windowed = window is not None
  win = jnp.reshape(jnp.asarray(1 if window is None else window, jnp.int32), (1,))
  scale = None if scale is None else float(scale)
  out = _attention(q, k, v, runs, start, end, win, tuple(sorted(t.items())), scale, windowed,
                   interpret)
  return out[:, :n] if pad else out
