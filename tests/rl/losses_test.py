"""Tests for jaxagent/rl/losses.py against an independent, loop-based NumPy reference.

The reference below is written from the papers' formulas (PPO/DAPO clip, dual-clip PPO, GSPO
eq. (5)-(7), GSPO-token, Schulman's k1/k2/k3, the four aggregation modes), one trajectory at a
time, with no packing and no masking tricks; gradients come from central finite differences in
float64. GSPO-token's stop-gradients are modelled by a second, frozen copy of the log-probs.
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.rl.losses import MAX_LOG_RATIO, LossConfig, combine_parts, finalize_parts, policy_loss, policy_loss_parts

ALGOS = ("grpo", "gspo", "gspo_token")
AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
ESTIMATORS = ("k1", "k2", "k3")
MAX_LEN_NORM = 16.0


def make_cfg(algo="grpo", agg="token_mean", **kw):
    if agg == "seq_mean_token_sum_norm":
        kw.setdefault("max_len_norm", MAX_LEN_NORM)
    return LossConfig(algo=algo, agg=agg, **kw)


# ----------------------------------------------------------------------------- NumPy reference


@dataclasses.dataclass
class Traj:
    mask: np.ndarray  # [n] 1 on policy tokens
    old: np.ndarray
    adv: np.ndarray
    ref: np.ndarray
    ent: np.ndarray
    lp: np.ndarray  # learner log-probs (the differentiated input)


def ppo_objective(r, a, cfg):
    """Per-unit objective (to maximise): min(r A, clip(r) A), dual-clipped below by c A for A < 0."""
    obj = min(r * a, float(np.clip(r, 1 - cfg.clip_low, 1 + cfg.clip_high)) * a)
    if cfg.dual_clip is not None and a < 0:
        obj = max(obj, cfg.dual_clip * a)
    return obj


def kl_estimate(lp, ref, estimator):
    if estimator == "k1":
        return lp - ref
    if estimator == "k2":
        return 0.5 * (lp - ref) ** 2
    return np.exp(ref - lp) - (ref - lp) - 1.0


def reference_loss(trajs, lps, cfg, lps_frozen=None, use_ref=True, use_ent=True):
    """Loss of `cfg` on unpacked trajectories; `lps_frozen` plays the stop-gradient copy."""
    lps_frozen = lps if lps_frozen is None else lps_frozen
    per_seq = []  # per live trajectory: its per-token total losses
    for tr, lp, lp_sg in zip(trajs, lps, lps_frozen):
        idx = [t for t in range(len(tr.mask)) if tr.mask[t] > 0]
        if not idx:
            continue
        if cfg.algo == "grpo":
            pg = [-ppo_objective(np.exp(lp[t] - tr.old[t]), tr.adv[t], cfg) for t in idx]
        elif cfg.algo == "gspo":
            s = np.exp(np.mean([lp[t] - tr.old[t] for t in idx]))
            a = np.mean([tr.adv[t] for t in idx])
            pg = [-ppo_objective(s, a, cfg)] * len(idx)
        else:
            s_sg = np.exp(np.mean([lp_sg[t] - tr.old[t] for t in idx]))
            pg = [-ppo_objective(s_sg * np.exp(lp[t] - lp_sg[t]), tr.adv[t], cfg) for t in idx]
        tot = []
        for k, t in enumerate(idx):
            x = pg[k]
            if use_ref:
                x += cfg.kl_coef * kl_estimate(lp[t], tr.ref[t], cfg.kl_estimator)
            if use_ent:
                x -= cfg.entropy_coef * tr.ent[t]
            tot.append(x)
        per_seq.append(tot)
    if cfg.agg == "token_mean":
        return sum(sum(s) for s in per_seq) / sum(len(s) for s in per_seq)
    if cfg.agg == "seq_mean_token_mean":
        return np.mean([np.mean(s) for s in per_seq])
    if cfg.agg == "seq_mean_token_sum":
        return np.mean([np.sum(s) for s in per_seq])
    return np.mean([np.sum(s) / cfg.max_len_norm for s in per_seq])


def reference_grad(trajs, cfg, h=1e-6, **kw):
    """d loss / d lp by central differences (float64), with the frozen copy held at lp."""
    lps = [tr.lp.astype(np.float64) for tr in trajs]
    grads = [np.zeros_like(lp) for lp in lps]
    for i, tr in enumerate(trajs):
        for t in np.flatnonzero(tr.mask > 0):
            plus = [x.copy() for x in lps]
            minus = [x.copy() for x in lps]
            plus[i][t] += h
            minus[i][t] -= h
            f_plus = reference_loss(trajs, plus, cfg, lps_frozen=lps, **kw)
            f_minus = reference_loss(trajs, minus, cfg, lps_frozen=lps, **kw)
            grads[i][t] = (f_plus - f_minus) / (2 * h)
    return grads


# ----------------------------------------------------------------------------- test data

# (log-ratio offset, advantage) per trajectory, chosen so every branch is exercised with
# clip_low=0.2, clip_high=0.28, dual_clip=3: unclipped, low clip, high clip, dual clip, a ratio
# between 1.2 and 1.28 (clipped only without clip-higher), A > 0 with r < 0.8 (never clipped).
SEQ_PLAN = [(0.0, 1.0), (0.05, -0.7), (-0.5, -1.2), (0.45, 0.9), (1.3, -0.5), (0.24, 0.8), (-0.4, 0.6)]


def make_trajs(seed=0, plan=SEQ_PLAN, token_adv_noise=0.1, with_empty=True):
    """Multi-turn-like trajectories: prompt, policy turn, observation, policy turn."""
    rng = np.random.default_rng(seed)
    trajs = []
    for offset, adv in plan:
        n_prompt, n_act1, n_obs, n_act2 = rng.integers(1, 4), rng.integers(2, 7), rng.integers(1, 4), rng.integers(1, 6)
        mask = np.concatenate([np.zeros(n_prompt), np.ones(n_act1), np.zeros(n_obs), np.ones(n_act2)])
        n = mask.size
        old = -rng.uniform(0.1, 3.0, n)
        noise = rng.normal(0, 0.3, n)
        noise -= np.sum(noise * mask) / np.sum(mask)  # the sequence log-ratio mean is exactly `offset`
        lp = np.where(mask > 0, old + offset + noise, -rng.uniform(0.1, 3.0, n))
        trajs.append(Traj(mask=mask, old=np.where(mask > 0, old, 0.0), adv=adv + token_adv_noise * rng.normal(size=n),
                          ref=lp + rng.normal(0, 0.2, n), ent=rng.uniform(0.1, 2.0, n), lp=lp))
    if with_empty:  # a trajectory without policy tokens (e.g. it failed before acting)
        n = 5
        trajs.append(Traj(mask=np.zeros(n), old=np.zeros(n), adv=np.full(n, 2.0), ref=-np.ones(n),
                          ent=np.ones(n), lp=-np.ones(n)))
    for tr in trajs:  # round to float32 so JAX (fp32) and the reference (fp64) see the same numbers
        for f in ("mask", "old", "adv", "ref", "ent", "lp"):
            setattr(tr, f, getattr(tr, f).astype(np.float32).astype(np.float64))
    return trajs


def to_batch(trajs, rows, L, pad_logp=0.0):
    """Lays trajectories into `[len(rows), L]` rows; rows[r] lists trajectory indices in order."""
    B = len(rows)
    arr = {k: np.zeros((B, L)) for k in ("lp", "old", "adv", "mask", "ref", "ent")}
    arr["lp"][:] = pad_logp
    seg = np.zeros((B, L), np.int32)
    where = {}
    for r, ids in enumerate(rows):
        o = 0
        for s, i in enumerate(ids, start=1):
            tr = trajs[i]
            n = tr.mask.size
            assert o + n <= L
            for k in arr:
                arr[k][r, o:o + n] = getattr(tr, k)
            seg[r, o:o + n] = s
            where[i] = (r, o, n)
            o += n
    return arr, seg, where


def jax_loss_and_grad(arr, seg, cfg, dtype=jnp.float32, use_ref=True, use_ent=True, parts=False):
    args = {k: jnp.asarray(v, dtype) for k, v in arr.items()}

    def f(lp):
        fn = policy_loss_parts if parts else policy_loss
        out = fn(lp, args["old"], args["adv"], args["mask"], jnp.asarray(seg), cfg,
                 ref_logps=args["ref"] if use_ref else None, entropies=args["ent"] if use_ent else None)
        return (out.numerator, out) if parts else out

    (val, aux), g = jax.value_and_grad(f, has_aux=True)(args["lp"])
    return val, aux, np.asarray(g)


def unpack_grad(g_BxL, where, trajs):
    return [g_BxL[where[i][0], where[i][1]:where[i][1] + where[i][2]] for i in range(len(trajs))]


ONE_PER_ROW = [[i] for i in range(8)]
PACKED_ROWS = [[0, 7, 3], [5, 1], [6, 2, 4]]  # 3 rows, padding at the end of each
L_UNPACKED, L_PACKED = 24, 64

# ----------------------------------------------------------------------------- reference sweep


@pytest.mark.parametrize("algo,agg,estimator", list(itertools.product(ALGOS, AGGS, ESTIMATORS)))
def test_matches_numpy_reference(algo, agg, estimator):
    cfg = make_cfg(algo, agg, clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.05, kl_estimator=estimator,
                   entropy_coef=0.01)
    trajs = make_trajs()
    arr, seg, where = to_batch(trajs, ONE_PER_ROW, L_UNPACKED)
    loss, metrics, g = jax_loss_and_grad(arr, seg, cfg)
    want = reference_loss(trajs, [t.lp for t in trajs], cfg)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-6)
    for got, ref in zip(unpack_grad(g, where, trajs), reference_grad(trajs, cfg)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6)
    # Every branch of the surrogate was exercised (else this test would prove little).
    assert metrics["clip_frac_low"] > 0 and metrics["clip_frac_high"] > 0 and metrics["clip_frac_dual"] > 0
    assert np.count_nonzero(g) == sum(int(t.mask.sum()) for t in trajs)


def test_matches_numpy_reference_float64():
    """The same check in float64 with a tight tolerance: the formulas, not just fp32 noise."""
    with jax.enable_x64(True):
        for algo, agg in itertools.product(ALGOS, AGGS):
            cfg = make_cfg(algo, agg, clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.1, kl_estimator="k3",
                           entropy_coef=0.02)
            trajs = make_trajs(seed=1)
            arr, seg, where = to_batch(trajs, ONE_PER_ROW, L_UNPACKED)
            loss, _, g = jax_loss_and_grad(arr, seg, cfg, dtype=jnp.float64)
            np.testing.assert_allclose(float(loss), reference_loss(trajs, [t.lp for t in trajs], cfg), rtol=1e-12)
            for got, ref in zip(unpack_grad(g, where, trajs), reference_grad(trajs, cfg)):
                np.testing.assert_allclose(got, ref, rtol=1e-7, atol=1e-9)


def test_metrics_match_reference_definitions():
    cfg = make_cfg("grpo", "token_mean", clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.05)
    trajs = make_trajs()
    arr, seg, _ = to_batch(trajs, ONE_PER_ROW, L_UNPACKED)
    _, m, _ = jax_loss_and_grad(arr, seg, cfg)
    pol = [(tr, t) for tr in trajs for t in np.flatnonzero(tr.mask > 0)]
    r = np.array([np.exp(tr.lp[t] - tr.old[t]) for tr, t in pol])
    a = np.array([tr.adv[t] for tr, t in pol])
    np.testing.assert_allclose(m["num_policy_tokens"], len(pol))
    np.testing.assert_allclose(m["num_segments"], len(trajs) - 1)  # the empty trajectory is not live
    np.testing.assert_allclose(m["ratio_mean"], r.mean(), rtol=1e-5)
    np.testing.assert_allclose(m["ratio_min"], r.min(), rtol=1e-5)
    np.testing.assert_allclose(m["ratio_max"], r.max(), rtol=1e-5)
    np.testing.assert_allclose(m["clip_frac_low"], np.mean((a < 0) & (r < 0.8)), rtol=1e-6)
    np.testing.assert_allclose(m["clip_frac_high"], np.mean((a > 0) & (r > 1.28)), rtol=1e-6)
    np.testing.assert_allclose(m["approx_kl_old"], np.mean(r - 1 - np.log(r)), rtol=1e-5)
    kl = np.array([kl_estimate(tr.lp[t], tr.ref[t], "k3") for tr, t in pol])
    np.testing.assert_allclose(m["kl_ref"], kl.mean(), rtol=1e-5)
    np.testing.assert_allclose(m["kl_loss"], kl.mean(), rtol=1e-5)  # token_mean: same reduction
    np.testing.assert_allclose(m["loss"], m["pg_loss"] + 0.05 * m["kl_loss"], rtol=1e-5)


def test_gspo_metrics_count_sequences():
    cfg = make_cfg("gspo", "token_mean", clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    trajs = make_trajs()
    arr, seg, _ = to_batch(trajs, ONE_PER_ROW, L_UNPACKED)
    _, m, _ = jax_loss_and_grad(arr, seg, cfg)
    # SEQ_PLAN: one low clip, one high clip (0.45), one dual clip, out of 7 live sequences.
    np.testing.assert_allclose([m["clip_frac_low"], m["clip_frac_high"], m["clip_frac_dual"]], [1 / 7] * 3, rtol=1e-6)
    s = np.exp([o for o, _ in SEQ_PLAN])
    np.testing.assert_allclose([m["ratio_mean"], m["ratio_min"], m["ratio_max"]], [s.mean(), s.min(), s.max()],
                               rtol=1e-5)


# ----------------------------------------------------------------------------- hand-worked cases


def single_token(log_ratio, adv, cfg, entropy=None):
    """Loss and d loss / d logp for one policy token (position 1 of a 2-token segment)."""
    arr = {"lp": np.array([[0.0, log_ratio - 1.0]]), "old": np.array([[0.0, -1.0]]), "adv": np.full((1, 2), adv),
           "mask": np.array([[0.0, 1.0]]), "ref": np.zeros((1, 2)), "ent": np.full((1, 2), entropy or 0.0)}
    loss, m, g = jax_loss_and_grad(arr, np.ones((1, 2), np.int32), cfg, use_ref=False, use_ent=entropy is not None)
    return float(loss), m, float(g[0, 1])


@pytest.mark.parametrize("algo", ALGOS)
def test_clip_higher_is_asymmetric(algo):
    sym = make_cfg(algo, clip_low=0.2, clip_high=0.2)
    dapo = make_cfg(algo, clip_low=0.2, clip_high=0.28)
    # r = 1.25, A = 1: clipped at 1.2 by the symmetric range, free under clip-higher.
    loss, m, g = single_token(np.log(1.25), 1.0, sym)
    assert (loss, g, float(m["clip_frac_high"])) == pytest.approx((-1.2, 0.0, 1.0), abs=1e-6)
    loss, m, g = single_token(np.log(1.25), 1.0, dapo)
    assert (loss, g, float(m["clip_frac_high"])) == pytest.approx((-1.25, -1.25, 0.0), abs=1e-6)
    # The low side is unchanged: r = 0.75, A = -1 is clipped at 0.8 by both.
    for cfg in (sym, dapo):
        loss, m, g = single_token(np.log(0.75), -1.0, cfg)
        assert (loss, g, float(m["clip_frac_low"])) == pytest.approx((0.8, 0.0, 1.0), abs=1e-6)


@pytest.mark.parametrize("algo", ALGOS)
def test_dual_clip_caps_negative_advantage_loss(algo):
    loss, m, g = single_token(np.log(5.0), -1.0, make_cfg(algo))
    assert (loss, g) == pytest.approx((5.0, 5.0), abs=1e-5)  # unbounded: -r A, gradient -r A
    loss, m, g = single_token(np.log(5.0), -1.0, make_cfg(algo, dual_clip=3.0))
    assert (loss, g, float(m["clip_frac_dual"])) == pytest.approx((3.0, 0.0, 1.0), abs=1e-6)
    # Below c the dual clip is inactive, and it never touches A > 0.
    assert single_token(np.log(2.0), -1.0, make_cfg(algo, dual_clip=3.0))[0] == pytest.approx(2.0, abs=1e-6)
    assert single_token(np.log(5.0), 1.0, make_cfg(algo, dual_clip=3.0))[0] == pytest.approx(-1.2, abs=1e-6)


@pytest.mark.parametrize("clip_low,clip_high,adv", [(0.0, 0.2, 1.0), (0.0, 0.2, -1.0), (0.2, 0.0, 1.0),
                                                     (0.2, 0.0, -1.0), (0.2, 0.2, 1.0)])
def test_ratio_on_a_clip_bound_keeps_its_full_gradient(clip_low, clip_high, adv):
    # r = 1 exactly (old log-probs equal to the learner's, the first update of a batch) with a
    # zero clip on one side: the ratio is inside the closed range, so d loss / d logp = -A.
    for algo in ALGOS:
        loss, m, g = single_token(0.0, adv, make_cfg(algo, clip_low=clip_low, clip_high=clip_high))
        assert (loss, g) == pytest.approx((-adv, -adv), abs=1e-6), algo


def two_tokens(log_ratios, adv, cfg):
    """Loss, metrics and gradient for a segment of three tokens, the last two policy tokens."""
    lr = np.asarray(log_ratios, np.float64)
    arr = {"lp": np.concatenate([[0.0], -1.0 + lr])[None], "old": np.array([[0.0, -1.0, -1.0]]),
           "adv": np.full((1, 3), adv), "mask": np.array([[0.0, 1.0, 1.0]]), "ref": np.zeros((1, 3)),
           "ent": np.zeros((1, 3))}
    loss, m, g = jax_loss_and_grad(arr, np.ones((1, 3), np.int32), cfg, use_ref=False, use_ent=False)
    return float(loss), m, g[0]


@pytest.mark.parametrize("adv", [1.0, 0.0, -1.0])
@pytest.mark.parametrize("algo", ALGOS)
def test_huge_log_ratio_is_finite_and_does_not_poison_other_tokens(algo, adv):
    # Token 1's old log-prob is 100 nats off (stale or corrupt): exp would overflow float32 and
    # 0 * inf would make the gradient NaN even where the clip zeroes it.
    cfg = make_cfg(algo, dual_clip=3.0)
    loss, m, g = two_tokens([100.0, 0.0], adv, cfg)
    assert np.isfinite(loss) and np.all(np.isfinite(g)), (loss, g)
    for k in ("approx_kl_old", "ratio_mean", "ratio_max"):
        assert np.isfinite(float(m[k])), k
    assert float(m["log_ratio_clamped"]) == pytest.approx(0.5 if algo == "grpo" else 1.0)
    if algo == "grpo":
        # Token 1 is clipped (A > 0), dual-clipped (A < 0) or has A = 0: no gradient; token 2 at
        # r = 1 keeps -A / 2 (token mean over two tokens), and the loss is exact.
        assert g[1] == 0.0 and g[2] == pytest.approx(-adv / 2, abs=1e-6)
        want = {1.0: -(1.2 + 1.0) / 2, 0.0: 0.0, -1.0: (3.0 + 1.0) / 2}[adv]
        assert loss == pytest.approx(want, abs=1e-6)
    else:
        # The sequence ratio exp(50) is clipped (A > 0) or dual-clipped (A < 0): no gradient.
        np.testing.assert_array_equal(g, 0.0)
    # Below the bound nothing changes: a log-ratio of 15 is not clamped.
    _, m, _ = two_tokens([15.0, 0.0], adv, cfg)
    assert float(m["log_ratio_clamped"]) == 0.0
    assert float(m["ratio_max"]) == pytest.approx(np.exp(15.0 if algo == "grpo" else 7.5), rel=1e-5)


@pytest.mark.parametrize("algo", ALGOS)
def test_clamped_log_ratio_gets_no_gradient_without_dual_clip(algo):
    # A < 0 and no dual clip: the unclipped branch binds, so only the clamp keeps the gradient of
    # a stale token / sequence from being exp(MAX_LOG_RATIO) |A| (about 5e8).
    loss, m, g = two_tokens([100.0, 0.0], -1.0, make_cfg(algo))
    assert np.isfinite(loss) and float(m["log_ratio_clamped"]) > 0
    if algo == "grpo":
        assert g[1] == 0.0 and g[2] == pytest.approx(0.5, abs=1e-6)
    else:
        np.testing.assert_array_equal(g, 0.0)


def test_entropy_bonus_lowers_loss():
    base = single_token(0.1, 0.5, make_cfg(), entropy=1.5)[0]
    bonus = single_token(0.1, 0.5, make_cfg(entropy_coef=0.1), entropy=1.5)
    assert bonus[0] == pytest.approx(base - 0.1 * 1.5, abs=1e-6)
    assert float(bonus[1]["entropy"]) == pytest.approx(1.5)


@pytest.mark.parametrize("estimator,want", [("k1", 0.5), ("k2", 0.125), ("k3", np.exp(-0.5) + 0.5 - 1)])
def test_kl_estimators_by_hand(estimator, want):
    cfg = make_cfg(kl_coef=1.0, kl_estimator=estimator)
    arr = {"lp": np.array([[0.0, -1.0]]), "old": np.array([[0.0, -1.0]]), "adv": np.zeros((1, 2)),
           "mask": np.array([[0.0, 1.0]]), "ref": np.array([[0.0, -1.5]]), "ent": np.zeros((1, 2))}
    loss, m, _ = jax_loss_and_grad(arr, np.ones((1, 2), np.int32), cfg, use_ent=False)
    assert float(loss) == pytest.approx(want, abs=1e-6)
    assert float(m["kl_ref"]) == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_metric_only_reference_and_entropies_do_not_reach_the_loss(bad):
    # With kl_coef = 0 and entropy_coef = 0 the terms were still added as 0 * value: reference
    # log-probs or entropies passed for their metrics alone, non-finite on one policy token,
    # made the loss and every gradient NaN.
    arr = {"lp": np.array([[0.0, -1.0, -2.0]]), "old": np.array([[0.0, -1.1, -2.0]]),
           "adv": np.full((1, 3), 0.5), "mask": np.array([[0.0, 1.0, 1.0]]),
           "ref": np.array([[0.0, bad, -2.0]]), "ent": np.array([[0.0, bad, 1.0]])}
    seg = np.ones((1, 3), np.int32)
    want, _, want_g = jax_loss_and_grad(arr, seg, make_cfg(), use_ref=False, use_ent=False)
    loss, m, g = jax_loss_and_grad(arr, seg, make_cfg())
    assert float(loss) == float(want) and np.array_equal(g, want_g), (loss, g)
    assert not np.isfinite(float(m["kl_ref"])) and not np.isfinite(float(m["entropy"]))  # shown


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("algo", ALGOS)
def test_kl_of_a_token_far_from_the_reference_is_finite(algo, estimator):
    # Token 1: the reference gives it log-prob 0, the policy -100 (log pi_ref / pi = 100: exp
    # overflows float32, which made k3's value and gradient infinite). Token 2 agrees with both.
    cfg = make_cfg(algo, kl_coef=0.1, kl_estimator=estimator)
    arr = {"lp": np.array([[0.0, -100.0, -1.0]]), "old": np.array([[0.0, -100.0, -1.0]]),
           "adv": np.full((1, 3), 0.5), "mask": np.array([[0.0, 1.0, 1.0]]),
           "ref": np.array([[0.0, 0.0, -1.0]]), "ent": np.zeros((1, 3))}
    loss, m, g = jax_loss_and_grad(arr, np.ones((1, 3), np.int32), cfg, use_ent=False)
    assert np.isfinite(float(loss)) and np.isfinite(float(m["kl_ref"])) and np.all(np.isfinite(g)), (loss, g)
    # Token 2 carries its policy-gradient term (r = 1, A = 0.5, token mean over two) and, for k1
    # only, a KL gradient (d k1 / d logp = 1; k2 and k3 are flat where pi = pi_ref).
    assert g[0, 2] == pytest.approx(-0.25 + (0.05 if estimator == "k1" else 0.0), abs=1e-6)
    if estimator == "k3":
        # Held at the bound: value exp(20) - 21, no gradient through the KL (pg only: -A / 2
        # for grpo and gspo_token; gspo's ratio gradient is shared by the sequence's tokens).
        assert float(m["kl_ref"]) == pytest.approx((np.exp(MAX_LOG_RATIO) - MAX_LOG_RATIO - 1) / 2, rel=1e-5)
        assert g[0, 1] == pytest.approx(-0.25, abs=1e-6)
    # Just below the bound k3 is exact, value and gradient 0.1 * (1 - exp(log_r)) / 2.
    arr["lp"][0, 1] = arr["old"][0, 1] = -19.0
    loss, m, g = jax_loss_and_grad(arr, np.ones((1, 3), np.int32), make_cfg(algo, kl_coef=0.1), use_ent=False)
    assert float(m["kl_ref"]) == pytest.approx((np.exp(19.0) - 20.0) / 2, rel=1e-5)
    assert g[0, 1] == pytest.approx(-0.25 + 0.1 * (1 - np.exp(19.0)) / 2, rel=1e-5)


# ----------------------------------------------------------------------------- structural properties


@pytest.mark.parametrize("agg", AGGS)
def test_gspo_token_equals_gspo_for_sequence_advantages(agg):
    trajs = make_trajs(token_adv_noise=0.0)
    arr, seg, _ = to_batch(trajs, PACKED_ROWS, L_PACKED)
    out = {algo: jax_loss_and_grad(arr, seg, make_cfg(algo, agg, clip_high=0.28, dual_clip=3.0)) for algo in
           ("gspo", "gspo_token")}
    np.testing.assert_allclose(out["gspo"][0], out["gspo_token"][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["gspo"][2], out["gspo_token"][2], rtol=1e-5, atol=1e-7)
    # ...while GRPO, with token-level ratios, differs.
    assert not np.allclose(out["gspo"][2], jax_loss_and_grad(arr, seg, make_cfg("grpo", agg))[2])


@pytest.mark.parametrize("algo,agg", list(itertools.product(ALGOS, AGGS)))
def test_packed_equals_unpacked(algo, agg):
    cfg = make_cfg(algo, agg, clip_high=0.28, dual_clip=3.0, kl_coef=0.05, entropy_coef=0.01)
    trajs = make_trajs(seed=2)
    arr_u, seg_u, where_u = to_batch(trajs, ONE_PER_ROW, L_UNPACKED)
    arr_p, seg_p, where_p = to_batch(trajs, PACKED_ROWS, L_PACKED, pad_logp=-np.inf)
    loss_u, m_u, g_u = jax_loss_and_grad(arr_u, seg_u, cfg)
    loss_p, m_p, g_p = jax_loss_and_grad(arr_p, seg_p, cfg)
    np.testing.assert_allclose(loss_p, loss_u, rtol=1e-5, atol=1e-6)
    for a, b in zip(unpack_grad(g_p, where_p, trajs), unpack_grad(g_u, where_u, trajs)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
    for k in m_u:
        np.testing.assert_allclose(m_p[k], m_u[k], rtol=1e-5, err_msg=k)


@pytest.mark.parametrize("algo,agg", list(itertools.product(ALGOS, AGGS)))
def test_masked_positions_nan_safe(algo, agg):
    cfg = make_cfg(algo, agg, dual_clip=3.0, kl_coef=0.05, entropy_coef=0.01)
    trajs = make_trajs(seed=3)
    clean, seg, _ = to_batch(trajs, PACKED_ROWS, L_PACKED)
    dirty = {k: v.copy() for k, v in clean.items()}
    off = clean["mask"] == 0
    dirty["lp"][off] = -np.inf
    for k in ("old", "adv", "ref", "ent"):
        dirty[k][off] = np.nan
    loss_c, _, g_c = jax_loss_and_grad(clean, seg, cfg)
    loss_d, m_d, g_d = jax_loss_and_grad(dirty, seg, cfg)
    assert np.isfinite(float(loss_d)) and all(np.isfinite(float(v)) for v in m_d.values())
    assert np.all(np.isfinite(g_d)) and np.all(g_d[off] == 0.0)
    np.testing.assert_allclose(loss_d, loss_c, rtol=1e-6)
    np.testing.assert_allclose(g_d, g_c, rtol=1e-6, atol=1e-9)


def test_all_masked_batch_is_zero_not_nan():
    arr = {k: np.zeros((2, L_PACKED)) for k in ("lp", "old", "adv", "mask", "ref", "ent")}
    arr["lp"][:] = -np.inf
    for agg in AGGS:
        loss, m, g = jax_loss_and_grad(arr, np.ones((2, L_PACKED), np.int32), make_cfg("gspo", agg, kl_coef=0.1))
        assert float(loss) == 0.0 and np.all(g == 0.0)
        assert float(m["ratio_mean"]) == 1.0 and float(m["num_policy_tokens"]) == 0.0


@pytest.mark.parametrize("shape", [(0, 8), (2, 0)])
def test_empty_batch_is_zero_like_an_all_masked_one(shape):
    # A micro-batch without rows (e.g. every row filtered out) raised "zero-size array to
    # reduction operation min" from the ratio extremes.
    z = jnp.zeros(shape)
    for algo in ALGOS:
        cfg = make_cfg(algo, "seq_mean_token_mean", kl_coef=0.1, entropy_coef=0.01)
        f = lambda lp: policy_loss(lp, z, z, z, z.astype(jnp.int32), cfg, ref_logps=z, entropies=z)
        (loss, m), g = jax.value_and_grad(f, has_aux=True)(z)
        assert float(loss) == 0.0 and g.shape == shape and float(jax.jit(f)(z)[0]) == 0.0
        assert float(m["ratio_min"]) == float(m["ratio_max"]) == 1.0 and float(m["num_policy_tokens"]) == 0.0


@pytest.mark.parametrize("agg", AGGS)
def test_micro_batch_accumulation_equals_full_batch(agg):
    rng = np.random.default_rng(4)
    plans = [[(rng.normal(0, 0.3), rng.normal()) for _ in range(4)] for _ in range(4)]
    trajs = [t for s, plan in enumerate(plans) for t in make_trajs(seed=10 + s, plan=plan, with_empty=s == 0)]
    rows = [list(range(i, min(i + 2, len(trajs)))) for i in range(0, len(trajs), 2)]  # 2 per row
    assert len(rows) == 9
    rows = rows[:8]  # 8 rows -> 4 micro-batches of 2 rows
    for algo in ALGOS:
        cfg = make_cfg(algo, agg, clip_high=0.28, kl_coef=0.05, entropy_coef=0.01)
        arr, seg, _ = to_batch(trajs, rows, L_PACKED)
        loss_full, m_full, g_full = jax_loss_and_grad(arr, seg, cfg)
        parts, grads = [], []
        for mb in range(4):
            sl = slice(2 * mb, 2 * mb + 2)
            _, p, g = jax_loss_and_grad({k: v[sl] for k, v in arr.items()}, seg[sl], cfg, parts=True)
            parts.append(p)
            grads.append(g)
        total = combine_parts(*parts)
        loss_acc, m_acc = finalize_parts(total)
        g_acc = np.concatenate(grads) / float(jnp.maximum(total.denominator, 1.0))
        np.testing.assert_allclose(loss_acc, loss_full, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g_acc, g_full, rtol=1e-5, atol=1e-9)
        for k in m_full:
            np.testing.assert_allclose(m_acc[k], m_full[k], rtol=1e-5, err_msg=k)


def test_jit_and_sharded_batch_match_eager():
    cfg = make_cfg("gspo_token", "seq_mean_token_mean", clip_high=0.28, kl_coef=0.05)
    trajs = make_trajs(seed=5) * 2  # 16 trajectories, 2 per row -> 8 rows
    rows = [[2 * r, 2 * r + 1] for r in range(8)]
    arr, seg, _ = to_batch(trajs, rows, L_PACKED)
    x = {k: jnp.asarray(v, jnp.float32) for k, v in arr.items()}
    eager, _ = policy_loss(x["lp"], x["old"], x["adv"], x["mask"], jnp.asarray(seg), cfg, ref_logps=x["ref"])
    mesh = jax.make_mesh((8,), ("data",))
    shard = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))
    xs = {k: jax.device_put(v, shard) for k, v in x.items()}
    fn = jax.jit(functools.partial(policy_loss, cfg=cfg))
    loss, metrics = fn(xs["lp"], xs["old"], xs["adv"], xs["mask"], jax.device_put(jnp.asarray(seg), shard),
                       ref_logps=xs["ref"])
    np.testing.assert_allclose(loss, eager, rtol=1e-5, atol=1e-6)
    assert np.isfinite(float(metrics["kl_ref"]))
    # Gradients too: the sharded jitted gradient is the eager one, and stays sharded by rows.
    g_eager = jax.grad(lambda v: policy_loss(v, x["old"], x["adv"], x["mask"], jnp.asarray(seg), cfg,
                                             ref_logps=x["ref"])[0])(x["lp"])
    g_sharded = jax.jit(jax.grad(lambda v, o, a, m, s, r: fn(v, o, a, m, s, ref_logps=r)[0]))(
        xs["lp"], xs["old"], xs["adv"], xs["mask"], jax.device_put(jnp.asarray(seg), shard), xs["ref"])
    assert g_sharded.sharding.is_equivalent_to(shard, 2)
    np.testing.assert_allclose(g_sharded, g_eager, rtol=1e-5, atol=1e-8)
    assert np.abs(np.asarray(g_eager)).max() > 0


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs,match", [
    ({"algo": "ppo"}, "algo"),
    ({"agg": "seq_mean"}, "agg"),
    ({"kl_estimator": "k4"}, "kl_estimator"),
    ({"clip_low": 1.0}, "clip_low"),
    ({"clip_high": -0.1}, "clip_high"),
    ({"dual_clip": 1.0}, "dual_clip"),
    ({"kl_coef": -1.0}, "kl_coef"),
    ({"entropy_coef": -1.0}, "entropy_coef"),
    ({"agg": "seq_mean_token_sum_norm"}, "max_len_norm"),
    ({"agg": "token_mean", "max_len_norm": 100.0}, "max_len_norm"),
    # Infinite values: a NaN loss (inf * 0) or, for max_len_norm, silently zero gradients.
    ({"kl_coef": float("inf")}, "kl_coef"),
    ({"entropy_coef": float("inf")}, "entropy_coef"),
    ({"dual_clip": float("inf")}, "dual_clip"),
    ({"agg": "seq_mean_token_sum_norm", "max_len_norm": float("inf")}, "max_len_norm"),
    # Not numbers: a TypeError naming no field, or (a bool) a silent 0 or 1.
    ({"clip_low": None}, r"clip_low=None \(NoneType\) must be a number$"),
    ({"clip_high": None}, r"clip_high=None \(NoneType\) must be a number$"),
    ({"kl_coef": "0.1"}, r"kl_coef='0.1' \(str\) must be a number$"),
    ({"entropy_coef": True}, r"entropy_coef=True \(bool\) must be a number$"),
    ({"dual_clip": "3"}, r"dual_clip='3' \(str\) must be a number or None"),
    ({"agg": "seq_mean_token_sum_norm", "max_len_norm": "16"}, r"max_len_norm='16' \(str\) must be a number or None"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossConfig(**kwargs)


def test_missing_ref_or_entropies_is_a_clear_error():
    z = jnp.zeros((1, 4))
    seg = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="ref_logps"):
        policy_loss(z, z, z, z, seg, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropies"):
        policy_loss(z, z, z, z, seg, LossConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match="shape"):
        policy_loss(z, z, z, jnp.zeros((1, 3)), seg, LossConfig())
    assert hash(LossConfig()) == hash(LossConfig())  # usable as a static jit argument


def test_config_that_is_not_a_loss_config_is_a_clear_error():
    # A run's `config.loss` section went through unvalidated: "gpso" was computed as gspo_token.
    import ml_collections
    z = jnp.zeros((1, 4))
    seg = jnp.ones((1, 4), jnp.int32)
    section = ml_collections.ConfigDict(dataclasses.asdict(LossConfig()))
    section.algo = "gpso"
    for cfg in (section, {"algo": "grpo"}):
        with pytest.raises(TypeError, match=rf"cfg must be a LossConfig, got {type(cfg).__name__}: .*LossConfig\(\*\*section\)"):
            policy_loss(z, z, z, z, seg, cfg)


def test_non_2d_logps_is_a_clear_error():
    z = jnp.zeros(4)
    with pytest.raises(ValueError, match=r"logps has shape \(4,\); expected \[B, L\]"):
        policy_loss(z, z, z, z, jnp.ones(4, jnp.int32), LossConfig())


@pytest.mark.parametrize("agg", AGGS)
def test_segment_id_past_the_bound_is_a_clear_error_when_eager(agg):
    # Ids numbered across the batch (here a trajectory index 9 in rows of 6) are left out of the
    # segment sums: the seq_* aggregations were NaN without a word in an eager call.
    z = jnp.zeros((2, 6))
    mask = jnp.asarray([[0, 1, 1, 0, 1, 1]] * 2, jnp.float32)
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2], [9, 9, 9, 9, 0, 0]])
    with pytest.raises(ValueError, match="segment_ids go up to 9 but max_segments_per_row=6"):
        policy_loss(z, z, jnp.ones((2, 6)), mask, seg, make_cfg(agg=agg))
    with pytest.raises(ValueError, match="max_segments_per_row=1"):
        policy_loss(z, z, jnp.ones((2, 6)), mask, jnp.minimum(seg, 2), make_cfg(agg=agg), max_segments_per_row=1)
    ok = jnp.asarray([[1, 1, 1, 2, 2, 2], [6, 6, 6, 6, 0, 0]])  # up to L is fine
    loss, _ = policy_loss(z, z, jnp.ones((2, 6)), mask, ok, make_cfg(agg=agg))
    assert np.isfinite(float(loss))
    # Under jit the ids are not known: no check (the documented NaN, which the step catches).
    jax.jit(lambda s: policy_loss(z, z, jnp.ones((2, 6)), mask, s, make_cfg(agg=agg))[0])(seg)


def test_numpy_float64_inputs_compute_in_float32_without_warnings():
    # NumPy's default float64 arrays (x64 off) used to warn "float64 ... truncated" per array.
    rng = np.random.default_rng(0)
    lp, old = -rng.uniform(0.1, 2, (2, 5)), -rng.uniform(0.1, 2, (2, 5))
    mask = np.array([[0, 1, 1, 1, 0], [0, 1, 1, 0, 0]], np.float64)
    seg = np.array([[1, 1, 1, 1, 0], [1, 1, 2, 2, 0]])
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, _ = policy_loss(lp, old, np.ones((2, 5)), mask, seg, LossConfig(kl_coef=0.1), ref_logps=lp + 0.1)
    assert loss.dtype == jnp.float32
    want, _ = policy_loss(*(jnp.asarray(x, jnp.float32) for x in (lp, old, np.ones((2, 5)), mask)), jnp.asarray(seg),
                          LossConfig(kl_coef=0.1), ref_logps=jnp.asarray(lp + 0.1, jnp.float32))
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)


def test_nested_lists_are_taken_as_arrays():
    # As `models.forward` takes tokens; they failed with "'list' object has no attribute 'ndim'".
    lp = [[-1.0, -0.5, -2.0, -0.3], [-0.7, -1.5, -0.2, -3.0]]
    old = [[-1.0, -0.6, -1.8, -0.3], [-0.7, -1.4, -0.3, -2.0]]
    adv, mask, seg = [[1.0] * 4, [-1.0] * 4], [[0, 1, 1, 1], [0, 1, 0, 1]], [[1, 1, 1, 1], [1, 1, 2, 2]]
    cfg = LossConfig(algo="gspo", agg="seq_mean_token_mean", kl_coef=0.1)
    got, m = policy_loss(lp, old, adv, mask, seg, cfg, ref_logps=old, entropies=lp)
    want, _ = policy_loss(*(jnp.asarray(x) for x in (lp, old, adv, mask, seg)), cfg,
                          ref_logps=jnp.asarray(old), entropies=jnp.asarray(lp))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    assert float(m["num_segments"]) == 3


@pytest.mark.parametrize("algo", ALGOS)
def test_uneven_and_empty_micro_batches_equal_full_batch(algo):
    # One row per micro-batch: six trajectories in one row, one each in two rows, a row of padding
    # only and a row whose only trajectory has no policy token (zero tokens, zero live segments:
    # denominator 0). Summed numerators over the summed denominator must equal the full batch,
    # for every aggregation, with nothing NaN from the empty parts.
    trajs = make_trajs(seed=6)
    rows = [[0, 1, 2, 3, 4, 5], [6], [], [7], [2]]
    for agg in AGGS:
        cfg = make_cfg(algo, agg, clip_high=0.28, dual_clip=3.0, kl_coef=0.05, entropy_coef=0.01)
        arr, seg, _ = to_batch(trajs, rows, 128)
        loss_full, m_full, g_full = jax_loss_and_grad(arr, seg, cfg)
        parts, grads = [], []
        for r in range(len(rows)):
            _, p, g = jax_loss_and_grad({k: v[r:r + 1] for k, v in arr.items()}, seg[r:r + 1], cfg, parts=True)
            parts.append(p)
            grads.append(g)
        for r in (2, 3):  # the micro-batches without a policy token contribute exactly nothing
            assert float(parts[r].numerator) == 0.0 and float(parts[r].denominator) == 0.0
            assert np.all(grads[r] == 0.0)
        total = combine_parts(*parts)
        loss_acc, m_acc = finalize_parts(total)
        g_acc = np.concatenate(grads) / float(jnp.maximum(total.denominator, 1.0))
        assert np.isfinite(float(loss_acc)) and np.all(np.isfinite(g_acc))
        np.testing.assert_allclose(loss_acc, loss_full, rtol=1e-5, atol=1e-6, err_msg=agg)
        np.testing.assert_allclose(g_acc, g_full, rtol=1e-5, atol=1e-9, err_msg=agg)
        for k in m_full:
            np.testing.assert_allclose(m_acc[k], m_full[k], rtol=1e-5, err_msg=f"{agg} {k}")
        # ...and the full batch is the reference formula on the unpacked trajectories.
        live = [trajs[i] for row in rows for i in row]
        lps = [t.lp for t in live]
        np.testing.assert_allclose(float(loss_full), reference_loss(live, lps, cfg), rtol=1e-5, atol=1e-6)


def analytic_loss_and_grad(lp, old, adv, mask, seg, ref, ent, cfg):
    """Loss, d loss / d lp and the token counts where the low, high and dual clips bind, for `[B, L]`
    rows, from the papers' closed-form gradients, vectorised.

    grpo: d/d lp_t of -min(r A, clip(r) A) is -A r_t where the unclipped branch binds, else 0.
    GSPO eq. (10): d s_i / d lp_t = s_i / |y_i|, shared by all tokens of sequence i. GSPO-token
    eq. (14): d s_{i,t} / d lp_t = s_i, for token t only. KL: d k1 = 1, d k2 = lp - ref,
    d k3 = 1 - pi_ref / pi. Segments are (row, id) pairs; ids need not be consecutive.
    """
    m = (mask > 0) & (seg > 0)
    key = np.where(m, np.arange(seg.shape[0])[:, None] * (seg.shape[1] + 1) + seg, -1)
    ids = np.unique(key[m])
    n_i = np.array([np.sum(key == k) for k in ids])
    seg_of = {k: j for j, k in enumerate(ids)}
    idx = np.vectorize(lambda k: seg_of.get(k, -1))(key)  # dense segment index, -1 off policy
    lr = np.where(m, lp - old, 0.0)
    seq_lr = np.bincount(idx[m], lr[m], len(ids)) / n_i
    seq_adv = np.bincount(idx[m], adv[m], len(ids)) / n_i
    if cfg.algo == "grpo":
        r, a = np.exp(lr), adv
    elif cfg.algo == "gspo":
        r, a = np.exp(seq_lr[idx]), seq_adv[idx]
    else:
        r, a = np.exp(seq_lr[idx]), adv
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    pg = np.maximum(-a * r, -a * np.clip(r, lo, hi))
    low, high = m & (a < 0) & (r < lo), m & (a > 0) & (r > hi)
    active = ~(low | high)
    capped = np.zeros_like(m)
    if cfg.dual_clip is not None:
        capped = m & (a < 0) & (pg > -cfg.dual_clip * a)
        pg = np.where(capped, -cfg.dual_clip * a, pg)
        active &= ~capped
    d = ref - lp
    kl, dkl = {"k1": (-d, np.ones_like(d)), "k2": (0.5 * d * d, -d), "k3": (np.exp(d) - d - 1, 1 - np.exp(d))}[
        cfg.kl_estimator]
    if cfg.agg == "token_mean":
        w, denom = m * 1.0, m.sum()
    elif cfg.agg == "seq_mean_token_mean":
        w, denom = np.where(m, 1.0 / n_i[idx], 0.0), len(ids)
    elif cfg.agg == "seq_mean_token_sum":
        w, denom = m * 1.0, len(ids)
    else:
        w, denom = m / cfg.max_len_norm, len(ids)
    tot = pg + cfg.kl_coef * kl - cfg.entropy_coef * ent
    loss = np.sum(np.where(m, w * tot, 0.0)) / max(denom, 1)
    dpg = np.where(active, -a * r, 0.0)
    if cfg.algo == "gspo":  # sequence i's summed weight times d s_i / d lp_t
        dpg = np.bincount(idx[m], w[m], len(ids))[idx] * dpg / n_i[idx]
    else:
        dpg = w * dpg
    grad = np.where(m, dpg + cfg.kl_coef * w * dkl, 0.0) / max(denom, 1)
    return loss, grad, np.array([low.sum(), high.sum(), capped.sum()])


@pytest.mark.parametrize("algo", ALGOS)
def test_random_layouts_match_closed_form_gradients(algo):
    # Random rows: segments of random lengths with gaps in their ids (1, 3, 4, ...), padding
    # between and after them, random policy masks. Checked against the closed forms above, an
    # independent derivation from the finite differences of `reference_grad`.
    rng = np.random.default_rng(11)
    B, L = 3, 40
    binds = np.zeros(3)
    for agg in AGGS:
        cfg = make_cfg(algo, agg, clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.1,
                       kl_estimator=ESTIMATORS[rng.integers(3)], entropy_coef=0.01)
        fn = jax.jit(jax.value_and_grad(
            lambda lp, old, adv, mask, seg, ref, ent: policy_loss(lp, old, adv, mask, seg, cfg, ref_logps=ref,
                                                                  entropies=ent)[0]))
        for _ in range(6):
            seg = np.zeros((B, L), np.int32)
            for b in range(B):
                t, s = 0, 0
                while t < L - 1:
                    t += int(rng.integers(0, 3))  # padding before the segment
                    s += int(rng.integers(1, 3))  # ids with gaps
                    n = int(rng.integers(1, 12))
                    seg[b, t:t + n] = s
                    t += n
            start = np.ones((B, L), bool)
            start[:, 1:] = seg[:, 1:] != seg[:, :-1]
            mask = ((rng.random((B, L)) < 0.7) & ~start & (seg > 0)).astype(np.float32)
            old = -rng.uniform(0.05, 4, (B, L)).astype(np.float32)
            # A log-ratio offset per segment, so sequence ratios also reach every clip branch.
            offset = rng.choice([0.0, 0.25, -0.3, 1.3], size=(B, L + 1))
            lp = (old + np.take_along_axis(offset, seg, 1) + rng.normal(0, 0.4, (B, L))).astype(np.float32)
            adv = (rng.normal(size=(B, L)) * rng.choice([0.1, 1.0])).astype(np.float32)
            ref = (lp + rng.normal(0, 0.3, (B, L))).astype(np.float32)
            ent = rng.uniform(0, 2, (B, L)).astype(np.float32)
            loss, g = fn(lp, old, adv, mask, seg, ref, ent)
            want, want_g, b = analytic_loss_and_grad(*(x.astype(np.float64) for x in (lp, old, adv, mask)), seg,
                                                  ref.astype(np.float64), ent.astype(np.float64), cfg)
            np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-6, err_msg=agg)
            np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-4, atol=1e-7, err_msg=agg)
            binds += b
    assert np.all(binds > 0), binds  # every branch of the clipped surrogate was exercised
