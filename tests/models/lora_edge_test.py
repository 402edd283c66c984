"""LoRA edge paths: gathered weights over fsdp, skipped non-finite steps, mixed precision and
bfloat16 bases, target subsets, q/k/v biases, untied embeddings, and the sampler's merged
weights against the learner's."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxagent import models, sharding
from jaxagent.models import lora, param_tree
from jaxagent.rl import losses, step
from tests.rl.step_test import two_sequence_rows

LCFG = lora.LoraConfig(rank=4, alpha=8.0)


def _random_adapter(cfg, lcfg=LCFG, seed=1):
  """An adapter with both A and B random (a fresh one has B = 0)."""
  fresh = lora.init_lora(cfg, lcfg, jax.random.key(seed))
  keys = iter(jax.random.split(jax.random.key(seed + 100), 64))
  return jax.tree.map(lambda x: 0.05 * jax.random.normal(next(keys), x.shape), fresh)


def _plain(tree):
  return jax.device_get(param_tree.unbox(tree))


@pytest.mark.slow  # four 8-device compiles and two steps: 20-45 s on 2 cores
@pytest.mark.parametrize("scan_layers", [True, False])
def test_gathered_weights_with_an_adapter_same_update_fewer_all_gathers(scan_layers):
  """fsdp over 8 devices, 4 micro-batches: `gather_weights` with an adapter gives the update of
  the default path and gathers the weights once per step (the merge used to run on the
  adapter's fsdp shards and all-gather each merged weight again in every micro-batch)."""
  from benchmarks.common import grpo_batch
  from jaxagent.plan import hlo

  cfg = models.get_config("tiny-qwen3", param_dtype="float32", dtype="bfloat16",
                          scan_layers=scan_layers)
  mesh = sharding.make_mesh(fsdp=8)
  batch = grpo_batch(cfg, 32, 8, 24)
  params = models.init_params(cfg, jax.random.key(0))
  ad = _random_adapter(cfg)
  out, gathered = {}, {}
  for g in (False, True):
    scfg = step.StepConfig(micro_batches=4, entropy=False, gather_weights=g)
    learner = step.Learner(cfg, scfg, step.make_optimizer(1e-3), mesh, lora=LCFG, base=params)
    st = learner.init(ad)
    text = learner.train_step_fn(st).lower(st, learner.put_batch(batch),
                                           learner.base).compile().as_text()
    stats = hlo.analyze(text, tuple(mesh.shape.values()), tuple(mesh.axis_names))
    gathered[g] = stats.collectives["all-gather"].bytes
    new, _ = learner.train_step(st, batch)
    out[g] = _plain(new.params)
  for a, b in zip(jax.tree.leaves(out[False]), jax.tree.leaves(out[True])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  # (The unrolled loop's default path gathers less to begin with: 1.38 MB here, 3.15 MB scanned.)
  assert gathered[True] < (0.6 if scan_layers else 0.8) * gathered[False], gathered
  # No more all-gathered bytes than full fine-tuning's step (the adapter's own are a few KB).
  for g in (False, True):
    scfg = step.StepConfig(micro_batches=4, entropy=False, gather_weights=g)
    learner = step.Learner(cfg, scfg, step.make_optimizer(1e-3), mesh)
    st = jax.eval_shape(learner.init, params)
    text = learner.train_step_fn(st).lower(st, learner.put_batch(batch)).compile().as_text()
    full = hlo.analyze(text, tuple(mesh.shape.values()), tuple(mesh.axis_names))
    assert gathered[g] <= 1.05 * full.collectives["all-gather"].bytes, (g, gathered, full)


def test_nonfinite_skip_keeps_the_adapter_and_its_optimizer_state():
  cfg = models.get_config("tiny-qwen3")
  params = models.init_params(cfg, jax.random.key(0), std=0.1)
  scfg = step.StepConfig(loss=losses.LossConfig(kl_coef=0.02), nonfinite="skip")
  learner = step.Learner(cfg, scfg, optax.adam(1e-2), lora=LCFG, base=params)
  st = learner.init(_random_adapter(cfg))
  host = two_sequence_rows(cfg.vocab_size, 4)
  st, m = learner.train_step(st, host)  # a finite step first: Adam's moments are non-zero
  assert m["nonfinite"] == 0.0
  before = _plain((st.params, st.opt_state))
  bad = dict(host, advantages=np.where(host["loss_mask"] > 0, np.nan, 0.0).astype(np.float32))
  st, m = learner.train_step(st, bad)
  assert m["nonfinite"] == 1.0 and int(st.step) == 2
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(_plain((st.params, st.opt_state)))):
    np.testing.assert_array_equal(a, b)
  # The base is untouched and a finite step after the skip trains again.
  st, m = learner.train_step(st, host)
  assert m["nonfinite"] == 0.0 and np.isfinite(m["loss"])


def test_sampler_weights_are_the_merged_compute_copy_and_score_like_the_learner():
  """`merged_params(adapter, dtype)` (what the sampler reads) is bitwise the compute copy of
  `merge(base, adapter)`, with the base's shardings; decoding from it (float32) gives the
  log-probs `Learner.score` gives the same tokens with the adapter."""
  from jaxagent.generate import scheduler

  for dt in ("bfloat16", "float32"):
    cfg = models.get_config("tiny-qwen3", param_dtype="float32", dtype=dt)
    params = models.init_params(cfg, jax.random.key(0), std=0.1)
    ad = _random_adapter(cfg)
    learner = step.Learner(cfg, step.StepConfig(), optax.sgd(0.1), lora=LCFG, base=params)
    adapter = learner.init(ad).params
    got = learner.merged_params(adapter, cfg.dtype)
    want = param_tree.compute_copy(lora.merge(params, ad, LCFG), cfg)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(_plain(got)),
                            jax.tree.leaves(_plain(want))):
      assert a.dtype == b.dtype and np.array_equal(a, b), jax.tree_util.keystr(path)
    assert any(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(_plain(got))) == (
        dt == "bfloat16")
  # float32: the engine's sampled log-probs are the learner's with the adapter.
  prompt = [5, 17, 33, 2, 9]
  done = scheduler.generate(got, cfg, [prompt], max_new_tokens=12, temperature=1.0, seed=3,
                            eos_ids=[])[0]
  toks = prompt + done.tokens
  n = len(toks)
  lp, _ = learner.score(adapter, dict(tokens=np.array([toks], np.int32),
                                      segment_ids=np.ones((1, n), np.int32),
                                      positions=np.arange(n, dtype=np.int32)[None]))
  gap = np.abs(np.asarray(lp)[0, len(prompt):] - np.asarray(done.logprobs))
  assert gap.max() <= 1e-5, gap


def test_merged_params_on_a_mesh_keep_the_base_shardings_and_adapter_placement():
  """On data=fsdp=tensor=2: the adapter's A and B are split like their weight's axes (never
  on the rank), and the merged params come out with the base's shardings."""
  cfg = models.get_config("tiny-qwen3", param_dtype="float32", dtype="bfloat16")
  params = models.init_params(cfg, jax.random.key(0), std=0.1)
  mesh = sharding.make_mesh(2, 2, 2)
  learner = step.Learner(cfg, step.StepConfig(), optax.adam(1e-3), mesh, lora=LCFG, base=params)
  st = learner.init(_random_adapter(cfg))
  ad = param_tree.unbox(st.params)["layers"]
  specs = {t: (ab["a"].sharding.spec, ab["b"].sharding.spec) for t, ab in ad.items()}
  assert specs["wq"] == (P(None, "fsdp", None), P(None, None, "tensor", None)), specs
  assert specs["wo"] == (P(None, "tensor", None, None), P(None, None, "fsdp")), specs
  assert specs["w_down"] == (P(None, "tensor", None), P(None, None, "fsdp")), specs
  # Adam's moments are placed like the adapter.
  mu = param_tree.unbox(st.opt_state[0].mu)["layers"]
  assert mu["wq"]["a"].sharding.spec == specs["wq"][0]
  merged = param_tree.unbox(learner.merged_params(st.params, cfg.dtype))
  base = param_tree.unbox(learner.base)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(merged), jax.tree.leaves(base)):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim), jax.tree_util.keystr(path)


@pytest.mark.parametrize("name,overrides,targets,micro_batches,rtol", [
    # float32 masters, bfloat16 compute: the merge casts to bfloat16 as the full path's copy.
    ("tiny-qwen3", dict(param_dtype="float32", dtype="bfloat16"), "all", 1, 1e-5),
    # q/k/v biases, untied lm_head, the unrolled layer loop, micro-batches, a target subset.
    ("tiny-qwen2", dict(tie_embeddings=False, scan_layers=False), "wq,v_proj,w_down", 2, 1e-5),
    # A bfloat16 base: the full path's update is itself rounded to bfloat16.
    pytest.param("tiny-qwen3", dict(param_dtype="bfloat16", dtype="bfloat16"), "all", 1, 2e-2,
                 marks=pytest.mark.slow),
])
def test_adapter_update_is_the_chain_rule_of_the_full_update(name, overrides, targets,
                                                             micro_batches, rtol):
  """With SGD(1), the adapter's update is dA = scale dW B^T, dB = scale A^T dW per layer, where
  dW is the full-parameter update of the merged params on the same batch."""
  cfg = models.get_config(name, **overrides)
  lcfg = lora.LoraConfig(rank=4, alpha=8.0, targets=targets)
  params = models.init_params(cfg, jax.random.key(0), std=0.1)
  scfg = step.StepConfig(loss=losses.LossConfig(kl_coef=0.02), micro_batches=micro_batches)
  batch = {k: jnp.asarray(v) for k, v in two_sequence_rows(cfg.vocab_size, 4).items()}
  ad = _random_adapter(cfg, lcfg)
  merged = lora.merge(params, ad, lcfg)
  sgd = optax.sgd(1.0)
  run = jax.jit(lambda s, b, base=None: step.train_step(
      s, b, cfg=cfg, scfg=scfg, optimizer=sgd, base=base, lora=None if base is None else lcfg))
  state = lambda p: step.TrainState(step=jnp.zeros((), jnp.int32), params=p,
                                    opt_state=sgd.init(p))
  full, m_full = run(state(merged), batch)
  new, m = run(state(ad), batch, params)
  np.testing.assert_allclose(m["loss"], m_full["loss"], rtol=1e-6)
  f64 = lambda t: jax.tree.map(lambda x: np.asarray(x, np.float64), _plain(t))
  dw_all = jax.tree.map(np.subtract, f64(merged), f64(full.params))["layers"]
  adp, newp = f64(ad)["layers"], f64(new.params)["layers"]
  assert set(newp) == set(lcfg.targets)
  for t in lcfg.targets:
    a, b = adp[t]["a"], adp[t]["b"]
    n, r = a.shape[0], a.shape[-1]
    dw = dw_all[t].reshape(n, a[0].size // r, -1)
    want_da = lcfg.scale * np.einsum("nio,nro->nir", dw, b.reshape(n, r, -1))
    want_db = lcfg.scale * np.einsum("nir,nio->nro", a.reshape(n, -1, r), dw)
    for got, want in (((a - newp[t]["a"]).reshape(want_da.shape), want_da),
                      ((b - newp[t]["b"]).reshape(want_db.shape), want_db)):
      assert np.abs(got - want).max() <= rtol * np.abs(want).max(), t


def test_unrolled_adapter_step_merges_layer_by_layer():
  """The unrolled layer loop (scan_layers=False) merges each layer from its own slices: with 4
  micro-batches the compiled step's temporary memory stays within half the float32 bytes of
  the targets of the one-micro-batch step's (merging the stacked targets in every micro-batch
  held a float32 product of every layer on top: +16 MB of 16 MB here)."""
  cfg, params, adapter, target_bytes = _widened(scan_layers=False)
  temp = {m: _update_temp(cfg, params, adapter, m) for m in (1, 4)}
  assert temp[4] - temp[1] < 0.5 * target_bytes, (temp, target_bytes)


def _widened(**overrides):
  """tiny-qwen3 widened to 4 layers of d_model 256 (abstract params and adapter), and its
  targets' float32 bytes."""
  cfg = models.get_config("tiny-qwen3", d_model=256, ffn_dim=1024, n_heads=8, n_kv_heads=4,
                          head_dim=32, n_layers=4, **overrides)
  params = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
  adapter = jax.eval_shape(lambda: lora.init_lora(cfg, LCFG, jax.random.key(1)))
  target_bytes = 4 * sum(x.size for k, x in param_tree.unbox(params)["layers"].items()
                         if k in LCFG.targets)
  return cfg, params, adapter, target_bytes


def _update_temp(cfg, params, adapter, m, lcfg=LCFG):
  """Compiled temporary bytes of the update (an adapter's with `lcfg`, else full)."""
  from benchmarks.common import grpo_batch
  scfg = step.StepConfig(micro_batches=m, entropy=False)
  kw = dict(lora=lcfg, base=params) if lcfg else {}
  learner = step.Learner(cfg, scfg, step.make_optimizer(1e-3), **kw)
  st = jax.eval_shape(learner.init, adapter if lcfg else params)
  compiled = learner.train_step_fn(st).lower(
      st, learner.put_batch(grpo_batch(cfg, 4 * m, 4, 16)), *((params,) if lcfg else ())
  ).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def _score_temp(cfg, params, adapter, m, lcfg=LCFG):
  """Compiled temporary bytes of `Learner.score` (an adapter's with `lcfg`, else full)."""
  from benchmarks.common import grpo_batch
  kw = dict(lora=lcfg, base=params) if lcfg else {}
  learner = step.Learner(cfg, step.StepConfig(micro_batches=m), optax.sgd(0.1), **kw)
  rows = learner.put_batch({k: v for k, v in grpo_batch(cfg, 4 * m, 4, 16).items()
                            if k in ("tokens", "segment_ids", "positions")})
  compiled = learner.score_fn().lower(adapter if lcfg else params, rows,
                                      *((params,) if lcfg else ())).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_the_scanned_loop_merges_each_layer_inside_its_body():
  """With the scanned layer loop the adapter is merged layer by layer inside the loop's body
  (`lora.LayerAdapter`), so neither the update nor `score` holds a merged copy of every
  layer's targets: merging the stacked targets before the scan held 40.1 MB (update, remat
  "dots_attention") and 19.0 MB (score, vs 4.0 MB for full params) of temporaries here."""
  cfg, params, adapter, target_bytes = _widened(remat="dots_attention")
  update = _update_temp(cfg, params, adapter, 4)
  assert update < target_bytes, (update, target_bytes)
  score, score_full = (_score_temp(cfg, params, adapter, 4, lcfg) for lcfg in (LCFG, None))
  assert score - score_full < 0.25 * target_bytes, (score, score_full, target_bytes)


def test_scoring_with_an_adapter_merges_once_for_all_micro_batches():
  """`Learner.score` with an adapter builds the merged weights once, not once per micro-batch:
  with 4 micro-batches its compiled temporary memory stays within a quarter of the targets'
  float32 bytes of the one-micro-batch program's (it was a second merged copy more)."""
  cfg, params, adapter, target_bytes = _widened(scan_layers=False)
  temp = {m: _score_temp(cfg, params, adapter, m) for m in (1, 4)}
  assert temp[4] - temp[1] < 0.25 * target_bytes, (temp, target_bytes)


def test_an_adapter_of_another_shape_is_refused_by_name():
  cfg = models.get_config("tiny-qwen3")
  params = models.init_params(cfg, jax.random.key(0))
  learner = step.Learner(cfg, step.StepConfig(), optax.sgd(0.1), lora=LCFG, base=params)
  mlp = lora.init_lora(cfg, lora.LoraConfig(rank=4, targets="mlp"), jax.random.key(1))
  rank8 = lora.init_lora(cfg, lora.LoraConfig(rank=8), jax.random.key(1))
  with pytest.raises(ValueError, match=r"Learner.init: the adapter targets \['w_down', "):
    learner.init(mlp)
  with pytest.raises(ValueError, match=r"Learner.init: adapter wq.a has shape .* \(lora.rank=4"):
    learner.init(rank8)
  rows = two_sequence_rows(cfg.vocab_size, 2)
  with pytest.raises(ValueError, match="Learner.score: the adapter targets"):
    learner.score(mlp, rows)
  with pytest.raises(ValueError, match="Learner.merged_params: adapter wq.a has shape"):
    learner.merged_params(rank8)


def test_sampler_learner_gap_with_an_adapter_is_full_fine_tunings_on_a_mesh():
  """bfloat16 compute on data=fsdp=tensor=2: the engine decoding from `merged_params` and
  `Learner.score` with the adapter disagree exactly as much as a full fine-tune's sampler (its
  compute copy) and learner do on the same merged weights."""
  from jaxagent.generate import scheduler

  cfg = models.get_config("tiny-qwen3", param_dtype="float32", dtype="bfloat16")
  params = models.init_params(cfg, jax.random.key(0), std=0.1)
  mesh = sharding.make_mesh(2, 2, 2)
  ad = _random_adapter(cfg)
  prompts = [[5, 17, 33, 2, 9], [7, 8, 9, 10, 11], [1, 2, 3, 4, 5], [9, 9, 9, 9, 9]]

  def gap(learner, p, weights):
    done = scheduler.generate(weights, cfg, prompts, max_new_tokens=8, temperature=1.0,
                              seed=3, eos_ids=[], mesh=mesh)
    toks = np.array([q + d.tokens for q, d in zip(prompts, done)], np.int32)
    n = toks.shape[1]
    lp, _ = learner.score(p, dict(tokens=toks, segment_ids=np.ones_like(toks),
                                  positions=np.tile(np.arange(n, dtype=np.int32), (4, 1))))
    return max(float(np.abs(np.asarray(lp)[i, 5:] - np.asarray(d.logprobs)).max())
               for i, d in enumerate(done))

  with_adapter = step.Learner(cfg, step.StepConfig(), optax.sgd(0.1), mesh, lora=LCFG,
                              base=params)
  a = with_adapter.init(ad).params
  got = gap(with_adapter, a, with_adapter.merged_params(a, cfg.dtype))
  full = step.Learner(cfg, step.StepConfig(), optax.sgd(0.1), mesh)
  p = full.init(lora.merge(params, ad, LCFG)).params
  want = gap(full, p, jax.jit(lambda x: param_tree.compute_copy(x, cfg))(p))
  assert got <= want * 1.01 + 1e-6, (got, want)
