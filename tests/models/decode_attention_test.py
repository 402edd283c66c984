"""The flash-decoding kernel (Pallas, interpret mode on CPU) against plain attention."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent import models
from jaxagent.generate import Engine, EngineConfig, SamplingConfig
from jaxagent.generate.scheduler import run_requests
from jaxagent.models import decoder, param_tree
from jaxagent.models.decode_attention import flash_decode


def _rand(key, *shape):
  return jax.random.normal(jax.random.key(key), shape)


def _layer_caches(cfg, s, c):
  """Random per-layer K and V caches `[s, KV, c, hd]` (the write-first step's buffers)."""
  shape = (s, cfg.n_kv_heads, c, cfg.head_dim)
  return (tuple(_rand(30 + i, *shape) for i in range(cfg.n_layers)),
          tuple(_rand(40 + i, *shape) for i in range(cfg.n_layers)))


@pytest.mark.parametrize("g,hd,c", [
    (3, 16, 128), pytest.param(1, 32, 96, marks=pytest.mark.slow),
    pytest.param(6, 16, 64, marks=pytest.mark.slow), (150, 16, 64)])
def test_flash_decode_matches_masked_softmax(g, hd, c):
  s, kv = 5, 2
  q, k, v = _rand(0, s, kv, g, hd), _rand(1, s, kv, c, hd), _rand(2, s, kv, c, hd)
  lens = jnp.array([0, 1, c // 2 + 3, c - 1, c])
  out, lse = flash_decode(q, k, v, lens, block_k=32, interpret=True)
  scores = jnp.einsum("skgd,skcd->skgc", q, k) / math.sqrt(hd)
  live = jnp.arange(c)[None, None, None, :] < lens[:, None, None, None]
  scores = jnp.where(live, scores, -1e30)
  ref = jnp.einsum("skgc,skcd->skgd", jax.nn.softmax(scores, -1), v)
  np.testing.assert_allclose(np.asarray(out[1:]), np.asarray(ref[1:]), atol=2e-6)
  np.testing.assert_allclose(np.asarray(lse[1:]), np.asarray(jax.nn.logsumexp(scores, -1)[1:]),
                             atol=2e-6)
  assert np.all(np.asarray(out[0]) == 0) and np.all(np.asarray(lse[0]) <= -1e29)


def test_flash_decode_launch_settings(monkeypatch):
  s, kv, g, hd, c = 3, 2, 2, 16, 128
  q, k, v = _rand(0, s, kv, g, hd), _rand(1, s, kv, c, hd), _rand(2, s, kv, c, hd)
  lens = jnp.array([7, 100, 128])
  ref, ref_lse = flash_decode(q, k, v, lens, interpret=True)
  monkeypatch.setenv("JAXAGENT_DECODE_KERNEL", "block_k=16,num_warps=8,num_stages=3")
  out, lse = flash_decode(q, k, v, lens, interpret=True)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-6)
  # Products in the cache's dtype (bf16) with float32 accumulation: close, not equal.
  kb, vb = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  out_bf, _ = flash_decode(q.astype(jnp.bfloat16), kb, vb, lens, interpret=True,
                           low_precision_dot=1)
  np.testing.assert_allclose(np.asarray(out_bf, np.float32), np.asarray(ref), atol=3e-2)
  with pytest.raises(TypeError, match="unknown launch"):
    flash_decode(q, k, v, lens, interpret=True, warps=4)
  monkeypatch.setenv("JAXAGENT_DECODE_KERNEL", "block=16")
  with pytest.raises(ValueError, match="JAXAGENT_DECODE_KERNEL"):
    flash_decode(q, k, v, lens, interpret=True)


def test_flash_decode_rejects_unaligned_cache():
  with pytest.raises(ValueError, match="multiple of 16"):
    flash_decode(_rand(0, 1, 1, 1, 16), _rand(1, 1, 1, 40, 16), _rand(2, 1, 1, 40, 16),
                 jnp.array([3]), interpret=True)


@pytest.mark.parametrize("n", [1, 5])
def test_cached_attention_pallas_equals_xla(n):
  cfg = models.get_config("tiny-qwen2")
  s, c = 3, 64
  q = _rand(0, s, n, cfg.n_heads, cfg.head_dim)
  kn, vn = _rand(1, s, n, cfg.n_kv_heads, cfg.head_dim), _rand(2, s, n, cfg.n_kv_heads,
                                                              cfg.head_dim)
  ck, cv = _rand(3, s, cfg.n_kv_heads, c, cfg.head_dim), _rand(4, s, cfg.n_kv_heads, c,
                                                               cfg.head_dim)
  lens = jnp.array([5, 64, 0])
  a = decoder.cached_attention(q, kn, vn, ck, cv, lens, cfg)
  b = decoder.cached_attention(q, kn, vn, ck, cv, lens, cfg, impl="pallas")
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)


@pytest.mark.slow  # the kernel runs in Pallas interpret mode on CPU: minutes per engine
def test_engine_tokens_equal_with_either_decode_attention():
  cfg = models.get_config("tiny-qwen2")
  params = models.init_params(cfg, jax.random.key(0), std=0.2)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, rng.integers(3, 30)).tolist() for _ in range(5)]
  outs = []
  # The last: merged weights, so the kernel takes the raw q|k|v projection (`decode_fused_qkv`).
  for attention, layout, merge in (("xla", "stacked", False), ("pallas", "stacked", False),
                                   ("pallas", "per_layer", False), ("pallas", "per_layer", True)):
    eng = Engine(cfg, EngineConfig(slots=4, max_len=100, sampling=SamplingConfig(1.0),
                                   decode_attention=attention, cache_layout=layout,
                                   decode_merge_weights=merge))
    outs.append(run_requests(eng, params, prompts, max_new_tokens=12,
                             request_ids=list(range(5)), seed=3))
  for other in outs[1:]:
    for a, b in zip(outs[0], other):
      assert a.tokens == b.tokens
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


# About 25 s on 2 cores; the engine tests check the per-layer append against a prefill of the
# same history (`test_append_then_decode_equals_prefill_of_history[per_layer]`).
@pytest.mark.slow
def test_append_equal_with_either_decode_attention():
  """An append into some rows of the per-layer cache (a layer scan that picks each layer's
  buffer with lax.switch) gives the stacked XLA path's tokens and log-probs."""
  cfg = models.get_config("tiny-qwen2")
  params = models.init_params(cfg, jax.random.key(1), std=0.2)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (9, 17, 5)]
  obs = [[3, 5, 7, 11], [13, 17]]
  outs = []
  for attention, layout in (("xla", "stacked"), ("pallas", "per_layer")):
    eng = Engine(cfg, EngineConfig(slots=4, max_len=64, sampling=SamplingConfig(1.0),
                                   decode_attention=attention, cache_layout=layout))
    state, _ = eng.prefill_insert(params, eng.init_decode_state(), prompts, [0, 1, 3], [0, 1, 2], 4)
    # Both decode calls alike (steps, kv_len): one decode program per path to compile.
    state, out = eng.generate(params, state, steps=3, kv_len=40)
    lens = np.asarray(state.lengths)[[3, 0]]
    state = eng.update_slots(state, [3, 0], lengths=lens, tokens=np.asarray(state.tokens)[[3, 0]],
                             active=False)
    state, (tok, lp, _) = eng.append(params, state, [3, 0], obs, cached_lens=lens)
    state, out2 = eng.generate(params, state, steps=3, kv_len=40)
    outs.append((np.asarray(tok), np.asarray(lp), np.asarray(out2.tokens), np.asarray(out2.logprobs)))
  (t0, l0, g0, gl0), (t1, l1, g1, gl1) = outs
  np.testing.assert_array_equal(t0, t1)
  np.testing.assert_allclose(l0, l1, atol=1e-4)
  np.testing.assert_array_equal(g0, g1)
  np.testing.assert_allclose(gl0, gl1, atol=1e-4)


def test_decode_in_place_equals_extend_then_write():
  """The write-first decode step (each layer writes its new K/V, then the kernel reads it with
  the cache) gives `extend` + `write_kv`'s logits and caches; a full slot drops its write."""
  cfg = models.get_config("tiny-qwen2")
  params = models.init_params(cfg, jax.random.key(2), std=0.2)
  s, c = 4, 64
  shape = (s, cfg.n_kv_heads, c, cfg.head_dim)
  ck = tuple(_rand(10 + i, *shape) for i in range(cfg.n_layers))
  cv = tuple(_rand(20 + i, *shape) for i in range(cfg.n_layers))
  lens = jnp.array([0, 5, 37, c], jnp.int32)
  tokens = jnp.array([3, 9, 27, 81], jnp.int32)
  logits, k1, v1 = decoder.decode_in_place(params, ck, cv, tokens, lens, cfg=cfg)
  ref, kn, vn = decoder.extend(params, ck, cv, tokens[:, None], lens, cfg=cfg, attn_impl="pallas")
  slots = jnp.arange(s, dtype=jnp.int32)
  k2, v2 = decoder.write_kv(ck, kn, slots, lens), decoder.write_kv(cv, vn, slots, lens)
  # The full slot (length c) attends to its c cached entries only in the write-first step.
  np.testing.assert_allclose(np.asarray(logits[:3]), np.asarray(ref[:3, 0]), atol=2e-5)
  assert np.isfinite(np.asarray(logits)).all()
  # Layer 0's new K/V are bitwise equal; deeper layers' differ by float rounding of the merge.
  np.testing.assert_array_equal(np.asarray(k1[0]), np.asarray(k2[0]))
  for a, b in zip(k1 + v1, k2 + v2):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("name", [
    pytest.param("tiny-llama", marks=pytest.mark.slow),
    pytest.param("tiny-qwen2", marks=pytest.mark.slow), "tiny-qwen3"])
def test_merged_decode_weights_compute_the_same_function(name):
  """`merge_decode_weights` (q|k|v and gate|up as one matrix each) leaves the decoder's
  function unchanged: the forward pass and the write-first decode step give the same logits
  and caches (bias, QK norm and tied embeddings included)."""
  cfg = models.get_config(name)
  params = models.init_params(cfg, jax.random.key(3), std=0.2)
  merged = param_tree.merge_decode_weights(params, cfg)
  assert {"wqkv", "w_gate_up"} <= set(merged["layers"])
  assert param_tree.merged_decode_weight_bytes(cfg) == sum(
      merged["layers"][n].nbytes for n in ("wqkv", "w_gate_up"))
  assert not {"wq", "wk", "wv", "w_gate", "w_up", "bq", "bk", "bv", "q_norm",
              "k_norm"} & set(merged["layers"])
  assert ("bqkv" in merged["layers"]) == cfg.qkv_bias
  assert ("qk_norms" in merged["layers"]) == cfg.qk_norm
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)))
  np.testing.assert_allclose(np.asarray(models.forward(merged, tokens, cfg=cfg)),
                             np.asarray(models.forward(params, tokens, cfg=cfg)), atol=1e-5)
  s, c = 3, 32
  ck, cv = _layer_caches(cfg, s, c)
  lens, tok = jnp.array([0, 9, 31], jnp.int32), jnp.array([5, 7, 11], jnp.int32)
  a = decoder.decode_in_place(params, ck, cv, tok, lens, cfg=cfg)
  b = decoder.decode_in_place(merged, ck, cv, tok, lens, cfg=cfg)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)


def _params_with_norms(cfg):
  """Random params whose layer norm weights are not one (folding them changes the matrices)."""
  params = param_tree.unbox(models.init_params(cfg, jax.random.key(3), std=0.2))
  layers = dict(params["layers"])
  for i, n in enumerate(("attn_norm", "mlp_norm")):
    layers[n] = layers[n] + 0.3 * _rand(60 + i, *layers[n].shape)
  return dict(params, layers=layers)


@pytest.mark.parametrize("name", [
    pytest.param("tiny-qwen2", marks=pytest.mark.slow), "tiny-qwen3",
    pytest.param("tiny-llama", marks=pytest.mark.slow)])
def test_folded_norms_compute_the_same_function(name, monkeypatch):
  """`merge_decode_weights(fold_norms=True)`: the layer norms' weights (random here, not one)
  go into the merged matrices and their entries are dropped. The forward and both write-first
  decode paths (the kernels' row scales and the SwiGLU kernel; XLA's scales) give the logits
  and caches of the unfolded weights, and the kernel path runs one RMS norm (the final one)
  and one SwiGLU kernel a layer."""
  cfg = models.get_config(name)
  params = _params_with_norms(cfg)
  merged = param_tree.merge_decode_weights(params, cfg)
  folded = param_tree.merge_decode_weights(params, cfg, fold_norms=True)
  assert param_tree.norms_folded(folded) and not param_tree.norms_folded(merged)
  assert not {"attn_norm", "mlp_norm"} & set(folded["layers"])
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)))
  np.testing.assert_allclose(np.asarray(models.forward(folded, tokens, cfg=cfg)),
                             np.asarray(models.forward(params, tokens, cfg=cfg)), atol=1e-4)
  s, c = 3, 32
  ck, cv = _layer_caches(cfg, s, c)
  lens, tok = jnp.array([0, 9, c], jnp.int32), jnp.array([5, 7, 11], jnp.int32)
  want = decoder.decode_in_place(merged, ck, cv, tok, lens, cfg=cfg)
  norms, swiglus = [], []
  rms, swiglu = decoder.rms_norm, decoder._swiglu_rms
  monkeypatch.setattr(decoder, "rms_norm", lambda *a: norms.append(1) or rms(*a))
  monkeypatch.setattr(decoder, "_swiglu_rms", lambda *a, **k: swiglus.append(1) or swiglu(*a, **k))
  got = decoder.decode_in_place(folded, ck, cv, tok, lens, cfg=cfg)
  assert len(norms) == 1 and len(swiglus) == cfg.n_layers
  xla = decoder.decode_in_place(folded, ck, cv, tok, lens, cfg=cfg, fused_qkv=False)
  for w, a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), jax.tree.leaves(xla)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=2e-5)
    np.testing.assert_allclose(np.asarray(b), np.asarray(w), atol=2e-5)


# One model of each in the default run (CI time): folded norms on tiny-qwen3 (q / k norms),
# chained weights on tiny-qwen2 (biases); the others with -m slow.
@pytest.mark.parametrize("name", [
    "tiny-qwen2", pytest.param("tiny-qwen3", marks=pytest.mark.slow),
    pytest.param("tiny-llama", marks=pytest.mark.slow)])
def test_chained_weights_compute_the_same_function(name, monkeypatch):
  """`chain_decode_weights`: each layer's four decode matrices as two, the residual stream
  riding in the first D columns of the kernels' inputs and outputs. The write-first step gives
  the logits and caches of the folded weights (bias and q / k norms included), running the
  decode kernel, two GEMMs and the SwiGLU kernel a layer and one RMS norm (the final one)."""
  cfg = models.get_config(name)
  params = _params_with_norms(cfg)
  folded = param_tree.merge_decode_weights(params, cfg, fold_norms=True)
  chained = param_tree.chain_decode_weights(folded, cfg)
  assert param_tree.is_chained(chained) and param_tree.is_merged(chained)
  assert param_tree.norms_folded(chained) and not param_tree.is_chained(folded)
  assert not {"wqkv", "w_gate_up", "wo", "w_down"} & set(chained["layers"])
  ch = chained["chain"]
  assert param_tree.chained_layer_bytes(cfg) == ch["a"][0].nbytes + ch["b"][0].nbytes
  d, q = cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
  assert ch["a"].shape == (cfg.n_layers, d + cfg.n_heads * cfg.head_dim, d + 2 * cfg.ffn_dim)
  assert ch["b"].shape == (cfg.n_layers - 1, d + cfg.ffn_dim, d + q)
  assert ch["in"].shape == (d, d + q) and ch["out"].shape == (d + cfg.ffn_dim, d)
  s, c = 3, 32
  ck, cv = _layer_caches(cfg, s, c)
  lens, tok = jnp.array([0, 9, c], jnp.int32), jnp.array([5, 7, 11], jnp.int32)
  want = decoder.decode_in_place(folded, ck, cv, tok, lens, cfg=cfg)
  norms, swiglus, kernels = [], [], []
  rms, swiglu, attn = decoder.rms_norm, decoder._swiglu_rms, decoder._flash_decode_write_qkv
  monkeypatch.setattr(decoder, "rms_norm", lambda *a: norms.append(1) or rms(*a))
  monkeypatch.setattr(decoder, "_swiglu_rms",
                      lambda *a, **k: swiglus.append(1) or swiglu(*a, **k))
  monkeypatch.setattr(decoder, "_flash_decode_write_qkv",
                      lambda *a, **k: kernels.append(k["resid_rows"]) or attn(*a, **k))
  got = decoder.decode_in_place(chained, ck, cv, tok, lens, cfg=cfg)
  assert len(norms) == 1 and len(swiglus) == cfg.n_layers
  assert kernels == [d // cfg.head_dim] * cfg.n_layers
  for w, a in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=2e-5)
  monkeypatch.undo()
  # Slot 1 reads its first 64 cached rows (a whole block at this launch's 64) from slot 0's
  # (prompt sharing).
  ck, cv = _layer_caches(cfg, s, 4 * c)
  lens = jnp.array([0, 100, 4 * c], jnp.int32)
  share = (jnp.array([0, 0, 2], jnp.int32), jnp.array([0, 64, 0], jnp.int32))
  want = decoder.decode_in_place(folded, ck, cv, tok, lens, cfg=cfg, share=share)
  got = decoder.decode_in_place(chained, ck, cv, tok, lens, cfg=cfg, share=share)
  for w, a in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=2e-5)
  own = decoder.decode_in_place(chained, ck, cv, tok, lens, cfg=cfg)[0]
  assert not np.allclose(np.asarray(got[0][1]), np.asarray(own[1]), atol=1e-3)  # it did share
  with pytest.raises(ValueError, match="chained weights need"):
    decoder.decode_in_place(chained, ck, cv, tok, lens, cfg=cfg, fused_qkv=False)
  with pytest.raises(ValueError, match="fold_norms=True"):
    param_tree.chain_decode_weights(param_tree.merge_decode_weights(params, cfg), cfg)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_rms_kernel_with_the_stream_in_front(dtype, monkeypatch):
  """`swiglu_rms(lead=D)` (chained weights): the stream in the projection's first D columns
  gives the scale and is copied in front of the activation, equal to the two-array form."""
  from jaxagent.models import decode_mlp
  monkeypatch.setattr(decode_mlp, "BLOCK_COLS", 16)
  s, d, f = 8, 40, 96
  gu = _rand(0, s, 2 * f).astype(dtype)
  resid = (3 * _rand(1, s, d)).astype(dtype)
  both = jnp.concatenate([resid, gu], axis=1)
  got = decode_mlp.swiglu_rms(both, None, 1e-6, lead=d, interpret=True)
  assert got.shape == (s, d + f) and got.dtype == dtype
  np.testing.assert_array_equal(np.asarray(got[:, :d]), np.asarray(resid))
  np.testing.assert_array_equal(np.asarray(got[:, d:]),
                                np.asarray(decode_mlp.swiglu_rms(gu, resid, 1e-6,
                                                                 interpret=True)))
  np.testing.assert_array_equal(np.asarray(decode_mlp.swiglu_rms_reference(both, None, 1e-6,
                                                                           lead=d)),
                                np.asarray(jnp.concatenate(
                                    [resid, decode_mlp.swiglu_rms_reference(gu, resid, 1e-6)],
                                    axis=1)))
  with pytest.raises(ValueError, match="lead=40 needs resid None"):
    decode_mlp.swiglu_rms(both, resid, 1e-6, lead=d, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("s,d,f,max_programs", [(8, 40, 96, 512), (6, 48, 80, 4), (16, 64, 64, 2)])
def test_swiglu_rms_kernel_equals_reference(s, d, f, max_programs, dtype, monkeypatch):
  """The folded MLP norm's scale and the SwiGLU in one kernel (interpret mode) against the
  same function in XLA ops, with one column block a program and with several (few programs
  allowed), for row widths D that are not powers of two."""
  from jaxagent.models import decode_mlp
  monkeypatch.setattr(decode_mlp, "BLOCK_COLS", 16)
  monkeypatch.setattr(decode_mlp, "MAX_PROGRAMS", max_programs)
  gu = _rand(0, s, 2 * f).astype(dtype)
  resid = (3 * _rand(1, s, d)).astype(dtype)
  got = decode_mlp.swiglu_rms(gu, resid, 1e-6, interpret=True)
  want = decode_mlp.swiglu_rms_reference(gu, resid, 1e-6)
  assert got.shape == (s, f) and got.dtype == dtype
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=1e-6, atol=1e-6)
  # The scale is that of each row's RMS norm.
  r = 1 / np.sqrt((np.asarray(resid, np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
  g, u = np.split(np.asarray(gu, np.float64), 2, axis=-1)
  ref = (g * r) / (1 + np.exp(-g * r)) * (u * r)
  tol = 1e-5 if dtype == jnp.float32 else 3e-2
  np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=tol, atol=tol)
  with pytest.raises(ValueError, match="swiglu_rms"):
    decode_mlp.swiglu_rms(gu[:, :-1], resid, 1e-6, interpret=True)
  with pytest.raises(ValueError, match="swiglu_rms"):
    decode_mlp.swiglu_rms(gu, resid[:-1], 1e-6, interpret=True)


@pytest.mark.parametrize("splits", [1, 2, 3, 8])
def test_flash_decode_splits_equal_one_pass(splits):
  """Cutting each slot's sequence into ranges (one program each, merged by log-sum-exp) gives
  the one-pass result, including slots shorter than a split and an empty slot."""
  s, kv, g, hd, c = 6, 2, 3, 16, 256
  q, k, v = _rand(0, s, kv, g, hd), _rand(1, s, kv, c, hd), _rand(2, s, kv, c, hd)
  lens = jnp.array([0, 1, 31, 100, 255, 256])
  ref, ref_lse = flash_decode(q, k, v, lens, block_k=32, splits=1, interpret=True)
  out, lse = flash_decode(q, k, v, lens, block_k=32, splits=splits, interpret=True)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6)
  np.testing.assert_allclose(np.asarray(lse[1:]), np.asarray(ref_lse[1:]), atol=2e-6)
  assert np.all(np.asarray(out[0]) == 0) and np.all(np.asarray(lse[0]) <= -1e29)


def test_auto_splits():
  from jaxagent.models.decode_attention import auto_splits
  assert auto_splits(256, 8, 1024, 64) == 1     # 2048 programs already
  assert auto_splits(256, 2, 1024, 64) == 4     # Qwen2.5-1.5B: 512 -> 2048
  assert auto_splits(256, 3, 1024, 64) == 2     # SmolLM2-135M: 768 -> 1536
  assert auto_splits(8, 2, 256, 64) == 2        # short cache: at least two blocks per split


def test_tuning_by_launch_size(monkeypatch):
  from jaxagent.models import decode_attention as da
  monkeypatch.delenv("JAXAGENT_DECODE_KERNEL", raising=False)
  assert da.tuning() == da.DEFAULT_TUNING
  assert da.tuning(programs=256 * 8) == da.DEFAULT_TUNING
  assert da.tuning(programs=64 * 2) == da.FEW_PROGRAMS_TUNING
  assert da.FEW_PROGRAMS_TUNING["block_k"] == 64
  # Heads up to 64 wide get 3 stages at many programs, wider ones the default's 2.
  assert da.tuning(programs=256 * 3, head_dim=64) == da.SMALL_HEAD_TUNING
  assert da.SMALL_HEAD_TUNING["num_stages"] == 3 and da.DEFAULT_TUNING["num_stages"] == 2
  assert da.tuning(programs=256 * 2, head_dim=128) == da.DEFAULT_TUNING
  assert da.tuning(programs=64 * 2, head_dim=64) == da.FEW_PROGRAMS_TUNING
  seen = []
  monkeypatch.setattr(da, "_flash_decode_write", lambda *a, **k: seen.append(k["num_stages"]))
  for hd in (64, 128):  # 256 slots x 2 KV heads: 512 programs
    cache = jnp.zeros((256, 2, 32, hd))
    da.flash_decode_write_qkv(jnp.zeros((256, 6, hd)), jnp.zeros((256, 2, hd // 2)), cache,
                              cache, jnp.zeros(256, jnp.int32), interpret=True)
  assert seen == [3, 2]  # the kernel's launch takes its head size into account
  monkeypatch.setenv("JAXAGENT_DECODE_KERNEL", "block_k=16")
  assert da.tuning(programs=64 * 2)["block_k"] == 16  # the environment still overrides


def test_a_warp_per_2048_accumulator_entries(monkeypatch):
  """The one-warp default is for one-token decode programs (16 rows of 64-128 lanes); a
  program with a larger float32 accumulator (an append's tokens folded into the head group,
  or wider heads) gets a warp per 2048 entries, an explicit setting included, so the
  accumulator stays in registers."""
  from jaxagent.models import decode_attention as da
  from jaxagent.models.decode_attention import flash_decode_write
  monkeypatch.delenv("JAXAGENT_DECODE_KERNEL", raising=False)
  # The settings are read when a kernel call is traced: drop the kernels' traces (not every
  # cache, which would make the rest of this module compile again).
  da._flash_decode.clear_cache()
  da._flash_decode_write.clear_cache()
  seen = []

  def record(interpret, num_warps, num_stages):
    seen.append(num_warps)
    return {}
  monkeypatch.setattr(da, "_compiler_params", record)
  # Tracing is enough: the launch settings are chosen when the kernel call is traced.
  trace = lambda fn, *a, **kw: jax.eval_shape(lambda *a: fn(*a, interpret=True, **kw), *a)
  s, kv, c = 80, 4, 32  # 320 programs: the default (one-warp) launch settings
  lens = jnp.full((s,), 9, jnp.int32)
  for hd, rows, want in ((128, 3, 1), (128, 16, 1), (128, 24, 2), (128, 64, 4), (128, 100, 4),
                         (64, 32, 1), (256, 16, 2)):
    k, v = _rand(1, s, kv, c, hd), _rand(2, s, kv, c, hd)
    seen.clear()
    trace(flash_decode, _rand(0, s, kv, rows, hd), k, v, lens)
    assert seen == [want], (hd, rows, seen)
  seen.clear()
  trace(flash_decode, _rand(0, s, kv, 3, 128), k[..., :128], v[..., :128], lens, num_warps=8)
  assert seen == [8]
  k, v = _rand(1, s, kv, c, 128), _rand(2, s, kv, c, 128)
  seen.clear()
  trace(flash_decode_write, _rand(0, s, kv, 24, 128), k[:, :, 0], v[:, :, 0], k, v, lens)
  assert seen == [2]


def test_flash_decode_runs_per_shard_on_a_mesh():
  # Slots over data x fsdp, KV heads over tensor: the kernel runs per shard (no all-gather of
  # the cache onto every device) and gives the single-device result.
  from jaxagent import sharding as shd
  s, kv, g, hd, c = 8, 2, 3, 16, 64
  q, k, v = _rand(0, s, kv, g, hd), _rand(1, s, kv, c, hd), _rand(2, s, kv, c, hd)
  lens = jnp.arange(s) * 7 + 3
  mesh = shd.make_mesh(2, 2, 2)
  spec = shd.NamedSharding(mesh, shd.P(("data", "fsdp"), "tensor"))
  fn = jax.jit(shd.on_mesh(lambda *a: decoder._flash_decode(*a, True), mesh),
               in_shardings=(spec, spec, spec, shd.NamedSharding(mesh, shd.P(("data", "fsdp")))))
  out, lse = fn(q, k, v, lens)
  want_out, want_lse = flash_decode(q, k, v, lens, interpret=True)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=1e-6)
  assert "all-gather" not in fn.lower(q, k, v, lens).compile().as_text()


@pytest.mark.slow  # ~40 s on 2 cores; the kernels' per-shard tests stay in the default run
def test_engine_on_a_mesh_with_the_decode_kernel_matches_single_device():
  from jaxagent import sharding as shd
  cfg = models.get_config("tiny-qwen2")
  params = models.init_params(cfg, jax.random.key(0), std=0.2)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, cfg.vocab_size, rng.integers(3, 30)).tolist() for _ in range(5)]
  outs = []
  # The last run merges the weights on a mesh without "tensor": the kernel that takes the raw
  # q|k|v projection, one slot a shard.
  for m, merge in ((None, False), (shd.make_mesh(2, 2, 2), False),
                   (shd.make_mesh(2, 2, 1, devices=jax.devices()[:4]), True)):
    eng = Engine(cfg, EngineConfig(slots=4, max_len=64, sampling=SamplingConfig(1.0),
                                   decode_attention="pallas", cache_layout="per_layer",
                                   decode_merge_weights=merge), mesh=m)
    p = params if m is None else shd.shard(params, m)
    outs.append(run_requests(eng, p, prompts, max_new_tokens=10, request_ids=list(range(5)),
                             seed=2))
  for other in outs[1:]:
    for a, b in zip(outs[0], other):
      assert a.tokens == b.tokens
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def _shared_cache(s, kv, c, hd, groups):
  """Random caches where slot `m` of each (leader, members, n) group repeats the leader's first
  n rows (the samples of one prompt)."""
  k, v = np.array(_rand(1, s, kv, c, hd)), np.array(_rand(2, s, kv, c, hd))
  src, shared = np.arange(s), np.zeros(s, np.int32)
  for leader, members, n in groups:
    for m in members:
      k[m, :, :n], v[m, :, :n] = k[leader, :, :n], v[leader, :, :n]
      src[m], shared[m] = leader, n
  return k, v, jnp.asarray(src), jnp.asarray(shared)


def test_flash_decode_reads_shared_rows_from_the_source_slot():
  """With `share`, whole blocks of a slot's shared rows come from its source slot: the result
  equals the unshared one, and the slot's own copy of those rows is not read."""
  s, kv, g, hd, c = 6, 2, 3, 16, 128
  q = _rand(0, s, kv, g, hd)
  k, v, src, shared = _shared_cache(s, kv, c, hd, [(0, (1, 2), 70), (3, (5,), 40)])
  lens = jnp.array([100, 90, 70, 50, 0, 45])
  want = flash_decode(q, jnp.asarray(k), jnp.asarray(v), lens, block_k=16, interpret=True)
  k[1, :, :64] = v[1, :, :64] = 1e3  # slot 1's own copy of its 4 whole shared blocks
  got = flash_decode(q, jnp.asarray(k), jnp.asarray(v), lens, share=(src, shared), block_k=16,
                     interpret=True)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  unshared = flash_decode(q, jnp.asarray(k), jnp.asarray(v), lens, block_k=16, interpret=True)
  assert not np.allclose(np.asarray(unshared[0][1]), np.asarray(want[0][1]), atol=1e-3)


def test_flash_decode_shared_rows_per_shard():
  """On a mesh each shard reads shared rows from its own slots; a source on another shard is
  ignored (the slot reads its own, equal rows)."""
  from jaxagent import sharding as shd
  s, kv, g, hd, c = 8, 2, 3, 16, 64
  q = _rand(0, s, kv, g, hd)
  # Slots 0-1, 2-3, ... per shard of a data x fsdp = 4 split: 0 -> 1 shares within a shard,
  # 2 -> 5 across shards.
  k, v, src, shared = _shared_cache(s, kv, c, hd, [(0, (1,), 40), (2, (5,), 33)])
  lens = jnp.arange(s) * 3 + 40
  mesh = shd.make_mesh(2, 2, 2)
  spec = shd.NamedSharding(mesh, shd.P(("data", "fsdp"), "tensor"))
  rows = shd.NamedSharding(mesh, shd.P(("data", "fsdp")))
  fn = jax.jit(shd.on_mesh(lambda q, k, v, l, a, b: decoder._flash_decode(q, k, v, l, True,
                                                                           (a, b)), mesh),
               in_shardings=(spec, spec, spec, rows, rows, rows))
  out, lse = fn(q, jnp.asarray(k), jnp.asarray(v), lens, src, shared)
  want_out, want_lse = flash_decode(q, jnp.asarray(k), jnp.asarray(v), lens, interpret=True)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=1e-6)


@pytest.mark.slow  # tens of seconds on a 2-core CPU (the default run's time budget)
def test_engine_prompt_sharing_matches_unshared(monkeypatch):
  """Groups of samples of one prompt through fewer slots than requests, with per-request
  budgets: sources finish and their slots take other prompts while their samples still decode.
  Outputs equal an engine that shares nothing."""
  monkeypatch.setenv("JAXAGENT_DECODE_KERNEL", "block_k=16")  # shared blocks of short prompts
  cfg = models.get_config("tiny-qwen2")
  params = models.init_params(cfg, jax.random.key(0), std=0.2)
  rng = np.random.default_rng(1)
  uniq = [rng.integers(0, cfg.vocab_size, rng.integers(34, 60)).tolist() for _ in range(3)]
  prompts = [p for p in uniq for _ in range(3)]
  budgets = [int(b) for b in rng.integers(2, 14, len(prompts))]
  outs = []
  # The third shares with merged weights: the kernel takes the raw q|k|v projection.
  for share, merge in ((True, False), (False, False), (True, True)):
    eng = Engine(cfg, EngineConfig(slots=4, max_len=96, sampling=SamplingConfig(1.0),
                                   decode_attention="pallas", cache_layout="per_layer",
                                   share_prompts=share, decode_merge_weights=merge))
    outs.append(run_requests(eng, params, prompts, max_new_tokens=budgets,
                             request_ids=list(range(len(prompts))), seed=2, decode_steps=4))
  for other in outs[1:]:
    for a, b in zip(outs[0], other):
      assert a.tokens == b.tokens
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_engine_share_bookkeeping():
  """`prefill_insert` points the samples of a prompt at its first slot; overwriting or
  rewinding the source (below the shared rows) points them back at themselves."""
  cfg = models.get_config("tiny-qwen2")
  params = models.init_params(cfg, jax.random.key(0))
  eng = Engine(cfg, EngineConfig(slots=6, max_len=64, decode_attention="pallas",
                                 cache_layout="per_layer"))
  a, b = [5] * 20, [7] * 30
  st, _ = eng.prefill_insert(params, eng.init_decode_state(), [a, b, a, a, b], [4, 0, 1, 3, 2],
                             list(range(5)))
  assert np.asarray(st.share_src).tolist() == [0, 4, 0, 4, 4, 5]
  assert np.asarray(st.share_len).tolist() == [0, 20, 30, 20, 0, 0]
  st, _ = eng.prefill_insert(params, st, [b], [4], [9])  # slot 4 now holds another prompt
  assert np.asarray(st.share_src).tolist() == [0, 1, 0, 3, 4, 5]
  assert np.asarray(st.share_len).tolist() == [0, 0, 30, 0, 0, 0]
  st = eng.update_slots(st, [0], lengths=[25], tokens=[1], active=False)  # 25 < 30 shared rows
  assert np.asarray(st.share_src).tolist() == [0, 1, 2, 3, 4, 5]
  assert np.asarray(st.share_len).tolist() == [0] * 6
  off = Engine(cfg, EngineConfig(slots=6, max_len=64, share_prompts=False))
  st, _ = off.prefill_insert(params, off.init_decode_state(), [a, a], [0, 1], [0, 1])
  assert np.asarray(st.share_len).tolist() == [0] * 6


def _scatter_then_attend(q, kn, vn, k, v, lens, **kw):
  c = k.shape[2]
  slots = jnp.arange(k.shape[0])
  k2 = k.at[slots, :, lens].set(kn, mode="drop")
  v2 = v.at[slots, :, lens].set(vn, mode="drop")
  out, _ = flash_decode(q, k2, v2, jnp.minimum(lens + 1, c), interpret=True, **kw)
  return out, k2, v2


@pytest.mark.parametrize("g", [3, 8])
def test_flash_decode_write_equals_scatter_then_attend(g):
  """The kernel that writes the new token's K/V gives the scatter-then-attend result: the new
  row lands at each slot's length (dropped for a full slot, which attends over its C cached
  rows), nothing else in the caches changes, and an empty slot attends to the new token only."""
  from jaxagent.models.decode_attention import flash_decode_write
  s, kv, hd, c = 6, 2, 16, 64
  q, k, v = _rand(0, s, kv, g, hd), _rand(1, s, kv, c, hd), _rand(2, s, kv, c, hd)
  kn, vn = _rand(3, s, kv, hd), _rand(4, s, kv, hd)
  lens = jnp.array([0, 5, 16, 33, 63, 64], jnp.int32)
  want, wk, wv = _scatter_then_attend(q, kn, vn, k, v, lens, block_k=16)
  out, k2, v2 = flash_decode_write(q, kn, vn, k, v, lens, block_k=16, interpret=True)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-6)
  np.testing.assert_array_equal(np.asarray(k2), np.asarray(wk))
  np.testing.assert_array_equal(np.asarray(v2), np.asarray(wv))
  np.testing.assert_allclose(np.asarray(out[0]), np.broadcast_to(np.asarray(vn[0])[:, None],
                                                                  (kv, g, hd)), atol=1e-6)


def test_flash_decode_write_reads_shared_rows_from_the_source_slot():
  from jaxagent.models.decode_attention import flash_decode_write
  s, kv, g, hd, c = 6, 2, 3, 16, 128
  q, kn, vn = _rand(0, s, kv, g, hd), _rand(3, s, kv, hd), _rand(4, s, kv, hd)
  k, v, src, shared = _shared_cache(s, kv, c, hd, [(0, (1, 2), 70), (3, (5,), 40)])
  lens = jnp.array([100, 90, 70, 50, 0, 45], jnp.int32)
  want, wk, wv = _scatter_then_attend(q, kn, vn, jnp.asarray(k), jnp.asarray(v), lens,
                                      block_k=16)
  k[1, :, :64] = v[1, :, :64] = 1e3  # slot 1's own copy of its 4 whole shared blocks
  out, k2, _ = flash_decode_write(q, kn, vn, jnp.asarray(k), jnp.asarray(v), lens,
                                  share=(src, shared), block_k=16, interpret=True)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-6)
  np.testing.assert_array_equal(np.asarray(k2)[:, :, 64:], np.asarray(wk)[:, :, 64:])
  unshared, _, _ = flash_decode_write(q, kn, vn, jnp.asarray(k), jnp.asarray(v), lens,
                                      block_k=16, interpret=True)
  assert not np.allclose(np.asarray(unshared[1]), np.asarray(want[1]), atol=1e-3)


def test_flash_decode_write_per_shard():
  """On a 2x2x2 mesh the writing kernel runs per shard (slots over data x fsdp, KV heads over
  tensor), writes every shard's rows and reads shared rows only within a shard."""
  from jaxagent import sharding as shd
  s, kv, g, hd, c = 8, 2, 3, 16, 64
  q, kn, vn = _rand(0, s, kv, g, hd), _rand(3, s, kv, hd), _rand(4, s, kv, hd)
  k, v, src, shared = _shared_cache(s, kv, c, hd, [(0, (1,), 40), (2, (5,), 33)])
  k, v = jnp.asarray(k), jnp.asarray(v)
  lens = jnp.arange(s, dtype=jnp.int32) * 3 + 40
  mesh = shd.make_mesh(2, 2, 2)
  spec = shd.NamedSharding(mesh, shd.P(("data", "fsdp"), "tensor"))
  rows = shd.NamedSharding(mesh, shd.P(("data", "fsdp")))
  fn = jax.jit(shd.on_mesh(lambda *a: decoder._flash_decode_write(*a[:6], True, a[6:]), mesh),
               in_shardings=(spec,) * 5 + (rows,) * 3)
  args = (q, kn, vn, k, v, lens, src, shared)
  out, k2, v2 = fn(*args)
  want, wk, wv = _scatter_then_attend(q, kn, vn, k, v, lens)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-6)
  np.testing.assert_array_equal(np.asarray(k2), np.asarray(wk))
  np.testing.assert_array_equal(np.asarray(v2), np.asarray(wv))
  assert "all-gather" not in fn.lower(*args).compile().as_text()


def _raw_qkv_case(dtype, s=5, kv=2, g=3, hd=16, c=64):
  """Raw projections, bias, q / k norm weights, caches, lengths and (cos, sin) of a
  `flash_decode_write_qkv` call."""
  r = (g + 2) * kv
  qkv = _rand(0, s, r, hd).astype(dtype)
  bias = (0.3 * _rand(1, r, hd)).astype(dtype)
  norms = 1 + 0.1 * _rand(2, 2, hd)
  k, v = _rand(3, s, kv, c, hd).astype(dtype), _rand(4, s, kv, c, hd).astype(dtype)
  lens = jnp.array([0, 5, 17, 40, c], jnp.int32)[:s]
  inv = jnp.asarray(1.0 / (10000 ** (np.arange(0, hd, 2) / hd)), jnp.float32)
  return qkv, bias, norms, k, v, lens, inv


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_bias,with_norms", [(False, False), (True, False), (False, True),
                                                  (True, True)])
def test_flash_decode_write_qkv_equals_xla_prepared_inputs(dtype, with_bias, with_norms):
  """Bias, q / k norms and RoPE applied inside the kernel give what `flash_decode_write` gives
  for q, k and v prepared by the decoder's own functions (bitwise in bfloat16 here), and the
  kernel writes the same new K/V rows."""
  from jaxagent.models.decode_attention import flash_decode_write, flash_decode_write_qkv
  s, kv, g, hd = 5, 2, 3, 16
  qkv, bias, norms, k, v, lens, inv = _raw_qkv_case(dtype, s, kv, g, hd)
  bias, norms = (bias if with_bias else None), (norms if with_norms else None)
  x = qkv if bias is None else qkv + bias
  q, kn, vn = jnp.split(x[:, None], [g * kv, g * kv + kv], axis=2)
  cos, sin = decoder.rope_tables(lens[:, None], inv)
  if norms is None:
    q, kn = (decoder.apply_rope(a, lens[:, None], inv) for a in (q, kn))
  else:
    q, kn = (decoder.norm_rope(a, w, cos, sin, 1e-6) for a, w in ((q, norms[0]), (kn, norms[1])))
  want = flash_decode_write(q[:, 0].reshape(s, kv, g, hd), kn[:, 0], vn[:, 0], k, v, lens,
                            block_k=16, interpret=True)
  rope = jnp.stack([cos[:, 0, 0], sin[:, 0, 0]], axis=1)
  got = flash_decode_write_qkv(qkv, rope, k, v, lens, bias, norms, eps=1e-6, block_k=16,
                               interpret=True)
  atol = 1e-6 if dtype == jnp.float32 else 0
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=atol)
  # The full slot (length c) keeps its cache; the others got their row written.
  assert not np.array_equal(np.asarray(got[1], np.float32), np.asarray(k, np.float32))


def test_flash_decode_write_qkv_rejects_bad_shapes():
  from jaxagent.models.decode_attention import flash_decode_write_qkv
  qkv, _, _, k, v, lens, _ = _raw_qkv_case(jnp.float32)
  rope = jnp.zeros((5, 2, 8))
  with pytest.raises(ValueError, match="projection rows"):
    flash_decode_write_qkv(qkv[:, :9], rope, k, v, lens, interpret=True)
  with pytest.raises(ValueError, match="rope must be"):
    flash_decode_write_qkv(qkv, rope[:, :, :4], k, v, lens, interpret=True)
  with pytest.raises(ValueError, match="on a GPU, >= 32"):
    flash_decode_write_qkv(qkv, rope, k, v, lens)  # hd 16 outside interpret mode
  with pytest.raises(ValueError, match="resid must be"):
    flash_decode_write_qkv(qkv, jnp.zeros((5, 2, 8)), k, v, lens, resid=jnp.zeros((4, 32)),
                           interpret=True)


def test_flash_decode_write_qkv_reads_its_layer_of_stacked_bias_and_norms():
  """With `layer`, bias and norms hold every layer's rows and the kernel reads that layer's:
  the same result as the layer's own slice, and not another layer's."""
  from jaxagent.models.decode_attention import flash_decode_write_qkv
  qkv, bias, norms, k, v, lens, inv = _raw_qkv_case(jnp.float32)
  cos, sin = decoder.rope_tables(lens[:, None], inv)
  rope = jnp.stack([cos[:, 0, 0], sin[:, 0, 0]], axis=1)
  biases = jnp.stack([bias + 0.5 * i for i in range(3)])
  normss = jnp.stack([norms * (1 + 0.2 * i) for i in range(3)])
  run = lambda b, w, **kw: flash_decode_write_qkv(qkv, rope, k, v, lens, b, w, eps=1e-6,
                                                  block_k=16, interpret=True, **kw)
  for layer in (0, 2):
    want = run(biases[layer], normss[layer])
    got = run(biases, normss, layer=layer)
    for a, b in zip(got, want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  other = run(biases, normss, layer=1)
  assert not np.allclose(np.asarray(other[0]), np.asarray(got[0]))
  with pytest.raises(ValueError, match="every layer, with layer given"):
    run(bias, norms, layer=0)
  with pytest.raises(ValueError, match="bias must be"):
    run(biases, None)


@pytest.mark.parametrize("name", [
    "tiny-qwen2", "tiny-qwen3", pytest.param("tiny-llama", marks=pytest.mark.slow)])
def test_decode_in_place_fused_qkv_equals_xla_prepared(name, monkeypatch):
  """With merged weights the write-first step hands the kernel the raw q|k|v projection
  (bias, Qwen3's q / k norms and RoPE in the kernel) and gives the logits and caches of the
  step whose q, k and v XLA prepares; without merged weights it keeps the XLA preparation."""
  cfg = models.get_config(name)
  params = models.init_params(cfg, jax.random.key(3), std=0.2)
  merged = param_tree.merge_decode_weights(params, cfg)
  layers = dict(merged["layers"])  # biases and norm weights that matter
  for key in ("bqkv", "qk_norms"):
    if key in layers:
      layers[key] = layers[key] + 0.2 * _rand(7, *layers[key].shape)
  merged = dict(merged, layers=layers)
  s, c = 3, 32
  ck, cv = _layer_caches(cfg, s, c)
  lens, tok = jnp.array([0, 9, c], jnp.int32), jnp.array([5, 7, 11], jnp.int32)
  calls = []
  fused = decoder._flash_decode_write_qkv
  monkeypatch.setattr(decoder, "_flash_decode_write_qkv",
                      lambda *a, **k: calls.append(1) or fused(*a, **k))
  a = decoder.decode_in_place(merged, ck, cv, tok, lens, cfg=cfg)
  assert len(calls) == cfg.n_layers
  b = decoder.decode_in_place(merged, ck, cv, tok, lens, cfg=cfg, fused_qkv=False)
  decoder.decode_in_place(params, ck, cv, tok, lens, cfg=cfg)
  assert len(calls) == cfg.n_layers
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)


def test_flash_decode_write_qkv_per_shard():
  """On a data x fsdp mesh the raw-projection kernel runs per shard (slots split, bias and
  norm weights whole on every shard) with shared rows read within a shard."""
  from jaxagent import sharding as shd
  s, kv, g, hd, c = 8, 2, 3, 16, 64
  qkv = _rand(0, s, (g + 2) * kv, hd)
  bias, norms = 0.3 * _rand(1, (g + 2) * kv, hd), 1 + 0.1 * _rand(2, 2, hd)
  k, v, src, shared = _shared_cache(s, kv, c, hd, [(0, (1,), 40), (2, (5,), 33)])
  k, v = jnp.asarray(k), jnp.asarray(v)
  lens = jnp.arange(s, dtype=jnp.int32) * 3 + 40
  rope = jnp.stack([jnp.cos(_rand(5, s, hd // 2)), jnp.sin(_rand(5, s, hd // 2))], axis=1)
  mesh = shd.make_mesh(2, 4, 1)
  rows = shd.NamedSharding(mesh, shd.P(("data", "fsdp")))
  whole = shd.NamedSharding(mesh, shd.P())

  def call(qkv, rope, k, v, lens, bias, norms, src, shared):
    return decoder._flash_decode_write_qkv(qkv, rope, k, v, lens, bias, norms, 1e-6, True,
                                           (src, shared))
  fn = jax.jit(shd.on_mesh(call, mesh), in_shardings=(rows,) * 5 + (whole,) * 2 + (rows,) * 2)
  args = (qkv, rope, k, v, lens, bias, norms, src, shared)
  got = fn(*args)
  from jaxagent.models.decode_attention import flash_decode_write_qkv
  want = flash_decode_write_qkv(qkv, rope, k, v, lens, bias, norms, eps=1e-6, interpret=True)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  assert "all-gather" not in fn.lower(*args).compile().as_text()
