"""Fused vocabulary-projection kernels for token log-probs (Pallas; GPU, interpret mode elsewhere).

The learner's token log-probs need, per token, the log-sum-exp of `h @ w / T` over a large
vocabulary, and in the backward pass the logits' cotangent `c (onehot(target) - p)`. The XLA
path (`logprobs._chunk_logprobs`) writes each chunk's float32 logits to HBM, then reads them back
once for the log-sum-exp and, in the backward pass, once more to form the cotangent: for 4096
tokens of a 151,936-entry vocabulary that is 2.5 GB written and read per pass. These kernels
compute a tile of logits in registers (a bf16 matmul with float32 accumulation) and use it in
place:

  * `logsumexp`: each (token block, vocabulary block) program writes the block's running max
    and sum of exponentials (and, for entropies, of `exp(z - max) z`); XLA merges the
    `vocab / block_n` partials per token, a few MB instead of the logits.
  * `cotangent`: each program recomputes its tile of logits and writes the cotangent in the
    compute dtype, the operand the two backward matmuls read anyway.

Tiles: `block_m` tokens x `block_n` vocabulary entries, the hidden dimension in steps of
`block_k`. Programs run vocabulary-block-major (consecutive programs share a block of `w`), so
each block of the weight is read from HBM about once while the chunk's hidden states stay in
L2. The vocabulary must be a multiple of `block_n` and the hidden size of `block_k`
(`tileable`). The products are bf16 / f16 with float32 accumulation; float32 inputs take the
full-precision `dot` (slow on a GPU, where a default float32 `dot` would round to TF32), so
`logprobs.logprob_path` picks the kernels by default only for bf16 / f16 models.

Measured on an H100 (one 4096-token chunk, forward + backward as the learner runs it): 1.18x
faster than the XLA path at d 1024 (Qwen3-0.6B's 151,936-entry vocabulary), 1.21x at d 576,
about even at d 1536-2048, and 0.92x at d 3584, where the kernels' matmul (about 490 / 410
TFLOP/s against cuBLAS's 617) costs more than the passes they save; `logprobs.logprob_path`
picks them by default up to d 2048 (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxagent.models import decode_attention

# Launch settings: a sweep of 36 on an H100 found none faster beyond the run-to-run spread
# (benchmarks/RESULTS.md); override with JAXAGENT_VOCAB_KERNEL="block_m=256,num_warps=8".
DEFAULT_TUNING = dict(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=3)


def tuning() -> dict:
  return decode_attention.env_tuning("JAXAGENT_VOCAB_KERNEL", DEFAULT_TUNING)


def tileable(d: int, v: int) -> bool:
  """Whether the kernels' tiles divide a hidden size `d` and a vocabulary `v`."""
  t = tuning()
  return d % t["block_k"] == 0 and v % t["block_n"] == 0


def _compiler_params(t, interpret):
  return decode_attention._compiler_params(interpret, t["num_warps"], t["num_stages"])


def _tile_logits(h_ref, w_ref, inv_t, *, tied, block_k):
  """float32 `h @ w * inv_t` of the program's tile, accumulated over the hidden dimension."""
  bm, d = h_ref.shape
  bn = w_ref.shape[0] if tied else w_ref.shape[1]
  dims = (((1,), (1,)), ((), ())) if tied else (((1,), (0,)), ((), ()))
  exact = h_ref.dtype == jnp.float32
  precision = jax.lax.Precision.HIGHEST if exact else None

  def body(k, acc):
    hk = h_ref[:, pl.ds(k * block_k, block_k)]
    wk = w_ref[:, pl.ds(k * block_k, block_k)] if tied else w_ref[pl.ds(k * block_k, block_k), :]
    return acc + jax.lax.dot_general(hk, wk, dims, precision=precision,
                                     preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(0, d // block_k, body, jnp.zeros((bm, bn), jnp.float32))
  return acc * inv_t[:, None]


def _lse_kernel(h_ref, w_ref, inv_t_ref, m_ref, s_ref, *u_ref, tied, block_k):
  z = _tile_logits(h_ref, w_ref, inv_t_ref[...], tied=tied, block_k=block_k)
  m = jnp.max(z, axis=1)
  e = jnp.exp(z - m[:, None])
  m_ref[...] = m
  s_ref[...] = jnp.sum(e, axis=1)
  if u_ref:
    u_ref[0][...] = jnp.sum(e * z, axis=1)


def _cot_kernel(h_ref, w_ref, inv_t_ref, lse_ref, coef_ref, tgt_ref, *rest, tied, block_k,
                entropy):
  if entropy:
    ent_ref, ent_coef_ref, gz_ref = rest
  else:
    (gz_ref,) = rest
  z = _tile_logits(h_ref, w_ref, inv_t_ref[...], tied=tied, block_k=block_k)
  bn = z.shape[1]
  col = pl.program_id(1) * bn + jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
  logp = z - lse_ref[...][:, None]
  p = jnp.exp(logp)
  onehot = (col == tgt_ref[...][:, None]).astype(jnp.float32)
  gz = coef_ref[...][:, None] * (onehot - p)
  if entropy:
    gz = gz - ent_coef_ref[...][:, None] * p * (logp + ent_ref[...][:, None])
  gz_ref[...] = gz.astype(gz_ref.dtype)


def _block_m(n: int, t) -> int:
  """The largest power-of-two token block up to `block_m` that divides `n` (16 at least)."""
  bm = t["block_m"]
  while bm > 16 and n % bm:
    bm //= 2
  return bm


def _pad_rows(n, bm, *arrays):
  pad = (-n) % bm
  if not pad:
    return arrays
  return tuple(jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in arrays)


def _specs(bm, bn, d, tied):
  h_spec = pl.BlockSpec((bm, d), lambda i, j: (i, 0))
  w_spec = (pl.BlockSpec((bn, d), lambda i, j: (j, 0)) if tied
            else pl.BlockSpec((d, bn), lambda i, j: (0, j)))
  row = pl.BlockSpec((bm,), lambda i, j: (i,))
  return h_spec, w_spec, row


@functools.partial(jax.jit, static_argnames=("tied", "with_entropy", "interpret", "launch"))
def logsumexp(h, w, inv_t, *, tied: bool, with_entropy: bool = False, interpret: bool = False,
              launch: tuple | None = None):
  """Per-token log-sum-exp of `z = (h @ w) * inv_t` over the vocabulary, float32.

  h: [n, d] (bf16 / f16); w: [v, d] when `tied` (the embedding) else [d, v]; inv_t: scalar
  1 / temperature. Returns (lse [n], and with `with_entropy` the expected logit `sum p z` [n],
  else None): the entropy is `lse - sum p z`. `launch`: (key, value) pairs over `tuning()`.
  """
  t = {**tuning(), **dict(launch or ())}
  n, d = h.shape
  v = w.shape[0] if tied else w.shape[1]
  bm, bn = _block_m(n, t), t["block_n"]
  inv = jnp.full((n,), inv_t, jnp.float32)
  hp, inv = _pad_rows(n, bm, h, inv)
  npad = hp.shape[0]
  nv = v // bn
  h_spec, w_spec, row = _specs(bm, bn, d, tied)
  part = pl.BlockSpec((None, bm), lambda i, j: (j, i))
  n_out = 3 if with_entropy else 2
  outs = pl.pallas_call(
      functools.partial(_lse_kernel, tied=tied, block_k=t["block_k"]),
      grid=(npad // bm, nv),
      in_specs=[h_spec, w_spec, row],
      out_specs=[part] * n_out,
      out_shape=[jax.ShapeDtypeStruct((nv, npad), jnp.float32)] * n_out,
      interpret=interpret, name="vocab_logsumexp", **_compiler_params(t, interpret),
  )(hp, w, inv)
  m, s = outs[0][:, :n], outs[1][:, :n]
  mx = jnp.max(m, axis=0)
  scale = jnp.exp(m - mx)
  total = jnp.sum(s * scale, axis=0)
  lse = mx + jnp.log(total)
  if not with_entropy:
    return lse, None
  return lse, jnp.sum(outs[2][:, :n] * scale, axis=0) / total


@functools.partial(jax.jit, static_argnames=("tied", "interpret", "launch"))
def cotangent(h, w, inv_t, lse, coef, targets, ent=None, ent_coef=None, *, tied: bool,
              interpret: bool = False, launch: tuple | None = None):
  """The logits' cotangent `coef (onehot(targets) - p) - ent_coef p (log p + ent)` per token,
  `[n, v]` in `h`'s dtype, where `p = softmax(z)`, `z = (h @ w) * inv_t` and `log p = z - lse`.

  coef, lse, ent, ent_coef: float32 [n]; targets: int [n]. The entropy term is left out when
  `ent` is None. With `coef = g / T` this is the cotangent of `h @ w` for a log-prob cotangent
  `g` (and `ent_coef = g_ent / T` for an entropy cotangent `g_ent`); with `coef = -1` it is
  `p - onehot(targets)`. `launch`: as for `logsumexp`.
  """
  t = {**tuning(), **dict(launch or ())}
  n, d = h.shape
  v = w.shape[0] if tied else w.shape[1]
  bm, bn = _block_m(n, t), t["block_n"]
  entropy = ent is not None
  rows = [jnp.full((n,), inv_t, jnp.float32), lse.astype(jnp.float32),
          coef.astype(jnp.float32), targets.astype(jnp.int32)]
  if entropy:
    rows += [ent.astype(jnp.float32), ent_coef.astype(jnp.float32)]
  hp, *rows = _pad_rows(n, bm, h, *rows)
  npad = hp.shape[0]
  h_spec, w_spec, row = _specs(bm, bn, d, tied)
  gz = pl.pallas_call(
      functools.partial(_cot_kernel, tied=tied, block_k=t["block_k"], entropy=entropy),
      grid=(npad // bm, v // bn),
      in_specs=[h_spec, w_spec] + [row] * len(rows),
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((npad, v), h.dtype),
      interpret=interpret, name="vocab_cotangent", **_compiler_params(t, interpret),
  )(hp, w, *rows)
  return gz if npad == n else gz[:n]
