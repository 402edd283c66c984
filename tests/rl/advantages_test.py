"""Tests for jaxagent/rl/advantages.py: hand-worked groups, a loop reference, zero variance, DAPO sampling."""

import numpy as np
import pytest

from jaxagent.rl.advantages import DynamicSampler, compute_advantages


@pytest.mark.parametrize("method,want", [
    # Group [1, 0, 0, 0]: mean 0.25; sample std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5.
    ("grpo", [1.5, -0.5, -0.5, -0.5]),
    ("dr_grpo", [0.75, -0.25, -0.25, -0.25]),
    # Leave-one-out: 1 - mean(0, 0, 0) = 1; 0 - mean(1, 0, 0) = -1/3.
    ("rloo", [1.0, -1 / 3, -1 / 3, -1 / 3]),
])
def test_hand_worked_group(method, want):
    adv, info = compute_advantages(np.array([1.0, 0, 0, 0]), np.zeros(4, int), method=method, eps=0.0)
    np.testing.assert_allclose(adv, want, rtol=1e-6)
    assert adv.dtype == np.float32 and info.num_groups == 1 and info.num_zero_variance_groups == 0


def test_grpo_uses_sample_std_and_eps():
    # [1, 0, 0, 1]: mean 0.5, sample std sqrt(1/3) (population std would be 0.5 and give +-1).
    adv, _ = compute_advantages(np.array([1.0, 0, 0, 1]), np.zeros(4, int), method="grpo", eps=0.0)
    np.testing.assert_allclose(adv, [np.sqrt(0.75), -np.sqrt(0.75), -np.sqrt(0.75), np.sqrt(0.75)], rtol=1e-6)
    adv_eps, _ = compute_advantages(np.array([1.0, 0, 0, 1]), np.zeros(4, int), method="grpo", eps=0.1)
    np.testing.assert_allclose(adv_eps[0], 0.5 / (np.sqrt(1 / 3) + 0.1), rtol=1e-6)


def loop_reference(rewards, group_ids, method, eps):
    out = np.zeros(len(rewards))
    for g in set(group_ids.tolist()):
        idx = [i for i in range(len(rewards)) if group_ids[i] == g]
        r = rewards[idx]
        if len(r) < 2 or r.max() == r.min():
            continue
        for k, i in enumerate(idx):
            if method == "grpo":
                out[i] = (r[k] - r.mean()) / (np.std(r, ddof=1) + eps)
            elif method == "dr_grpo":
                out[i] = r[k] - r.mean()
            else:
                out[i] = r[k] - np.mean(np.delete(r, k))
    return out


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo"])
def test_matches_loop_reference_on_shuffled_groups(method):
    rng = np.random.default_rng(0)
    group_ids = np.repeat(rng.permutation(40) * 7 + 3, 8)  # arbitrary ids, G = 8
    rewards = rng.choice([0.0, 1.0], size=group_ids.size, p=[0.6, 0.4]) + 0.1 * rng.integers(0, 3, group_ids.size)
    rewards[group_ids == group_ids[0]] = 1.0  # at least one zero-variance group
    perm = rng.permutation(group_ids.size)  # members of a group need not be contiguous
    rewards, group_ids = rewards[perm], group_ids[perm]
    adv, info = compute_advantages(rewards, group_ids, method=method, eps=1e-6)
    np.testing.assert_allclose(adv, loop_reference(rewards, group_ids, method, 1e-6), rtol=1e-5, atol=1e-6)
    assert info.num_groups == 40 and info.num_zero_variance_groups >= 1


def test_zero_variance_keep_and_drop():
    rewards = np.array([1.0, 1, 1, 0, 0, 0, 1, 0, 0.1 + 0.2, 0.3])
    group_ids = np.array([0, 0, 0, 1, 1, 1, 2, 2, 3, 3])  # group 3 is equal up to float error
    adv, info = compute_advantages(rewards, group_ids, zero_variance="keep")
    assert info.keep.all()
    assert info.num_groups == 4 and info.num_zero_variance_groups == 3 and info.zero_variance_frac == 0.75
    assert np.all(adv[[0, 1, 2, 3, 4, 5, 8, 9]] == 0.0) and adv[6] > 0 > adv[7]
    adv_d, info_d = compute_advantages(rewards, group_ids, zero_variance="drop")
    np.testing.assert_array_equal(info_d.keep, [False] * 6 + [True, True, False, False])
    np.testing.assert_array_equal(adv_d, adv)
    assert info_d.metrics()["kept_frac"] == pytest.approx(0.2)


@pytest.mark.filterwarnings("error")
def test_eps_zero_with_a_zero_variance_group_warns_nothing():
    # eps=0 divided a zero-variance group by its std of 0 (0 / 0 RuntimeWarning every step,
    # an error under -W error) before the group was set to 0.
    adv, _ = compute_advantages(np.array([1.0, 1.0, 1.0, 0.0, 7.0]), np.array([0, 0, 1, 1, 2]), eps=0.0)
    np.testing.assert_allclose(adv, [0.0, 0.0, np.sqrt(0.5), -np.sqrt(0.5), 0.0], rtol=1e-6)


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo"])
def test_singleton_group_is_zero_variance(method):
    adv, info = compute_advantages(np.array([3.0, 1.0, 0.0]), np.array([5, 6, 6]), method=method, zero_variance="drop")
    assert adv[0] == 0.0 and not info.keep[0] and info.keep[1:].all() and np.all(np.isfinite(adv))


def test_validation_errors():
    with pytest.raises(ValueError, match="method"):
        compute_advantages(np.zeros(2), np.zeros(2), method="ppo")
    with pytest.raises(ValueError, match="zero_variance"):
        compute_advantages(np.zeros(2), np.zeros(2), zero_variance="skip")
    with pytest.raises(ValueError, match="finite"):
        compute_advantages(np.array([0.0, np.nan]), np.zeros(2))
    with pytest.raises(ValueError, match="same length"):
        compute_advantages(np.zeros(3), np.zeros(2))
    adv, info = compute_advantages(np.zeros(0), np.zeros(0))
    assert adv.size == 0 and info.num_groups == 0


def test_group_ids_that_do_not_name_groups_are_refused():
    # NaN ids were all one group (four unrelated prompts normalised together); None ids raised
    # "'<' not supported between instances of 'NoneType' and 'NoneType'".
    sampler = DynamicSampler(4)
    for fn in (compute_advantages, sampler.update):
        with pytest.raises(ValueError, match=r"group_ids must be finite; got \[nan nan\] at indices \[2, 3\]"):
            fn([1.0, 0.0, 1.0, 0.0], [0.0, 0.0, np.nan, np.nan])
        with pytest.raises(ValueError, match="group_ids must be ints or strings that sort together; got NoneType"):
            fn([1.0, 0.0, 1.0, 0.0], [None, None, 1, 1])
    assert sampler.rounds == 0  # a refused round is not counted
    adv, info = compute_advantages([1.0, 0.0, 1.0, 0.0], ["a", "a", "b", "b"])
    assert info.num_groups == 2 and adv[0] > 0 > adv[1]


def groups(rewards_per_group, start=0):
    rewards = np.concatenate([np.asarray(r, float) for r in rewards_per_group])
    ids = np.concatenate([np.full(len(r), start + g) for g, r in enumerate(rewards_per_group)])
    return rewards, ids


def test_dynamic_sampler_fills_target_with_informative_groups():
    s = DynamicSampler(target_groups=4)
    assert s.num_prompts_to_sample() == 4  # no data yet: assume every group is informative
    r, g = groups([[1, 1], [0, 1], [0, 0], [1, 1], [1, 0], [0, 0]])
    keep = s.update(r, g)
    np.testing.assert_array_equal(keep, [0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0])
    assert s.accepted == 2 and not s.done and s.informative_rate() == pytest.approx(1 / 3)
    assert s.num_prompts_to_sample() == 6  # 2 still needed at an observed rate of 1/3
    r, g = groups([[0, 0], [1, 0], [0, 1], [1, 0]], start=100)
    keep = s.update(r, g)
    np.testing.assert_array_equal(keep, [0, 0, 1, 1, 1, 1, 0, 0])  # surplus informative group rejected
    assert s.done and s.shortfall == 0 and s.num_prompts_to_sample() == 0
    s.reset()
    assert not s.done and s.num_prompts_to_sample() == 4


def test_dynamic_sampler_gives_up_after_max_rounds():
    s = DynamicSampler(target_groups=2, max_rounds=2, max_prompts_per_round=10, min_informative_rate=0.1)
    for _ in range(2):
        assert not s.done
        s.update(*groups([[0, 0], [1, 1]]))
        assert s.num_prompts_to_sample() in (0, 10)  # rate 0 -> 2 / 0.1 = 20, capped at 10
    assert s.done and s.shortfall == 2 and s.metrics()["dynamic_sampling_rounds"] == 2.0


def test_dynamic_sampler_validation():
    with pytest.raises(ValueError, match="target_groups"):
        DynamicSampler(target_groups=0)
    with pytest.raises(ValueError, match="min_informative_rate"):
        DynamicSampler(target_groups=1, min_informative_rate=0.0)


def test_dynamic_sampler_rejects_non_finite_rewards():
    # A NaN reward made its group look informative and get accepted into the batch.
    s = DynamicSampler(target_groups=2)
    with pytest.raises(ValueError, match="rewards must be finite"):
        s.update(np.array([np.nan, 1.0, 0.0, 0.0]), np.array([0, 0, 1, 1]))
    assert s.accepted == 0 and s.rounds == 0


def test_dynamic_sampler_matches_loop_reference_on_random_rounds():
  rng = np.random.default_rng(1)
  for _ in range(200):
    target, rounds = int(rng.integers(1, 10)), int(rng.integers(1, 5))
    cap = None if rng.random() < 0.5 else int(rng.integers(1, 30))
    s = DynamicSampler(target, max_rounds=rounds, max_prompts_per_round=cap)
    accepted = seen = informative = done_rounds = 0
    while not s.done:
      rate = max(informative / seen if seen else 1.0, 0.05)
      want = int(np.ceil((target - accepted) / rate))
      n = s.num_prompts_to_sample()
      assert n == (want if cap is None else min(want, cap))
      G = int(rng.integers(1, 5))
      ids = np.repeat(np.arange(n) * 3 + 7, G)
      rewards = (rng.random(n * G) < rng.random()).astype(float)
      perm = rng.permutation(n * G)  # members interleaved
      ids, rewards = ids[perm], rewards[perm]
      keep = s.update(rewards, ids)
      order = list(dict.fromkeys(ids.tolist()))  # groups by first appearance
      useful = [g for g in order if np.ptp(rewards[ids == g]) > 0]
      taken = set(useful[:target - accepted])
      np.testing.assert_array_equal(keep, [g in taken for g in ids])
      accepted, seen, informative, done_rounds = (accepted + len(taken), seen + len(order),
                                                  informative + len(useful), done_rounds + 1)
    assert s.accepted == accepted and s.shortfall == max(target - accepted, 0)
    assert accepted == target or done_rounds == rounds
    assert s.metrics()["dynamic_sampling_groups_seen"] == seen


@pytest.mark.parametrize("method,want", [("grpo", [-1.0, 0.0, 1.0]), ("dr_grpo", [-0.01, 0.0, 0.01]),
                                         ("rloo", [-0.015, 0.0, 0.015])])
def test_float64_rewards_keep_differences_float32_would_lose(method, want):
    # Rewards 1e6 + {0, 0.01, 0.02}: float32 spaces numbers near 1e6 by 0.0625, so reading them
    # in float32 would make the group all equal (zero variance, advantage 0). The group is
    # centred in float64, and only the advantages are float32.
    rewards = 1e6 + np.array([0.0, 0.01, 0.02])
    assert np.ptp(rewards.astype(np.float32)) == 0.0
    adv, info = compute_advantages(rewards, np.zeros(3, int), method=method, eps=0.0)
    np.testing.assert_allclose(adv, want, rtol=1e-6, atol=1e-7)  # 1e6 + 0.01 is itself rounded
    assert info.num_zero_variance_groups == 0 and adv.dtype == np.float32
