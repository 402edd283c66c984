"""Sharded execution on 8 fake CPU devices equals unsharded execution."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxagent import models, sharding


def test_mesh_config_resolves_and_validates():
  assert sharding.MeshConfig(2, -1, 2).resolve(8) == (2, 2, 2)
  with pytest.raises(ValueError, match="at most one axis"):
    sharding.MeshConfig(-1, -1, 1)
  with pytest.raises(ValueError, match="devices"):
    sharding.MeshConfig(3, 1, 1).resolve(8)
  # data=3 on 8 devices: the advice was to set an axis to -1, which 3 cannot make work.
  with pytest.raises(ValueError, match=r"= 3 but 8 devices are available; give sizes whose "
                     r"product is 8 \(3 does not divide 8, so no axis of -1 can absorb"):
    sharding.MeshConfig(3, 1, 1).resolve(8)
  with pytest.raises(ValueError, match=r"= 4 but 8 devices are available; set one axis to -1"):
    sharding.MeshConfig(2, 2, 1).resolve(8)
  with pytest.raises(ValueError, match=r"MeshConfig \(data=3, fsdp=-1, tensor=1\): 8 devices are "
                     r"not divisible by 3, the product of the sizes other than -1; give those "
                     r"sizes a product that divides 8"):
    sharding.MeshConfig(3, -1, 1).resolve(8)
  # More than the devices: the advice was "set one axis to -1 to absorb the rest", which cannot
  # help when the fixed sizes alone are too many.
  with pytest.raises(ValueError, match=r"data\*fsdp\*tensor = 16 but 8 devices are available; a "
                     r"mesh cannot be larger than the devices: give sizes whose product is 8"):
    sharding.make_mesh(2, 4, 2)
  # A size that is not an int (a string from a hand-written override, a float, a bool) is
  # named; a string used to fail as a bare TypeError, a float to build the mesh anyway.
  for bad in ("2", 2.0, True):
    with pytest.raises(ValueError, match=r"MeshConfig.fsdp must be an int .*got " + repr(bad)):
      sharding.MeshConfig(1, bad, 1)
  # No devices, or one device twice, is refused instead of giving an empty or invalid mesh.
  with pytest.raises(ValueError, match="non-empty list of distinct devices"):
    sharding.make_mesh(devices=[])
  with pytest.raises(ValueError, match="non-empty list of distinct devices"):
    sharding.make_mesh(devices=jax.devices()[:1] * 2)
  # Another mesh's `.devices` grid (2-D or 3-D) was a TypeError ("unhashable type").
  grid = sharding.make_mesh(2, 2, 2).devices
  assert sharding.make_mesh(8, 1, 1, devices=grid).shape == {"data": 8, "fsdp": 1, "tensor": 1}
  assert set(sharding.make_mesh(1, 2, 2, devices=grid[0]).devices.flat) == set(grid[0].flat)


def test_logical_rules_replicate_indivisible_dims():
  mesh = sharding.make_mesh(2, 2, 2)
  assert sharding.logical_to_spec(("embed", "kv_heads"), (64, 3), mesh) == P("fsdp", None)
  assert sharding.logical_to_spec(("embed", "kv_heads"), (64, 2), mesh) == P("fsdp", "tensor")
  assert sharding.logical_to_spec(("batch", None), (8, 5), mesh) == P(("data", "fsdp"), None)


def test_init_sharded_places_params_by_logical_axes():
  cfg = models.get_config("tiny-llama")
  mesh = sharding.make_mesh(2, 2, 2)
  params = sharding.init_sharded(lambda k: models.init_params(cfg, k), mesh,
                                 jax.random.key(0))
  wq = models.unbox(params)["layers"]["wq"]
  assert wq.sharding.spec == P(None, "fsdp", "tensor", None)
  ref = models.init_params(cfg, jax.random.key(0))
  # Same values as an unsharded init (up to float rounding of the fused scale).
  np.testing.assert_allclose(np.asarray(wq), np.asarray(models.unbox(ref)["layers"]["wq"]),
                             rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_sharded_forward_equals_unsharded(preset):
  cfg = models.get_config(preset)
  params = models.init_params(cfg, jax.random.key(1))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (8, 32))
  seg = np.repeat(np.array([[1] * 12 + [2] * 15 + [0] * 5]), 8, 0)
  ref = models.forward(params, tokens, cfg=cfg, segment_ids=seg)

  mesh = sharding.make_mesh(2, 2, 2)
  sp = sharding.shard(params, mesh)
  bs = sharding.batch_sharding(mesh)
  fwd = jax.jit(lambda p, t, s: models.forward(p, t, cfg=cfg, segment_ids=s),
                in_shardings=(sharding.shardings(sp, mesh), bs, bs))
  out = fwd(sp, jax.device_put(jnp.asarray(tokens), bs), jax.device_put(jnp.asarray(seg), bs))
  assert len(out.sharding.device_set) == 8
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)


def test_residual_stream_is_constrained_to_batch_sharding_only_under_a_mesh():
  from jaxagent.models.per_shard import constrain_batch
  from jaxagent.rl import step as step_lib
  x = jnp.ones((8, 4, 16))
  assert "sharding_constraint" not in str(jax.make_jaxpr(constrain_batch)(x))  # no mesh: no-op
  mesh = sharding.make_mesh(1, 8, 1)
  cfg = models.get_config("tiny-llama")
  learner = step_lib.Learner(cfg, step_lib.StepConfig(), step_lib.make_optimizer(1e-3), mesh)
  params = jax.eval_shape(lambda k: models.init_params(cfg, k), jax.random.key(0))
  state = jax.eval_shape(learner.init, params)
  batch = {k: jax.ShapeDtypeStruct((8, 32), jnp.int32 if k in ("tokens", "segment_ids",
                                                                "positions") else jnp.float32)
           for k in ("tokens", "segment_ids", "positions", "loss_mask", "old_logps",
                     "advantages")}
  text = learner.train_step_fn(state).lower(state, batch).as_text()
  # A constraint in the scanned layer body (forward and backward), rows over the 8 fsdp
  # devices (Shardy's text form; GSPMD's where Shardy is off).
  shardy = re.findall(r'sharding_constraint[^\n]*\[\{"fsdp"\}, \{\}, \{\}\]', text)
  gspmd = re.findall(r"@Sharding[^\n]*\n[^\n]*devices=\[8,1,1\]", text)
  assert len(shardy) + len(gspmd) >= 2


def test_engine_warns_when_slots_do_not_divide_the_batch_devices(caplog):
  from jaxagent.generate import Engine, EngineConfig
  cfg = models.get_config("tiny-qwen3", vocab_size=64)
  mesh = sharding.make_mesh(2, 2, 2)
  with caplog.at_level("WARNING", logger="jaxagent.generate.engine"):
    Engine(cfg, EngineConfig(slots=8, max_len=32), mesh=mesh)
    assert not caplog.records
    Engine(cfg, EngineConfig(slots=6, max_len=32), mesh=mesh)
  assert "slots=6 does not divide the 4 devices" in caplog.text


def test_replicated_fallbacks_are_logged_once_naming_the_arrays(caplog, monkeypatch):
  """A dim that its mesh axes do not divide is replicated (the rules' documented fallback)
  with a warning that names the axis, the arrays and the mesh sizes, once per process."""
  monkeypatch.setattr(sharding, "_LOGGED_FALLBACKS", set())
  cfg = models.get_config("tiny-llama", n_heads=6, n_kv_heads=2, vocab_size=510, ffn_dim=96)
  abstract = jax.eval_shape(lambda k: models.init_params(cfg, k), jax.random.key(0))
  mesh = sharding.make_mesh(1, 2, 4)
  with caplog.at_level("WARNING", logger="jaxagent.sharding"):
    sh = models.unbox(sharding.shardings(abstract, mesh))
  assert sh["layers"]["wq"].spec == P(None, "fsdp", None, None)  # 6 heads on tensor=4
  assert sh["layers"]["w_up"].spec == P(None, "fsdp", "tensor")  # 96 divides: split
  text = caplog.text
  assert "logical axis 'heads' has size 6, which the mesh's tensor=4" in text
  assert "(layers/wo, layers/wq)" in text and "tensor divides 6" in text
  assert "'kv_heads' has size 2" in text and "(layers/wk, layers/wv)" in text
  assert "'vocab' has size 510" in text and "(embed)" in text
  assert "'mlp'" not in text and len(caplog.records) == 3
  caplog.clear()
  with caplog.at_level("WARNING", logger="jaxagent.sharding"):
    sharding.shardings(abstract, mesh)
  assert not caplog.records


def test_engine_warns_when_kv_heads_do_not_divide_the_tensor_devices(caplog):
  from jaxagent.generate import Engine, EngineConfig
  cfg = models.get_config("tiny-qwen3", vocab_size=64)  # 2 KV heads
  with caplog.at_level("WARNING", logger="jaxagent.generate.engine"):
    Engine(cfg, EngineConfig(slots=8, max_len=32), mesh=sharding.make_mesh(1, 4, 2))
    assert not caplog.records
    eng = Engine(cfg, EngineConfig(slots=8, max_len=32), mesh=sharding.make_mesh(1, 2, 4))
  assert "2 KV heads do not divide the mesh's tensor=4 devices" in caplog.text
  want = jax.sharding.NamedSharding(eng.mesh, P(None, "fsdp", None, None, None))
  assert eng.abstract_decode_state().k.sharding.is_equivalent_to(want, 5)


def test_optimizer_statistics_of_another_rank_are_replicated(caplog, monkeypatch):
  """optax.adafactor keeps its factored second moments (a param's shape less one dim) in the
  param's box: names of another rank. They are replicated (with a warning) instead of
  failing the Learner's init with an IndexError (or a spec longer than the array)."""
  import optax
  from jaxagent.rl import step as step_lib
  monkeypatch.setattr(sharding, "_LOGGED_FALLBACKS", set())
  # d_model and ffn_dim of at least 128: adafactor factors the MLP weights.
  cfg = models.get_config("tiny-llama", d_model=128, ffn_dim=256)
  abstract = jax.eval_shape(lambda k: models.init_params(cfg, k), jax.random.key(0))
  opt = optax.adafactor(1e-3)
  mesh = sharding.make_mesh(2, 2, 2)
  with caplog.at_level("WARNING", logger="jaxagent.sharding"):
    state = sharding.shardings(jax.eval_shape(opt.init, abstract), mesh)
  v_row = models.unbox(jax.eval_shape(opt.init, abstract))[0].v_row["layers"]["w_gate"]
  assert v_row.ndim == 2  # [layers, ...] of a [layers, embed, mlp] param
  assert models.unbox(state)[0].v_row["layers"]["w_gate"].spec == P()
  assert "carry logical axis names of a different rank" in caplog.text
  learner = step_lib.Learner(cfg, step_lib.StepConfig(), opt, mesh)
  state = learner.init(models.init_params(cfg, jax.random.key(0)))
  assert models.unbox(state.params)["layers"]["wq"].sharding.spec == P(None, "fsdp", "tensor", None)


@pytest.mark.slow  # about 15 s of compiles on 2 cores, more when they are shared
def test_train_step_on_a_data_fsdp_tensor_mesh_equals_one_device():
  """One RL update (KL term, two micro-batches) on a 2 x 2 x 2 mesh gives the loss, gradients
  and log-probs of one device, and keeps the optimizer state sharded like the params (no
  statistic left replicated on every device)."""
  import optax
  from jaxagent.rl import losses, step as step_lib
  from tests.rl.step_test import two_sequence_rows
  cfg = models.get_config("tiny-qwen3", n_heads=4, n_kv_heads=2)
  params = models.init_params(cfg, jax.random.key(0))
  batch = two_sequence_rows(cfg.vocab_size)
  scfg = step_lib.StepConfig(loss=losses.LossConfig(kl_coef=0.1), micro_batches=2)
  out = []
  for mesh in (sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]),
               sharding.make_mesh(2, 2, 2)):
    # Plain SGD with rate 1: the params move by exactly the gradients (Adam would turn
    # rounding-level differences of near-zero gradients into whole steps).
    learner = step_lib.Learner(cfg, scfg, optax.chain(optax.trace(0.9), optax.sgd(1.0)), mesh)
    state, metrics = learner.train_step(learner.init(params), batch)
    out.append((state, metrics, np.asarray(learner.score(state.params, batch)[0])))
  (ref, ref_m, ref_lp), (state, m, lp) = out
  assert m["loss"] == pytest.approx(ref_m["loss"], rel=1e-6, abs=1e-6)  # a loss of ~15: ulp 1e-6
  assert m["grad_norm"] == pytest.approx(ref_m["grad_norm"], rel=1e-5)
  for a, c in zip(jax.tree.leaves(ref.params), jax.tree.leaves(state.params)):
    np.testing.assert_allclose(np.asarray(c), np.asarray(a), atol=2e-6, rtol=1e-5)
  np.testing.assert_allclose(lp, ref_lp, atol=1e-4)
  p = models.unbox(state.params)
  assert p["layers"]["wq"].sharding.spec == P(None, "fsdp", "tensor", None)
  trace = models.unbox(state.opt_state[0].trace)
  for a, c in zip(jax.tree.leaves(p), jax.tree.leaves(trace)):
    assert c.sharding == a.sharding


def test_a_mesh_without_the_library_axes_is_named():
  """A user's own ("fsdp", "tensor") mesh reached the learner's batch layout and failed inside
  JAX ("Resource axis: data of P(('data', 'fsdp'), None) is not found in mesh"; `Learner`'s
  `put_batch`: KeyError 'data'). It is named, with the axes it lacks and the ones needed."""
  from jax.sharding import Mesh
  from jaxagent.rl import step as step_lib
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tensor"))
  match = (r"the mesh has axes \('fsdp', 'tensor'\) \(fsdp=2, tensor=2\) and lacks \('data',\); "
           r"jaxagent needs a mesh with the axes \('data', 'fsdp', 'tensor'\)")
  with pytest.raises(ValueError, match="batch_sharding: " + match):
    sharding.batch_sharding(mesh)
  cfg = models.get_config("tiny-llama")
  with pytest.raises(ValueError, match="Learner: " + match):
    step_lib.Learner(cfg, step_lib.StepConfig(), step_lib.make_optimizer(1e-3), mesh)
  # Any order of the three axes, and extra ones, are meshes the library can use.
  ok = Mesh(np.array(jax.devices()[:2]).reshape(1, 2, 1, 1), ("tensor", "data", "fsdp", "x"))
  assert sharding.batch_sharding(ok).spec == P(("data", "fsdp"), None)
  step_lib.Learner(cfg, step_lib.StepConfig(), step_lib.make_optimizer(1e-3), ok)


def test_batch_sharding_takes_an_array_rank_of_at_least_one():
  # 0 or -1 gave P(('data', 'fsdp')): rows for a scalar, refused later by device_put or jit.
  mesh = sharding.make_mesh(1, 2, 1, devices=jax.devices()[:2])
  assert sharding.batch_sharding(mesh, 1).spec == P(("data", "fsdp"))
  assert sharding.batch_sharding(mesh, np.int64(3)).spec == P(("data", "fsdp"), None, None)
  for ndim in (0, -1, 2.0, True):
    with pytest.raises(ValueError, match=r"batch_spec: ndim must be an int >= 1 .*replicated"):
      sharding.batch_sharding(mesh, ndim)


def test_a_misspelt_mesh_axis_is_named_not_replicated():
  """A mesh with a misspelt axis ("tensors"), or rules naming an axis the mesh lacks, gave
  params that were silently whole on every device over that axis (wq: P(None, 'fsdp', None,
  None) on a 2x2x2 mesh); `shardings`, `init_sharded` and `logical_to_spec` name the axis."""
  from jax.sharding import Mesh
  bad = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "tensors"))
  cfg = models.get_config("tiny-llama")
  abstract = jax.eval_shape(lambda k: models.init_params(cfg, k), jax.random.key(0))
  match = (r"the rules map logical axis '\w+' to mesh axes \('tensor',\), but the mesh has "
           r"axes \('data', 'fsdp', 'tensors'\) \(lacks \('tensor',\)\)")
  with pytest.raises(ValueError, match=match):
    sharding.shardings(abstract, bad)
  rules = tuple((k, "tensors" if v == "tensor" else v) for k, v in sharding.RULES)
  with pytest.raises(ValueError, match=r"logical axis 'heads' to mesh axes \('tensors',\)"):
    sharding.logical_to_spec(("embed", "heads"), (64, 4), sharding.make_mesh(1, 2, 4), rules)
  # Names the rules do not map, and rules over the mesh's own axes, are as before.
  assert sharding.logical_to_spec(("embd", "heads"), (64, 4),
                                  sharding.make_mesh(1, 2, 4)) == P(None, "tensor")
