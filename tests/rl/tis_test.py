"""Truncated importance sampling of the behaviour policy (`LossConfig.tis_cap`, `behavior_logps`).

The reference re-derives the weights from the formula in `jaxagent/rl/losses.py`'s docstring in
NumPy, one trajectory at a time (token: min(pi_prox / pi_behav, cap) per token; sequence: the
product over the trajectory's policy tokens, truncated), and the surrogate from `losses_test`'s
loop-based reference; the learner step is checked against the loss without the weights.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxagent import models
from jaxagent.rl import losses, step
from jaxagent.rl.losses import LossConfig, policy_loss, policy_loss_parts
from tests.rl.losses_test import ONE_PER_ROW, PACKED_ROWS, make_trajs, ppo_objective, to_batch
from tests.rl.step_test import two_sequence_rows

CAP = 1.5


def _behavior(trajs, seed=1):
  """Behaviour log-probs off the old ones by up to about +-1 nat on policy tokens (so the cap
  binds on some tokens and segments and not on others) and junk (NaN, -inf) elsewhere."""
  rng = np.random.default_rng(seed)
  out = []
  for k, tr in enumerate(trajs):
    b = tr.old + rng.normal(0, 0.5, tr.mask.size)
    b = np.where(tr.mask > 0, b, [np.nan, -np.inf, 3.0][k % 3])
    out.append(b.astype(np.float32).astype(np.float64))
  return out


def _ref_weights(trajs, behav, cap, level):
  """Per trajectory: the weight of each policy token (NumPy, float64)."""
  out = []
  for tr, b in zip(trajs, behav):
    idx = np.flatnonzero(tr.mask > 0)
    d = tr.old[idx] - b[idx]
    out.append(np.minimum(np.exp(d), cap) if level == "token"
               else np.full(idx.size, min(np.exp(d.sum()), cap)))
  return out


def _ref_loss(trajs, weights, cfg):
  """The weighted policy-gradient loss (no KL, no entropy) of `cfg` on unpacked trajectories."""
  per_seq = []
  for tr, w in zip(trajs, weights):
    idx = np.flatnonzero(tr.mask > 0)
    if not idx.size:
      continue
    if cfg.algo == "grpo":
      pg = [-ppo_objective(np.exp(tr.lp[t] - tr.old[t]), tr.adv[t], cfg) for t in idx]
    else:  # gspo and gspo_token have the same value
      s = np.exp(np.mean(tr.lp[idx] - tr.old[idx]))
      if cfg.algo == "gspo":
        pg = [-ppo_objective(s, np.mean(tr.adv[idx]), cfg)] * idx.size
      else:
        pg = [-ppo_objective(s, tr.adv[t], cfg) for t in idx]
    per_seq.append(np.asarray(pg) * w)
  if cfg.agg == "token_mean":
    return sum(s.sum() for s in per_seq) / sum(s.size for s in per_seq)
  return np.mean([s.mean() for s in per_seq])  # seq_mean_token_mean


def _args(arr, seg, behav_BxL=None):
  a = {k: jnp.asarray(v, jnp.float32) for k, v in arr.items()}
  out = dict(logps=a["lp"], old_logps=a["old"], advantages=a["adv"], loss_mask=a["mask"],
             segment_ids=jnp.asarray(seg))
  if behav_BxL is not None:
    out["behavior_logps"] = jnp.asarray(behav_BxL, jnp.float32)
  return out


def _lay(trajs, behav, rows, L, fill=0.0):
  arr, seg, where = to_batch(trajs, rows, L)
  b = np.full(seg.shape, fill)
  for i, (r, o, n) in where.items():
    b[r, o:o + n] = behav[i]
  return arr, seg, where, b


def _loss_grad(args, cfg):
  def f(lp):
    return policy_loss(**{**args, "logps": lp}, cfg=cfg)
  (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(args["logps"])
  return loss, metrics, np.asarray(g)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("algo,agg", [("grpo", "token_mean"), ("gspo", "seq_mean_token_mean"),
                                      ("gspo_token", "token_mean")])
@pytest.mark.parametrize("rows,L", [(ONE_PER_ROW, 24), (PACKED_ROWS, 64)])
def test_weights_loss_and_metrics_match_the_formula(level, algo, agg, rows, L):
  trajs = make_trajs()
  behav = _behavior(trajs)
  cfg = LossConfig(algo=algo, agg=agg, clip_low=0.2, clip_high=0.28, dual_clip=3.0, tis_cap=CAP,
                   tis_level=level)
  arr, seg, _, b = _lay(trajs, behav, rows, L)
  loss, m, _ = _loss_grad(_args(arr, seg, b), cfg)
  w = _ref_weights(trajs, behav, CAP, level)
  np.testing.assert_allclose(float(loss), _ref_loss(trajs, w, cfg), rtol=1e-5, atol=1e-6)
  # Units: policy tokens ("token") or live trajectories ("sequence").
  units = (np.concatenate(w) if level == "token" else np.array([x[0] for x in w if x.size]))
  raw = (np.concatenate([np.exp(tr.old[tr.mask > 0] - bb[tr.mask > 0]) for tr, bb in zip(trajs, behav)])
         if level == "token" else
         np.array([np.exp(np.sum(tr.old[tr.mask > 0] - bb[tr.mask > 0])) for tr, bb in zip(trajs, behav)
                   if tr.mask.sum()]))
  clipped = np.mean(raw > CAP)
  assert 0 < clipped < 1  # the cap binds on some units, not all (else this test proves little)
  np.testing.assert_allclose(float(m["tis_weight_mean"]), units.mean(), rtol=1e-5)
  np.testing.assert_allclose(float(m["tis_clip_frac"]), clipped, rtol=1e-6)
  q = np.concatenate([np.exp(tr.old[tr.mask > 0] - bb[tr.mask > 0]) for tr, bb in zip(trajs, behav)])
  np.testing.assert_allclose(float(m["behavior_kl"]), np.mean(q - 1 - np.log(q)), rtol=1e-5)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("algo", ["grpo", "gspo_token"])
def test_gradient_is_the_weight_times_the_unweighted_gradient(level, algo):
  """The weight is a constant: d(w_t pg_t)/d logp_t = w_t d pg_t / d logp_t, token by token
  (gspo_token's gradient flows through token t only, so the same holds there)."""
  trajs = make_trajs()
  behav = _behavior(trajs)
  arr, seg, where, b = _lay(trajs, behav, PACKED_ROWS, 64)
  cfg = LossConfig(algo=algo, clip_low=0.2, clip_high=0.28, tis_cap=CAP, tis_level=level)
  _, _, g = _loss_grad(_args(arr, seg, b), cfg)
  _, _, g0 = _loss_grad(_args(arr, seg), dataclasses.replace(cfg, tis_cap=None))
  w = np.ones_like(g)
  for i, wi in enumerate(_ref_weights(trajs, behav, CAP, level)):
    r, o, n = where[i]
    w[r, o:o + n][trajs[i].mask > 0] = wi
  assert np.count_nonzero(g0) > 20
  np.testing.assert_allclose(g, w * g0, rtol=2e-5, atol=1e-9)


def test_tis_off_is_bitwise_the_plain_loss_and_behavior_logps_add_metrics_only():
  trajs = make_trajs()
  arr, seg, _, b = _lay(trajs, _behavior(trajs), PACKED_ROWS, 64)
  cfg = LossConfig(algo="grpo", clip_high=0.28, dual_clip=3.0)
  loss0, m0, g0 = _loss_grad(_args(arr, seg), cfg)
  loss1, m1, g1 = _loss_grad(_args(arr, seg, b), cfg)
  assert float(loss1) == float(loss0) and np.array_equal(g1, g0)
  assert set(m1) - set(m0) == {"behavior_kl"}  # no tis_* metrics without a cap
  assert all(np.array_equal(m0[k], m1[k]) for k in m0)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("algo,agg", [("grpo", "token_mean"), ("gspo", "seq_mean_token_sum"),
                                      ("gspo_token", "seq_mean_token_mean")])
def test_behaviour_equal_to_old_gives_weight_one_and_exactly_the_plain_loss(level, algo, agg):
  trajs = make_trajs()
  arr, seg, _ = to_batch(trajs, PACKED_ROWS, 64)
  cfg = LossConfig(algo=algo, agg=agg, clip_high=0.28, tis_cap=2.0, tis_level=level)
  loss, m, g = _loss_grad(_args(arr, seg, arr["old"]), cfg)
  loss0, _, g0 = _loss_grad(_args(arr, seg), dataclasses.replace(cfg, tis_cap=None))
  assert float(loss) == float(loss0) and np.array_equal(g, g0)
  assert float(m["tis_weight_mean"]) == 1.0 and float(m["tis_clip_frac"]) == 0.0
  assert float(m["behavior_kl"]) == 0.0
  # A cap of 1 with equal policies: every weight is exactly at the cap, and the cap truncates
  # nothing (tis_clip_frac counts weights above the cap).
  _, m1, g1 = _loss_grad(_args(arr, seg, arr["old"]), dataclasses.replace(cfg, tis_cap=1.0))
  assert float(m1["tis_clip_frac"]) == 0.0 and np.array_equal(g1, g0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_junk_behaviour_log_probs_off_policy_tokens_change_nothing(level):
  """NaN, -inf and +inf behaviour log-probs outside policy tokens: the same loss, metrics and
  (finite) gradient as zeros there, and zero gradient on those positions."""
  trajs = make_trajs()
  behav = _behavior(trajs)
  cfg = LossConfig(algo="grpo", clip_high=0.28, tis_cap=CAP, tis_level=level)
  results = []
  for fill in (np.nan, -np.inf, np.inf, 0.0):
    arr, seg, _, b = _lay(trajs, behav, PACKED_ROWS, 64, fill=fill)
    off = ~((arr["mask"] > 0) & (seg > 0))
    b[off] = fill
    results.append(_loss_grad(_args(arr, seg, b), cfg))
  loss_ref, m_ref, g_ref = results[-1]
  assert np.isfinite(float(loss_ref)) and np.all(np.isfinite(g_ref))
  assert np.all(g_ref[off] == 0.0)
  for loss, m, g in results[:-1]:
    assert float(loss) == float(loss_ref) and np.array_equal(g, g_ref)
    assert all(float(m[k]) == float(m_ref[k]) for k in m_ref)


def test_behaviour_log_probs_far_off_are_bounded():
  """A behaviour log-prob of -inf on a policy token (pi_behav gave it no mass) holds the weight
  at the cap and the metrics finite; the gradient stays finite."""
  trajs = make_trajs()
  arr, seg, _ = to_batch(trajs, PACKED_ROWS, 64)
  b = arr["old"].copy()
  r, c = np.argwhere((arr["mask"] > 0) & (seg > 0))[0]
  b[r, c] = -np.inf
  for level in ("token", "sequence"):
    cfg = LossConfig(tis_cap=CAP, tis_level=level)
    loss, m, g = _loss_grad(_args(arr, seg, b), cfg)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(g))
    assert all(np.isfinite(float(v)) for v in m.values())
    assert float(m["tis_clip_frac"]) > 0


def test_missing_or_misshapen_behavior_logps_and_bad_settings_are_named():
  trajs = make_trajs()
  arr, seg, _ = to_batch(trajs, PACKED_ROWS, 64)
  a = _args(arr, seg)
  with pytest.raises(ValueError, match=r"tis_cap=2.0 needs behavior_logps"):
    policy_loss_parts(**a, cfg=LossConfig(tis_cap=2.0))
  with pytest.raises(ValueError, match=r"behavior_logps has shape \(3, 63\); expected \(3, 64\)"):
    policy_loss_parts(**a, cfg=LossConfig(tis_cap=2.0), behavior_logps=np.zeros((3, 63)))
  for bad in (0.5, float("inf"), float("nan"), 0.0):
    with pytest.raises(ValueError, match=r"LossConfig.tis_cap=.* must be None \(off\) or a finite constant >= 1"):
      LossConfig(tis_cap=bad)
  for bad in ("2", True):
    with pytest.raises(ValueError, match=r"LossConfig.tis_cap=.* must be a number or None"):
      LossConfig(tis_cap=bad)
  with pytest.raises(ValueError, match=r"LossConfig.tis_level='seq' is not supported; allowed values: "
                     r"\('token', 'sequence'\)"):
    LossConfig(tis_level="seq")
  assert LossConfig(tis_cap=1).tis_cap == 1  # a cap of 1 only ever down-weights: allowed


def test_micro_batched_parts_combine_to_the_whole_batch():
  """tis_weight_mean / tis_clip_frac are (sum, count) pairs like every other metric: two halves
  combined equal the whole batch."""
  trajs = make_trajs()
  behav = _behavior(trajs)
  arr, seg, _, b = _lay(trajs, behav, PACKED_ROWS + [[]], 64)
  a = _args(arr, seg, b)
  cfg = LossConfig(tis_cap=CAP, tis_level="sequence", agg="seq_mean_token_mean")
  whole = losses.finalize_parts(policy_loss_parts(**a, cfg=cfg))
  halves = [policy_loss_parts(**{k: v[s] for k, v in a.items()}, cfg=cfg) for s in (slice(0, 2), slice(2, 4))]
  both = losses.finalize_parts(losses.combine_parts(*halves))
  for k in ("tis_weight_mean", "tis_clip_frac", "behavior_kl", "loss"):
    np.testing.assert_allclose(float(both[1][k]), float(whole[1][k]), rtol=1e-6)


# ----------------------------------------------------------------------------- the learner step

CFG = models.get_config("tiny-qwen3")


@pytest.fixture(scope="module")
def params():
  return models.init_params(CFG, jax.random.key(0), std=0.1)


def _step(params, scfg, batch):
  learner = step.Learner(CFG, scfg, optax.sgd(0.1))
  state, metrics = learner.train_step(learner.init(params), batch)
  return learner, jax.device_get(state.params), metrics


def test_train_step_weights_by_the_sampler_and_reports_the_metrics(params):
  batch = two_sequence_rows(CFG.vocab_size, rows=4)
  scfg = step.StepConfig(loss=LossConfig(tis_cap=2.0), entropy=False)
  learner = step.Learner(CFG, scfg, optax.sgd(0.1))
  prox, _ = learner.score(params, batch)
  prox = np.asarray(prox)
  mask = batch["loss_mask"] > 0
  # The proximal log-probs are the learner's own (ratio 1 on the first update); the sampler's
  # are off by up to +-1 nat, so the cap binds on some tokens.
  behav = prox + np.random.default_rng(3).uniform(-1, 1, prox.shape).astype(np.float32)
  tis = {**batch, "old_logps": prox, "behavior_logps": behav}
  _, p_tis, m = _step(params, scfg, tis)
  for k in ("tis_weight_mean", "tis_clip_frac", "behavior_kl"):
    assert np.isfinite(m[k]), k
  q = np.exp(prox - behav)[mask]
  np.testing.assert_allclose(m["tis_weight_mean"], np.minimum(q, 2.0).mean(), rtol=1e-4)
  np.testing.assert_allclose(m["tis_clip_frac"], np.mean(q > 2.0), rtol=1e-6)
  assert 0 < m["tis_clip_frac"] < 1
  # logprob_gap is against the sampler (the behaviour policy), not the learner's own old_logps.
  np.testing.assert_allclose(m["logprob_gap"], np.abs(prox - behav)[mask].mean(), rtol=1e-4)
  # The weights changed the update; with the sampler equal to the proximal policy they do not.
  _, p_plain, m_plain = _step(params, dataclasses.replace(scfg, loss=LossConfig()),
                              {**batch, "old_logps": prox})
  _, p_one, m_one = _step(params, scfg, {**batch, "old_logps": prox, "behavior_logps": prox})
  leaves = lambda p: jax.tree.leaves(p)
  # (equal to float rounding: the two programs differ, and XLA:CPU's kernels for them need
  # not round alike: 3e-8 apart; weights of 1.001 instead of 1 move them by 2e-5)
  for a, b in zip(leaves(p_one), leaves(p_plain)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-7)
  assert not all(np.allclose(a, b) for a, b in zip(leaves(p_tis), leaves(p_plain)))
  assert m_one["loss"] == m_plain["loss"] and m_one["tis_weight_mean"] == 1.0


def test_train_step_without_behavior_logps_names_the_key(params):
  batch = two_sequence_rows(CFG.vocab_size, rows=2)
  scfg = step.StepConfig(loss=LossConfig(tis_cap=2.0), entropy=False)
  learner = step.Learner(CFG, scfg, optax.sgd(0.1))
  state = learner.init(params)
  with pytest.raises(ValueError, match=r"tis_cap=2.0 needs the batch key 'behavior_logps'"):
    learner.train_step(state, batch)
  with pytest.raises(ValueError, match=r"needs the batch key 'behavior_logps'"):  # the pure step too
    step.train_step(state, batch, cfg=CFG, scfg=scfg, optimizer=optax.sgd(0.1))
  # The warm start keeps the run's loss settings but reads no log-probs.
  sft = dataclasses.replace(scfg, objective="sft")
  step._check_behavior_key(batch, sft)


def test_learner_parts_read_the_tis_settings():
  from configs.quickstart import get_config
  c = get_config("tiny")
  (scfg, _), (sft_scfg, _) = step.learner_parts(c)
  assert scfg.loss.tis_cap is None and scfg.loss.tis_level == "token"  # keys absent: off
  c.loss.tis_cap, c.loss.tis_level = 2.0, "sequence"
  (scfg, _), (sft_scfg, _) = step.learner_parts(c)
  assert scfg.loss.tis_cap == 2.0 and scfg.loss.tis_level == "sequence"


def test_only_the_policy_gradient_term_is_weighted():
  """The KL and entropy terms keep their weights: loss = weighted pg + kl_coef kl - ent_coef ent."""
  trajs = make_trajs()
  behav = _behavior(trajs)
  arr, seg, _, b = _lay(trajs, behav, PACKED_ROWS, 64)
  cfg = LossConfig(clip_high=0.28, kl_coef=0.1, entropy_coef=0.01, tis_cap=CAP)
  a = {**_args(arr, seg, b), "ref_logps": jnp.asarray(arr["ref"], jnp.float32),
       "entropies": jnp.asarray(arr["ent"], jnp.float32)}
  loss, m = policy_loss(**a, cfg=cfg)
  _, m0 = policy_loss(**{k: v for k, v in a.items() if k != "behavior_logps"},
                      cfg=dataclasses.replace(cfg, tis_cap=None))
  w = _ref_weights(trajs, behav, CAP, "token")
  np.testing.assert_allclose(float(m["pg_loss"]), _ref_loss(trajs, w, cfg), rtol=1e-5)
  assert float(m["kl_loss"]) == float(m0["kl_loss"]) and float(m["entropy"]) == float(m0["entropy"])
  np.testing.assert_allclose(float(loss), float(m["pg_loss"] + 0.1 * m["kl_loss"] - 0.01 * m["entropy"]),
                             rtol=1e-5)
  assert abs(float(m["pg_loss"]) - float(m0["pg_loss"])) > 1e-3  # the weights did change pg


def test_micro_batched_tis_step_equals_one_batch_and_compiles_once_per_key_set(params):
  """behavior_logps splits into micro-batches with the other keys (the sequence weights and
  their metrics sum over micro-batches like one batch); a second batch with the same keys
  reuses the compiled program."""
  batch = two_sequence_rows(CFG.vocab_size, rows=4)
  rng = np.random.default_rng(5)
  batch["behavior_logps"] = batch["old_logps"] + rng.uniform(-0.3, 0.3, batch["old_logps"].shape).astype(np.float32)
  loss = LossConfig(agg="seq_mean_token_mean", tis_cap=1.2, tis_level="sequence")
  scfg = step.StepConfig(loss=loss, entropy=False)
  _, p1, m1 = _step(params, scfg, batch)
  learner = step.Learner(CFG, dataclasses.replace(scfg, micro_batches=2), optax.sgd(0.1))
  state, m2 = learner.train_step(learner.init(params), batch)
  for k in ("loss", "tis_weight_mean", "tis_clip_frac", "behavior_kl", "logprob_gap"):
    np.testing.assert_allclose(m2[k], m1[k], rtol=1e-5, err_msg=k)
  assert 0 < m1["tis_clip_frac"] < 1
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(jax.device_get(state.params))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
  learner.train_step(state, {**batch, "advantages": -batch["advantages"]})
  assert learner.train_step_fn(state)._cache_size() == 1

