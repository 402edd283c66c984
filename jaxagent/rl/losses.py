"""Policy-gradient losses over packed `[B, L]` rows: GRPO, GSPO, GSPO-token.

Place in the data flow: `rl/packing.py` turns trajectories into rows, the model scores them
(`rl/step.py`), and this file turns the learner log-probs into a scalar loss and metrics.

Conventions (shared with `rl/packing.py`):
  * Every array is `[B, L]`. Position t holds the log-prob of token t given tokens < t, so the
    first token of every segment has no log-prob and its `loss_mask` is 0.
  * A row packs several trajectories ("segments"), told apart by `segment_ids` (1, 2, ... per
    row; 0 is padding). A segment is identified by its (row, segment_id) pair; it never spans
    rows. "seq" in the aggregation names always means a segment, never a row.
  * Policy tokens are positions with `loss_mask > 0`; everything else (prompt, tool
    observations, padding) contributes exactly zero value and exactly zero gradient, even when
    its log-prob is -inf or NaN: every input is sanitised with `jnp.where` before any `exp`.

Every aggregation mode is a per-token weight `w_t` times the per-token loss, summed, over a
denominator that does not depend on the parameters:

  ===========================  ======================  =================================
  agg                          w_t for t in segment i   denominator
  ===========================  ======================  =================================
  token_mean                   1                        number of policy tokens
  seq_mean_token_mean          1 / n_i                  number of live segments
  seq_mean_token_sum           1                        number of live segments
  seq_mean_token_sum_norm      1 / max_len_norm         number of live segments
  ===========================  ======================  =================================

where n_i is the number of policy tokens of segment i and a segment is *live* when n_i > 0
(segments without policy tokens contribute nothing, neither to the sum nor to the count).
`policy_loss_parts` returns the (numerator, denominator) pair so that micro-batches and packed
rows normalise exactly like one big batch; `combine_parts` + `finalize_parts` do the rest.

The total per-token loss is pg + kl_coef * kl - entropy_coef * entropy, all three reduced with the
same `agg`. Metrics (`finalize_parts`):
  * loss, pg_loss, kl_loss: the aggregated total, policy-gradient and KL terms (kl_loss before
    `kl_coef`; 0 without `ref_logps`).
  * kl_ref: mean over policy tokens of the configured KL estimator against `ref_logps` (k3 with
    log(pi_ref / pi) held at most `MAX_LOG_RATIO`; see `_kl_per_token`).
  * entropy: mean over policy tokens of `entropies` (only when given).
  * approx_kl_old: mean over policy tokens of k3 = r - 1 - log r, r = pi_theta / pi_old: an
    unbiased estimate of KL(pi_old || pi_theta), since the tokens were sampled from pi_old
    (with `behavior_logps` they were sampled from pi_behav: then only as far as pi_behav is
    near pi_old, which `behavior_kl` shows).
  * clip_frac_low / clip_frac_high / clip_frac_dual: fraction of units where the lower clip
    (A < 0, r < 1 - clip_low), upper clip (A > 0, r > 1 + clip_high) or dual clip (A < 0,
    loss capped at c |A|) binds, i.e. where the ratio gets no gradient.
  * ratio_mean, ratio_min, ratio_max: of the importance ratio over units.
  * log_ratio_clamped: fraction of policy tokens whose |log r| (for gspo: of their sequence's
    mean log r) exceeds `MAX_LOG_RATIO` and was clamped to it (a sign of stale or mismatched
    old log-probs; such tokens get no gradient through the ratio).
  * num_policy_tokens, num_segments (live segments).
A "unit" is a policy token for grpo and gspo_token, and a live segment for gspo.

Truncated importance sampling of the behaviour policy (`LossConfig.tis_cap`; decoupled PPO,
Hilton et al. 2021, "Batch size-invariance for policy optimization", with the truncation of
Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training").
Three policies meet in an update: pi_theta (the learner, differentiated), pi_prox = `old_logps`
(the learner's own log-probs of the batch before this step's first update, recomputed by the
learner) and pi_behav = `behavior_logps` (the sampler that generated the tokens: an older policy
when rollouts run k steps ahead, and other numerics even when it is not). The clip keeps
pi_theta near pi_prox as before (r = pi_theta / pi_prox in every formula above), and the
policy-gradient term of each policy token t of segment i is multiplied by a constant
(stop-gradient) weight that corrects for tokens sampled from pi_behav instead of pi_prox:

  d_t  = clip(old_logps_t - behavior_logps_t, -MAX_LOG_RATIO, MAX_LOG_RATIO)
  tis_level="token":     w_t = min(exp(d_t), tis_cap)
  tis_level="sequence":  w_t = W_i = min(exp(sum_{u in i} d_u), tis_cap)   (u: policy tokens of i)

so a token's loss is w_t * pg_t; the KL and entropy terms are not weighted, and the
denominators do not change. "sequence" is the importance weight of the whole trajectory,
pi_prox(y_i) / pi_behav(y_i) (tool observations cancel: both policies see the same ones; a
trained token the sampler did not sample, such as an observation token trained on, should carry
`behavior_logps` == `old_logps`, a factor 1), unbiased before truncation; "token" corrects each
token's own sampling only, biased but of much lower variance, and the usual choice. The same
weights serve gspo and gspo_token: GSPO's length-normalised ratio (eq. 7) is a trust-region
measure that keeps one clip range meaningful across lengths, not an importance weight of any
distribution, so a sequence-level correction uses the product of the token ratios. For gspo
each token carries its sequence's loss, so W_i multiplies GSPO's sequence loss, and token
weights (with agg="seq_mean_token_mean") multiply it by the mean of the segment's w_t. Past
`tis_cap` the weight is held at the cap (truncation: bias for bounded variance). With
`behavior_logps` == `old_logps` every weight is exactly 1 and the loss is the plain one.
Metrics (with `behavior_logps`):
  * behavior_kl: mean over policy tokens of k3 = q - 1 - log q, q = pi_prox / pi_behav (log q
    bounded as above): an estimate of KL(pi_behav || pi_prox) on the tokens pi_behav sampled.
  * tis_weight_mean, tis_clip_frac (only with `tis_cap`): the mean of the truncated weight and
    the fraction where the cap binds, over policy tokens ("token") or live segments ("sequence").
`behavior_logps` without `tis_cap` gives behavior_kl only and leaves the loss unchanged.

Gradient accumulation over micro-batches (what `rl/step.py` does)::

    def numerator(params, mb):
        parts = policy_loss_parts(logps_fn(params, mb), ..., cfg)
        return parts.numerator, parts
    grads, parts = zero_grads, None
    for mb in micro_batches:
        (_, p), g = jax.value_and_grad(numerator, has_aux=True)(params, mb)
        grads = jax.tree.map(jnp.add, grads, g)
        parts = p if parts is None else combine_parts(parts, p)
    grads = jax.tree.map(lambda g: g / jnp.maximum(parts.denominator, 1.0), grads)
    loss, metrics = finalize_parts(parts)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

Algo = Literal["grpo", "gspo", "gspo_token"]
Agg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]
TISLevel = Literal["token", "sequence"]

_SEQ_AGGS = ("seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")

# Bound on |log(pi_theta / pi_old)| before it is exponentiated. exp(88.7) overflows float32, and
# an infinite ratio makes a NaN gradient even where the clip zeroes the token's gradient
# (0 * inf in the backward pass of exp), so one stale or corrupt old log-prob would poison the
# whole update. Past the bound the ratio is held at exp(+-20) (about 4.9e8 / 2.1e-9), with zero
# gradient through the log-ratio. A sampled token's log-ratio between two nearby policies is a
# few nats at most, so only stale or corrupt log-probs reach the bound. k3's log(pi_ref / pi) has
# the same upper bound (`_kl_per_token`).
MAX_LOG_RATIO = 20.0


def _check_choice(field: str, value, literal) -> None:
    allowed = get_args(literal)
    if value not in allowed:
        raise ValueError(f"LossConfig.{field}={value!r} is not supported; allowed values: {allowed}")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Static loss settings; hashable, so it can be a static argument of `jax.jit`.

    Attributes:
      algo: "grpo" (token ratio, PPO clip), "gspo" (sequence ratio, sequence clip) or
        "gspo_token" (GSPO-token: sequence-ratio value, per-token advantages and gradients).
      agg: how per-token losses reduce to a scalar; see the module docstring.
      clip_low, clip_high: the clip range is [1 - clip_low, 1 + clip_high]. Unequal values give
        DAPO's clip-higher (e.g. 0.2 / 0.28). GSPO uses much smaller ranges (e.g. 3e-4 / 4e-4)
        because its ratio is a per-token geometric mean.
      dual_clip: c > 1 enables dual-clip PPO: for A < 0 the loss is capped at c * |A|.
      kl_coef, kl_estimator: weight and estimator of the KL penalty against `ref_logps`.
      entropy_coef: weight of the entropy bonus (needs per-token `entropies`).
      max_len_norm: the constant divisor of "seq_mean_token_sum_norm" (Dr. GRPO); required by
        that mode and rejected by the others.
      tis_cap: None (off) or a finite constant >= 1 (e.g. 2.0): the truncation of the importance
        weight pi_prox / pi_behav that multiplies each policy token's policy-gradient loss, for
        rollouts sampled by another policy than `old_logps` (asynchronous rollouts, sampler
        numerics). Needs `behavior_logps` (the sampler's log-probs), with `old_logps` then the
        learner's own log-probs of the batch before the update; see the module docstring.
      tis_level: "token" (a weight per policy token) or "sequence" (one weight per segment, the
        product of its tokens' ratios, truncated at `tis_cap`); see the module docstring.
    """

    algo: Algo = "grpo"
    agg: Agg = "token_mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    max_len_norm: float | None = None
    tis_cap: float | None = None
    tis_level: TISLevel = "token"

    def __post_init__(self):
        _check_choice("algo", self.algo, Algo)
        _check_choice("agg", self.agg, Agg)
        _check_choice("kl_estimator", self.kl_estimator, KLEstimator)
        _check_choice("tis_level", self.tis_level, TISLevel)
        # A string, None or bool would fail the range checks below with a TypeError that names
        # no field, or (a bool) pass as 0 or 1.
        for field in ("clip_low", "clip_high", "dual_clip", "kl_coef", "entropy_coef", "max_len_norm", "tis_cap"):
            value, optional = getattr(self, field), field in ("dual_clip", "max_len_norm", "tis_cap")
            if (value is not None or not optional) and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
                raise ValueError(f"LossConfig.{field}={value!r} ({type(value).__name__}) must be a number"
                                 + (" or None" if optional else ""))
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"LossConfig.clip_low={self.clip_low} must be in [0, 1) so 1 - clip_low > 0")
        if not self.clip_high >= 0.0:
            raise ValueError(f"LossConfig.clip_high={self.clip_high} must be >= 0")
        # An infinite coefficient makes the loss NaN (inf * 0) and an infinite max_len_norm
        # zeroes every gradient without a word, so these must be finite.
        if self.dual_clip is not None and not 1.0 < self.dual_clip < math.inf:
            raise ValueError(f"LossConfig.dual_clip={self.dual_clip} must be None or a finite constant c > 1 (e.g. 3.0)")
        if not 0.0 <= self.kl_coef < math.inf:
            raise ValueError(f"LossConfig.kl_coef={self.kl_coef} must be finite and >= 0")
        if not 0.0 <= self.entropy_coef < math.inf:
            raise ValueError(f"LossConfig.entropy_coef={self.entropy_coef} must be finite and >= 0")
        # A cap below 1 would down-weight even tokens both policies agree on; an infinite one is
        # untruncated importance sampling, whose weights can reach exp(MAX_LOG_RATIO).
        if self.tis_cap is not None and not 1.0 <= self.tis_cap < math.inf:
            raise ValueError(f"LossConfig.tis_cap={self.tis_cap} must be None (off) or a finite constant >= 1 "
                             "(e.g. 2.0)")
        if self.agg == "seq_mean_token_sum_norm":
            if self.max_len_norm is None or not 0 < self.max_len_norm < math.inf:
                raise ValueError(
                    "LossConfig.max_len_norm must be a finite positive constant (e.g. the maximum response "
                    f"length) when agg='seq_mean_token_sum_norm'; got {self.max_len_norm!r}"
                )
        elif self.max_len_norm is not None:
            raise ValueError(
                f"LossConfig.max_len_norm={self.max_len_norm} is only used by agg='seq_mean_token_sum_norm'; "
                f"set it to None for agg={self.agg!r}"
            )


class LossParts(NamedTuple):
    """Additive pieces of the loss and its metrics for one (micro-)batch; a pytree of scalars.

    `numerator / denominator` is the loss. Mean metrics are `sums[k] / counts[k]`; keys of `sums`
    without a count (token and segment counts) are reported as totals.
    """

    numerator: Array
    denominator: Array
    sums: dict[str, Array]
    counts: dict[str, Array]
    ratio_min: Array
    ratio_max: Array


def _segment_sum_BxS(values_BxL: Array, segment_ids_BxL: Array, num_segments: int) -> Array:
    """Per-(row, segment) sums; column s of the result is segment id s of that row.

    Equivalent to one `segment_sum` over the global index row * num_segments + segment_id, but
    kept per row so the batch axis stays sharded.
    """
    return jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, num_segments=num_segments))(values_BxL, segment_ids_BxL)


def _gather_BxL(per_segment_BxS: Array, segment_ids_BxL: Array) -> Array:
    """Broadcasts per-segment values back to the tokens of each segment."""
    return jnp.take_along_axis(per_segment_BxS, segment_ids_BxL, axis=1)


def _clipped_surrogate(ratio: Array, adv: Array, cfg: LossConfig):
    """Per-element PPO loss -min(r A, clip(r) A), with the optional dual clip.

    Clipped PPO objective (Schulman et al. 2017, eq. 7) with DAPO's decoupled bounds
    clip(r, 1 - eps_low, 1 + eps_high) (DAPO Sec. 3.1, Clip-Higher). Dual-clip PPO (Ye et al.
    2020) additionally takes max(., c A) of the objective when A < 0, i.e. the loss is capped at
    -c A = c |A| so a huge ratio on a bad token cannot blow up the update.

    Returns the loss and boolean masks of where the low clip, the high clip and the dual clip bind
    (where the gradient through the ratio is zero).
    """
    lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    unclipped = -adv * ratio
    # clip(ratio, lo, hi) written with `where` so that a ratio exactly on a bound keeps its full
    # gradient (jnp.clip would pass half of it at the tie, e.g. at r = 1 with clip_low = 0).
    clipped = -adv * jnp.where(ratio < lo, lo, jnp.where(ratio > hi, hi, ratio))
    loss = jnp.maximum(unclipped, clipped)
    clip_low = (adv < 0) & (ratio < lo)
    clip_high = (adv > 0) & (ratio > hi)
    if cfg.dual_clip is not None:
        cap = -cfg.dual_clip * adv
        dual = (adv < 0) & (loss > cap)
        loss = jnp.where(adv < 0, jnp.minimum(loss, cap), loss)
    else:
        dual = jnp.zeros_like(clip_low)
    return loss, clip_low, clip_high, dual


def _kl_per_token(logps: Array, ref_logps: Array, estimator: KLEstimator) -> Array:
    """Per-token estimators of KL(pi_theta || pi_ref) on tokens sampled from pi_theta.

    Schulman's k1/k2/k3 (http://joschu.net/blog/kl-approx.html); k3 is the GRPO form
    (DeepSeekMath eq. 4): pi_ref/pi - log(pi_ref/pi) - 1, unbiased and non-negative.

    k3 exponentiates log(pi_ref / pi), which overflows float32 past 88.7 nats (a token the
    reference finds far likelier than the policy does), and an infinite value makes the loss and
    the gradient infinite or NaN. So k3 holds log(pi_ref / pi) at most `MAX_LOG_RATIO`: beyond it
    the token's k3 is exp(20) - 21 (about 4.9e8) with zero gradient, as for the importance ratio.
    Below, exp cannot overflow and the gradient 1 - pi_ref / pi is bounded by 1, so that side is
    exact. k1 and k2 do not exponentiate and are used as they are.

    As a loss term, k1's gradient is that of log pi on every token, whose mean over tokens the
    policy sampled is zero: its value estimates the KL, but it does not pull the policy towards
    the reference. k2 (gradient log(pi / pi_ref)) and k3 (gradient 1 - pi_ref / pi) do.
    """
    log_r = ref_logps - logps
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * jnp.square(log_r)
    log_r = jnp.minimum(log_r, MAX_LOG_RATIO)
    return jnp.exp(log_r) - log_r - 1.0


def policy_loss_parts(
    logps: Array,
    old_logps: Array,
    advantages: Array,
    loss_mask: Array,
    segment_ids: Array,
    cfg: LossConfig,
    ref_logps: Array | None = None,
    entropies: Array | None = None,
    *,
    behavior_logps: Array | None = None,
    max_segments_per_row: int | None = None,
) -> LossParts:
    """Loss numerator, denominator and metric parts for one `[B, L]` (micro-)batch.

    Args:
      logps: learner log-probs `[B, L]` (differentiated).
      old_logps: log-probs `[B, L]` of the policy the ratio is taken against (treated as
        constants): the sampler's, or with `behavior_logps` the learner's own before the update.
      advantages: per-token advantages `[B, L]`.
      loss_mask: `[B, L]`, > 0 on policy tokens.
      segment_ids: `[B, L]` int, 1.. per packed trajectory, 0 on padding; each id one
        contiguous run of its row, as attention sees it (`rl/packing.py` builds such rows and
        `step.Learner.put_batch` rejects others).
      ref_logps: reference-policy log-probs `[B, L]`; required when `cfg.kl_coef > 0`.
      entropies: per-token policy entropies `[B, L]`; required when `cfg.entropy_coef > 0`.
      behavior_logps: log-probs `[B, L]` of the policy that sampled the tokens (constants);
        required when `cfg.tis_cap` is set, else used for the behavior_kl metric only.
      max_segments_per_row: static bound on segment ids (default L, always safe). A segment id
        above it is an error in an eager call; under jit it is left out of the segment sums and
        makes the per-segment terms (GSPO, the seq_* aggregations) NaN, so pass a smaller value
        only when the packer guarantees it.
    """
    if not isinstance(cfg, LossConfig):
        # A dict failed on its first attribute, and a run's `config.loss` section went through
        # unvalidated: a misspelt algo was computed as gspo_token.
        raise TypeError(f"cfg must be a LossConfig, got {type(cfg).__name__}: build one from a config "
                        "section with LossConfig(**section), which checks its fields")
    if cfg.kl_coef > 0 and ref_logps is None:
        raise ValueError(f"LossConfig.kl_coef={cfg.kl_coef} > 0 needs ref_logps; pass the reference policy's log-probs")
    if cfg.entropy_coef > 0 and entropies is None:
        raise ValueError(f"LossConfig.entropy_coef={cfg.entropy_coef} > 0 needs per-token entropies")
    if cfg.tis_cap is not None and behavior_logps is None:
        raise ValueError(
            f"LossConfig.tis_cap={cfg.tis_cap} needs behavior_logps: pass the log-probs of the policy that "
            "sampled the tokens (the sampler's), with old_logps the learner's own log-probs of the batch "
            "before this update; or set tis_cap=None")
    # Nested lists, as `models.forward` takes tokens (they failed on '.ndim' / '.shape').
    as_array = lambda x: np.asarray(x) if isinstance(x, (list, tuple)) else x
    logps, old_logps, advantages, loss_mask, segment_ids, ref_logps, entropies, behavior_logps = map(
        as_array, (logps, old_logps, advantages, loss_mask, segment_ids, ref_logps, entropies, behavior_logps))
    if logps.ndim != 2:
        raise ValueError(f"logps has shape {logps.shape}; expected [B, L] (rows x positions): give a single "
                         "sequence a leading axis of 1, and vmap over any further leading axes")
    B, L = logps.shape
    for name, x in (("old_logps", old_logps), ("advantages", advantages), ("loss_mask", loss_mask),
                    ("segment_ids", segment_ids), ("ref_logps", ref_logps), ("entropies", entropies),
                    ("behavior_logps", behavior_logps)):
        if x is not None and x.shape != (B, L):
            raise ValueError(f"{name} has shape {x.shape}; expected {(B, L)} like logps")
    num_segments = (L if max_segments_per_row is None else max_segments_per_row) + 1  # + padding id 0
    # Concrete ids (an eager call) are checked here; under jit an id past the bound makes the
    # per-segment terms NaN (see max_segments_per_row), which the step's non-finite check catches.
    try:  # not for tracers, nor for arrays spread over several hosts
        top = (int(np.max(np.asarray(segment_ids), initial=0))
               if getattr(segment_ids, "is_fully_addressable", True) else None)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        top = None
    if top is not None and top >= num_segments:
        raise ValueError(
            f"segment_ids go up to {top} but max_segments_per_row={num_segments - 1}: number the "
            "segments 1, 2, ... within each row (0 for padding), as `rl/packing.pack` does, or pass a "
            "larger max_segments_per_row")

    # float32 at least; float64 only under jax_enable_x64 (NumPy's float64 inputs otherwise
    # compute in float32, without a truncation warning per array).
    dtype = jax.dtypes.canonicalize_dtype(jnp.promote_types(logps.dtype, jnp.float32))
    segment_ids_BxL = segment_ids.astype(jnp.int32)
    mask_BxL = (loss_mask > 0) & (segment_ids_BxL > 0)
    maskf_BxL = mask_BxL.astype(dtype)

    def clean(x):  # zero (value and gradient) outside policy tokens, before any exp
        return jnp.where(mask_BxL, x.astype(dtype), 0.0)

    logps_BxL = clean(logps)
    old_BxL = clean(jax.lax.stop_gradient(old_logps))
    adv_BxL = clean(jax.lax.stop_gradient(advantages))
    log_ratio_BxL = logps_BxL - old_BxL

    def bounded(x):  # the log-ratio exponentiated below; see MAX_LOG_RATIO
        return jnp.clip(x, -MAX_LOG_RATIO, MAX_LOG_RATIO)

    ntok_BxS = _segment_sum_BxS(maskf_BxL, segment_ids_BxL, num_segments)
    live_BxS = ntok_BxS > 0
    inv_ntok_BxS = jnp.where(live_BxS, 1.0 / jnp.maximum(ntok_BxS, 1.0), 0.0)
    num_tokens = jnp.sum(maskf_BxL)
    num_live = jnp.sum(live_BxS.astype(dtype))

    # Per-token aggregation weights (module docstring table).
    if cfg.agg == "token_mean":
        w_BxL, denominator = maskf_BxL, num_tokens
    elif cfg.agg == "seq_mean_token_mean":
        w_BxL, denominator = maskf_BxL * _gather_BxL(inv_ntok_BxS, segment_ids_BxL), num_live
    elif cfg.agg == "seq_mean_token_sum":
        w_BxL, denominator = maskf_BxL, num_live
    else:
        w_BxL, denominator = maskf_BxL / cfg.max_len_norm, num_live

    def seq_mean(x_BxL):  # mean over each segment's policy tokens, broadcast back to its tokens
        return _gather_BxL(_segment_sum_BxS(x_BxL * maskf_BxL, segment_ids_BxL, num_segments) * inv_ntok_BxS,
                           segment_ids_BxL)

    if cfg.algo == "grpo":
        # Token-level ratio r_t = pi(y_t) / pi_old(y_t) (GRPO, DeepSeekMath eq. 3).
        ratio_log_BxL = log_ratio_BxL
        ratio_BxL = jnp.exp(bounded(ratio_log_BxL))
        pg_BxL, low_BxL, high_BxL, dual_BxL = _clipped_surrogate(ratio_BxL, adv_BxL, cfg)
        unit_BxL = maskf_BxL  # clip and ratio metrics count policy tokens
    elif cfg.algo == "gspo":
        # GSPO eq. (7): s_i = exp(1/|y_i| sum_t log(pi / pi_old)); eq. (5): the clipped objective
        # with s_i and the sequence advantage A_i, which we take as the mean of the per-token
        # advantages over the segment's policy tokens (exactly A_i for outcome rewards, which are
        # constant within a segment). Each policy token carries its sequence's loss, so
        # agg="seq_mean_token_mean" is eq. (5) exactly and the other modes reweight sequences.
        ratio_log_BxL = seq_mean(log_ratio_BxL)
        ratio_BxL = jnp.exp(bounded(ratio_log_BxL))
        pg_BxL, low_BxL, high_BxL, dual_BxL = _clipped_surrogate(ratio_BxL, seq_mean(adv_BxL), cfg)
        # Metrics count sequences: put each segment's weight 1 on its tokens as 1/n_i.
        unit_BxL = maskf_BxL * _gather_BxL(inv_ntok_BxS, segment_ids_BxL)
    else:
        # GSPO-token (GSPO Sec. 4.3): s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]; its value is s_i,
        # its gradient flows only through token t, and advantages stay per token.
        # A clamped sequence ratio gets no gradient, as for grpo and gspo: else an unclipped
        # token (A < 0, no dual clip) would carry a gradient of exp(MAX_LOG_RATIO) |A|.
        ratio_log_BxL = jax.lax.stop_gradient(seq_mean(log_ratio_BxL))
        grad_path_BxL = jnp.where(jnp.abs(ratio_log_BxL) <= MAX_LOG_RATIO,
                                  logps_BxL - jax.lax.stop_gradient(logps_BxL), 0.0)
        ratio_BxL = jnp.exp(bounded(ratio_log_BxL) + grad_path_BxL)
        pg_BxL, low_BxL, high_BxL, dual_BxL = _clipped_surrogate(ratio_BxL, adv_BxL, cfg)
        unit_BxL = maskf_BxL

    sums, counts = {}, {}
    if behavior_logps is not None:
        # log(pi_prox / pi_behav) per policy token (0 elsewhere), bounded so that one corrupt or
        # -inf log-prob neither overflows the exp below nor makes a segment's sum inf - inf.
        log_q_BxL = bounded(old_BxL - clean(jax.lax.stop_gradient(behavior_logps)))
        k3_behav_BxL = clean(jnp.exp(log_q_BxL) - 1.0 - log_q_BxL)
        sums["behavior_kl"], counts["behavior_kl"] = jnp.sum(k3_behav_BxL), num_tokens
        if cfg.tis_cap is not None:
            if cfg.tis_level == "token":
                log_w_BxL, tis_unit_BxL = log_q_BxL, maskf_BxL
            else:  # the segment's product of token ratios, on each of its tokens
                log_w_BxL = _gather_BxL(_segment_sum_BxS(log_q_BxL, segment_ids_BxL, num_segments), segment_ids_BxL)
                tis_unit_BxL = maskf_BxL * _gather_BxL(inv_ntok_BxS, segment_ids_BxL)  # counts segments
            log_cap = math.log(cfg.tis_cap)
            tis_BxL = jnp.exp(jnp.minimum(log_w_BxL, log_cap))
            # Weights the policy-gradient term only, token by token (not the KL or entropy terms).
            pg_BxL = tis_BxL * pg_BxL
            num_tis = jnp.sum(tis_unit_BxL)
            sums["tis_weight_mean"], counts["tis_weight_mean"] = jnp.sum(tis_unit_BxL * tis_BxL), num_tis
            sums["tis_clip_frac"], counts["tis_clip_frac"] = jnp.sum(tis_unit_BxL * (log_w_BxL > log_cap)), num_tis

    pg_num = jnp.sum(w_BxL * pg_BxL)
    numerator = pg_num
    num_units = jnp.sum(unit_BxL)

    kl_num = jnp.zeros((), dtype)
    if ref_logps is not None:
        kl_BxL = clean(_kl_per_token(logps_BxL, clean(jax.lax.stop_gradient(ref_logps)), cfg.kl_estimator))
        kl_num = jnp.sum(w_BxL * kl_BxL)
        # Only a term with weight: 0 * (a NaN or inf KL) is NaN, so reference log-probs passed
        # for the kl_ref metric alone would otherwise make the loss and every gradient NaN.
        if cfg.kl_coef:
            numerator = numerator + cfg.kl_coef * kl_num
        sums["kl_ref"], counts["kl_ref"] = jnp.sum(kl_BxL), num_tokens
    if entropies is not None:
        ent_BxL = clean(entropies)
        if cfg.entropy_coef:  # (as for the KL: entropies passed for the metric only)
            numerator = numerator - cfg.entropy_coef * jnp.sum(w_BxL * ent_BxL)
        sums["entropy"], counts["entropy"] = jnp.sum(ent_BxL), num_tokens

    # approx_kl_old: k3 estimate of KL(pi_old || pi_theta) on the sampled tokens (which come from
    # pi_old): r - 1 - log r with r = pi_theta / pi_old. Token-level even for GSPO.
    # The log-ratio is bounded as for the loss, so that one corrupt old log-prob cannot make the
    # metric infinite.
    sg_log_ratio_BxL = bounded(jax.lax.stop_gradient(log_ratio_BxL))
    k3_old_BxL = clean(jnp.exp(sg_log_ratio_BxL) - 1.0 - sg_log_ratio_BxL)
    sums["approx_kl_old"], counts["approx_kl_old"] = jnp.sum(k3_old_BxL), num_tokens
    sums["pg_loss"], counts["pg_loss"] = pg_num, denominator
    sums["kl_loss"], counts["kl_loss"] = kl_num, denominator
    ratio_sg = jax.lax.stop_gradient(ratio_BxL)
    for name, x in (("clip_frac_low", low_BxL), ("clip_frac_high", high_BxL), ("clip_frac_dual", dual_BxL),
                    ("ratio_mean", ratio_sg)):
        sums[name], counts[name] = jnp.sum(unit_BxL * x), num_units
    clamped_BxL = maskf_BxL * (jnp.abs(jax.lax.stop_gradient(ratio_log_BxL)) > MAX_LOG_RATIO)
    sums["log_ratio_clamped"], counts["log_ratio_clamped"] = jnp.sum(clamped_BxL), num_tokens
    sums["num_policy_tokens"] = num_tokens
    sums["num_segments"] = num_live
    # `initial` so an empty batch ([0, L] or [B, 0]) reduces like an all-masked one.
    ratio_min = jnp.min(jnp.where(mask_BxL, ratio_sg, jnp.inf), initial=jnp.inf)
    ratio_max = jnp.max(jnp.where(mask_BxL, ratio_sg, -jnp.inf), initial=-jnp.inf)
    return LossParts(numerator, denominator, sums, counts, ratio_min, ratio_max)


def combine_parts(*parts: LossParts) -> LossParts:
    """Merges the parts of several micro-batches: sums add, extremes take min / max."""
    out = parts[0]
    for p in parts[1:]:
        out = LossParts(
            numerator=out.numerator + p.numerator,
            denominator=out.denominator + p.denominator,
            sums=jax.tree.map(jnp.add, out.sums, p.sums),
            counts=jax.tree.map(jnp.add, out.counts, p.counts),
            ratio_min=jnp.minimum(out.ratio_min, p.ratio_min),
            ratio_max=jnp.maximum(out.ratio_max, p.ratio_max),
        )
    return out


def finalize_parts(parts: LossParts) -> tuple[Array, dict[str, Array]]:
    """Loss = numerator / max(denominator, 1) and the metrics dict (0 / 1 when nothing to average)."""
    loss = parts.numerator / jnp.maximum(parts.denominator, 1.0)
    metrics = {}
    for k, v in parts.sums.items():
        metrics[k] = v / jnp.maximum(parts.counts[k], 1.0) if k in parts.counts else v
    has_tokens = parts.sums["num_policy_tokens"] > 0
    metrics["ratio_min"] = jnp.where(has_tokens, parts.ratio_min, 1.0)
    metrics["ratio_max"] = jnp.where(has_tokens, parts.ratio_max, 1.0)
    metrics["ratio_mean"] = jnp.where(has_tokens, metrics["ratio_mean"], 1.0)
    metrics["loss"] = loss
    return loss, metrics


def policy_loss(
    logps: Array,
    old_logps: Array,
    advantages: Array,
    loss_mask: Array,
    segment_ids: Array,
    cfg: LossConfig,
    ref_logps: Array | None = None,
    entropies: Array | None = None,
    *,
    behavior_logps: Array | None = None,
    max_segments_per_row: int | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Scalar loss and metrics for one batch; see `policy_loss_parts` for the arguments.

    For micro-batched steps use `policy_loss_parts` + `combine_parts` + `finalize_parts`, which
    normalise by the denominator of the whole batch.
    """
    parts = policy_loss_parts(logps, old_logps, advantages, loss_mask, segment_ids, cfg, ref_logps, entropies,
                              behavior_logps=behavior_logps, max_segments_per_row=max_segments_per_row)
    return finalize_parts(parts)
