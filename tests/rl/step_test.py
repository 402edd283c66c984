"""Learner steps: packing invariance, masking, micro-batching, sharding, and that it learns."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxagent import models, sharding
from jaxagent.rl import losses, packing, step

CFG = models.get_config("tiny-qwen3")


@pytest.fixture(scope="module")
def params():
  return models.init_params(CFG, jax.random.key(0), std=0.1)


def _items(n=6, seed=0):
  """Multi-turn-like items: prompt, policy turn, observation, policy turn."""
  rng = np.random.default_rng(seed)
  items = []
  for i in range(n):
    parts = [(0, rng.integers(3, 8)), (1, rng.integers(2, 9)), (2, rng.integers(2, 6)),
             (1, rng.integers(1, 7))]
    roles = np.concatenate([np.full(k, r) for r, k in parts])
    toks = rng.integers(0, CFG.vocab_size, len(roles)).astype(np.int32)
    mask = (roles == 1).astype(np.float32)
    old = np.where(mask > 0, rng.normal(-3.0, 0.5, len(roles)), 0.0).astype(np.float32)
    items.append(packing.PackItem(tokens=toks, loss_mask=mask, old_logps=old,
                                  advantages=float(rng.normal()),
                                  ref_logps=old + rng.normal(0, 0.1, len(roles)).astype(
                                      np.float32)))
  return items


def two_sequence_rows(vocab_size: int, rows: int = 8, seed: int = 0) -> dict:
  """A packed RL batch of `rows` rows of 16 tokens: two sequences (7 and 6 tokens) then 3
  padding tokens per row, a random loss mask off each sequence's first token, random old and
  reference log-probs and advantages. Also used by `tests/sharding_test.py`."""
  rng = np.random.default_rng(seed)
  n = 16
  seg = np.repeat(np.array([[1] * 7 + [2] * 6 + [0] * 3]), rows, 0).astype(np.int32)
  pos = np.concatenate([np.arange(7), np.arange(6), np.zeros(3, int)])[None].repeat(rows, 0)
  return dict(tokens=rng.integers(0, vocab_size, (rows, n)).astype(np.int32),
              segment_ids=seg, positions=pos.astype(np.int32),
              loss_mask=((pos > 0) & (rng.random((rows, n)) > 0.3)).astype(np.float32),
              old_logps=(-3 * rng.random((rows, n))).astype(np.float32),
              advantages=rng.normal(size=(rows, n)).astype(np.float32),
              ref_logps=(-3 * rng.random((rows, n))).astype(np.float32))


def _batch(items, max_len, rows_multiple=1):
  pb = packing.pack(items, packing.PackingConfig(max_len=max_len, row_multiple=rows_multiple))
  return pb, {k: jnp.asarray(v) for k, v in pb.arrays().items()}


def _grads(params, batch, scfg):
  # Compiled: op by op, the forward and backward dispatched hundreds of small programs (22 s on
  # 2 cores for the packed-vs-unpacked test; compiled once per batch shape, a few seconds).
  return _grads_jit(params, batch, scfg)


@functools.partial(jax.jit, static_argnums=2)
def _grads_jit(params, batch, scfg):
  (num, parts), g = jax.value_and_grad(step._micro_parts, has_aux=True)(params, batch, CFG, scfg)
  d = jnp.maximum(parts.denominator, 1.0)
  return num / d, jax.tree.map(lambda x: x / d, g)


# The other aggregations only in the slow run (CI time); the loss tests cover every agg.
@pytest.mark.parametrize("agg", [
    "token_mean", pytest.param("seq_mean_token_mean", marks=pytest.mark.slow),
    pytest.param("seq_mean_token_sum", marks=pytest.mark.slow)])
def test_packed_equals_unpacked_loss_and_param_grads(params, agg):
  scfg = step.StepConfig(loss=losses.LossConfig(agg=agg, kl_coef=0.05, kl_estimator="k3"))
  items = _items()
  _, packed = _batch(items, max_len=64)
  assert packed["tokens"].shape[0] < len(items)  # several trajectories share rows
  # Unpacked: one trajectory per row.
  L = max(len(it.tokens) for it in items)
  rows = []
  for it in items:
    _, b = _batch([it], max_len=L)
    rows.append({k: jnp.pad(v, ((0, 0), (0, L - v.shape[1]))) for k, v in b.items()})
  unpacked = {k: jnp.concatenate([r[k] for r in rows]) for k in rows[0]}
  l1, g1 = _grads(params, packed, scfg)
  l2, g2 = _grads(params, unpacked, scfg)
  np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    # float32 summation order: an absolute floor relative to the leaf's largest gradient
    # (token sums make gradients of order 1; one entry of 5e-4 differed by 1.3e-6).
    b = np.asarray(b)
    np.testing.assert_allclose(np.asarray(a), b, rtol=2e-4,
                               atol=max(1e-6, 2e-6 * float(np.abs(b).max())))


def test_logit_gradient_is_zero_off_policy_tokens(params):
  items = _items(3, seed=1)
  _, b = _batch(items, max_len=64)
  cfg = losses.LossConfig(kl_coef=0.1)

  def loss_of_logits(logits):
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    nxt = jnp.concatenate([b["tokens"][:, 1:], jnp.zeros_like(b["tokens"][:, :1])], 1)
    lp = jnp.take_along_axis(logp_all, nxt[..., None], -1)[..., 0]
    lp = jnp.concatenate([jnp.zeros_like(lp[:, :1]), lp[:, :-1]], 1)
    return losses.policy_loss(lp, b["old_logps"], b["advantages"], b["loss_mask"],
                              b["segment_ids"], cfg, ref_logps=b["ref_logps"])[0]

  logits = models.forward(params, b["tokens"], cfg=CFG, segment_ids=b["segment_ids"])
  g = np.asarray(jax.grad(loss_of_logits)(logits))
  # logits at position t-1 score token t: nonzero exactly where token t is a policy token.
  mask = np.asarray(b["loss_mask"])
  target_is_policy = np.concatenate([mask[:, 1:], np.zeros_like(mask[:, :1])], 1) > 0
  per_pos = np.abs(g).sum(-1)
  assert np.all(per_pos[~target_is_policy] == 0.0)
  assert np.all(per_pos[target_is_policy] > 0.0)


def _log_softmax_np(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_packed_logprobs_equal_each_trajectory_scored_alone(params):
  """`sequence_logprobs` on packed rows, position by position, against a NumPy log-softmax of
  the logits of each trajectory run alone: position t of a segment holds log p(token t | its own
  tokens < t) and the entropy of that prediction (temperature 0.7), for every t >= 1 of every
  segment, so no segment sees its neighbour and positions restart per segment. A chunk of 16
  makes the vocabulary projection cross segment boundaries."""
  temp = 0.7
  items = _items(5, seed=7)
  pb, b = _batch(items, max_len=64)
  assert pb.shape[0] < len(items) and pb.stats["max_segments_per_row"] >= 2
  lp, ent = jax.jit(lambda p, b: step.sequence_logprobs(p, b, cfg=CFG, temperature=temp, chunk=16,
                                                        with_entropy=True))(params, b)
  lp, ent = np.asarray(lp), np.asarray(ent)
  assert np.all(lp[:, 0] == 0.0)
  # Alone: one trajectory per row, left-aligned, padding (segment 0) after it.
  n_max = max(len(it.tokens) for it in items)
  alone = np.zeros((len(items), n_max), np.int32)
  for i, it in enumerate(items):
    alone[i, :len(it.tokens)] = it.tokens
  seg = (np.arange(n_max) < np.array([len(it.tokens) for it in items])[:, None]).astype(np.int32)
  logits = np.asarray(jax.jit(lambda p, t, s: models.forward(p, t, cfg=CFG, segment_ids=s))(
      params, alone, seg), np.float64)
  for i, it in enumerate(items):
    logp = _log_softmax_np(logits[i] / temp)
    n = len(it.tokens)
    want_lp = logp[np.arange(n - 1), it.tokens[1:]]
    want_ent = -(np.exp(logp) * logp).sum(-1)[:n - 1]
    r, o = pb.item_row[i], pb.item_offset[i]
    np.testing.assert_allclose(lp[r, o + 1:o + n], want_lp, rtol=1e-4, atol=1e-4, err_msg=str(i))
    np.testing.assert_allclose(ent[r, o + 1:o + n], want_ent, rtol=1e-4, atol=1e-4, err_msg=str(i))


@pytest.mark.parametrize("save_probs", [False, True])
def test_hidden_state_gradient_is_zero_off_policy_tokens(params, save_probs):
  """The production log-prob path (`logprobs.token_logprobs`, its custom VJP, differentiated
  entropies and a k3 KL term): d loss / d h at position t - 1, which predicts token t, is exactly
  0 where token t is not a policy token, even with NaN old/reference log-probs and advantages
  there, and nonzero where it is."""
  items = _items(3, seed=8)
  _, b = _batch(items, max_len=64)
  off = np.asarray(b["loss_mask"]) == 0
  dirty = {k: jnp.where(off, jnp.nan, b[k]) for k in ("old_logps", "ref_logps", "advantages")}
  cfg = losses.LossConfig(algo="grpo", agg="seq_mean_token_mean", kl_coef=0.1, entropy_coef=0.01)
  h = jax.jit(lambda p, b: models.hidden_states(p, b["tokens"], cfg=CFG, segment_ids=b["segment_ids"],
                                                positions=b["positions"]))(params, b)
  nxt = jnp.concatenate([b["tokens"][:, 1:], jnp.zeros_like(b["tokens"][:, :1])], 1)
  shift = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], 1)

  def loss_of_h(h):
    lp, ent = models.token_logprobs(params, h, nxt, cfg=CFG, temperature=0.7, chunk=16,
                                    with_entropy=True, save_probs=save_probs)
    return losses.policy_loss(shift(lp), dirty["old_logps"], dirty["advantages"], b["loss_mask"],
                              b["segment_ids"], cfg, ref_logps=dirty["ref_logps"],
                              entropies=shift(ent))[0]

  loss, g = jax.jit(jax.value_and_grad(loss_of_h))(h)
  assert np.isfinite(float(loss))
  per_pos = np.abs(np.asarray(g)).sum(-1)
  target_is_policy = np.concatenate([~off[:, 1:], np.zeros_like(off[:, :1])], 1)
  assert np.all(per_pos[~target_is_policy] == 0.0)
  assert np.all(per_pos[target_is_policy] > 0.0)


@pytest.mark.parametrize("agg", [
    "token_mean", pytest.param("seq_mean_token_mean", marks=pytest.mark.slow)])
def test_four_micro_batches_equal_one_batch(params, agg):
  items = _items(16, seed=2)
  _, b = _batch(items, max_len=32, rows_multiple=4)
  assert b["tokens"].shape[0] % 4 == 0
  opt = optax.sgd(0.5)
  outs = []
  for m in (1, 4):
    scfg = step.StepConfig(loss=losses.LossConfig(agg=agg), micro_batches=m)
    st = step.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                         opt_state=opt.init(params))
    outs.append(jax.jit(lambda s, x: step.train_step(s, x, cfg=CFG, scfg=scfg,
                                                     optimizer=opt))(st, b))
  (s1, m1), (s4, m4) = outs
  np.testing.assert_allclose(m1["loss"], m4["loss"], rtol=1e-5)
  np.testing.assert_allclose(m1["grad_norm"], m4["grad_norm"], rtol=1e-4)
  for a, c in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-4, atol=1e-6)


def test_sharded_train_step_equals_unsharded(params):
  items = _items(16, seed=3)
  _, b = _batch(items, max_len=32, rows_multiple=8)
  scfg = step.StepConfig(loss=losses.LossConfig(kl_coef=0.02), micro_batches=2)
  # SGD: Adam's normalisation would amplify rounding noise in near-zero gradients.
  opt = optax.sgd(0.1)
  host = {k: np.asarray(v) for k, v in b.items()}
  one = step.Learner(CFG, scfg, opt, sharding.make_mesh(devices=jax.devices()[:1]))
  eight = step.Learner(CFG, scfg, opt, sharding.make_mesh(2, 2, 2))
  s1, m1 = one.train_step(one.init(params), host)
  s8, m8 = eight.train_step(eight.init(params), host)
  wq = models.unbox(s8.params)["layers"]["wq"]
  assert len(wq.sharding.device_set) == 8
  for k in ("loss", "grad_norm", "kl_ref", "clip_frac_high"):
    np.testing.assert_allclose(m1[k], m8[k], rtol=1e-4, atol=1e-7)
  for a, c in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s8.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-4, atol=1e-6)
  lp1, _ = one.score(s1.params, host)
  lp8, _ = eight.score(s8.params, host)
  np.testing.assert_allclose(np.asarray(lp1), np.asarray(lp8), atol=1e-5)


def test_updates_lower_the_loss_on_a_fixed_batch(params):
  items = _items(8, seed=4)
  _, b = _batch(items, max_len=64)
  host = {k: np.asarray(v) for k, v in b.items()}
  learner = step.Learner(CFG, step.StepConfig(), step.make_optimizer(3e-3))
  st = learner.init(params)
  first = None
  for _ in range(5):
    st, m = learner.train_step(st, host)
    first = m["loss"] if first is None else first
  assert m["loss"] < first - 1e-3
  assert int(st.step) == 5


def test_a_state_without_optimizer_state_is_placed_and_refused_by_train_step(params):
  learner = step.Learner(CFG, step.StepConfig(), step.make_optimizer(3e-3))
  st = learner.init(params, optimizer=False)
  assert st.opt_state is None and int(st.step) == 0
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(st.params),
                                                  jax.tree.leaves(params)))
  _, b = _batch(_items(2), max_len=64)
  with pytest.raises(ValueError, match=r"no optimizer state .*optimizer=False"):
    learner.train_step(st, {k: np.asarray(v) for k, v in b.items()})


def test_has_gradient_needs_a_trained_non_zero_advantage_or_a_kl_or_entropy_term():
  from jaxagent.rl import losses
  mask = np.array([[0, 1, 1, 0]], np.float32)
  adv = lambda *a: {"advantages": np.array([a], np.float32), "loss_mask": mask}
  plain = losses.LossConfig()
  assert not step.has_gradient(plain, adv(0, 0, 0, 0))
  assert not step.has_gradient(plain, adv(1, 0, 0, -1))  # off the trained tokens only
  assert step.has_gradient(plain, adv(0, 0, -0.5, 0))
  assert step.has_gradient(plain, adv(0, np.nan, 0, 0))  # reported as nonfinite by the step
  assert step.has_gradient(losses.LossConfig(kl_coef=0.1), adv(0, 0, 0, 0))
  assert step.has_gradient(losses.LossConfig(entropy_coef=0.01), adv(0, 0, 0, 0))


def test_sft_objective_is_masked_cross_entropy(params):
  items = _items(4, seed=5)
  _, b = _batch(items, max_len=64)
  loss, _ = _grads(params, b, step.StepConfig(objective="sft"))
  lp, _ = step.sequence_logprobs(params, b, cfg=CFG)
  mask = np.asarray(b["loss_mask"])
  ref = -(np.asarray(lp) * mask).sum() / mask.sum()
  np.testing.assert_allclose(float(loss), ref, rtol=1e-5)


def test_sft_with_an_entropy_bonus_in_the_loss_config_computes_no_entropy(params):
  # The warm start keeps the run's loss config (`learner_parts`) with entropy=False; the RL
  # loss's entropy_coef made every SFT step compute entropies and differentiate through them.
  b = two_sequence_rows(CFG.vocab_size, rows=2)
  def update(coef):
    scfg = step.StepConfig(objective="sft", entropy=False,
                           loss=losses.LossConfig(entropy_coef=coef))
    fn = jax.value_and_grad(step._micro_parts, has_aux=True)
    return lambda p, mb: fn(p, mb, CFG, scfg)
  (_, parts), _ = jax.eval_shape(update(0.01), params, b)
  assert sorted(parts.sums) == ["nll", "num_policy_tokens", "ratio_mean"]
  # The same program as without the bonus: no entropy computed, nor differentiated.
  assert str(jax.make_jaxpr(update(0.01))(params, b)) == str(jax.make_jaxpr(update(0.0))(params, b))


@functools.lru_cache(maxsize=None)
def _skip_learner():
  """A learner that skips non-finite updates, with a two-update warmup (one compile shared)."""
  return step.Learner(CFG, step.StepConfig(nonfinite="skip"),
                      step.make_optimizer(1e-2, warmup_steps=2))


def test_nonfinite_step_raises_with_step_and_metric(params):
  items = _items(2, seed=6)
  _, b = _batch(items, max_len=64)
  host = {k: np.asarray(v) for k, v in b.items()}
  host["advantages"] = np.where(host["loss_mask"] > 0, np.nan, 0.0).astype(np.float32)
  learner = step.Learner(CFG, step.StepConfig(), step.make_optimizer(1e-3))
  st = learner.init(params)
  before = np.asarray(models.unbox(st.params)["embed"]).copy()
  with pytest.raises(FloatingPointError, match="train step 0.*loss") as err:
    learner.train_step(st, host)
  # The state passed in was donated; the unchanged one comes with the error (it was lost).
  np.testing.assert_array_equal(np.asarray(models.unbox(err.value.state.params)["embed"]), before)
  skip = _skip_learner()
  st = skip.init(params)
  before = np.asarray(models.unbox(st.params)["embed"]).copy()
  st, m = skip.train_step(st, host)
  assert m["nonfinite"] == 1.0
  np.testing.assert_array_equal(np.asarray(models.unbox(st.params)["embed"]), before)


def _first_weight_loss(p, mb, cfg, scfg):
  """A stand-in for `step._micro_parts` whose loss reaches `p["w"][0]` only."""
  one = jnp.ones(())
  parts = losses.LossParts(p["w"][0], one, {"num_policy_tokens": one, "ratio_mean": one},
                           {"ratio_mean": one}, one, one)
  return parts.numerator, parts


def test_a_non_finite_update_from_finite_gradients_is_caught(monkeypatch):
  """Adam with eps=0 turns a gradient of exactly 0 (a weight the batch does not reach, or every
  weight when all advantages are 0) into 0 / 0: the loss and gradient norm are finite, yet the
  update would write NaN params. The step must see it like a non-finite loss."""
  monkeypatch.setattr(step, "_micro_parts", _first_weight_loss)
  params = {"w": jnp.ones(3)}
  for kind, opt in (("eps=0", step.make_optimizer(1e-2, eps=0.0)),
                    ("eps>0", step.make_optimizer(1e-2))):
    state = step.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                            opt_state=opt.init(params))
    new, m = jax.jit(functools.partial(step.train_step, cfg=CFG, scfg=step.StepConfig(),
                                       optimizer=opt))(state, {})
    w = np.asarray(new.params["w"])
    assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])
    if kind == "eps=0":
      assert float(m["nonfinite"]) == 1.0 and not np.isfinite(float(m["update_norm"]))
      np.testing.assert_array_equal(w, [1.0, 1.0, 1.0])  # not updated
    else:
      assert float(m["nonfinite"]) == 0.0 and np.isfinite(float(m["update_norm"]))
      assert w[0] < 1.0 and w[1] == w[2] == 1.0


def test_a_non_finite_update_alone_is_named_with_its_likely_cause(monkeypatch):
  monkeypatch.setattr(step, "_micro_parts", _first_weight_loss)
  learner = step.Learner(CFG, step.StepConfig(), step.make_optimizer(1e-2, eps=0.0))
  with pytest.raises(FloatingPointError, match=r"step 0: \['update_norm'\].*use eps > 0"):
    learner.train_step(learner.init({"w": jnp.ones(3)}), {})
  # With eps > 0 the cause is the size of the update: the hint names the learning rate first.
  learner = step.Learner(CFG, step.StepConfig(), step.make_optimizer(1e30))
  with pytest.raises(FloatingPointError, match=r"\['update_norm'\].*learning rate far too large"):
    learner.train_step(learner.init({"w": jnp.ones(3)}), {})


def test_a_skipped_update_leaves_the_schedule_where_it_was(params):
  """With nonfinite='skip' the learning-rate schedule (and Adam's bias correction) count the
  updates applied, not the steps taken (documented in `StepConfig` and the README): after a
  skipped step the run continues exactly as if that step had not been taken, while
  `TrainState.step` counts every call."""
  items = _items(2, seed=6)
  _, b = _batch(items, max_len=64)
  good = {k: np.asarray(v) for k, v in b.items()}
  bad = dict(good, advantages=np.where(good["loss_mask"] > 0, np.nan, 0.0).astype(np.float32))
  learner = _skip_learner()
  counts = lambda st: [int(v) for _, v in optax.tree_utils.tree_get_all_with_path(
      st.opt_state, "count")]
  embed = lambda st: np.asarray(models.unbox(st.params)["embed"])
  skipped = learner.init(params)
  skipped, m = learner.train_step(skipped, bad)
  assert m["nonfinite"] == 1.0 and int(skipped.step) == 1 and set(counts(skipped)) == {0}
  plain = learner.init(params)
  first = embed(plain).copy()
  for i in range(2):
    skipped, _ = learner.train_step(skipped, good)
    plain, _ = learner.train_step(plain, good)
    if i == 0:  # update 0 of the warmup runs at rate 0, after the skipped step too
      np.testing.assert_array_equal(embed(skipped), first)
  assert int(skipped.step) == 3 and int(plain.step) == 2
  assert counts(skipped) == counts(plain) and set(counts(plain)) == {2}
  assert np.abs(embed(plain) - first).max() > 0
  np.testing.assert_array_equal(embed(skipped), embed(plain))


def test_score_in_micro_batches_equals_one_pass():
  cfg = models.get_config("tiny-llama")
  params = models.init_params(cfg, jax.random.key(0), std=0.2)
  rng = np.random.default_rng(0)
  batch = {"tokens": rng.integers(0, cfg.vocab_size, (8, 24)).astype(np.int32),
           "segment_ids": np.ones((8, 24), np.int32),
           "positions": np.tile(np.arange(24, dtype=np.int32), (8, 1))}
  outs = []
  for m in (1, 4):
    learner = step.Learner(cfg, step.StepConfig(micro_batches=m), step.make_optimizer(1e-3))
    outs.append(learner.score(params, batch, with_entropy=True))
  for a, b in zip(*outs):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.slow  # ~50 s on 2 cores; the sharded unrolled test covers gathered weights
def test_gather_weights_once_per_step_same_update_fewer_all_gathers():
  """fsdp over 8 devices, 4 micro-batches: gathering the weights once per step gives the same
  new params as the default path and executes fewer all-gather bytes (loop-weighted HLO)."""
  from benchmarks.common import grpo_batch
  from jaxagent.plan import hlo

  cfg = models.get_config("tiny-qwen3", param_dtype="float32", dtype="bfloat16")
  mesh = sharding.make_mesh(fsdp=8)
  batch = grpo_batch(cfg, 32, 8, 24)
  params = models.init_params(cfg, jax.random.key(0))
  out, gathered = {}, {}
  for g in (False, True):
    scfg = step.StepConfig(micro_batches=4, entropy=False, gather_weights=g)
    learner = step.Learner(cfg, scfg, step.make_optimizer(1e-3), mesh)
    st = learner.init(params)
    text = learner.train_step_fn(st).lower(st, learner.put_batch(batch)).compile().as_text()
    stats = hlo.analyze(text, tuple(mesh.shape.values()), tuple(mesh.axis_names))
    gathered[g] = stats.collectives["all-gather"].bytes
    new, _ = learner.train_step(st, batch)
    out[g] = jax.device_get(models.param_tree.unbox(new.params))
  for a, b in zip(jax.tree.leaves(out[False]), jax.tree.leaves(out[True])):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert gathered[True] < 0.6 * gathered[False], gathered


@pytest.mark.slow  # ~30 s on 2 cores
def test_mixed_precision_step_equals_per_use_casts():
  """float32 masters with bfloat16 compute: the step differentiates a bfloat16 copy made once
  and accumulates in float32; its update equals differentiating the float32 masters directly
  (each use casting its weight) up to the tied embedding's two bfloat16 uses."""
  cfg = models.get_config("tiny-qwen3", param_dtype="float32", dtype="bfloat16")
  p = models.init_params(cfg, jax.random.key(3), std=0.1)
  _, batch = _batch(_items(8, seed=4), max_len=64, rows_multiple=2)
  scfg = step.StepConfig(loss=losses.LossConfig(), micro_batches=2)
  state = step.TrainState(step=jnp.asarray(0), params=p, opt_state=optax.sgd(1.0).init(p))
  new, _ = jax.jit(lambda s, b: step.train_step(s, b, cfg=cfg, scfg=scfg,
                                                optimizer=optax.sgd(1.0)))(state, batch)
  got = jax.tree.map(lambda a, b: b - a, models.unbox(new.params), models.unbox(p))
  mbs = step.split_micro_batches(batch, 2)
  total, den = None, 0.0
  for i in range(2):
    mb = jax.tree.map(lambda x: x[i], mbs)
    (_, parts), g = jax.value_and_grad(step._micro_parts, has_aux=True)(p, mb, cfg, scfg)
    total = g if total is None else jax.tree.map(jnp.add, total, g)
    den = den + parts.denominator
  want = jax.tree.map(lambda x: x / jnp.maximum(den, 1.0), models.unbox(total))
  for path, a in jax.tree_util.tree_leaves_with_path(got):
    b, w = want, models.unbox(p)
    for k in path:
      b, w = b[k.key], w[k.key]
    assert a.dtype == jnp.float32
    # `new - old` carries the float32 rounding of `old - g` (an ulp of the weight).
    ulp = 2.0 ** -23 * float(jnp.abs(w).max())
    rel = 2e-2 if "embed" in str(path) else 1e-4
    assert float(jnp.abs(a - b).max()) <= 2 * ulp + rel * float(jnp.abs(b).max()), path


@pytest.mark.parametrize("micro_batches,dtype,save_probs", [
    (1, "float32", False), pytest.param(2, "float32", True, marks=pytest.mark.slow),
    pytest.param(2, "bfloat16", True, marks=pytest.mark.slow)])
def test_unrolled_layer_loop_equals_scan(micro_batches, dtype, save_probs):
  """`ModelConfig.scan_layers=False` (per-layer weights cut once per step, an unrolled layer
  loop) gives the scan's loss, metrics and update (float32 masters; float32 compute to float32
  rounding, bfloat16 compute to bfloat16 rounding), with the "dots_attention" remat policy and
  boxed params; with `StepConfig.logprob_save_probs` on the unrolled side, the token
  log-probs' backward reads saved probabilities instead of recomputing the logits (entropies
  on as a metric)."""
  kw = dict(param_dtype="float32", dtype=dtype)
  base = models.get_config("tiny-qwen3", remat="dots", **kw)
  unrolled = models.get_config("tiny-qwen3", remat="dots_attention", scan_layers=False, **kw)
  p = models.init_params(base, jax.random.key(5), std=0.1)
  _, batch = _batch(_items(8, seed=6), max_len=64, rows_multiple=2)
  scfg = step.StepConfig(loss=losses.LossConfig(kl_coef=0.05, kl_estimator="k3"),
                         micro_batches=micro_batches)
  opt = optax.sgd(0.5)
  tol = 1e-5 if dtype == "float32" else 2e-2
  state = step.TrainState(step=jnp.asarray(0), params=p, opt_state=opt.init(p))
  run = lambda cfg, scfg: jax.jit(lambda s, b: step.train_step(s, b, cfg=cfg, scfg=scfg,
                                                               optimizer=opt))(state, batch)
  want, want_m = run(base, scfg)
  got, got_m = run(unrolled, dataclasses.replace(scfg, logprob_save_probs=save_probs))
  assert "entropy" in want_m
  assert jax.tree.structure(got.params) == jax.tree.structure(p)
  for k in want_m:
    np.testing.assert_allclose(got_m[k], want_m[k], rtol=tol, atol=1e-6, err_msg=k)
  for path, a in jax.tree_util.tree_leaves_with_path(models.unbox(got.params)):
    b, w = want.params, p
    for k in path:
      b, w = b[k.key], w[k.key]
    b, w = models.unbox(b), models.unbox(w)
    moved = float(jnp.abs(b - w).max())
    assert moved > 0, path  # the step did move every weight
    assert float(jnp.abs((a - w) - (b - w)).max()) <= tol * moved + 1e-7, path


def test_unrolled_hidden_states_and_kv_equal_scan(params):
  """The unrolled loop over stacked or per-layer weights equals the scan, K/V included."""
  from jaxagent.models import decoder, param_tree
  toks = jax.random.randint(jax.random.key(1), (2, 12), 0, CFG.vocab_size)
  seg = jnp.asarray([[1] * 7 + [2] * 5, [1] * 9 + [0] * 3])
  run = jax.jit(decoder.hidden_states, static_argnames=("cfg", "collect_kv"))  # not op by op
  want = run(params, toks, cfg=CFG, segment_ids=seg, collect_kv=True)
  cfg = models.get_config("tiny-qwen3", scan_layers=False)
  for p in (params, param_tree.unstack_layers(params)):
    got = run(p, toks, cfg=cfg, segment_ids=seg, collect_kv=True)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  restacked = param_tree.stack_layers(param_tree.unstack_layers(params), params)
  assert jax.tree.structure(restacked) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(restacked), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # default-run time budget: 10-22 s; the unrolled loop stays in test_unrolled_layer_loop_equals_scan
@pytest.mark.parametrize("gather", [False, True])
def test_unrolled_layer_loop_sharded_equals_scan(gather):
  """The unrolled loop on 8 fsdp devices, with and without gathered weights, gives the scan's
  update (float32)."""
  from benchmarks.common import grpo_batch
  mesh = sharding.make_mesh(fsdp=8)
  out = {}
  for scan in (True, False):
    cfg = models.get_config("tiny-qwen3", scan_layers=scan)
    params = models.init_params(cfg, jax.random.key(0), std=0.1)
    scfg = step.StepConfig(micro_batches=2, entropy=False, gather_weights=gather)
    learner = step.Learner(cfg, scfg, optax.sgd(0.5), mesh)
    new, _ = learner.train_step(learner.init(params), grpo_batch(cfg, 16, 8, 24))
    out[scan] = jax.device_get(models.unbox(new.params))
  assert jax.tree.structure(out[True]) == jax.tree.structure(out[False])
  for a, b in zip(jax.tree.leaves(out[True]), jax.tree.leaves(out[False])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # sharded sums' order


@pytest.mark.parametrize("kwargs,match", [
    (dict(learning_rate=float("nan")), "learning_rate must be a finite number > 0"),
    (dict(learning_rate=float("inf")), "learning_rate must be a finite number > 0"),
    (dict(learning_rate=0.0), "learning_rate must be a finite number > 0"),
    (dict(learning_rate=1e-3, max_grad_norm=-1.0), "max_grad_norm must be a finite number >= 0"),
    (dict(learning_rate=1e-3, max_grad_norm=float("nan")), "max_grad_norm"),
    (dict(learning_rate=1e-3, weight_decay=-0.1), "weight_decay"),
    (dict(learning_rate=1e-3, b2=1.0), "b2 must be a finite number in"),
    (dict(learning_rate=1e-3, warmup_steps=-2), "warmup_steps must be an int >= 0"),
])
def test_make_optimizer_rejects_values_that_would_poison_or_invert_training(kwargs, match):
  with pytest.raises(ValueError, match=match):
    step.make_optimizer(**kwargs)


def _lrs(n, **kw):
  """The learning rate of each of the first n updates (SGD-like: b1 = b2 = eps = 0)."""
  opt = step.make_optimizer(1.0, max_grad_norm=None, b1=0.0, b2=0.0, eps=0.0, **kw)
  p = {"w": jnp.ones(())}
  state, out = opt.init(p), []
  for _ in range(n):
    u, state = opt.update({"w": jnp.ones(())}, state, p)
    out.append(-float(u["w"]))
  return np.array(out)


def test_decay_schedules_without_warmup_start_at_the_full_rate():
  # warmup_steps=0 used to become a one-step warmup: the first update had learning rate 0.
  np.testing.assert_allclose(_lrs(4, schedule="cosine", total_steps=4),
                             0.5 * (1 + np.cos(np.pi * np.arange(4) / 4)), atol=1e-6)
  np.testing.assert_allclose(_lrs(4, schedule="linear", total_steps=4), [1, .75, .5, .25],
                             atol=1e-6)
  # With a warmup: 0, 1/w, ..., then the decay over the remaining steps.
  np.testing.assert_allclose(_lrs(6, schedule="linear", warmup_steps=2, total_steps=6),
                             [0, .5, 1, .75, .5, .25], atol=1e-6)
  np.testing.assert_allclose(_lrs(4, warmup_steps=2), [0, .5, 1, 1], atol=1e-6)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
@pytest.mark.parametrize("total", [None, 0, 3, 2.5])
def test_decay_schedule_needs_total_steps_past_the_warmup(schedule, total):
  with pytest.raises(ValueError, match="needs an int total_steps > warmup_steps"):
    step.make_optimizer(1e-3, schedule=schedule, warmup_steps=3, total_steps=total)


def test_max_grad_norm_zero_or_none_turns_clipping_off():
  g = {"w": jnp.array([30.0, 40.0])}
  for norm in (None, 0, 0.0):
    opt = step.make_optimizer(0.1, max_grad_norm=norm)
    updates, _ = opt.update(g, opt.init(g), g)
    assert float(updates["w"][0]) < 0  # descent, Adam's first step -lr * sign(g)
  opt = step.make_optimizer(0.1, max_grad_norm=1.0)
  updates, _ = opt.update(g, opt.init(g), g)
  assert float(updates["w"][0]) < 0


@pytest.mark.parametrize("t", [0.0, -1.0, float("inf"), float("nan")])
def test_step_config_temperature_must_be_finite_and_positive(t):
  with pytest.raises(ValueError, match="StepConfig.temperature must be a finite number > 0"):
    step.StepConfig(temperature=t)


@pytest.mark.parametrize("field,value", [("micro_batches", 2.0), ("micro_batches", 0), ("logprob_chunk", 256.0),
                                         ("logprob_chunk_tokens", True), ("logprob_chunk", -1)])
def test_step_config_sizes_must_be_positive_ints(field, value):
  # A float failed inside the step ("Shapes must be 1D sequences of concrete values of integer
  # type"), a negative chunk there too.
  with pytest.raises(ValueError, match=f"StepConfig.{field} must be an int >= 1, got {value!r}"):
    step.StepConfig(**{field: value})
  assert step.StepConfig(micro_batches=np.int64(2)).micro_batches == 2


def test_learner_parts_warm_start_fits_the_untempered_distribution():
  # The RL learner scores at the sampler's temperature; the SFT cross-entropy must not: at 0.7
  # it would fit logits / 0.7 to the demonstrations.
  from configs.quickstart import get_config
  c = get_config("tiny")
  c.rollout.temperature = 0.7
  (scfg, _), (sft_scfg, _) = step.learner_parts(c)
  assert scfg.temperature == 0.7 and scfg.objective == "rl"
  assert sft_scfg.temperature == 1.0 and sft_scfg.objective == "sft"
  assert dataclasses.replace(sft_scfg, temperature=0.7, objective="rl", entropy=scfg.entropy) == scfg


def test_put_batch_names_rows_that_do_not_split_over_the_data_devices():
  learner = step.Learner(CFG, step.StepConfig(), optax.sgd(0.1), sharding.make_mesh(2, 2, 2))
  batch = {"tokens": np.zeros((6, 8), np.int32), "loss_mask": np.zeros((6, 8), np.float32)}
  with pytest.raises(ValueError, match=r"'tokens' has 6 rows, not a multiple of the 4 "
                     r"data-parallel devices \(mesh data x fsdp = 2 x 2\)"):
    learner.put_batch(batch)
  placed = learner.put_batch({k: np.zeros((8, 8), v.dtype) for k, v in batch.items()})
  assert len(placed["tokens"].sharding.device_set) == 8


@pytest.mark.parametrize("seg,match", [
    ([1, 1, 2, 2, 1, 1, 0, 0], r"row 1: id 1 starts at column 0 and again at column 4"),
    ([1, 1, 2, 2, 9, 9, 0, 0], r"segment_ids\[1, 4\] = 9 is outside \[0, 8\]"),
    ([1, 1, 2, 2, -1, -1, 0, 0], r"segment_ids\[1, 4\] = -1 is outside \[0, 8\]")])
def test_put_batch_rejects_segment_ids_the_loss_would_misread(seg, match):
  # Attention and positions take each contiguous run as a trajectory; the loss reduces per
  # (row, id), so ids 1, 2, 1 were silently one GSPO sequence, and ids > L made the loss NaN.
  learner = step.Learner(CFG, step.StepConfig(), optax.sgd(0.1))
  good = np.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 2, 2, 3, 3, 0, 0]], np.int32)
  assert learner.put_batch({"segment_ids": good})["segment_ids"].shape == (2, 8)
  with pytest.raises(ValueError, match=match):
    learner.put_batch({"segment_ids": np.stack([good[0], np.asarray(seg, np.int32)])})
  with pytest.raises(ValueError, match=match):
    learner.score(None, {"tokens": np.zeros((2, 8), np.int32),
                         "segment_ids": np.stack([good[0], np.asarray(seg, np.int32)])})


@pytest.mark.parametrize("col,match", [
    (0, r"loss_mask\[1, 0\] > 0 on the first token of its segment"),
    (3, r"loss_mask\[1, 3\] > 0 on the first token of its segment"),
    (7, r"loss_mask\[1, 7\] > 0 on padding")])
def test_put_batch_rejects_a_loss_mask_on_a_position_without_its_own_log_prob(col, match):
  # A segment's first position holds the previous trajectory's prediction of its first token
  # (0 in column 0): a hand-built batch that trained it ran without a word.
  learner = step.Learner(CFG, step.StepConfig(), optax.sgd(0.1))
  seg = np.array([[1, 1, 1, 2, 2, 2, 0, 0], [1, 1, 1, 2, 2, 2, 2, 0]], np.int32)
  mask = np.array([[0, 1, 1, 0, 1, 1, 0, 0], [0, 1, 1, 0, 1, 1, 1, 0]], np.float32)
  assert learner.put_batch({"segment_ids": seg, "loss_mask": mask})["loss_mask"].shape == (2, 8)
  mask[1, col] = 1.0
  with pytest.raises(ValueError, match=match):
    learner.put_batch({"segment_ids": seg, "loss_mask": mask})


@pytest.mark.parametrize("bad", [CFG.vocab_size, -3])
def test_put_batch_rejects_token_ids_outside_the_vocabulary(bad):
  # One past the embedding table made the trajectory's log-probs and the step's loss NaN (the
  # step stopped blaming the learning rate); a negative id was wrapped onto another token.
  learner = step.Learner(CFG, step.StepConfig(), optax.sgd(0.1))
  tokens = np.array([[1, 2, 3, 4], [5, 6, 7, CFG.vocab_size - 1]], np.int32)
  assert learner.put_batch({"tokens": tokens})["tokens"].shape == (2, 4)
  tokens[1, 2] = bad
  with pytest.raises(ValueError, match=rf"tokens\[1, 2\] = {bad} is outside the model's "
                     rf"vocabulary \[0, {CFG.vocab_size}\)"):
    learner.put_batch({"tokens": tokens})


_COMPILE_ON_DATA_MESHES = """
import jax, numpy as np, optax
from jaxagent import models, sharding
from jaxagent.rl import step
from tests.rl.step_test import CFG, _batch, _items

params = models.init_params(CFG, jax.random.key(0), std=0.1)
_, b = _batch(_items(16, seed=3), max_len=32, rows_multiple=8)
for mesh in [(2, 2, 2), (2, 4, 1)]:
  learner = step.Learner(CFG, step.StepConfig(micro_batches=2), optax.sgd(0.1),
                         sharding.make_mesh(*mesh))
  state = learner.init(params)
  batch = learner.put_batch({k: np.asarray(v) for k, v in b.items()})
  learner.train_step_fn(state).lower(state, batch).compile()
  print("compiled", mesh, flush=True)
"""


@pytest.mark.slow  # a compile-log regression check in a process of its own: 30 s on 2 cores
def test_update_on_a_data_mesh_moves_no_activation_through_a_full_copy():
  """The embedding lookup's output (and its gradient) go straight to the rows' split: XLA's
  partitioner logged "Involuntary full rematerialization" (every device holding the whole
  batch's embeddings, then slicing its rows) for the lookup and its transpose on meshes with
  data > 1. In a process of its own, with the persistent compilation cache off: a cache hit
  compiles nothing and logs nothing."""
  import os
  import pathlib
  import subprocess
  import sys

  env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false")
  root = pathlib.Path(__file__).resolve().parents[2]
  out = subprocess.run([sys.executable, "-c", _COMPILE_ON_DATA_MESHES], cwd=root, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.count("compiled") == 2, out.stdout
  assert "Involuntary full rematerialization" not in out.stderr, out.stderr[-3000:]


@pytest.mark.slow  # about 30 s of compiles on 2 cores
@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (2, 1, 4)])
def test_gspo_update_is_the_same_on_meshes_whose_axes_do_not_divide_the_model(mesh_shape):
  """A GSPO update with a KL term over two micro-batches gives one device's loss, gradient
  norm, params and optimizer state on a mesh where the tensor axis divides neither the heads
  (6), the KV heads (2) nor the vocabulary (510), so they fall back to replication (2 x 1 x 4),
  or where a micro-batch's 4 rows do not split over the 8 fsdp devices (1 x 8 x 1); the new
  params and their momentum keep the layout `sharding.shardings` gives them."""
  cfg = models.get_config("tiny-llama", n_heads=6, n_kv_heads=2, vocab_size=510, ffn_dim=96)
  params = models.init_params(cfg, jax.random.key(0), std=0.1)
  batch = two_sequence_rows(cfg.vocab_size)
  scfg = step.StepConfig(loss=losses.LossConfig(algo="gspo", kl_coef=0.1), micro_batches=2)
  out = []
  for mesh in (sharding.make_mesh(devices=jax.devices()[:1]), sharding.make_mesh(*mesh_shape)):
    # SGD with momentum: params move by the gradients (Adam would amplify rounding noise).
    learner = step.Learner(cfg, scfg, optax.chain(optax.trace(0.9), optax.sgd(0.5)), mesh)
    state, metrics = learner.train_step(learner.init(params), batch)
    out.append((mesh, state, metrics))
  (_, ref, ref_m), (mesh, state, m) = out
  assert m["loss"] == pytest.approx(ref_m["loss"], rel=1e-5)
  assert m["grad_norm"] == pytest.approx(ref_m["grad_norm"], rel=1e-5)
  for a, c in zip(jax.tree.leaves((ref.params, ref.opt_state)),
                  jax.tree.leaves((state.params, state.opt_state))):
    # Gradients of norm ~150 summed in another order: a few 1e-6 apart.
    np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=1e-5, atol=1e-5)
  want = models.unbox(sharding.shardings(jax.eval_shape(lambda: params), mesh))
  got = models.unbox(state.params)
  trace = models.unbox(state.opt_state[0].trace)
  for w, p, t in zip(jax.tree.leaves(want), jax.tree.leaves(got), jax.tree.leaves(trace)):
    assert p.sharding.spec == w.spec and t.sharding.spec == w.spec
  # The rules still split what divides: the model dim over fsdp, the MLP over tensor.
  assert got["layers"]["w_up"].sharding.spec == (P(None, None, "tensor") if mesh_shape[2] > 1
                                                 else P(None, "fsdp", None))
