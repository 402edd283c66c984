"""The unmerged LoRA forward (`LoraConfig.forward="unmerged"`) and LoRA dropout: the same
function and adapter gradients as the merged forward, no full-size weight gradient in the
update, PEFT's dropout semantics, and dropout masks that depend on (seed, step) only."""
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from jaxagent import models
from jaxagent.models import lora, param_tree
from jaxagent.rl import losses, step
from tests.rl.step_test import two_sequence_rows

CFG = models.get_config("tiny-qwen3")  # float32, scanned layers
SCFG = step.StepConfig(loss=losses.LossConfig(kl_coef=0.02))
# The Learners': the unrolled layer loop (the scanned one is `test_unmerged_forward_...`'s)
# and 2 micro-batches.
UNROLLED = CFG.replace(scan_layers=False)
SCFG2 = step.StepConfig(loss=SCFG.loss, micro_batches=2)


def _lcfg(forward="merged", dropout=0.0):
  return lora.LoraConfig(rank=4, alpha=8.0, forward=forward, dropout=dropout)


@pytest.fixture(scope="module")
def params():
  return models.init_params(CFG, jax.random.key(0), std=0.1)


@pytest.fixture(scope="module")
def adapter():
  """An adapter with both A and B random (a fresh one has B = 0)."""
  fresh = lora.init_lora(CFG, _lcfg(), jax.random.key(1))
  keys = iter(jax.random.split(jax.random.key(101), 64))
  return jax.tree.map(lambda x: 0.05 * jax.random.normal(next(keys), x.shape), fresh)


@pytest.fixture(scope="module")
def batch():
  return two_sequence_rows(CFG.vocab_size, 4)


_LEARNERS = {}


def _learner(params, forward, dropout=0.0, cfg=UNROLLED, scfg=SCFG2):
  """A Learner with SGD(1): the adapter's update is minus its mean gradient. Built once per
  setting (its jitted programs compile once)."""
  key = (forward, dropout, cfg, scfg)
  if key not in _LEARNERS:
    _LEARNERS[key] = step.Learner(cfg, scfg, optax.sgd(1.0), lora=_lcfg(forward, dropout),
                                  base=params)
  return _LEARNERS[key]


def _step(learner, adapter, batch, at_step=0):
  state = learner.init(jax.tree.map(jnp.copy, adapter))  # (the step donates it)
  state = state.replace(step=jnp.asarray(at_step, jnp.int32))
  new, metrics = learner.train_step(state, batch)
  return param_tree.unbox(new.params)["layers"], metrics


def _close(got, want, rtol):
  for t in want:
    for part in ("a", "b"):
      g, w = np.asarray(got[t][part]), np.asarray(want[t][part])
      np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * np.abs(w).max(),
                                 err_msg=f"{t}.{part}")


def test_lowrank_specs_follow_the_projection_spec():
  assert lora.lowrank_specs("btd,dhk->bthk", 1) == ("btd,dr->btr", "btr,rhk->bthk")
  assert lora.lowrank_specs("bthk,hkd->btd", 2) == ("bthk,hkr->btr", "btr,rd->btd")
  assert lora.lowrank_specs("btf,fd->btd", 1) == ("btf,fr->btr", "btr,rd->btd")
  # A spec that uses "r" itself gets another rank letter.
  a_spec, b_spec = lora.lowrank_specs("brd,dh->brh", 1)
  assert a_spec == "brd,dz->brz" and b_spec == "brz,zh->brh"


def test_unmerged_forward_and_adapter_gradients_equal_the_merged(params, adapter, batch):
  """float32: the loss and dA, dB of one micro-batch agree to float rounding."""
  b = {k: jnp.asarray(v) for k, v in batch.items()}
  out = {}
  for fw in ("merged", "unmerged"):
    parts = step._lora_step_parts(params, _lcfg(fw), CFG, False)
    fn = jax.jit(jax.value_and_grad(lambda a, mb: parts(a, mb, CFG, SCFG), has_aux=True))
    (value, _), grads = fn(adapter, b)
    out[fw] = value, param_tree.unbox(grads)["layers"]
  np.testing.assert_allclose(out["unmerged"][0], out["merged"][0], rtol=1e-6)
  _close(out["unmerged"][1], out["merged"][1], rtol=2e-5)
  # (and the gradients are not zero: the comparison means something)
  assert all(float(jnp.abs(g).max()) > 1e-4 for g in jax.tree.leaves(out["merged"][1]))


def test_unmerged_learner_step_and_score_equal_the_merged(params, adapter, batch):
  """The Learner's update (2 micro-batches, the unrolled layer loop) and `score`."""
  got = {fw: _step(_learner(params, fw), adapter, batch) for fw in ("merged", "unmerged")}
  assert got["unmerged"][1]["loss"] == pytest.approx(got["merged"][1]["loss"], rel=1e-5)
  _close(got["unmerged"][0], got["merged"][0], rtol=1e-5)
  score = {fw: _learner(params, fw).score(adapter, batch)[0] for fw in ("merged", "unmerged")}
  np.testing.assert_allclose(score["unmerged"], score["merged"], rtol=1e-5, atol=1e-5)


def _dot_shapes(jaxpr) -> list[tuple[int, ...]]:
  """Output shapes of every dot_general in a jaxpr and the jaxprs inside it (scan, remat,
  custom_vjp bodies)."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      out.append(tuple(eqn.outvars[0].aval.shape))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          out += _dot_shapes(inner)
  return out


def test_unmerged_update_forms_no_full_weight_gradient(params, adapter, batch):
  """The claim users rely on: the unmerged update's program (forward, backward, every
  micro-batch) has no dot whose result is a target weight's size ([d_model, ffn] for the
  MLP); the merged update's has one per target."""
  # 3 rows: no activation ([3, 16, 64], [48, 64], ...) has a weight's shape
  b = {k: jnp.asarray(v) for k, v in two_sequence_rows(CFG.vocab_size, 3).items()}
  specs = param_tree.param_specs(CFG)["layers"]
  per_layer = {t: tuple(d for d in specs[t][0][1:]) for t in lora.INPUT_AXES}
  weight_like = {}
  for t, shape in per_layer.items():
    k = lora.INPUT_AXES[t]
    flat = (int(np.prod(shape[:k])), int(np.prod(shape[k:])))
    weight_like[t] = {shape, flat}

  def found(forward):
    st = step.TrainState(step=jnp.zeros((), jnp.int32), params=adapter,
                         opt_state=optax.sgd(1.0).init(adapter))
    fn = lambda s, mb: step.train_step(s, mb, cfg=CFG, scfg=SCFG, optimizer=optax.sgd(1.0),
                                       base=params, lora=_lcfg(forward))
    shapes = {tuple(d for d in s if d != 1) for s in _dot_shapes(
        jax.make_jaxpr(fn)(st, b).jaxpr)}
    return {t for t, like in weight_like.items() if like & shapes}

  assert found("merged") == set(lora.INPUT_AXES)  # the check sees them where they are
  assert found("unmerged") == set()


def test_dropout_follows_peft_semantics():
  """drop(x) on the adapter's input only: zeros with probability p, the rest scaled by
  1 / (1 - p); the base product is untouched; p = 0 is no dropout."""
  x = jnp.ones((4, 16, 8), jnp.float32)
  eye = jnp.eye(8, dtype=jnp.float32)
  rng = jax.vmap(lambda r: jax.random.fold_in(jax.random.key(0), r))(jnp.arange(4))
  w = 3.0 * eye
  out = lora.LowRankWeight(w, eye, eye, rng, target="w_up", scale=1.0,
                           dropout=0.25).project("btd,df->btf", x, jnp.float32)
  lowrank = np.asarray(out) - 3.0  # the base product x @ W is 3 everywhere
  np.testing.assert_allclose(np.unique(np.round(lowrank, 5)), [0.0, 1 / 0.75], rtol=1e-5)
  assert 0.18 < np.mean(lowrank == 0) < 0.32  # 512 draws of p = 0.25
  assert abs(lowrank.mean() - 1.0) < 0.1  # unbiased
  # Rows draw their own masks.
  assert not np.array_equal(lowrank[0], lowrank[1])
  no_drop = lora.LowRankWeight(w, eye, eye, None, target="w_up", scale=1.0)
  zero_p = lora.LowRankWeight(w, eye, eye, rng, target="w_up", scale=1.0, dropout=0.0)
  np.testing.assert_array_equal(zero_p.project("btd,df->btf", x, jnp.float32),
                                no_drop.project("btd,df->btf", x, jnp.float32))
  np.testing.assert_array_equal(no_drop.project("btd,df->btf", x, jnp.float32), 4.0)


def test_dropout_acts_in_the_update_only_and_its_masks_follow_seed_and_step(params, adapter,
                                                                              batch):
  plain = _learner(params, "unmerged")
  drop = _learner(params, "unmerged", dropout=0.3)
  # Scoring (reference / old log-probs) never drops.
  np.testing.assert_array_equal(drop.score(adapter, batch)[0], plain.score(adapter, batch)[0])
  base_new, base_m = _step(plain, adapter, batch)
  new0, m0 = _step(drop, adapter, batch)
  assert m0["loss"] != base_m["loss"]
  # The same (seed, step): the same masks, bitwise.
  again, m_again = _step(drop, adapter, batch)
  assert m_again["loss"] == m0["loss"]
  for t in new0:
    np.testing.assert_array_equal(again[t]["a"], new0[t]["a"])
  # Another step: other masks.
  _, m1 = _step(drop, adapter, batch, at_step=1)
  assert m1["loss"] != m0["loss"]
  # Another seed: other masks.
  seeded = _learner(params, "unmerged", dropout=0.3,
                    scfg=step.StepConfig(loss=SCFG.loss, micro_batches=2, seed=7))
  _, m_seed = _step(seeded, adapter, batch)
  assert m_seed["loss"] != m0["loss"]


def test_bad_settings_are_named():
  for bad in ("fused", "Merged", None):
    with pytest.raises(ValueError, match="LoraConfig.forward must be 'merged' or 'unmerged'"):
      lora.LoraConfig(forward=bad)
  for bad in (1.0, -0.1, 1.5, float("nan"), True, "0.1"):
    with pytest.raises(ValueError, match=r"LoraConfig.dropout must be a number in \[0, 1\)"):
      lora.LoraConfig(forward="unmerged", dropout=bad)
  with pytest.raises(ValueError, match="LoraConfig.dropout=0.1 needs "
                     "LoraConfig.forward='unmerged'"):
    lora.LoraConfig(dropout=0.1)
  assert lora.LoraConfig(forward="unmerged", dropout=0.1).dropout == 0.1
  section = ml_collections.ConfigDict(dict(rank=4, alpha=8.0, targets="all",
                                           forward="unmerged", dropout=0.05))
  assert lora.from_config(section) == _lcfg("unmerged", 0.05)
  section.forward = "merged"
  with pytest.raises(ValueError, match="lora.dropout=0.05 needs lora.forward='unmerged'"):
    lora.from_config(section)
  section.forward = "fast"
  with pytest.raises(ValueError, match="lora.forward must be 'merged' or 'unmerged', got "
                     "'fast'"):
    lora.from_config(section)
  section.update(forward="unmerged", rank=0)
  with pytest.raises(ValueError, match="lora.dropout=0.05 drops an adapter's input, but "
                     "lora.rank=0"):
    lora.from_config(section)
  with pytest.raises(ValueError, match="StepConfig.seed must be an int"):
    step.StepConfig(seed=1.5)


def test_peft_lora_dropout_loads_with_the_unmerged_forward(tmp_path, adapter):
  lcfg = _lcfg("unmerged", 0.1)
  lora.save_peft(tmp_path / "a", CFG, lcfg, adapter)
  merged_cfg, _ = lora.load_peft(tmp_path / "a", CFG)
  assert (merged_cfg.forward, merged_cfg.dropout) == ("merged", 0.0)
  got, ad = lora.load_peft(tmp_path / "a", CFG, forward="unmerged")
  assert got == lcfg
  np.testing.assert_array_equal(param_tree.unbox(ad)["layers"]["wo"]["b"],
                                param_tree.unbox(adapter)["layers"]["wo"]["b"])
  with pytest.raises(ValueError, match="load_peft: forward must be 'merged' or 'unmerged'"):
    lora.load_peft(tmp_path / "a", CFG, forward="fast")
  conf_file = tmp_path / "a" / lora.PEFT_CONFIG
  conf_file.write_text(conf_file.read_text().replace('"lora_dropout": 0.1', '"lora_dropout": 1.0'))
  assert lora.load_peft(tmp_path / "a", CFG)[0].dropout == 0.0  # unread by the merged forward
  with pytest.raises(ValueError, match=r"adapter_config.json: lora_dropout must be a number in "
                     r"\[0, 1\), got 1.0"):
    lora.load_peft(tmp_path / "a", CFG, forward="unmerged")
  # lora.init_from: the run's forward and dropout are its own; rank, alpha, targets must match.
  from jaxagent.trainer import Trainer
  run = types.SimpleNamespace(cfg=CFG, lora=_lcfg("unmerged", 0.2))
  got = Trainer._adapter_from(run, str(tmp_path / "a"))
  np.testing.assert_array_equal(param_tree.unbox(got)["layers"]["wq"]["a"],
                                param_tree.unbox(adapter)["layers"]["wq"]["a"])
  run.lora = lora.LoraConfig(rank=4, alpha=16.0, forward="unmerged")
  with pytest.raises(ValueError, match="holds an adapter of rank 4, alpha 8.0"):
    Trainer._adapter_from(run, str(tmp_path / "a"))


def test_a_resume_may_change_the_lora_forward_and_dropout(tmp_path):
  """Training settings, not what the checkpoint is: a LoRA checkpoint from before the keys
  existed (or with other values) resumes with them set; another rank is still refused."""
  from jaxagent import checkpoint
  def config(**lora_keys):
    return ml_collections.ConfigDict(dict(seed=0, model=dict(path="tiny-qwen3"),
                                          lora=dict(rank=4, alpha=8.0, **lora_keys)))
  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1))
  meta = {"format": checkpoint.FORMAT, "config": checkpoint.config_to_json(config())}
  changed = mgr.check(meta, step=1, config=config(forward="unmerged", dropout=0.1))
  assert changed == [("lora.dropout", "<unset>", 0.1), ("lora.forward", "<unset>", "unmerged")]
  with pytest.raises(checkpoint.IncompatibleCheckpointError, match="config lora.rank: 4 in "
                     "the checkpoint, 8 now"):
    mgr.check(meta, step=1, config=ml_collections.ConfigDict(dict(
        seed=0, model=dict(path="tiny-qwen3"), lora=dict(rank=8, alpha=8.0))))
  mgr.close()


def test_dropout_masks_do_not_depend_on_micro_batches_layer_loop_or_sharding(params, adapter,
                                                                            batch):
  """A row's masks come from its index in the step's batch, the layer's and the target's:
  the scanned layer loop (a traced layer index), one micro-batch, on a mesh that splits the
  rows and the weights, draws the masks of the unrolled loop with 2 micro-batches on one
  device."""
  from jaxagent import sharding
  mesh = sharding.make_mesh(1, 2, 2, devices=jax.devices()[:4])
  scanned = step.Learner(CFG, SCFG, optax.sgd(1.0), mesh, lora=_lcfg("unmerged", 0.3),
                         base=params)
  got = _step(scanned, adapter, batch)
  want = _step(_learner(params, "unmerged", dropout=0.3), adapter, batch)
  assert got[1]["loss"] == pytest.approx(want[1]["loss"], rel=1e-5)
  _close(got[0], want[0], rtol=1e-4)


def test_unmerged_bfloat16_gradients_match_the_merged_to_rounding(adapter, batch):
  """float32 params, bfloat16 compute: the unmerged adapter gradients (computed in bfloat16,
  returned as the adapter's float32) point where the merged ones do."""
  cfg = CFG.replace(dtype="bfloat16")
  base = models.init_params(cfg, jax.random.key(0), std=0.1)
  b = {k: jnp.asarray(v) for k, v in batch.items()}
  grads = {}
  for fw in ("merged", "unmerged"):
    parts = step._lora_step_parts(base, _lcfg(fw), cfg, False)
    fn = jax.jit(jax.grad(lambda a, mb: parts(a, mb, cfg, SCFG)[0]))
    grads[fw] = param_tree.unbox(fn(adapter, b))["layers"]
  for t in lora.INPUT_AXES:
    for part in ("a", "b"):
      g, w = (np.asarray(grads[fw][t][part]).ravel() for fw in ("unmerged", "merged"))
      assert g.dtype == np.float32
      cos = g @ w / (np.linalg.norm(g) * np.linalg.norm(w))
      assert cos > 0.99 and abs(np.linalg.norm(g) / np.linalg.norm(w) - 1) < 0.05, (t, part)


def test_unmerged_update_holds_no_more_than_the_merged():
  """Compiled temporaries of the scanned update (float32 params, bfloat16 compute): the
  unmerged forward casts each layer's targets where it uses them, so it holds no copy of the
  base's targets (copied once per step: 58.0 against 19.7 MB here)."""
  cfg = models.get_config("tiny-qwen3", d_model=512, n_layers=4, ffn_dim=1536,
                          dtype="bfloat16", remat="dots_attention")
  base = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
  temp = {}
  for fw in ("merged", "unmerged"):
    lcfg = _lcfg(fw)
    learner = step.Learner(cfg, step.StepConfig(micro_batches=4), optax.sgd(1.0), lora=lcfg,
                           base=base)
    state = jax.eval_shape(lambda: step.TrainState(
        step=jnp.zeros((), jnp.int32), params=lora.init_lora(cfg, lcfg, jax.random.key(1)),
        opt_state=optax.sgd(1.0).init(lora.init_lora(cfg, lcfg, jax.random.key(1)))))
    rows = {k: jax.ShapeDtypeStruct(v.shape, v.dtype)
            for k, v in two_sequence_rows(cfg.vocab_size, 8).items()}
    compiled = learner.train_step_fn(state).lower(state, rows, base).compile()
    temp[fw] = compiled.memory_analysis().temp_size_in_bytes
  assert temp["unmerged"] <= 1.1 * temp["merged"], temp


@pytest.mark.parametrize("remat", ["dots", "dots_attention"])
def test_unmerged_projection_saves_what_a_plain_one_saves(remat, capsys):
  """Under the layer's "dots" remat policies a projection saves its one dot output. The
  unmerged low-rank path must add no saved value of the output's size: its `xa @ B` saved
  too was a second copy of every target's output (+17.5 GiB of temporaries in an H200
  compile of the Qwen2.5-1.5B r16 update), which a CPU compile's total does not show."""
  from jaxagent.models import decoder
  cfg = CFG.replace(remat=remat)
  k = jax.random.split(jax.random.key(0), 4)
  w = jax.random.normal(k[0], (64, 96))
  a = jax.random.normal(k[1], (64, 4))
  b = jax.random.normal(k[2], (4, 96))
  x = jax.random.normal(k[3], (2, 8, 64)).astype(jnp.bfloat16)
  rng = jax.random.split(jax.random.key(1), 2)

  def norm(x):  # a non-dot producer of the projection's input, as in the layer
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)

  def plain(x, a, b):
    return jnp.sum(jax.nn.silu(lora.project("btd,df->btf", norm(x), w, jnp.bfloat16)))

  def unmerged(dropout):
    def fn(x, a, b):
      lw = lora.LowRankWeight(w=w, a=a, b=b, target="w_gate", scale=2.0,
                              rng=rng if dropout else None, dropout=dropout)
      return jnp.sum(jax.nn.silu(lora.project("btd,df->btf", norm(x), lw, jnp.bfloat16)))
    return fn

  def saved_outputs(fn):
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(decoder._remat(fn, cfg), x, a, b)
    lines = capsys.readouterr().out.splitlines()
    assert lines, "print_saved_residuals printed nothing"
    return sum(line.split()[0] in ("bf16[2,8,96]", "bfloat16[2,8,96]") for line in lines)

  assert saved_outputs(plain) == 1
  assert saved_outputs(unmerged(0.0)) == 1
  assert saved_outputs(unmerged(0.1)) == 1
  # and the low-rank path still computes what it did
  lw = lora.LowRankWeight(w=w, a=a, b=b, target="w_gate", scale=2.0)
  x32 = x.astype(jnp.float32)
  want = x32 @ w + 2.0 * (x32 @ a) @ b
  np.testing.assert_allclose(np.asarray(lw.project("btd,df->btf", x32, jnp.float32)), want,
                             rtol=1e-5, atol=1e-4)
