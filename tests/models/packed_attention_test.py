"""The packed-segment attention kernels (Pallas, interpret mode on CPU) against dense-mask
attention: values and q / k / v gradients, grouped-query heads, unaligned lengths, the
decoder wired to them, and remat keeping their residuals."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent import models
from jaxagent.models import decoder, packed_attention
from jaxagent.models.packed_attention import packed_attention as attend

# Small blocks (and unequal ones per kernel) so a short row spans many blocks of each kernel.
SMALL = dict(fwd_q=32, fwd_k=16, dq_q=16, dq_k=32, dkv_q=32, dkv_k=16)


def dense(q, k, v, runs):
  """float32 softmax attention, causal within equal `runs` entries (a dense mask)."""
  t, g = q.shape[1], q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
  mask = (runs[:, :, None] == runs[:, None, :]) & jnp.tril(jnp.ones((t, t), bool))[None]
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(mask[:, None], s, -1e30), -1), v)


def _qkv(b, t, h, kv, hd, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  return (jax.random.normal(ks[0], (b, t, h, hd)), jax.random.normal(ks[1], (b, t, kv, hd)),
          jax.random.normal(ks[2], (b, t, kv, hd)), jax.random.normal(ks[3], (b, t, h, hd)))


def _segments(b, t, seed):
  """Random packed rows: segments of 1-90 tokens, then padding (id 0) on some rows."""
  rng = np.random.default_rng(seed)
  seg = np.zeros((b, t), np.int32)
  for r in range(b):
    pos, sid = 0, 1
    end = t - int(rng.integers(0, 40)) * (r % 2)
    while pos < end:
      n = min(int(rng.integers(1, 91)), end - pos)
      seg[r, pos:pos + n] = sid
      pos, sid = pos + n, sid + 1
  return jnp.asarray(seg)


@pytest.mark.parametrize("t,h,kv,hd", [
    pytest.param(192, 4, 2, 16, marks=pytest.mark.slow),
    pytest.param(200, 6, 2, 32, marks=pytest.mark.slow), (100, 3, 3, 16)])
def test_values_and_grads_equal_dense_mask(t, h, kv, hd):
  b = 3
  q, k, v, w = _qkv(b, t, h, kv, hd, seed=t)
  seg = _segments(b, t, seed=t)
  out = attend(q, k, v, seg, **SMALL)
  np.testing.assert_allclose(np.asarray(out), np.asarray(dense(q, k, v, seg)), atol=2e-5)
  got = jax.grad(lambda *x: (attend(*x, seg, **SMALL) * w).sum(), (0, 1, 2))(q, k, v)
  want = jax.grad(lambda *x: (dense(*x, seg) * w).sum(), (0, 1, 2))(q, k, v)
  for name, a, e in zip("qkv", got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=5e-5, err_msg=f"d{name}")


def _dense_windowed(q, k, v, runs, window, scale):
  t, g = q.shape[1], q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
  idx = jnp.arange(t)
  near = (idx[:, None] - idx[None, :] < window) & (idx[:, None] >= idx[None, :])
  mask = (runs[:, :, None] == runs[:, None, :]) & near[None]
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(mask[:, None], s, -1e30), -1), v)


@pytest.mark.parametrize("window", [1, 7, 40])
def test_a_sliding_window_and_a_scale_equal_dense_mask(window):
  """The window (a traced scalar: the decoder's scanned layers pass one) with the block
  skipping it allows, and another scale, in values and q / k / v gradients; 40 spans several
  blocks of every kernel, 7 and 1 skip most."""
  b, t, h, kv, hd = 2, 120, 4, 2, 16
  q, k, v, w = _qkv(b, t, h, kv, hd, seed=window)
  seg = _segments(b, t, seed=window)
  scale = 24 ** -0.5
  run = jax.jit(lambda q, k, v, win: attend(q, k, v, seg, win, scale=scale, **SMALL))
  win = jnp.int32(window)
  out = run(q, k, v, win)
  want = _dense_windowed(q, k, v, seg, window, scale)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5)
  got = jax.grad(lambda *x: (run(*x, win) * w).sum(), (0, 1, 2))(q, k, v)
  ref = jax.grad(lambda *x: (_dense_windowed(*x, seg, window, scale) * w).sum(),
                 (0, 1, 2))(q, k, v)
  for name, a, e in zip("qkv", got, ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=5e-5, err_msg=f"d{name}")


def test_one_segment_rows_are_plain_causal_attention():
  q, k, v, _ = _qkv(2, 128, 4, 1, 16)
  ones = jnp.ones((2, 128), jnp.int32)
  ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(np.asarray(attend(q, k, v, ones)), np.asarray(ref), atol=2e-5)


def test_a_repeated_segment_id_starts_a_new_run():
  # Ids 1, 2, 1: the second run of 1 does not see the first (segments are contiguous runs).
  q, k, v, _ = _qkv(1, 96, 2, 1, 16)
  seg = jnp.asarray(np.repeat([1, 2, 1], 32)[None].astype(np.int32))
  runs = jnp.asarray(np.repeat([1, 2, 3], 32)[None].astype(np.int32))
  np.testing.assert_allclose(np.asarray(attend(q, k, v, seg, **SMALL)),
                             np.asarray(dense(q, k, v, runs)), atol=2e-5)


def test_xla_path_also_starts_a_new_run_at_a_repeated_segment_id():
  # Ids 1, 2, 1 in the decoder: the XLA path masked by id equality, so its third run attended
  # to the first while the Pallas kernels (above) and the restarting positions treat it as a
  # trajectory of its own, which must equal running it alone.
  cfg = models.get_config("tiny-qwen3", dtype="float32").replace(attention_impl="xla")
  params = models.init_params(cfg, jax.random.key(0))
  toks = jax.random.randint(jax.random.key(1), (1, 48), 0, cfg.vocab_size)
  seg = jnp.asarray(np.repeat([1, 2, 1], 16)[None].astype(np.int32))
  out = decoder.forward(params, toks, cfg=cfg, segment_ids=seg)
  alone = decoder.forward(params, toks[:, 32:], cfg=cfg)
  np.testing.assert_allclose(np.asarray(out[:, 32:]), np.asarray(alone), atol=2e-5)
  q, k, v, _ = _qkv(1, 48, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
  np.testing.assert_allclose(np.asarray(decoder.segment_attention(q, k, v, seg, cfg)),
                             np.asarray(attend(q, k, v, seg, **SMALL)), atol=2e-5)


def test_bfloat16_error_is_that_of_rounding():
  q, k, v, _ = _qkv(2, 160, 4, 2, 32)
  seg = _segments(2, 160, seed=3)
  ref = dense(q, k, v, seg)
  bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  out = attend(*bf, seg, **SMALL)
  assert out.dtype == jnp.bfloat16
  err = float(jnp.abs(out.astype(jnp.float32) - ref).max())
  assert err < 0.03, err


def test_decoder_forward_and_grads_equal_xla_attention():
  base = models.get_config("tiny-qwen3", dtype="float32")
  cfgs = {impl: base.replace(attention_impl=impl) for impl in ("xla", "pallas")}
  params = models.init_params(cfgs["xla"], jax.random.key(0))
  toks = jax.random.randint(jax.random.key(1), (2, 64), 0, base.vocab_size)
  seg = _segments(2, 64, seed=5)

  def loss(p, cfg):
    return (decoder.forward(p, toks, cfg=cfg, segment_ids=seg) ** 2).mean()

  vals = {i: jax.value_and_grad(loss)(params, c) for i, c in cfgs.items()}
  np.testing.assert_allclose(float(vals["pallas"][0]), float(vals["xla"][0]), rtol=1e-5)
  for a, e in zip(jax.tree.leaves(vals["pallas"][1]), jax.tree.leaves(vals["xla"][1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e),
                               atol=1e-5 * float(jnp.abs(e).max()) + 1e-7)


def test_remat_dots_attention_keeps_the_kernel_residuals(capsys):
  cfg = models.get_config("tiny-qwen3").replace(attention_impl="pallas", remat="dots_attention")
  q, k, v, _ = _qkv(1, 64, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
  seg = jnp.ones((1, 64), jnp.int32)
  layer = decoder._remat(lambda q, k, v: jnp.sin(decoder.segment_attention(q, k, v, seg, cfg)),
                         cfg)
  jax.ad_checkpoint.print_saved_residuals(lambda *x: layer(*x).sum(), q, k, v)
  names = capsys.readouterr().out
  for name in packed_attention.RESIDUAL_NAMES:
    assert name in names, names


def test_launch_settings_are_checked(monkeypatch):
  assert packed_attention.tuning(fwd_q=32)["fwd_q"] == 32
  monkeypatch.setenv("JAXAGENT_PACKED_ATTENTION", "dq_q=128, dkv_warps=8")
  t = packed_attention.tuning()
  assert t["dq_q"] == 128 and t["dkv_warps"] == 8
  monkeypatch.setenv("JAXAGENT_PACKED_ATTENTION", "dq=128")
  with pytest.raises(ValueError, match="JAXAGENT_PACKED_ATTENTION"):
    packed_attention.tuning()
  monkeypatch.delenv("JAXAGENT_PACKED_ATTENTION")
  with pytest.raises(ValueError, match="power of two"):
    packed_attention.tuning(fwd_k=48)
  with pytest.raises(TypeError, match="unknown launch settings"):
    packed_attention.tuning(block=64)


def test_bad_shapes_are_rejected():
  q, k, v, _ = _qkv(1, 32, 3, 2, 16)
  seg = jnp.ones((1, 32), jnp.int32)
  with pytest.raises(ValueError, match="not a multiple"):
    attend(q, k, v, seg)
  q, k, v, _ = _qkv(1, 32, 4, 2, 16)
  with pytest.raises(ValueError, match="segment_ids"):
    attend(q, k, v, seg[:, :16])
  with pytest.raises(ValueError, match="expected q"):
    attend(q[0], k, v, seg)
  with pytest.raises(ValueError, match="attention_impl"):
    models.get_config("tiny-qwen3").replace(attention_impl="flash")
  q, k, v, _ = _qkv(1, 32, 4, 2, 24)
  with pytest.raises(ValueError, match="power of two"):  # checked before any GPU lowering
    attend(q, k, v, seg, interpret=False)


def test_auto_attention_path():
  cfg = models.get_config("qwen2.5-1.5b")
  assert cfg.attention_impl == "auto"
  assert decoder.attention_path(cfg, "gpu") == "pallas"
  assert decoder.attention_path(cfg, "tpu") == decoder.attention_path(cfg, "cpu") == "xla"
  bf16 = cfg.replace(dtype="bfloat16")
  assert decoder.attention_path(bf16.replace(head_dim=80), "gpu") == "cudnn"
  assert decoder.attention_path(bf16.replace(head_dim=256), "gpu") == "cudnn"
  # cuDNN's fused attention refuses float32 inputs ("Unsupported dtype for inputs."): a
  # float32 model of such a head size took it and failed on GPUs (seen on an H200).
  assert decoder.attention_path(cfg.replace(head_dim=256), "gpu") == "xla"
  assert decoder.attention_path(cfg.replace(head_dim=64), "gpu") == "pallas"
  assert decoder.attention_path(cfg.replace(attention_impl="cudnn"), "gpu") == "cudnn"
  # An explicit "pallas" on a TPU ran the Triton kernels in interpret mode, with no error (the
  # norm / RoPE and vocabulary kernel paths refuse it there).
  pallas = cfg.replace(attention_impl="pallas")
  assert decoder.attention_path(pallas, "gpu") == decoder.attention_path(pallas, "cpu") == "pallas"
  with pytest.raises(ValueError, match="attention_impl='pallas' runs Triton kernels .* on TPUs"):
    decoder.attention_path(pallas, "tpu")


@pytest.mark.parametrize("data,fsdp,tensor", [
    pytest.param(4, 1, 2, marks=pytest.mark.slow), pytest.param(1, 8, 1, marks=pytest.mark.slow),
    (2, 2, 2)])
def test_sharded_rows_and_heads_run_per_shard(data, fsdp, tensor):
  # Under a mesh the kernels run per shard (shard_map): the same values and gradients as one
  # device, and no all-gather of q / k / v onto every device.
  from jaxagent import sharding as shd
  cfg = models.get_config("tiny-qwen3").replace(attention_impl="pallas")
  q, k, v, w = _qkv(8, 64, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
  seg = _segments(8, 64, seed=7)

  def loss(q, k, v, seg):
    return (decoder.segment_attention(q, k, v, seg, cfg) * w).sum()

  mesh = shd.make_mesh(data=data, fsdp=fsdp, tensor=tensor)
  rows4, rows2 = shd.batch_sharding(mesh, 4), shd.batch_sharding(mesh, 2)
  jitted = jax.jit(shd.on_mesh(jax.value_and_grad(loss, (0, 1, 2)), mesh),
                   in_shardings=(rows4, rows4, rows4, rows2))
  (val, grads) = jitted(q, k, v, seg)
  want_val, want_grads = jax.value_and_grad(loss, (0, 1, 2))(q, k, v, seg)
  np.testing.assert_allclose(float(val), float(want_val), rtol=1e-5)
  for a, e in zip(grads, want_grads):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=1e-5)
  assert "all-gather" not in jitted.lower(q, k, v, seg).compile().as_text()


def test_segment_positions_of_numpy_int64_ids_warn_nothing():
  """NumPy's default int64 segment ids (an eager call, x64 off) give the positions without a
  dtype-truncation warning per call."""
  import warnings
  seg = np.array([[1, 1, 2, 2, 2, 0], [3, 3, 3, 1, 1, 1]])  # int64
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    pos = decoder.segment_positions(seg)
  np.testing.assert_array_equal(np.asarray(pos), [[0, 1, 0, 1, 2, 0], [0, 1, 2, 0, 1, 2]])
  # One row must still be [1, T]: a 1-D one failed with "not enough values to unpack".
  with pytest.raises(ValueError, match=r"segment ids must be \[B, T\] .*got shape \(4,\)"):
    decoder.segment_positions([1, 1, 2, 2])
