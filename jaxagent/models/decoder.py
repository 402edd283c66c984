"""The decoder: one definition, used for training (packed rows) and for sampling (KV cache).

Everything here is a pure function of a params pytree (laid out, initialised and transformed
in `jaxagent.models.param_tree`). Layers are stacked on a leading `layers` axis and run with
`lax.scan`, which keeps compile time flat in depth (or unrolled, `ModelConfig.scan_layers`).
The projection onto the vocabulary and the learner's token log-probs are in
`jaxagent.models.logprobs`; how the work splits over a mesh, in `jaxagent.models.per_shard`.

Three entry points share `_block`, so the training forward, prefill and cached decode compute
the same function of the same weights:
  * `forward` / `hidden_states`: packed `[B, L]` rows, attention causal within a segment.
  * `prefill`: a fresh prompt, returning the K/V to insert into a cache slot.
  * `extend`: new tokens for live cache slots (one token per slot when decoding, a chunk of
    tool-observation tokens when appending), attending to the slot's cached prefix.
The GPU decode step (`decode_in_place`) runs `_block` too, except over chained matrices
(`param_tree.chain_decode_weights`), where `_decode_chained` computes the same layer as two
products that carry the residual stream along (tested equal to `_block`'s to float rounding).

Gemma 3 layers (`ModelConfig.post_norms`) run `_gemma_block`: four (1 + w) norms, GeGLU, q / k
norms, `query_pre_attn_scalar` scaling. Layers may differ in their attention window and RoPE
frequencies (`layer_constants`: windowed layers with a RoPE base of their own); the layer loops
carry each layer's pair beside its weights. The Pallas decode kernels compute neither
(`decode_kernels_fit`), so such models decode through `extend` on the XLA path.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.models import decode_attention
from jaxagent.models import decode_mlp
from jaxagent.models import lora
from jaxagent.models import norm_rope_kernels
from jaxagent.models import packed_attention
from jaxagent.models.config import ModelConfig
# Parameters, the vocabulary path and the mesh helpers have modules of their own; the names
# below stay importable from here, where they lived before.
from jaxagent.models.logprobs import (FUSED_LOGPROB_MAX_D, logits_from_hidden,  # noqa: F401
                                      logprob_path, token_logprobs)
from jaxagent.models.param_tree import (Params, box, check_model_shapes,  # noqa: F401
                                        compute_copy, init_params, is_chained, is_merged,
                                        logical_axes, merge_decode_weights,
                                        merged_decode_weight_bytes, norms_folded, param_specs,
                                        stack_layers, unbox, unstack_layers)
from jaxagent.models.per_shard import batch_split, constrain_batch, per_shard, tensor_split

_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


# ----------------------------------------------------------------------------- pieces
def rms_norm(x, w, eps):
  y = x.astype(jnp.float32) * decode_mlp.row_scale(x, eps)
  return (y * w.astype(jnp.float32)).astype(x.dtype)


def norm_weight(w, cfg: ModelConfig):
  """The factor a stored norm weight scales by: w, or float32 1 + w for (1 + w) norms (Gemma;
  `ModelConfig.norm_plus_one`)."""
  return 1.0 + w.astype(jnp.float32) if cfg.norm_plus_one else w


def norm(x, w, cfg: ModelConfig):
  """The model's RMSNorm of x by the stored weight w (`norm_weight`)."""
  return rms_norm(x, norm_weight(w, cfg), cfg.norm_eps)


# The window of a layer that has none, where windows are per-layer arrays (longer than any
# sequence).
_NO_WINDOW = 1 << 30


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
  """Per-pair inverse frequencies, with Llama-3 or linear scaling when configured (float64 on
  host). `local`: those of the windowed layers where they have a base of their own
  (`ModelConfig.local_rope_theta`, unscaled)."""
  hd = cfg.head_dim
  if local and cfg.local_rope_theta is not None:
    inv = 1.0 / (cfg.local_rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    return inv.astype(np.float32)
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
  if cfg.rope_linear_factor is not None:
    inv = inv / cfg.rope_linear_factor
  if cfg.rope_scaling is not None:
    factor, lo_f, hi_f, orig = cfg.rope_scaling
    lo_wl, hi_wl = orig / lo_f, orig / hi_f
    wl = 2 * math.pi / inv
    smooth = (orig / wl - lo_f) / (hi_f - lo_f)
    scaled = np.where(wl > lo_wl, inv / factor, inv)
    mid = (wl <= lo_wl) & (wl >= hi_wl)
    inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
  return inv.astype(np.float32)


def layer_constants(cfg: ModelConfig):
  """Per-layer (inverse RoPE frequencies `[L, hd/2]` float32, window `[L]` int32, `_NO_WINDOW`
  for the layers without one) where the layers differ (a sliding window in some layers, or a
  RoPE base of the windowed layers' own), else None (every layer as `rope_inv_freq(cfg)`, no
  window)."""
  if not cfg.windowed and not cfg.per_layer_rope:
    return None
  glob, loc = rope_inv_freq(cfg), rope_inv_freq(cfg, local=True)
  inv = np.stack([loc if i in cfg.sliding_layers else glob for i in range(cfg.n_layers)])
  win = np.array([cfg.layer_window(i) or _NO_WINDOW for i in range(cfg.n_layers)], np.int32)
  return jnp.asarray(inv), jnp.asarray(win)


def rope_tables(positions, inv_freq):
  """float32 (cos, sin) `[B, T, 1, hd/2]` of the rotation angles at `positions` `[B, T]`."""
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
  return jnp.cos(freqs)[:, :, None, :], jnp.sin(freqs)[:, :, None, :]


def decode_rope(lengths, inv_freq):
  """Each slot's cos / sin at position `lengths[s]` as the raw-projection decode kernel takes
  them (`decode_attention.flash_decode_write_qkv`'s `rope`): float32 `[S, 2, hd / 2]`."""
  cos, sin = rope_tables(lengths[:, None], inv_freq)
  return jnp.stack([cos[:, 0, 0], sin[:, 0, 0]], axis=1)


def _rotate(xf, cos, sin, sign=1.0):
  """Rotate-half RoPE of float32 `xf` by the angles (`sign=-1`: by minus the angles, the
  rotation's transpose)."""
  x1, x2 = jnp.split(xf, 2, axis=-1)
  sin = sign * sin
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def apply_rope(x, positions, inv_freq):
  """HF (rotate-half) RoPE. x: [B, T, N, hd]; positions: [B, T]."""
  cos, sin = rope_tables(positions, inv_freq)
  return _rotate(x.astype(jnp.float32), cos, sin).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def norm_rope(x, w, cos, sin, eps, impl="xla"):
  """`apply_rope(rms_norm(x, w, eps))` (Qwen3's per-head q / k norms, then RoPE) for x
  `[B, T, N, hd]` and the `rope_tables` cos / sin, with a written-out backward pass.

  `impl`: "xla" (the two functions' own operations forward; backward, the rotation's
  transpose and the norm's backward from x and the per-row scale) or "pallas"
  (`norm_rope_kernels`: one kernel each way, per shard under the ambient mesh; see
  `norm_rope_path`). Both round the normed heads to x's dtype before the rotation, as the two
  functions do."""
  return _norm_rope_fwd(x, w, cos, sin, eps, impl)[0]


def _norm_rope_kernel_fwd(x, w, cos, sin, eps):
  interpret = jax.default_backend() == "cpu"
  fn = lambda x, cos, sin, w: norm_rope_kernels.forward(x, w, cos, sin, eps=eps,
                                                          interpret=interpret)
  return per_shard(fn, (x, cos, sin), 4, None, shared=(w,))


def _norm_rope_kernel_bwd(x, w, cos, sin, g, eps):
  interpret = jax.default_backend() == "cpu"
  fn = lambda x, cos, sin, g, w: norm_rope_kernels.backward(x, w, cos, sin, g, eps=eps,
                                                              interpret=interpret)
  dx, dw = per_shard(fn, (x, cos, sin, g), (4, 2), None, shared=(w,))
  return dx, jnp.sum(dw, axis=0)


def _norm_rope_fwd(x, w, cos, sin, eps, impl):
  if impl == "pallas":
    return _norm_rope_kernel_fwd(x, w, cos, sin, eps), (x, None, w, cos, sin)
  xf = x.astype(jnp.float32)
  r = decode_mlp.row_scale(x, eps)
  normed = (xf * r * w.astype(jnp.float32)).astype(x.dtype)
  out = _rotate(normed.astype(jnp.float32), cos, sin).astype(x.dtype)
  return out, (x, r, w, cos, sin)


def _norm_rope_bwd(eps, impl, res, g):
  x, r, w, cos, sin = res
  if impl == "pallas":
    dx, dw = _norm_rope_kernel_bwd(x, w, cos, sin, g, eps)
  else:
    dn = _rotate(g.astype(jnp.float32), cos, sin, sign=-1.0)  # the rotation's transpose
    xhat = x.astype(jnp.float32) * r
    dw = jnp.sum(dn * xhat, axis=tuple(range(x.ndim - 1)))
    dxhat = dn * w.astype(jnp.float32)
    dx = r * (dxhat - xhat * jnp.mean(dxhat * xhat, axis=-1, keepdims=True))
  return dx.astype(x.dtype), dw.astype(w.dtype), jnp.zeros_like(cos), jnp.zeros_like(sin)


norm_rope.defvjp(_norm_rope_fwd, _norm_rope_bwd)


def norm_rope_path(cfg: ModelConfig, backend: str) -> str:
  """How `_qkv` applies Qwen3's q / k norms and RoPE on `backend` (`norm_rope`):
  `cfg.norm_rope_impl`, with "auto" resolved to "pallas" (`norm_rope_kernels`) on GPUs when
  the kernels tile the head counts and head size and no "tensor" mesh axis splits the heads,
  and to "xla" elsewhere. An explicit "pallas" on a TPU, or that the kernels cannot tile, is
  an error. Gemma's (1 + w) q / k norms always take "xla" (an explicit "pallas" is an
  error)."""
  tileable = (norm_rope_kernels.tileable(cfg.n_heads, cfg.head_dim)
              and norm_rope_kernels.tileable(cfg.n_kv_heads, cfg.head_dim))
  # Gemma's (1 + w) q / k norms: the kernels are not tested with the offset weight.
  if cfg.norm_plus_one:
    if cfg.norm_rope_impl == "pallas":
      raise ValueError(f"norm_rope_impl='pallas' is for plain RMSNorm weights; architecture "
                       f"{cfg.architecture!r} has (1 + w) norms: use norm_rope_impl='xla' or "
                       "'auto'")
    return "xla"
  if cfg.norm_rope_impl != "auto":
    if cfg.norm_rope_impl == "pallas" and backend == "tpu":
      raise ValueError("norm_rope_impl='pallas' runs Triton kernels (GPUs; interpret mode on "
                       "CPUs); use norm_rope_impl='xla' or 'auto' on TPUs")
    if cfg.norm_rope_impl == "pallas" and not tileable:
      raise ValueError(
          "norm_rope_impl='pallas' needs head counts and head_dim that are powers of two; got "
          f"n_heads {cfg.n_heads}, n_kv_heads {cfg.n_kv_heads}, head_dim {cfg.head_dim}: use "
          "norm_rope_impl='xla' or 'auto'")
    return cfg.norm_rope_impl
  return "pallas" if backend == "gpu" and tensor_split() == 1 and tileable else "xla"


def _project_qkv(h, lp, cfg: ModelConfig):
  """The merged q|k|v projection (`merge_decode_weights`) `[B, T, H + 2 KV, hd]`, before its
  bias."""
  b, t, _ = h.shape
  qkv = jnp.einsum("btd,de->bte", h, lp["wqkv"].astype(cfg.jnp_dtype))
  return qkv.reshape(b, t, cfg.n_heads + 2 * cfg.n_kv_heads, cfg.head_dim)


def _qkv(h, lp, positions, cfg: ModelConfig, inv_freq, scale=None):
  """q, k, v of the layer's input h; `scale` (`[B, T, 1]`), where the attention norm's weight
  is folded into "wqkv": h is the unnormed stream and the projection is scaled by it."""
  dt = cfg.jnp_dtype
  if "wqkv" in lp:  # `merge_decode_weights`: one matmul, its output split by heads
    qkv = _project_qkv(h, lp, cfg)
    if scale is not None:
      qkv = (qkv.astype(jnp.float32) * scale[..., None]).astype(dt)
    if cfg.qkv_bias:
      qkv = qkv + lp["bqkv"].astype(dt)
    q, k, v = jnp.split(qkv, [cfg.n_heads, cfg.n_heads + cfg.n_kv_heads], axis=2)
  else:
    # (`lora.project`: a plain weight, or a `lora.LowRankWeight` of the unmerged learner)
    q = lora.project("btd,dhk->bthk", h, lp["wq"], dt)
    k = lora.project("btd,dhk->bthk", h, lp["wk"], dt)
    v = lora.project("btd,dhk->bthk", h, lp["wv"], dt)
    if cfg.qkv_bias:
      q = q + lp["bq"].astype(dt)
      k = k + lp["bk"].astype(dt)
      v = v + lp["bv"].astype(dt)
  if cfg.qk_norm:
    cos, sin = rope_tables(positions, inv_freq)
    impl = norm_rope_path(cfg, jax.default_backend())
    qn, kn = (lp["qk_norms"][0], lp["qk_norms"][1]) if "qk_norms" in lp else (lp["q_norm"],
                                                                               lp["k_norm"])
    qn, kn = norm_weight(qn, cfg), norm_weight(kn, cfg)
    return (norm_rope(q, qn, cos, sin, cfg.norm_eps, impl),
            norm_rope(k, kn, cos, sin, cfg.norm_eps, impl), v)
  q = apply_rope(q, positions, inv_freq)
  k = apply_rope(k, positions, inv_freq)
  return q, k, v


def _gate(g, cfg: ModelConfig):
  """The gate's activation: silu (SwiGLU) or tanh-approximated gelu (GeGLU, Gemma)."""
  return jax.nn.gelu(g, approximate=True) if cfg.activation == "gelu_tanh" else jax.nn.silu(g)


def _mlp(h, lp, cfg: ModelConfig, act: Callable | None = None):
  """The gated MLP of h (`_gate`(g) * u); `act(gu)`, with merged weights: the activation of the
  gate|up projection `[B, T, 2 F]` instead of silu(g) * u (the folded norm's scaled form)."""
  dt = cfg.jnp_dtype
  if "w_gate_up" in lp:  # `merge_decode_weights`
    gu = jnp.einsum("btd,df->btf", h, lp["w_gate_up"].astype(dt))
    if act is not None:
      return jnp.einsum("btf,fd->btd", act(gu), lp["w_down"].astype(dt))
    g, u = jnp.split(gu, 2, axis=-1)
  else:
    g = lora.project("btd,df->btf", h, lp["w_gate"], dt)
    u = lora.project("btd,df->btf", h, lp["w_up"], dt)
  return lora.project("btf,fd->btd", _gate(g, cfg) * u, lp["w_down"], dt)


def _block(x, lp, positions, attend: Callable, cfg: ModelConfig, inv_freq,
           raw_qkv: bool = False, swiglu: Callable | None = None):
  """One decoder layer. `attend(q, k, v) -> [B, T, H, hd]` supplies the attention pattern;
  with `raw_qkv`, `attend(qkv, resid)` takes the merged projection before its bias, norms and
  RoPE (`_project_qkv`), and the layer returns None for k and v.

  With the norm weights folded into the merged matrices (`param_tree.norms_folded`), both
  projections multiply the unnormed stream and each norm becomes a per-row scale afterwards:
  `resid` is then the stream entering the layer (the raw-q|k|v kernel scales by its norm
  itself; else None), and `swiglu(gu, resid)` (default `decode_mlp.swiglu_rms_reference`) the
  MLP's scaled activation."""
  x = constrain_batch(x)
  folded = norms_folded(lp)
  if cfg.post_norms:  # Gemma: four (1 + w) norms, never folded nor raw (`_gemma_block`)
    return _gemma_block(x, lp, positions, attend, cfg, inv_freq)
  h = x if folded else rms_norm(x, lp["attn_norm"], cfg.norm_eps)
  if raw_qkv:
    a, k, v = attend(_project_qkv(h, lp, cfg), x if folded else None), None, None
  else:
    scale = decode_mlp.row_scale(x, cfg.norm_eps) if folded else None
    q, k, v = _qkv(h, lp, positions, cfg, inv_freq, scale)
    a = attend(q, k, v)
  x = x + lora.project("bthk,hkd->btd", a, lp["wo"], cfg.jnp_dtype)
  if folded:
    swiglu = swiglu or functools.partial(decode_mlp.swiglu_rms_reference, eps=cfg.norm_eps)
    return x + _mlp(x, lp, cfg, act=lambda gu: swiglu(gu, x)), k, v
  h = rms_norm(x, lp["mlp_norm"], cfg.norm_eps)
  x = x + _mlp(h, lp, cfg)
  return x, k, v


def _gemma_block(x, lp, positions, attend: Callable, cfg: ModelConfig, inv_freq):
  """`_block` of a Gemma 3 layer: x + post_attn_norm(attention(attn_norm(x))), then
  x + post_mlp_norm(mlp(mlp_norm(x))), every norm a (1 + w) one."""
  q, k, v = _qkv(norm(x, lp["attn_norm"], cfg), lp, positions, cfg, inv_freq)
  a = lora.project("bthk,hkd->btd", attend(q, k, v), lp["wo"], cfg.jnp_dtype)
  x = x + norm(a, lp["post_attn_norm"], cfg)
  m = _mlp(norm(x, lp["mlp_norm"], cfg), lp, cfg)
  return x + norm(m, lp["post_mlp_norm"], cfg), k, v


def _group(q, cfg: ModelConfig):
  b, t, _, hd = q.shape
  return q.reshape(b, t, cfg.n_kv_heads, cfg.q_per_kv, hd)


def _softmax_attend(logits, mask):
  logits = jnp.where(mask, logits, _MASK_VALUE)
  return jax.nn.softmax(logits, axis=-1)


def attention_path(cfg: ModelConfig, backend: str) -> str:
  """The training attention `segment_attention` runs on `backend`: `cfg.attention_impl`, with
  "auto" resolved to "pallas" on GPUs for head sizes of 16-128 that are powers of two (the
  Pallas kernels' tiles need a power of two; 64 and 128 are the sizes measured), "cudnn" for
  other head sizes, and "xla" elsewhere. An explicit "pallas" on a TPU is an error.

  Models with a sliding window or an attention scale other than head_dim ** -0.5 (Gemma 3)
  get "cudnn" from "auto" on GPUs (the window is part of its dense mask): the Pallas kernels'
  window and scale are tested in interpret mode only, so they run those models only when
  asked ("pallas"). cuDNN takes bfloat16 and float16 only: "auto" gives float32 models that
  the Pallas kernels do not take "xla"."""
  special = cfg.windowed or cfg.attn_scale != 1.0 / math.sqrt(cfg.head_dim)
  if cfg.attention_impl != "auto":
    # The kernels would run in Pallas' interpret mode there: right, and far slower than XLA.
    if cfg.attention_impl == "pallas" and backend == "tpu":
      raise ValueError("attention_impl='pallas' runs Triton kernels (GPUs; interpret mode on "
                       "CPUs); use attention_impl='xla' or 'auto' on TPUs")
    return cfg.attention_impl
  if backend != "gpu":
    return "xla"
  hd = cfg.head_dim
  if packed_attention.tileable(hd) and hd <= 128 and not special:
    return "pallas"
  # cuDNN's fused attention takes bfloat16 / float16 inputs only (JAX refuses float32 ones).
  return "cudnn" if cfg.dtype != "float32" else "xla"


def _pallas_attention(q, k, v, segment_ids, cfg: ModelConfig, window=None):
  """`packed_attention`, per shard under the ambient mesh (rows over the batch axes, heads
  over "tensor"); the window (an int or int32 scalar) goes to every shard whole."""
  default = cfg.attn_scale == 1.0 / math.sqrt(cfg.head_dim)
  scale = None if default else cfg.attn_scale
  if window is None:
    fn = functools.partial(packed_attention.packed_attention, scale=scale)
    return per_shard(fn, (q, k, v, segment_ids), 4, 2, k.shape[2])
  fn = lambda q, k, v, seg, w: packed_attention.packed_attention(q, k, v, seg, w, scale=scale)
  return per_shard(fn, (q, k, v, segment_ids), 4, 2, k.shape[2],
                   shared=(jnp.asarray(window, jnp.int32),))


def _local_share(offset, shared):
  """Per-shard `share` from slot-to-source offsets: a source on another shard is not readable
  here, and such a slot reads its own (equal) rows."""
  own = jnp.arange(offset.shape[0], dtype=offset.dtype)
  local = own + offset
  ok = (local >= 0) & (local < offset.shape[0])
  return jnp.where(ok, local, own), jnp.where(ok, shared, 0)


def _per_shard_decode(kernel, arrays, out_ndims, interpret, share, shared=()):
  """`kernel(*arrays, *shared, share=..., interpret=...)` (a decode attention kernel of
  `decode_attention.py`; `arrays` end with the caches and the lengths) per shard under the
  ambient mesh: slots over the batch axes, KV heads over "tensor", as
  `sharding.kv_cache_spec` lays out the cache; the arrays of `shared` go to every shard whole.
  `share`: None or (src, shared) slot indices and lengths; a slot and its `src` must be on the
  same shard."""
  kv_heads = arrays[-2].shape[1]
  if share is None:
    fn = functools.partial(kernel, interpret=interpret)
    return per_shard(fn, arrays, out_ndims, 1, kv_heads, shared)
  src, shared_len = share
  # Offsets from each slot to its source stay valid in every shard's local slot numbering.
  offset = src - jnp.arange(src.shape[0], dtype=src.dtype)
  n = len(arrays)

  def fn(*args):
    (offset, shared_len), whole = args[n:n + 2], args[n + 2:]
    return kernel(*args[:n], *whole, share=_local_share(offset, shared_len),
                  interpret=interpret)

  return per_shard(fn, (*arrays, offset, shared_len), out_ndims, 1, kv_heads, shared)


def _flash_decode(q, cache_k, cache_v, lens, interpret, share=None):
  """`decode_attention.flash_decode` per shard (`_per_shard_decode`)."""
  return _per_shard_decode(decode_attention.flash_decode, (q, cache_k, cache_v, lens), (4, 3),
                           interpret, share)


def _flash_decode_write(q, k_new, v_new, cache_k, cache_v, lens, interpret, share=None):
  """`decode_attention.flash_decode_write` (the new token's K/V written into the cache by the
  attention kernel) per shard (`_per_shard_decode`)."""
  return _per_shard_decode(decode_attention.flash_decode_write,
                           (q, k_new, v_new, cache_k, cache_v, lens), (4, 4, 4), interpret, share)


def _flash_decode_write_qkv(qkv, rope, cache_k, cache_v, lens, bias, norms, eps, interpret,
                           share=None, resid=None, resid_eps=0.0, resid_rows=0, layer=None):
  """`decode_attention.flash_decode_write_qkv` (bias, q / k norms and RoPE in the kernel; with
  `resid`, the folded attention norm's scale too) per shard (`_per_shard_decode`; rows only:
  the projection's heads are not split). With `layer` (an int), bias and norms are every
  layer's (`[L, ...]`, the stacked params) and the kernel picks this layer's rows."""
  # The given ones go to every shard whole, and back to the kernel by name.
  given = {k: a for k, a in (("bias", bias), ("qk_norm", norms)) if a is not None}
  rows = (qkv, rope) if resid is None else (qkv, rope, resid)

  def kernel(*args, **kw):
    n = len(rows)
    named = dict(zip(given, args[n + 3:]))
    if resid is not None:
      named["resid"] = args[2]
    return decode_attention.flash_decode_write_qkv(
        args[0], args[1], *args[n:n + 3], **named, eps=eps, resid_eps=resid_eps,
        resid_rows=resid_rows, layer=layer, **kw)

  out_ndims = (3 if resid_rows else 4, 4, 4)
  return _per_shard_decode(kernel, (*rows, cache_k, cache_v, lens), out_ndims, interpret,
                           share, shared=tuple(given.values()))


def _swiglu_rms(gu, resid, eps, interpret, lead=0):
  """`decode_mlp.swiglu_rms` (the folded MLP norm's scale and SwiGLU in one kernel) per shard
  (rows over the batch axes): gu `[S, 2 F]`, resid `[S, D]` -> `[S, F]`; with `lead` = D
  (resid None, chained weights), gu `[S, D + 2 F]` -> `[S, D + F]`."""
  rows = (gu,) if resid is None else (gu, resid)
  fn = lambda g, r=None: decode_mlp.swiglu_rms(g, r, eps, lead=lead, interpret=interpret)
  return per_shard(fn, rows, 2, None)


def _run_ids(segment_ids):
  """[B, T] int32 ids that change wherever `segment_ids` changes: one id per contiguous run."""
  change = segment_ids[:, 1:] != segment_ids[:, :-1]
  return jnp.cumsum(jnp.pad(change, ((0, 0), (1, 0))), axis=1, dtype=jnp.int32)


def _window_mask(t: int, window):
  """`[T, T]` bool: key s within `window` positions of query t (t - s < window); all True
  for window None."""
  if window is None:
    return None
  idx = jnp.arange(t, dtype=jnp.int32)
  return (idx[:, None] - idx[None, :]) < window


def segment_attention(q, k, v, segment_ids, cfg: ModelConfig, window=None):
  """Causal attention within each segment. q: [B,T,H,hd]; k, v: [B,T,KV,hd].

  A segment is a contiguous run of equal ids, on every path (as `segment_positions` restarts
  positions): an id that reappears after another one starts a new segment that does not see
  the earlier run, which is what the Pallas kernels do by construction. `window` (an int or
  an int32 scalar, None: none): a query sees only the keys of its segment fewer than `window`
  positions back (itself included); within a segment, row offsets are position offsets.
  Logits are scaled by `cfg.attn_scale`.
  """
  b, t, _, hd = q.shape
  impl = attention_path(cfg, jax.default_backend())
  if impl == "pallas":
    return _pallas_attention(q, k, v, segment_ids, cfg, window)
  runs = _run_ids(segment_ids)
  near = _window_mask(t, window)
  if impl == "cudnn":
    mask = (runs[:, None, :, None] == runs[:, None, None, :])
    if near is not None:
      mask = mask & near[None, None]
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=True, scale=cfg.attn_scale,
        implementation="cudnn")
  qg = _group(q, cfg) * jnp.asarray(cfg.attn_scale, q.dtype)
  logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
  causal = jnp.tril(jnp.ones((t, t), bool))
  if near is not None:
    causal = causal & near
  same = runs[:, :, None] == runs[:, None, :]
  mask = (causal[None] & same)[:, None, None]
  probs = _softmax_attend(logits, mask).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
  return out.reshape(b, t, cfg.n_heads, hd)


# The cuDNN fused-attention forward as it appears in a traced step (jax's primitive names).
_CUDNN_ATTENTION_FWD = ("dot_product_attention_fwd_wrapper", "dot_product_attention_fwd")


def _save_dots_and_attention(prim, *args, **params) -> bool:
  """Remat policy "dots_attention": what "dots" saves, plus the outputs of the cuDNN or Pallas
  attention forward (its output and softmax statistics, which its backward reads), so the
  backward pass does not run the attention forward again. On the XLA attention path it equals
  "dots"."""
  if prim.name in _CUDNN_ATTENTION_FWD:
    return True
  if prim.name == "name" and params.get("name") in packed_attention.RESIDUAL_NAMES:
    return True
  return jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params)


def _remat(fn, cfg: ModelConfig):
  if cfg.remat == "full":
    return jax.checkpoint(fn)
  if cfg.remat == "dots":
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
  if cfg.remat == "dots_attention":
    return jax.checkpoint(fn, policy=_save_dots_and_attention)
  return fn


def segment_positions(segment_ids):
  """Positions restarting at 0 at each segment start (segments are contiguous runs)."""
  segment_ids = jnp.asarray(segment_ids)  # a NumPy int64 array: int32 here, without a warning
  if segment_ids.ndim != 2:
    raise ValueError(f"segment_positions: segment ids must be [B, T] (one row per sequence), "
                     f"got shape {segment_ids.shape}")
  b, t = segment_ids.shape
  idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  prev = jnp.concatenate([jnp.full((b, 1), -1, segment_ids.dtype), segment_ids[:, :-1]], 1)
  start = jnp.where(segment_ids != prev, idx, 0)
  return idx - jax.lax.cummax(start, axis=1)


def embed(p, tokens, cfg: ModelConfig):
  """The token embeddings `[B, ..., D]`, split by rows over the batch axes under a mesh.

  The lookup in a table whose model dim is split over "fsdp" gives rows split that way too;
  XLA's partitioner could not move them to the rows' split (on meshes with data > 1 it
  logged "Involuntary full rematerialization" and copied the whole batch's embeddings onto
  every device, in the update's forward and backward). Two steps it does move: rows over
  the other batch axes (a local slice), then rows over "fsdp" for model dims (an all-to-all).
  """
  x = jnp.take(p["embed"], tokens, axis=0).astype(cfg.jnp_dtype)
  if cfg.embed_scale:
    # sqrt(d_model) rounded to the compute dtype first (as transformers rounds it to its
    # weights' dtype), and applied after the cast: float32 params and their compute-dtype copy
    # (`param_tree.compute_copy`) then give bitwise the same embeddings.
    x = x * jnp.asarray(math.sqrt(cfg.d_model), x.dtype)
  axes, n = batch_split()
  if "fsdp" in axes and x.shape[0] % n == 0:
    fsdp = jax.sharding.get_abstract_mesh().shape["fsdp"]
    if x.shape[-1] % fsdp == 0:
      other = tuple(a for a in axes if a != "fsdp") or None
      x = jax.lax.with_sharding_constraint(
          x, jax.sharding.PartitionSpec(other, *([None] * (x.ndim - 2)), "fsdp"))
  return constrain_batch(x)


# ----------------------------------------------------------------------------- training
def _check_concrete_tokens(tokens, vocab_size: int) -> None:
  """A ValueError for an id outside [0, vocab_size) in tokens known here (an eager call; under
  jit they are not, and the engine and the learner check theirs on the host): the embedding
  lookup gave NaN logits for an id past the table and wrapped a negative one onto another
  token, without an error."""
  try:  # not for tracers, nor for arrays spread over several hosts
    if not getattr(tokens, "is_fully_addressable", True):
      return
    tok = np.asarray(tokens)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return
  bad = (tok < 0) | (tok >= vocab_size)
  if bad.any():
    row, col = np.argwhere(bad)[0]
    raise ValueError(f"tokens[{row}, {col}] = {tok[row, col]} is outside the model's vocabulary "
                     f"[0, {vocab_size}) ({int(bad.sum())} such tokens): encode with the "
                     "tokenizer of this model (an id past the table gave NaN logits)")


def hidden_states(params: Params, tokens, *, cfg: ModelConfig, positions=None,
                  segment_ids=None, collect_kv: bool = False):
  """Final-normed hidden states `[B, L, D]` (and stacked per-layer K/V when `collect_kv`).

  With `segment_ids` (0 = padding) attention is causal within a segment and blocked across
  segments; positions default to restarting per segment. The layers run as a `lax.scan` over
  the stacked weights, or unrolled when `cfg.scan_layers` is False or `params["layers"]` is a
  tuple of per-layer dicts (`unstack_layers`). `params["adapter"]` (a
  `models.lora.LayerAdapter`, stacked over layers) applies each layer's low-rank adapter to
  its weights inside the loop, one layer at a time: merged into them, or as an unmerged
  low-rank path beside each target (`LoraConfig.forward`).
  """
  adapter = params.get("adapter") if isinstance(params, dict) else None
  if adapter is not None:
    params = {k: v for k, v in params.items() if k != "adapter"}
  p = unbox(params)
  tokens = jnp.asarray(tokens, jnp.int32)
  # Nested lists as the tokens are: the attention slices the ids and RoPE casts the positions.
  positions = None if positions is None else jnp.asarray(positions)
  segment_ids = None if segment_ids is None else jnp.asarray(segment_ids)
  # Shapes that broadcast against the tokens' ran: segment ids or positions of shape [B, 1]
  # put every token of a row at one position (RoPE at 0 everywhere) without an error.
  if tokens.ndim != 2:
    raise ValueError(f"hidden_states: tokens of shape {tokens.shape}: tokens must be [B, L] "
                     "(a batch of rows; wrap one sequence as [tokens])")
  _check_concrete_tokens(tokens, cfg.vocab_size)
  check_model_shapes(params, cfg, "hidden_states")  # (shapes and names: at trace time only)
  for name, x in (("segment_ids", segment_ids), ("positions", positions)):
    if x is not None and x.shape != tokens.shape:
      raise ValueError(f"hidden_states: {name} of shape {x.shape} for tokens of shape "
                       f"{tokens.shape}: {name} must be [B, L] = {tokens.shape}")
  if segment_ids is None:
    segment_ids = jnp.ones_like(tokens)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  elif positions is None:
    positions = segment_positions(segment_ids)
  inv_freq = jnp.asarray(rope_inv_freq(cfg))
  consts = layer_constants(cfg)  # per-layer RoPE and windows, where the layers differ

  def body(x, lp_ab):
    # ab: the adapter's slices and the layer's index (`LayerAdapter.scanned`); lc: the layer's
    # (inv_freq, window), or None
    lp, ab, lc = lp_ab
    if adapter is not None:
      lp = adapter.apply(lp, ab)
    freq, window = (inv_freq, None) if lc is None else lc
    attend = functools.partial(segment_attention, segment_ids=segment_ids, cfg=cfg,
                               window=window)
    x, k, v = _block(x, lp, positions, attend, cfg, freq)
    return x, ((k, v) if collect_kv else None)

  x = embed(p, tokens, cfg)
  layers = p["layers"]
  ad_layers = None if adapter is None else adapter.scanned()
  if isinstance(layers, (tuple, list)) or not cfg.scan_layers:
    if not isinstance(layers, (tuple, list)):
      layers = unstack_layers({"layers": layers})["layers"]
    layer = _remat(body, cfg)
    outs = []
    for i, lp in enumerate(layers):
      lc = None if consts is None else (consts[0][i], cfg.layer_window(i))
      x, o = layer(x, (lp, None if adapter is None else adapter.layer(i), lc))
      outs.append(o)
    kv = jax.tree.map(lambda *xs: jnp.stack(xs), *outs) if collect_kv else None
  else:
    x, kv = jax.lax.scan(_remat(body, cfg), x, (layers, ad_layers, consts))
  h = norm(x, p["final_norm"], cfg)
  return (h, kv) if collect_kv else h


def forward(params: Params, tokens, *, cfg: ModelConfig, positions=None, segment_ids=None):
  """Logits `[B, L, V]` (float32) of packed or plain rows."""
  h = hidden_states(params, tokens, cfg=cfg, positions=positions, segment_ids=segment_ids)
  return logits_from_hidden(params, h, cfg)


# ----------------------------------------------------------------------------- sampling
def prefill(params: Params, tokens, lengths, *, cfg: ModelConfig):
  """Run fresh prompts. tokens: [B, T] right-padded; lengths: [B].

  Returns (logits of each prompt's last token `[B, V]`, K `[layers, B, T, KV, hd]`, V).
  Padding positions produce K/V that the cache masks out (it tracks each slot's length).
  """
  tokens = jnp.asarray(tokens, jnp.int32)
  lengths = jnp.asarray(lengths)  # a list, as the tokens may be
  if tokens.ndim != 2 or lengths.shape != tokens.shape[:1]:
    raise ValueError(f"prefill: tokens of shape {tokens.shape} and lengths of shape "
                     f"{lengths.shape}: tokens must be [B, T] and lengths [B] (one per row)")
  seg = (jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]).astype(jnp.int32)
  h, (k, v) = hidden_states(params, tokens, cfg=cfg, segment_ids=seg, collect_kv=True)
  last = jnp.take_along_axis(h, (lengths - 1)[:, None, None].astype(jnp.int32), axis=1)[:, 0]
  return logits_from_hidden(params, last, cfg), k, v


def cached_attention(q, k_new, v_new, cache_k, cache_v, cache_lens, cfg: ModelConfig,
                     impl: str = "xla", window=None):
  """Attention of new tokens over a slot's cached prefix plus themselves (causally).

  q: [S, n, H, hd]; k_new, v_new: [S, n, KV, hd]; cache_k, cache_v: [S, KV, C, hd] (head-major,
  so each (slot, head) reads one contiguous run; only the first `cache_lens[s]` entries of slot
  s are valid). The cached part and the new part are scored separately and share one softmax,
  so the cache is read once and never copied. `impl="pallas"` computes the cached part with the
  flash-decoding kernel of `decode_attention.py` and merges the two parts by log-sum-exp.
  `window` (None, an int or an int32 scalar): the new token at position p sees only the keys at
  positions above p - window (cached or new), as `segment_attention`; the Pallas kernel has no
  window (an error with one).
  """
  s, n, _, hd = q.shape
  c = cache_k.shape[2]
  qg = _group(q, cfg) * jnp.asarray(cfg.attn_scale, q.dtype)
  ln = jnp.einsum("snkgd,smkd->skgnm", qg, k_new, preferred_element_type=jnp.float32)
  mask_n = jnp.tril(jnp.ones((n, n), bool))
  if window is not None:
    mask_n = mask_n & _window_mask(n, window)
  ln = jnp.where(mask_n[None, None, None], ln, _MASK_VALUE)
  if impl == "pallas" and window is not None:
    raise ValueError("cached_attention: the Pallas decode kernel has no sliding window; use "
                     "impl='xla' for windowed layers")
  if impl == "pallas":
    g = cfg.q_per_kv
    # Every new token sees the same cached prefix: fold the n queries into the head group.
    qf = q.reshape(s, n, cfg.n_kv_heads, g, hd).transpose(0, 2, 1, 3, 4)
    o_c, lse_c = _flash_decode(qf.reshape(s, cfg.n_kv_heads, n * g, hd), cache_k, cache_v,
                               cache_lens, jax.default_backend() == "cpu")
    o_c = o_c.reshape(s, cfg.n_kv_heads, n, g, hd).astype(jnp.float32)
    lse_c = lse_c.reshape(s, cfg.n_kv_heads, n, g).transpose(0, 1, 3, 2)  # [S, KV, G, n]
    lse_n = jax.nn.logsumexp(ln, axis=-1)
    o_n = jnp.einsum("skgnm,smkd->skngd",
                     jax.nn.softmax(ln, axis=-1), v_new.astype(jnp.float32))
    lse = jnp.logaddexp(lse_c, lse_n)
    w_c = jnp.exp(lse_c - lse).transpose(0, 1, 3, 2)[..., None]  # [S, KV, n, G, 1]
    w_n = jnp.exp(lse_n - lse).transpose(0, 1, 3, 2)[..., None]
    out = (w_c * o_c + w_n * o_n).transpose(0, 2, 1, 3, 4).astype(v_new.dtype)
    return out.reshape(s, n, cfg.n_heads, hd)
  lc = jnp.einsum("snkgd,skcd->skgnc", qg, cache_k.astype(q.dtype),
                  preferred_element_type=jnp.float32)
  mask_c = (jnp.arange(c)[None, :] < cache_lens[:, None])[:, None, None, None, :]
  if window is not None:  # query i (position len + i) sees cached key j where len + i - j < w
    pos_q = cache_lens[:, None] + jnp.arange(n, dtype=cache_lens.dtype)[None, :]  # [S, n]
    near = (pos_q[:, :, None] - jnp.arange(c, dtype=pos_q.dtype)[None, None, :]) < window
    mask_c = mask_c & near[:, None, None]  # [S, 1, 1, n, C]
  logits = jnp.concatenate([jnp.where(mask_c, lc, _MASK_VALUE), ln], axis=-1)
  probs = jax.nn.softmax(logits, axis=-1).astype(v_new.dtype)
  pc, pn = probs[..., :c], probs[..., c:]
  out = (jnp.einsum("skgnc,skcd->snkgd", pc, cache_v.astype(v_new.dtype))
         + jnp.einsum("skgnm,smkd->snkgd", pn, v_new))
  return out.reshape(s, n, cfg.n_heads, hd)


def extend(params: Params, cache_k, cache_v, tokens, cache_lens, *, cfg: ModelConfig,
           kv_len: int | None = None, unroll: int | bool = 1, attn_impl: str = "xla",
           rows=None, logit_index=None):
  """Process new tokens for cache slots without touching the cache.

  tokens: [S, n] (n = 1 for a decode step); cache_lens: [S] tokens already cached per slot
  (the new tokens get positions cache_lens .. cache_lens + n - 1). cache_k, cache_v:
  [layers, S, KV, Lmax, hd]; only the first `kv_len` (static, >= max cache_lens) entries are
  read. `rows` ([S'] ints, optional): the new tokens belong to these cache rows (tokens and
  cache_lens are then [S', ...]); each layer gathers its rows inside the layer loop.
  `logit_index` ([S'] ints, optional): project only this position of each row to the
  vocabulary (an append needs the next-token logits after its last token, and the full
  `[S', n, V]` float32 logits of a long chunk are gigabytes). Returns (logits `[S', n, V]`, or
  `[S', V]` with `logit_index`, new K [layers, S', n, KV, hd], new V); write the new K/V with
  `write_kv`. `unroll` is `lax.scan`'s over layers (measured on an H200: unrolling makes
  a single step faster but a multi-step decode loop much slower, so the engine keeps it rolled).
  """
  p = unbox(params)
  tokens = jnp.asarray(tokens, jnp.int32)
  n = tokens.shape[1]
  positions = cache_lens[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
  inv_freq = jnp.asarray(rope_inv_freq(cfg))
  if attn_impl == "pallas" and not decode_kernels_fit(cfg):
    raise ValueError("extend: the Pallas decode kernel has no sliding window and scales by "
                     f"head_dim ** -0.5; this model ({cfg.architecture!r}) needs attn_impl='xla'")
  if isinstance(cache_k, (tuple, list)):
    x, k, v = _extend_per_layer(p, cache_k, cache_v, tokens, positions, cache_lens, cfg,
                                kv_len, attn_impl, inv_freq, rows)
    return _extend_logits(params, p, x, logit_index, cfg), k, v
  kv_len = cache_k.shape[3] if kv_len is None else kv_len

  def body(x, xs):
    lp, ck, cv, lc = xs
    freq, window = (inv_freq, None) if lc is None else lc
    ck, cv = _cache_rows(ck, rows), _cache_rows(cv, rows)
    attend = lambda q, k, v: cached_attention(q, k, v, ck[:, :, :kv_len], cv[:, :, :kv_len],
                                              cache_lens, cfg, impl=attn_impl, window=window)
    x, k, v = _block(x, lp, positions, attend, cfg, freq)
    return x, (k, v)

  x = embed(p, tokens, cfg)
  x, (k, v) = jax.lax.scan(body, x, (p["layers"], cache_k, cache_v, layer_constants(cfg)),
                           unroll=unroll)
  return _extend_logits(params, p, x, logit_index, cfg), k, v


def _extend_logits(params, p, x, logit_index, cfg: ModelConfig):
  """Final norm and vocabulary projection of `extend`'s output `x` `[S, n, D]`: every position,
  or only `logit_index` `[S]` of each row (gathered before the norm and the projection)."""
  if logit_index is not None:
    x = jnp.take_along_axis(x, jnp.asarray(logit_index, jnp.int32)[:, None, None], axis=1)[:, 0]
  return logits_from_hidden(params, norm(x, p["final_norm"], cfg), cfg)


def _cache_rows(cache, rows):
  """One layer's cache `[S, KV, L, hd]` restricted to `rows` (all when None), gathered inside
  the layer loop so that only one layer's rows are ever copied, split over the batch axes."""
  return cache if rows is None else constrain_batch(cache[rows])


def _extend_per_layer(p, cache_k, cache_v, tokens, positions, cache_lens, cfg, kv_len,
                      attn_impl, inv_freq, rows=None):
  """`extend` over a cache held as one `[S, KV, Lmax, hd]` buffer per layer: an unrolled
  layer loop, so that each layer's attention reads its own buffer where it lies (the Pallas
  kernel stops at each slot's length; the XLA path reads the first `kv_len` entries). Returns
  the last layer's output (before the final norm) and the new K, V."""
  kv_len = cache_k[0].shape[2] if kv_len is None else kv_len
  x = embed(p, tokens, cfg)
  if rows is not None:
    return _extend_rows_per_layer(p, x, cache_k, cache_v, positions, cache_lens, cfg, kv_len,
                                  attn_impl, inv_freq, rows)
  ks, vs = [], []
  consts = layer_constants(cfg)
  for layer in range(cfg.n_layers):
    lp = jax.tree.map(lambda w: w[layer], p["layers"])
    ck, cv = cache_k[layer], cache_v[layer]
    if attn_impl != "pallas":  # a copy anyway: of the live prefix only
      ck, cv = ck[:, :, :kv_len], cv[:, :, :kv_len]
    window = cfg.layer_window(layer)
    attend = lambda q, k, v, ck=ck, cv=cv, w=window: cached_attention(
        q, k, v, ck, cv, cache_lens, cfg, impl=attn_impl, window=w)
    freq = inv_freq if consts is None else consts[0][layer]
    x, k, v = _block(x, lp, positions, attend, cfg, freq)
    ks.append(k)
    vs.append(v)
  return x, jnp.stack(ks), jnp.stack(vs)


def decode_kernels_fit(cfg: ModelConfig) -> bool:
  """Whether the Pallas decode kernels (`decode_attention`: the cached part of
  `cached_attention`, `decode_in_place`, the raw-q|k|v and folded-norm kernels, the chained
  step) compute this model's attention: no sliding window, logits scaled by head_dim ** -0.5,
  plain RMSNorm weights and no post-norms. Gemma 3 fails all of these; the engine decodes such
  models with the XLA path (`extend`)."""
  return (not cfg.windowed and not cfg.norm_plus_one and not cfg.post_norms
          and cfg.attn_scale == 1.0 / math.sqrt(cfg.head_dim))


def fused_qkv_fits(cfg: ModelConfig, interpret: bool = False) -> bool:
  """Whether `decode_in_place(fused_qkv=True)` hands the kernel the raw q|k|v projection (given
  merged weights) under the ambient mesh: no "tensor" axis splitting the heads, and a head size
  from 32 (any in interpret mode) to `decode_attention.FUSED_QKV_MAX_HEAD_DIM`."""
  return (tensor_split() == 1 and cfg.head_dim <= decode_attention.FUSED_QKV_MAX_HEAD_DIM
          and (interpret or cfg.head_dim >= 32))


def decode_in_place(params: Params, cache_k, cache_v, tokens, cache_lens, *, cfg: ModelConfig,
                    share=None, interpret: bool | None = None, fused_qkv: bool = True):
  """One decode token per slot over a per-layer cache, with the Pallas kernel: in each layer the
  kernel (`decode_attention.flash_decode_write`) writes the new K/V into the layer's cache
  buffer and attends over the `cache_lens` cached entries plus the new one.

  Same function as `extend` followed by `write_kv`, but without the separate attention of the
  new token to itself and the log-sum-exp merge of the two parts (about ten small kernels per
  layer, which at decode sizes cost more than the bytes they move), without the two K/V
  scatter kernels per layer, and without stacking the new K/V of all layers. tokens: [S] ints;
  cache_lens: [S]; cache_k, cache_v: tuples of per-layer `[S, KV, C, hd]` buffers (donate them
  to update in place). A slot whose cache is full (`cache_lens == C`) gets its write dropped
  and attends over the C cached entries only.
  `share`: None or (src [S], shared [S]): the first `shared[s]` cached entries of slot s equal
  those of slot `src[s]` in every layer (the kernel reads them there).
  `fused_qkv`: with merged weights (`merge_decode_weights`) where `fused_qkv_fits`, the kernel
  takes each layer's raw q|k|v projection and applies its bias, q / k norms and RoPE itself
  (`decode_attention.flash_decode_write_qkv`): one XLA fusion a layer fewer. With the norm
  weights folded in too (`merge_decode_weights(fold_norms=True)`), the kernel also applies
  the attention norm's row scale, and the MLP's scale and SwiGLU run as one kernel
  (`decode_mlp.swiglu_rms`): no norm kernel in the layer. With chained weights
  (`param_tree.chain_decode_weights`) a layer runs two GEMMs instead of four: `_decode_chained`.
  Returns (logits `[S, V]` float32, cache_k, cache_v).
  """
  if not decode_kernels_fit(cfg):
    raise ValueError("decode_in_place: the Pallas decode kernels have no sliding window, "
                     "attention scale, (1 + w) norms or post-norms; this model "
                     f"({cfg.architecture!r}) decodes with extend "
                     "(EngineConfig.decode_attention='xla')")
  p = unbox(params)
  tokens = jnp.asarray(tokens, jnp.int32)[:, None]
  s = tokens.shape[0]
  positions = cache_lens[:, None]
  inv_freq = jnp.asarray(rope_inv_freq(cfg))
  interpret = jax.default_backend() == "cpu" if interpret is None else interpret
  raw = fused_qkv and is_merged(p) and fused_qkv_fits(cfg, interpret)
  if raw:  # each slot's cos / sin, once for every layer
    rope = decode_rope(cache_lens, inv_freq)
  if is_chained(p):
    if not raw:
      raise ValueError("decode_in_place: chained weights need the kernel to take the raw q|k|v "
                       "projection (fused_qkv=True where decoder.fused_qkv_fits)")
    return _decode_chained(params, p, cache_k, cache_v, tokens, cache_lens, rope, cfg=cfg,
                           share=share, interpret=interpret)
  x = embed(p, tokens, cfg)
  new_k, new_v = list(cache_k), list(cache_v)
  # Norm weights folded into the merged matrices: the MLP's scale and SwiGLU in one kernel.
  swiglu = ((lambda gu, r: _swiglu_rms(gu[:, 0], r[:, 0], cfg.norm_eps, interpret)[:, None])
            if norms_folded(p) else None)
  for layer in range(cfg.n_layers):
    lp = jax.tree.map(lambda w: w[layer], p["layers"])

    # The kernel writes the new K/V into the layer's buffer (in place) and attends over the
    # cached rows plus the new token.
    def attend(q, k, v, layer=layer):
      qg = q.reshape(s, cfg.n_kv_heads, cfg.q_per_kv, cfg.head_dim)
      out, new_k[layer], new_v[layer] = _flash_decode_write(
          qg, k[:, 0], v[:, 0], new_k[layer], new_v[layer], cache_lens, interpret, share)
      return out.reshape(s, 1, cfg.n_heads, cfg.head_dim).astype(v.dtype)

    def attend_raw(qkv, resid, layer=layer):
      # The stacked bias / norms and the layer's index: a per-layer slice of them would be
      # copied before each kernel.
      out, new_k[layer], new_v[layer] = _flash_decode_write_qkv(
          qkv[:, 0], rope, new_k[layer], new_v[layer], cache_lens, p["layers"].get("bqkv"),
          p["layers"].get("qk_norms"), cfg.norm_eps, interpret, share,
          None if resid is None else resid[:, 0], cfg.norm_eps, layer=layer)
      return out.reshape(s, 1, cfg.n_heads, cfg.head_dim).astype(qkv.dtype)

    x, _, _ = _block(x, lp, positions, attend_raw if raw else attend, cfg, inv_freq,
                     raw_qkv=raw, swiglu=swiglu)
  logits = logits_from_hidden(params, rms_norm(x[:, 0], p["final_norm"], cfg.norm_eps), cfg)
  return logits, tuple(new_k), tuple(new_v)


def _decode_chained(params, p, cache_k, cache_v, tokens, cache_lens, rope, *, cfg: ModelConfig,
                    share, interpret):
  """`decode_in_place` over `param_tree.chain_decode_weights`'s matrices: per layer the decode
  kernel (its input `[x | x Wqkv]`, its output `[x | a]`), one GEMM to `[x' | x' Wgu]`, the
  SwiGLU kernel (to `[x' | f]`) and one GEMM to the next layer's `[x'' | x'' Wqkv]`. The
  stream rides in the first D columns, so no kernel but these four runs in a layer."""
  dt, d, hd = cfg.jnp_dtype, cfg.d_model, cfg.head_dim
  c, layers = p["chain"], p["layers"]
  s = tokens.shape[0]
  lead = d // hd
  y = embed(p, tokens, cfg)[:, 0] @ c["in"].astype(dt)  # [S, D + Q]: [x | x Wqkv]
  new_k, new_v = list(cache_k), list(cache_v)
  for layer in range(cfg.n_layers):
    xa, new_k[layer], new_v[layer] = _flash_decode_write_qkv(
        y.reshape(s, -1, hd), rope, new_k[layer], new_v[layer], cache_lens, layers.get("bqkv"),
        layers.get("qk_norms"), cfg.norm_eps, interpret, share, resid_eps=cfg.norm_eps,
        resid_rows=lead, layer=layer)
    z = xa.reshape(s, -1) @ c["a"][layer].astype(dt)  # [x' | x' Wgu]
    f = _swiglu_rms(z, None, cfg.norm_eps, interpret, lead=d)  # [x' | f]
    last = layer == cfg.n_layers - 1
    y = f @ (c["out"] if last else c["b"][layer]).astype(dt)  # [x'' | x'' Wqkv_next]
  logits = logits_from_hidden(params, rms_norm(y, p["final_norm"], cfg.norm_eps), cfg)
  return logits, tuple(new_k), tuple(new_v)


def _extend_rows_per_layer(p, x, cache_k, cache_v, positions, cache_lens, cfg, kv_len,
                           attn_impl, inv_freq, rows):
  """`extend` for some cache rows of a per-layer cache (an append): the rows have to be
  gathered (copied) from each layer's buffer anyway, so the layer loop can be a `lax.scan`
  whose body picks its layer's buffer with `lax.switch`. One layer is gathered at a time, as
  in the unrolled loop, but the program holds one layer body instead of `n_layers`: appends
  are bucketed on rows, chunk length and live KV, and each bucket is a compile, which for the
  unrolled loop took seconds on a GPU."""
  def gather(cache, layer):
    take = [lambda c=c: _cache_rows(c, rows)[:, :, :kv_len] for c in cache]
    return jax.lax.switch(layer, take)

  def body(x, xs):
    lp, layer, lc = xs
    freq, window = (inv_freq, None) if lc is None else lc
    ck, cv = gather(cache_k, layer), gather(cache_v, layer)
    attend = lambda q, k, v: cached_attention(q, k, v, ck, cv, cache_lens, cfg, impl=attn_impl,
                                              window=window)
    x, k, v = _block(x, lp, positions, attend, cfg, freq)
    return x, (k, v)

  layers = jnp.arange(cfg.n_layers, dtype=jnp.int32)
  x, (k, v) = jax.lax.scan(body, x, (p["layers"], layers, layer_constants(cfg)))
  return x, k, v


def write_kv(cache, new, slots, starts):
  """Scatter new K or V `[layers, S', n, KV, hd]` into `cache` `[layers, S, KV, Lmax, hd]` (or
  a tuple of per-layer `[S, KV, Lmax, hd]` buffers) at (slot, start + i). Writes past the cache
  end are dropped. Donate `cache` to update in place.
  """
  n = new.shape[2]
  pos = starts[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
  sl = jnp.broadcast_to(slots[:, None], pos.shape)
  if isinstance(cache, (tuple, list)):
    # Advanced indices split by a slice put their broadcast dims first: [S', n, KV, hd].
    return tuple(c.at[sl, :, pos].set(new[layer].astype(c.dtype), mode="drop")
                 for layer, c in enumerate(cache))
  # Advanced indices split by a slice put their broadcast dims first: [S', n, layers, KV, hd].
  return cache.at[:, sl, :, pos].set(new.transpose(1, 2, 0, 3, 4).astype(cache.dtype),
                                     mode="drop")
