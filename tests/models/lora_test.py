"""Low-rank adapters: config checks, the merge, and the learner's adapter update."""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from jaxagent import models, sharding
from jaxagent.models import lora, param_tree
from jaxagent.rl import losses, step
from tests.rl.step_test import two_sequence_rows

CFG = models.get_config("tiny-qwen3")
LCFG = lora.LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def params():
  return models.init_params(CFG, jax.random.key(0), std=0.1)


def _random_adapter(seed=1, lcfg=LCFG):
  """An adapter with both A and B random (a fresh one has B = 0)."""
  fresh = lora.init_lora(CFG, lcfg, jax.random.key(seed))
  keys = iter(jax.random.split(jax.random.key(seed + 100), 64))
  return jax.tree.map(lambda x: 0.05 * jax.random.normal(next(keys), x.shape), fresh)


def test_config_checks_and_targets():
  assert lora.LoraConfig().targets == ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
  assert lora.parse_targets("attention") == ("wq", "wk", "wv", "wo")
  assert lora.parse_targets("v_proj, wq,mlp") == ("wq", "wv", "w_gate", "w_up", "w_down")
  assert lora.LoraConfig(rank=2, alpha=4).scale == 2.0
  with pytest.raises(ValueError, match="unknown LoRA target 'qproj'"):
    lora.parse_targets("qproj")
  with pytest.raises(ValueError, match="name no weight"):
    lora.parse_targets(" , ")
  for bad in (0, -1, 2.0, True):
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
      lora.LoraConfig(rank=bad)
  for bad in (0.0, float("nan"), float("inf"), "16"):
    with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
      lora.LoraConfig(alpha=bad)
  section = ml_collections.ConfigDict(dict(rank=0, alpha=16.0, targets="all"))
  assert lora.from_config(section) is None and lora.from_config(None) is None
  section.rank = 4
  assert lora.from_config(section) == lora.LoraConfig(rank=4, alpha=16.0)
  section.targets = "qkv"  # checked with LoRA off too
  with pytest.raises(ValueError, match="unknown LoRA target 'qkv'"):
    lora.from_config(section)
  section.targets = "all"
  section.rank = -2
  with pytest.raises(ValueError, match=r"lora.rank must be an int >= 1, got -2"):
    lora.from_config(section)
  section = ml_collections.ConfigDict(dict(rank=0.0, alpha=16.0, targets="all"))
  with pytest.raises(ValueError, match=r"lora.rank must be an int >= 1, got 0.0"):
    lora.from_config(section)
  section.rank = -2
  with pytest.raises(ValueError, match=r"lora.rank must be an int >= 1, got -2"):
    lora.from_config(section)


def test_shapes_axes_and_count():
  ad = lora.init_lora(CFG, LCFG, jax.random.key(0))
  wq, wo = ad["layers"]["wq"], ad["layers"]["wo"]
  n, d, h, hd = CFG.n_layers, CFG.d_model, CFG.n_heads, CFG.head_dim
  assert wq["a"].value.shape == (n, d, 4) and wq["b"].value.shape == (n, 4, h, hd)
  assert wq["a"].names == ("layers", "embed", "lora_rank")
  assert wo["a"].value.shape == (n, h, hd, 4) and wo["b"].names == ("layers", "lora_rank", "embed")
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(ad))
  assert not any(np.any(np.asarray(ab["b"].value)) for ab in ad["layers"].values())
  assert lora.num_params(CFG, LCFG) == sum(x.size for x in jax.tree.leaves(ad))
  lora.check_lora(ad, CFG, LCFG, "adapter")
  with pytest.raises(ValueError, match=r"adapter wq.a has shape .* \(lora.rank=8\)"):
    lora.check_lora(ad, CFG, lora.LoraConfig(rank=8), "adapter")
  with pytest.raises(ValueError, match="the adapter targets"):
    lora.check_lora(ad, CFG, lora.LoraConfig(rank=4, targets="mlp"), "adapter")


def test_fresh_adapter_leaves_the_model_unchanged_and_merge_is_w_plus_scaled_ab(params):
  tokens = jnp.arange(12, dtype=jnp.int32)[None] % CFG.vocab_size
  forward = jax.jit(lambda p: models.forward(p, tokens, cfg=CFG))  # one compile for all three
  fresh = lora.init_lora(CFG, LCFG, jax.random.key(3))
  base_logits = forward(params)
  np.testing.assert_array_equal(forward(lora.merge(params, fresh, LCFG)), base_logits)
  ad = _random_adapter()
  merged = lora.merge(params, ad, LCFG)
  plain, adp = param_tree.unbox(params), param_tree.unbox(ad)
  for t, k in lora.INPUT_AXES.items():
    w = np.asarray(plain["layers"][t], np.float64)
    a = np.asarray(adp["layers"][t]["a"], np.float64)
    b = np.asarray(adp["layers"][t]["b"], np.float64)
    n, r = a.shape[0], a.shape[-1]
    want = w + 2.0 * np.einsum("nir,nro->nio", a.reshape(n, -1, r),
                               b.reshape(n, r, -1)).reshape(w.shape)
    got = merged["layers"][t]
    assert isinstance(got, type(params["layers"][t])) and got.names == params["layers"][t].names
    np.testing.assert_allclose(np.asarray(got.value), want, rtol=1e-5, atol=1e-6)
  # Untargeted params are the base's own arrays.
  assert merged["embed"] is params["embed"]
  assert merged["layers"]["attn_norm"] is params["layers"]["attn_norm"]
  assert not np.allclose(forward(merged), base_logits)


def _adam_free_sgd():
  return optax.sgd(1.0)


def test_adapter_gradients_are_the_chain_rule_of_the_merged_weights_gradients(params):
  """dA = scale dW B^T and dB = scale A^T dW per layer, where dW is the gradient of the same
  loss w.r.t. the merged weight (computed by the full-parameter path)."""
  scfg = step.StepConfig(loss=losses.LossConfig(kl_coef=0.02))
  batch = {k: jnp.asarray(v) for k, v in two_sequence_rows(CFG.vocab_size, 4).items()}
  ad = _random_adapter()
  merged = lora.merge(params, ad, LCFG)
  # (jitted: the reference run op by op compiled each of its hundreds of ops apart)
  g_full = jax.jit(jax.grad(lambda p: step._micro_parts(p, batch, CFG, scfg)[0]))(merged)
  st = step.TrainState(step=jnp.zeros((), jnp.int32), params=ad,
                       opt_state=_adam_free_sgd().init(ad))
  new, m = jax.jit(lambda s, b, base: step.train_step(
      s, b, cfg=CFG, scfg=scfg, optimizer=_adam_free_sgd(), base=base, lora=LCFG))(
          st, batch, params)
  # With SGD(1), the adapter's gradient is (old - new) times the loss denominator.
  parts = jax.jit(lambda p: step._micro_parts(p, batch, CFG, scfg)[1])(merged)
  denom = float(jnp.maximum(parts.denominator, 1.0))
  dw_all, adp = param_tree.unbox(g_full)["layers"], param_tree.unbox(ad)["layers"]
  newp = param_tree.unbox(new.params)["layers"]
  for t in LCFG.targets:
    a, b = np.asarray(adp[t]["a"], np.float64), np.asarray(adp[t]["b"], np.float64)
    n, r = a.shape[0], a.shape[-1]
    dw = np.asarray(dw_all[t], np.float64).reshape(n, a[0].size // r, -1)
    a2, b2 = a.reshape(n, -1, r), b.reshape(n, r, -1)
    want_da = LCFG.scale * np.einsum("nio,nro->nir", dw, b2)
    want_db = LCFG.scale * np.einsum("nir,nio->nro", a2, dw)
    got_da = (a - np.asarray(newp[t]["a"])).reshape(want_da.shape) * denom
    got_db = (b - np.asarray(newp[t]["b"])).reshape(want_db.shape) * denom
    np.testing.assert_allclose(got_da, want_da, rtol=2e-3, atol=1e-6)
    np.testing.assert_allclose(got_db, want_db, rtol=2e-3, atol=1e-6)
  assert np.isfinite(m["loss"]) and m["grad_norm"] > 0


@pytest.mark.parametrize("scan_layers", [True, False])
def test_learner_with_adapter_micro_batches_sharding_and_score(params, scan_layers):
  cfg = CFG.replace(scan_layers=scan_layers)
  host = two_sequence_rows(cfg.vocab_size, 8)
  opt = optax.sgd(0.1)
  ad = _random_adapter()
  outs = {}
  for name, m, mesh in (("one", 1, sharding.make_mesh(devices=jax.devices()[:1])),
                        ("eight", 4, sharding.make_mesh(2, 2, 2))):
    scfg = step.StepConfig(loss=losses.LossConfig(kl_coef=0.02), micro_batches=m)
    learner = step.Learner(cfg, scfg, opt, mesh, lora=LCFG, base=params)
    st = learner.init(ad)
    lp0, _ = learner.score(st.params, host)
    new, metrics = learner.train_step(st, host)
    outs[name] = (jax.device_get(param_tree.unbox(new.params)), metrics, np.asarray(lp0),
                  jax.device_get(param_tree.unbox(learner.merged_params(new.params))))
    # The learner's base is frozen: the train state holds the adapter only.
    assert jax.tree.structure(param_tree.unbox(new.params)) == jax.tree.structure(
        param_tree.unbox(ad))
  (p1, m1, lp1, w1), (p8, m8, lp8, w8) = outs["one"], outs["eight"]
  for k in ("loss", "grad_norm", "kl_ref"):
    np.testing.assert_allclose(m1[k], m8[k], rtol=1e-4, atol=1e-7)
  for a, c in zip(jax.tree.leaves(p1), jax.tree.leaves(p8)):
    np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(lp1, lp8, atol=1e-5)
  # Scoring an adapter equals scoring its merged params without one.
  plain = step.Learner(cfg, step.StepConfig(), opt)
  want, _ = plain.score(lora.merge(params, ad, LCFG), host)
  np.testing.assert_allclose(lp1, np.asarray(want), atol=1e-6)
  for a, c in zip(jax.tree.leaves(w1), jax.tree.leaves(w8)):
    np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-6)
  base_plain = jax.device_get(param_tree.unbox(params))
  np.testing.assert_array_equal(w1["embed"], base_plain["embed"])


def test_learner_needs_both_lora_and_base(params):
  with pytest.raises(ValueError, match="pass both lora"):
    step.Learner(CFG, step.StepConfig(), optax.sgd(0.1), lora=LCFG)
  with pytest.raises(ValueError, match="pass both lora"):
    step.Learner(CFG, step.StepConfig(), optax.sgd(0.1), base=params)
  with pytest.raises(ValueError, match="Learner base"):
    step.Learner(models.get_config("tiny-llama"), step.StepConfig(), optax.sgd(0.1), lora=LCFG,
                 base=params)
