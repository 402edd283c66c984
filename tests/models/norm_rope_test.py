"""decoder.norm_rope (Qwen3's q / k norms + RoPE with a written-out backward pass): the same
forward values as rms_norm then apply_rope, and their gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent import models
from jaxagent.models import decoder


def _inputs(dtype, shape=(2, 9, 4, 32), seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  x = (3.0 * jax.random.normal(k[0], shape)).astype(dtype)
  w = (1.0 + 0.2 * jax.random.normal(k[1], shape[-1:])).astype(dtype)
  g = jax.random.normal(k[2], shape).astype(dtype)
  positions = jnp.stack([jnp.arange(shape[1]) + 5, jnp.arange(shape[1])[::-1]])[:shape[0]]
  return x, w, g, positions


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 2e-6), (jnp.bfloat16, 0.04)])
def test_values_and_gradients_equal_norm_then_rope(dtype, atol):
  x, w, g, positions = _inputs(dtype)
  inv_freq = decoder.rope_inv_freq(models.get_config("tiny-qwen3").replace(head_dim=32))

  @jax.jit
  def reference(x, w):
    return decoder.apply_rope(decoder.rms_norm(x, w, 1e-6), positions, inv_freq)

  @jax.jit
  def fused(x, w):
    cos, sin = decoder.rope_tables(positions, inv_freq)
    return decoder.norm_rope(x, w, cos, sin, 1e-6)

  y_ref, vjp_ref = jax.vjp(reference, x, w)
  y, vjp = jax.vjp(fused, x, w)
  assert y.dtype == dtype
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
  for got, want in zip(vjp(g), vjp_ref(g)):
    assert got.dtype == want.dtype == dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    # bf16: the reference rounds the cotangent of the normed heads to bf16, this one does not.
    np.testing.assert_allclose(got, want, atol=atol * max(1.0, np.abs(want).max()), rtol=0)


def test_gradient_matches_finite_differences():
  x, w, g, positions = _inputs(jnp.float32, shape=(1, 5, 2, 8), seed=1)
  inv_freq = decoder.rope_inv_freq(models.get_config("tiny-qwen3").replace(head_dim=8))
  cos, sin = decoder.rope_tables(positions, inv_freq)
  loss = lambda x, w: jnp.sum(decoder.norm_rope(x, w, cos, sin, 1e-6) * g)
  dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
  rng = np.random.default_rng(0)
  eps = 1e-2
  for _ in range(5):
    u = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    v = jnp.asarray(rng.standard_normal(w.shape), jnp.float32)
    numeric = (loss(x + eps * u, w + eps * v) - loss(x - eps * u, w - eps * v)) / (2 * eps)
    analytic = jnp.sum(dx * u) + jnp.sum(dw * v)
    np.testing.assert_allclose(float(numeric), float(analytic), rtol=2e-3, atol=2e-3)


def _tables(shape, hd):
  positions = (jnp.arange(shape[0] * shape[1]).reshape(shape[:2]) * 7) % 50
  inv_freq = decoder.rope_inv_freq(models.get_config("tiny-qwen3").replace(head_dim=hd))
  return decoder.rope_tables(positions, inv_freq)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(2, 9, 4, 32), (1, 3, 8, 16)])
def test_kernels_equal_the_xla_path(shape, dtype):
  # Token counts that are not a whole number of blocks (padded), several heads a block.
  x, w, g, _ = _inputs(dtype, shape)
  cos, sin = _tables(shape, shape[-1])
  fwd = jax.jit(lambda impl, x, w, g: jax.vjp(
      lambda x, w: decoder.norm_rope(x, w, cos, sin, 1e-6, impl), x, w)[1](g),
      static_argnums=0)
  out = {impl: decoder.norm_rope(x, w, cos, sin, 1e-6, impl) for impl in ("xla", "pallas")}
  grads = {impl: fwd(impl, x, w, g) for impl in ("xla", "pallas")}
  tol = 2e-6 if dtype == jnp.float32 else 0.02
  f32 = lambda a: np.asarray(a, np.float32)
  assert out["pallas"].dtype == dtype
  np.testing.assert_allclose(f32(out["pallas"]), f32(out["xla"]), atol=tol * 4, rtol=0)
  for got, want in zip(grads["pallas"], grads["xla"]):
    assert got.dtype == want.dtype
    np.testing.assert_allclose(f32(got), f32(want), atol=tol * max(1.0, np.abs(f32(want)).max()),
                               rtol=0)


def test_kernels_run_per_shard_without_gathering_the_heads():
  from jaxagent import sharding as shd
  x, w, g, _ = _inputs(jnp.float32, (8, 5, 4, 32), seed=3)
  cos, sin = _tables(x.shape, 32)

  def loss(x, w):
    return jnp.sum(decoder.norm_rope(x, w, cos, sin, 1e-6, "pallas") * g)

  mesh = shd.make_mesh(data=2, fsdp=4, tensor=1)
  jitted = jax.jit(shd.on_mesh(jax.value_and_grad(loss, (0, 1)), mesh),
                   in_shardings=(shd.batch_sharding(mesh, 4), None))
  val, (dx, dw) = jitted(x, w)
  want_val, (want_dx, want_dw) = jax.value_and_grad(loss, (0, 1))(x, w)
  np.testing.assert_allclose(float(val), float(want_val), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(dx), np.asarray(want_dx), atol=1e-5)
  np.testing.assert_allclose(np.asarray(dw), np.asarray(want_dw), rtol=1e-5, atol=1e-5)
  assert "all-gather" not in jitted.lower(x, w).compile().as_text()


def test_path_selection():
  cfg = models.get_config("tiny-qwen3")
  assert decoder.norm_rope_path(cfg, "cpu") == "xla"
  assert decoder.norm_rope_path(cfg, "gpu") == "pallas"
  assert decoder.norm_rope_path(cfg.replace(n_heads=6, n_kv_heads=2), "gpu") == "xla"
  assert decoder.norm_rope_path(cfg.replace(norm_rope_impl="pallas"), "cpu") == "pallas"
  with pytest.raises(ValueError, match="powers of two"):
    decoder.norm_rope_path(cfg.replace(n_heads=6, n_kv_heads=2, norm_rope_impl="pallas"), "gpu")
  with pytest.raises(ValueError, match="TPUs"):
    decoder.norm_rope_path(cfg.replace(norm_rope_impl="pallas"), "tpu")
  with pytest.raises(ValueError, match="norm_rope_impl must be"):
    cfg.replace(norm_rope_impl="triton")


def test_decoder_forward_and_grads_equal_with_either_path():
  base = models.get_config("tiny-qwen3", dtype="float32", remat="dots_attention", n_layers=1)
  cfgs = {impl: base.replace(norm_rope_impl=impl) for impl in ("xla", "pallas")}
  params = models.init_params(base, jax.random.key(0))
  toks = jax.random.randint(jax.random.key(1), (2, 24), 0, base.vocab_size)

  def loss(p, cfg):
    return (decoder.forward(p, toks, cfg=cfg) ** 2).mean()

  vals = {i: jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, c)
          for i, c in cfgs.items()}
  np.testing.assert_allclose(float(vals["pallas"][0]), float(vals["xla"][0]), rtol=1e-5)
  for a, e in zip(jax.tree.leaves(vals["pallas"][1]), jax.tree.leaves(vals["xla"][1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e),
                               atol=1e-5 * float(jnp.abs(e).max()) + 1e-7)
