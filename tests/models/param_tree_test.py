"""`param_tree`'s transforms of the params against the plain params: merged q|k|v and gate|up,
folded norms and chained matrices give the same decode step; `compute_copy`'s dtypes; inputs
are left as they were."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.models import decoder, param_tree as pt
from jaxagent.models.config import PRESETS


def _params(cfg, seed=0):
  """Random params with norm weights away from 1 and biases away from 0, so that folding and
  merging them is exercised."""
  p = pt.unbox(pt.init_params(cfg, jax.random.key(seed), std=0.2))
  key = jax.random.key(seed + 1)

  def perturb(path, x):
    name = path[-1].key
    k = jax.random.fold_in(key, len(jax.tree_util.keystr(path)) * 31 + x.size)
    if name in ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm"):
      return 1 + 0.3 * jax.random.normal(k, x.shape)
    if name in ("bq", "bk", "bv"):
      return 0.1 * jax.random.normal(k, x.shape)
    return x
  return jax.tree_util.tree_map_with_path(perturb, p)


def _cache(params, cfg, prompts, lens, size):
  _, k, v = decoder.prefill(params, prompts, lens, cfg=cfg)
  t = prompts.shape[1]
  shape = (cfg.n_layers, prompts.shape[0], cfg.n_kv_heads, size, cfg.head_dim)
  ck = jnp.zeros(shape).at[:, :, :, :t].set(k.transpose(0, 1, 3, 2, 4))
  cv = jnp.zeros(shape).at[:, :, :, :t].set(v.transpose(0, 1, 3, 2, 4))
  return ck, cv


@pytest.mark.parametrize("name", [pytest.param("tiny-llama", marks=pytest.mark.slow), "tiny-qwen2",
                                  "tiny-qwen3"])  # tiny-llama 9-18 s on 2 cores
def test_merged_folded_and_chained_weights_give_the_plain_decode_step(name):
  cfg = PRESETS[name]
  params = _params(cfg)
  before = jax.tree.map(np.array, params)
  prompts = jax.random.randint(jax.random.key(2), (3, 5), 0, cfg.vocab_size)
  lens = jnp.array([5, 3, 1])
  nxt = jnp.array([[7], [8], [9]])
  with jax.default_matmul_precision("highest"):
    ck, cv = _cache(params, cfg, prompts, lens, 16)
    ref = np.asarray(decoder.extend(params, ck, cv, nxt, lens, cfg=cfg)[0][:, 0])
    merged = pt.merge_decode_weights(params, cfg)
    folded = pt.merge_decode_weights(params, cfg, fold_norms=True)
    chained = pt.chain_decode_weights(folded, cfg)
    assert pt.is_merged(merged) and not pt.norms_folded(merged)
    assert pt.norms_folded(folded) and pt.is_chained(chained) and not pt.is_chained(folded)
    for p in (merged, folded):
      out = decoder.extend(p, ck, cv, nxt, lens, cfg=cfg)[0][:, 0]
      np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)
    out = decoder.decode_in_place(chained, tuple(ck), tuple(cv), nxt[:, 0], lens, cfg=cfg)[0]
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)
  # The inputs are untouched and still usable.
  jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.array, params))
  assert "wq" in params["layers"] and "attn_norm" in params["layers"]
  assert "wqkv" in folded["layers"] and "attn_norm" not in folded["layers"]
  with jax.default_matmul_precision("highest"):
    again = decoder.extend(params, ck, cv, nxt, lens, cfg=cfg)[0][:, 0]
  np.testing.assert_array_equal(again, ref)


def test_merged_layout_matches_a_numpy_reference():
  cfg = PRESETS["tiny-qwen3"].replace(qkv_bias=True)
  p = _params(cfg)
  lw = jax.tree.map(np.asarray, p["layers"])
  n, d = cfg.n_layers, cfg.d_model
  m = pt.merge_decode_weights(p, cfg)["layers"]
  np.testing.assert_array_equal(m["wqkv"], np.concatenate(
      [lw[w].reshape(n, d, -1) for w in ("wq", "wk", "wv")], -1))
  np.testing.assert_array_equal(m["w_gate_up"], np.concatenate([lw["w_gate"], lw["w_up"]], -1))
  np.testing.assert_array_equal(m["bqkv"], np.concatenate([lw["bq"], lw["bk"], lw["bv"]], -2))
  np.testing.assert_array_equal(m["qk_norms"], np.stack([lw["q_norm"], lw["k_norm"]], -2))
  f = pt.merge_decode_weights(p, cfg, fold_norms=True)["layers"]
  np.testing.assert_allclose(f["wqkv"], m["wqkv"] * lw["attn_norm"][:, :, None], rtol=1e-6)
  np.testing.assert_allclose(f["w_gate_up"], m["w_gate_up"] * lw["mlp_norm"][:, :, None],
                             rtol=1e-6)


def test_merging_merged_params_is_refused():
  cfg = PRESETS["tiny-llama"]
  merged = pt.merge_decode_weights(pt.init_params(cfg, jax.random.key(0)), cfg)
  with pytest.raises(ValueError, match="merged already"):
    pt.merge_decode_weights(merged, cfg)
  with pytest.raises(ValueError, match="fold_norms=True"):
    pt.chain_decode_weights(merged, cfg)


@pytest.mark.parametrize("boxed", [True, False])
def test_compute_copy_casts_matmul_weights_only_and_keeps_outputs(boxed):
  cfg = PRESETS["tiny-qwen2"].replace(dtype="bfloat16", tie_embeddings=False)
  params = pt.init_params(cfg, jax.random.key(0), std=0.2)
  params = params if boxed else pt.unbox(params)
  cc = pt.compute_copy(params, cfg)
  for path, x in jax.tree_util.tree_leaves_with_path(pt.unbox(cc)):
    name = path[-1].key
    want = jnp.float32 if name.endswith("norm") else jnp.bfloat16
    assert x.dtype == want, (name, x.dtype)
  assert jax.tree.structure(pt.unbox(cc)) == jax.tree.structure(pt.unbox(params))
  assert ([x.shape for x in jax.tree.leaves(pt.unbox(cc))]
          == [x.shape for x in jax.tree.leaves(pt.unbox(params))])
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(pt.unbox(params)))
  tokens = jnp.arange(12).reshape(2, 6)
  np.testing.assert_array_equal(decoder.forward(cc, tokens, cfg=cfg),
                                decoder.forward(params, tokens, cfg=cfg))
  same = PRESETS["tiny-qwen2"]
  assert pt.compute_copy(params, same) is params


@pytest.mark.parametrize("std", [float("nan"), float("inf"), -0.02, None, "0.02", True])
def test_init_params_refuses_a_std_that_is_no_standard_deviation(std):
  # A NaN made NaN weights without an error; None or a string (a run's model.init_std) failed
  # with a bare TypeError.
  with pytest.raises(ValueError, match=r"init_params: std must be a finite number >= 0 .*got "
                     + re.escape(repr(std))):
    pt.init_params(PRESETS["tiny-llama"], jax.random.key(0), std=std)



def test_params_of_another_architecture_of_the_same_sizes_are_refused():
  # The tiny presets share their sizes: a Qwen2 model's q/k/v biases or a Qwen3 model's q/k norms
  # under a Llama config were ignored (other logits, no error); the reverse was a bare KeyError.
  params = {name: jax.eval_shape(lambda c=PRESETS[name]: pt.unbox(pt.init_params(c, jax.random.key(0))))
            for name in ("tiny-llama", "tiny-qwen2", "tiny-qwen3")}  # shapes: all that is read
  for src, dst, extra, missing in (("tiny-qwen2", "tiny-llama", "'bk', 'bq', 'bv'", ""),
                                   ("tiny-qwen3", "tiny-llama", "'k_norm', 'q_norm'", ""),
                                   ("tiny-llama", "tiny-qwen3", "", "'k_norm', 'q_norm'")):
    cfg = PRESETS[dst]
    match = (rf"the params' layers do not match the model config '{dst}' \({cfg.architecture}\): "
             rf"weights it has no use for \[{extra}\], weights it needs \[{missing}\]")
    with pytest.raises(ValueError, match="prefill: " + match):
      pt.check_model_shapes(params[src], cfg, "prefill")
    with pytest.raises(ValueError, match="hidden_states: " + match):
      decoder.hidden_states(params[src], [[1, 2]], cfg=cfg)
    pt.check_model_shapes(params[dst], cfg, "prefill")
  # Per-layer (unstacked), boxed and merged params pass for their own config.
  cfg = PRESETS["tiny-qwen3"]
  pt.check_model_shapes(jax.eval_shape(pt.unstack_layers, params["tiny-qwen3"]), cfg, "forward")
  pt.check_model_shapes(jax.eval_shape(lambda: pt.init_params(cfg, jax.random.key(0))), cfg, "forward")
  merged = jax.eval_shape(lambda p: pt.merge_decode_weights(p, cfg), params["tiny-qwen3"])
  pt.check_model_shapes(merged, cfg, "generate")
