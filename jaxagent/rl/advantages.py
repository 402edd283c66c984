"""Group-relative advantages (GRPO, Dr. GRPO, RLOO) and DAPO dynamic sampling, on the host.

Place in the data flow: `rewards/` scores each finished trajectory with one scalar; this file
turns the G rewards of each prompt's group into advantages (one scalar per trajectory, which
`rl/packing.py` broadcasts onto the trajectory's policy tokens) and decides which groups carry a
learning signal. Everything here is NumPy: rewards are few and live on the host.

Methods, for a group with rewards r_1..r_G, mean m and standard deviation s:
  * "grpo":    A_i = (r_i - m) / (s + eps)           (DeepSeekMath, Sec. 4.1.2)
  * "dr_grpo": A_i = r_i - m                          (Dr. GRPO, Liu et al. 2025: no std division)
  * "rloo":    A_i = r_i - (sum_{j != i} r_j) / (G - 1)  (Ahmadian et al. 2024; = G/(G-1) (r_i - m))

`s` is the *sample* standard deviation (ddof=1), as in the reference GRPO implementations that
call `torch.std` (unbiased by default). For G = 2 it is sqrt(2) times the population value.

A *zero-variance* group (all rewards equal, up to `_ZERO_VARIANCE_ATOL`, or a group of one) has
no learning signal: every method gives it advantage 0 exactly. With `zero_variance="drop"` its
trajectories are also marked False in the returned keep mask, so the trainer does not spend
compute on them (the filter of DAPO's dynamic sampling, DAPO Sec. 3.2).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, get_args

import numpy as np

Method = Literal["grpo", "dr_grpo", "rloo"]
ZeroVariance = Literal["keep", "drop"]

# Rewards within a group are "equal" when max - min <= this (shaped rewards accumulate float error).
_ZERO_VARIANCE_ATOL = 1e-9


@dataclasses.dataclass(frozen=True)
class AdvantageInfo:
    """What `compute_advantages` saw and decided.

    Attributes:
      keep: bool `[N]`; False for trajectories of dropped zero-variance groups (all True under
        zero_variance="keep").
      num_groups: distinct group ids.
      num_zero_variance_groups: groups whose rewards are all equal (or that have one member).
      zero_variance_frac: num_zero_variance_groups / num_groups.
      reward_mean, reward_std: over all trajectories (population std), for logging.
    """

    keep: np.ndarray
    num_groups: int
    num_zero_variance_groups: int
    zero_variance_frac: float
    reward_mean: float
    reward_std: float

    def metrics(self) -> dict[str, float]:
        """Scalars for logging."""
        return {
            "num_groups": float(self.num_groups),
            "num_zero_variance_groups": float(self.num_zero_variance_groups),
            "zero_variance_frac": self.zero_variance_frac,
            "kept_frac": float(np.mean(self.keep)) if self.keep.size else 0.0,
            "reward_mean": self.reward_mean,
            "reward_std": self.reward_std,
        }


def _check_rewards(rewards, group_ids) -> tuple[np.ndarray, np.ndarray]:
    """float64 rewards `[N]` and group ids `[N]`, or a ValueError saying what is wrong."""
    rewards = np.asarray(rewards, dtype=np.float64)
    group_ids = np.asarray(group_ids)
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards {rewards.shape} and group_ids {group_ids.shape} must be 1-D of the same length")
    bad = np.flatnonzero(~np.isfinite(rewards))
    if bad.size:
        raise ValueError(f"rewards must be finite; got {rewards[bad[:5]]} at indices {bad[:5].tolist()} "
                         "(score failures as a finite reward upstream, e.g. 0)")
    if group_ids.dtype.kind in "fc":
        bad = np.flatnonzero(~np.isfinite(group_ids))
        if bad.size:  # np.unique takes every NaN for the same id: unrelated prompts, one group
            raise ValueError(f"group_ids must be finite; got {group_ids[bad[:5]]} at indices "
                             f"{bad[:5].tolist()} (give each prompt's samples one int or string id)")
    return rewards, group_ids


def _group_index(group_ids: np.ndarray) -> tuple[np.ndarray, int]:
    """Dense index 0..K-1 per trajectory, numbered by first appearance."""
    try:
        _, first, inverse = np.unique(group_ids, return_index=True, return_inverse=True)
    except TypeError as e:  # ids that do not sort together (None, mixed types in an object array)
        kinds = sorted({type(g).__name__ for g in group_ids.ravel()})
        raise ValueError(f"group_ids must be ints or strings that sort together; got "
                         f"{', '.join(kinds)} values") from e
    order = np.argsort(np.argsort(first, kind="stable"), kind="stable")  # rank of each unique id by first use
    return order[inverse.reshape(-1)], len(first)


def _zero_variance_groups(rewards: np.ndarray, idx: np.ndarray, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-group (count, is_zero_variance)."""
    count = np.bincount(idx, minlength=num_groups)
    gmax = np.full(num_groups, -np.inf)
    gmin = np.full(num_groups, np.inf)
    np.maximum.at(gmax, idx, rewards)
    np.minimum.at(gmin, idx, rewards)
    return count, (count < 2) | (gmax - gmin <= _ZERO_VARIANCE_ATOL)


def compute_advantages(
    rewards: np.ndarray,
    group_ids: np.ndarray,
    method: Method = "grpo",
    eps: float = 1e-6,
    zero_variance: ZeroVariance = "keep",
) -> tuple[np.ndarray, AdvantageInfo]:
    """Per-trajectory advantages `[N]` (float32) from scalar rewards `[N]` and group ids `[N]`.

    Group members need not be contiguous. See the module docstring for the formulas.
    """
    if method not in get_args(Method):
        raise ValueError(f"method={method!r} is not supported; allowed values: {get_args(Method)}")
    if zero_variance not in get_args(ZeroVariance):
        raise ValueError(f"zero_variance={zero_variance!r} is not supported; allowed values: {get_args(ZeroVariance)}")
    if not eps >= 0:
        raise ValueError(f"eps={eps} must be >= 0")
    rewards, group_ids = _check_rewards(rewards, group_ids)
    n = rewards.size
    if n == 0:
        return np.zeros(0, np.float32), AdvantageInfo(np.zeros(0, bool), 0, 0, 0.0, 0.0, 0.0)

    idx, num_groups = _group_index(group_ids)
    count, zero_var = _zero_variance_groups(rewards, idx, num_groups)
    gsum = np.bincount(idx, weights=rewards, minlength=num_groups)
    mean = gsum / count
    centered = rewards - mean[idx]
    if method == "grpo":
        sq = np.bincount(idx, weights=centered**2, minlength=num_groups)
        std = np.sqrt(sq / np.maximum(count - 1, 1))  # sample std (ddof=1)
        # Zero-variance groups get 0 below; dividing them by 1 keeps eps=0 free of 0 / 0 warnings.
        adv = centered / np.where(zero_var, 1.0, std + eps)[idx]
    elif method == "dr_grpo":
        adv = centered
    else:
        # Leave-one-out baseline: mean of the other G - 1 rewards of the group.
        others = (gsum[idx] - rewards) / np.maximum(count[idx] - 1, 1)
        adv = rewards - others
    member_zero_var = zero_var[idx]
    adv = np.where(member_zero_var, 0.0, adv)
    keep = ~member_zero_var if zero_variance == "drop" else np.ones(n, bool)
    num_zero = int(np.sum(zero_var))
    info = AdvantageInfo(
        keep=keep,
        num_groups=int(num_groups),
        num_zero_variance_groups=num_zero,
        zero_variance_frac=num_zero / num_groups,
        reward_mean=float(np.mean(rewards)),
        reward_std=float(np.std(rewards)),
    )
    return adv.astype(np.float32), info


class DynamicSampler:
    """DAPO dynamic sampling (DAPO Sec. 3.2): fill a batch with informative groups.

    A group is informative when its rewards are not all equal (0 < accuracy < 1 for binary
    rewards), the test `compute_advantages` uses for zero-variance groups. The trainer passes
    each trajectory's total reward, so with shaping terms (format, tool use, length) a group
    that is all right or all wrong still counts when those terms differ within it: it has
    non-zero advantages. DAPO's filter reads accuracy alone; a caller that wants it passes the
    outcome component's values (`RewardOutput.components[name]`) instead. The trainer loop::

        sampler = DynamicSampler(target_groups=32, max_rounds=4)
        while not sampler.done:
            prompts = next_prompts(sampler.num_prompts_to_sample())
            rewards, group_ids = rollout_and_score(prompts)   # G samples per prompt
            keep = sampler.update(rewards, group_ids)         # bool per trajectory
            ...accumulate the kept trajectories...

    `update` accepts informative groups in order of first appearance until the target is reached
    (surplus informative groups are rejected so every step trains on the same number of groups).
    `num_prompts_to_sample` over-samples by the observed informative rate so one more round usually
    suffices. If `max_rounds` runs out first the step proceeds with fewer groups; `shortfall` says
    how many.
    """

    def __init__(self, target_groups: int, max_rounds: int = 8, max_prompts_per_round: int | None = None,
                 min_informative_rate: float = 0.05):
        if target_groups < 1:
            raise ValueError(f"target_groups={target_groups} must be >= 1")
        if max_rounds < 1:
            raise ValueError(f"max_rounds={max_rounds} must be >= 1")
        if max_prompts_per_round is not None and max_prompts_per_round < 1:
            raise ValueError(f"max_prompts_per_round={max_prompts_per_round} must be None or >= 1")
        if not 0 < min_informative_rate <= 1:
            raise ValueError(f"min_informative_rate={min_informative_rate} must be in (0, 1]")
        self.target_groups = target_groups
        self.max_rounds = max_rounds
        self.max_prompts_per_round = max_prompts_per_round
        self.min_informative_rate = min_informative_rate
        self.reset()

    def reset(self) -> None:
        """Starts a new training step."""
        self.rounds = 0
        self.groups_seen = 0
        self.informative_seen = 0
        self.accepted = 0

    @property
    def remaining(self) -> int:
        return self.target_groups - self.accepted

    @property
    def done(self) -> bool:
        return self.remaining <= 0 or self.rounds >= self.max_rounds

    @property
    def shortfall(self) -> int:
        return max(self.remaining, 0)

    def informative_rate(self) -> float:
        """Observed fraction of informative groups this step (1.0 before any data)."""
        return self.informative_seen / self.groups_seen if self.groups_seen else 1.0

    def num_prompts_to_sample(self) -> int:
        """Prompts (groups) to roll out next: remaining need / informative rate, rounded up."""
        if self.done:
            return 0
        rate = max(self.informative_rate(), self.min_informative_rate)
        n = math.ceil(self.remaining / rate)
        return n if self.max_prompts_per_round is None else min(n, self.max_prompts_per_round)

    def update(self, rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
        """Records one round of scored groups; returns the bool keep mask over its trajectories."""
        # A NaN reward would make its group look informative (NaN compares as not equal).
        rewards, group_ids = _check_rewards(rewards, group_ids)
        if rewards.size == 0:
            self.rounds += 1
            return np.zeros(0, bool)
        idx, num_groups = _group_index(group_ids)  # (may refuse the ids: no round is counted)
        self.rounds += 1
        _, zero_var = _zero_variance_groups(rewards, idx, num_groups)
        informative = np.flatnonzero(~zero_var)  # dense group indices, in order of first appearance
        take = informative[: max(self.remaining, 0)]
        accepted = np.zeros(num_groups, bool)
        accepted[take] = True
        self.groups_seen += num_groups
        self.informative_seen += informative.size
        self.accepted += take.size
        return accepted[idx]

    def metrics(self) -> dict[str, float]:
        """Scalars for logging."""
        return {
            "dynamic_sampling_rounds": float(self.rounds),
            "dynamic_sampling_groups_seen": float(self.groups_seen),
            "dynamic_sampling_informative_rate": self.informative_rate(),
            "dynamic_sampling_shortfall": float(self.shortfall),
        }
