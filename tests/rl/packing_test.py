"""Tests for jaxagent/rl/packing.py: round trips, layout invariants, efficiency, overflow, buckets."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.rl.losses import LossConfig, policy_loss
from jaxagent.rl.packing import PackingConfig, PackItem, best_fit_decreasing, pack, unpack


def make_item(rng, n, traj_id=-1, scalar_adv=True, ref=False):
    """A multi-turn ledger: prompt, then alternating policy turns and observations."""
    mask = np.zeros(n)
    t = int(rng.integers(1, max(2, n // 4) + 1))  # prompt
    policy = True
    while t < n:
        span = int(rng.integers(1, max(2, n // 5) + 1))
        mask[t:t + span] = 1.0 if policy else 0.0
        t += span
        policy = not policy
    old = np.where(mask > 0, -rng.uniform(0.01, 5.0, n), 0.0)
    adv = float(rng.normal()) if scalar_adv else rng.normal(size=n)
    return PackItem(tokens=rng.integers(1, 50_000, n), loss_mask=mask, old_logps=old, advantages=adv,
                    ref_logps=-np.abs(rng.normal(size=n)) if ref else None, group_id=traj_id // 4, traj_id=traj_id)


def realistic_lengths(rng, n):
    """Multi-turn trajectory lengths: mostly short tool episodes, some long ones (200-1500 tokens)."""
    kind = rng.choice(3, size=n, p=[0.5, 0.3, 0.2])
    return rng.integers(np.array([200, 600, 1000])[kind], np.array([600, 1000, 1500])[kind] + 1)


def check_layout(packed):
    """Invariants every packed batch must satisfy."""
    B, L = packed.shape
    placed = packed.item_row >= 0
    assert packed.segment_ids.shape == packed.positions.shape == packed.loss_mask.shape == (B, L)
    # Each row: segments 1..k contiguous and left-aligned, then padding.
    for r in range(B):
        seg = packed.segment_ids[r]
        used = int(np.count_nonzero(seg))
        assert np.all(seg[used:] == 0) and np.all(np.diff(seg[:used]) >= 0)
        assert used == 0 or (seg[0] == 1 and set(np.diff(seg[:used]).tolist()) <= {0, 1})
        pad = seg == 0
        assert np.all(packed.positions[r][pad] == 0) and np.all(packed.loss_mask[r][pad] == 0)
        assert np.all(packed.tokens[r][pad] == 0) and np.all(packed.old_logps[r][pad] == 0)
    # Each placed item: its slice holds its segment, positions restart at 0.
    for i in np.flatnonzero(placed):
        r, o, n = packed.item_row[i], packed.item_offset[i], packed.item_length[i]
        assert np.all(packed.segment_ids[r, o:o + n] == packed.item_segment[i])
        np.testing.assert_array_equal(packed.positions[r, o:o + n], np.arange(n))
    assert int(np.count_nonzero(packed.segment_ids)) == packed.stats["real_tokens"] == int(packed.item_length.sum())


def test_round_trip_no_token_lost_or_duplicated():
    rng = np.random.default_rng(0)
    items = [make_item(rng, int(n), traj_id=i, scalar_adv=i % 2 == 0, ref=True)
             for i, n in enumerate(rng.integers(2, 60, 100))]
    packed = pack(items, PackingConfig(max_len=64, len_buckets=(16, 32, 64), row_multiple=8))
    check_layout(packed)
    assert packed.stats["packed_items"] == 100 and packed.shape[0] % 8 == 0
    for field in ("tokens", "loss_mask", "old_logps", "advantages", "ref_logps"):
        for it, got in zip(items, unpack(getattr(packed, field), packed)):
            np.testing.assert_array_equal(got, getattr(it, field), err_msg=field)
    # A per-token "model output" that depends on (token, position) unpacks to the per-item value.
    out_BxL = packed.tokens.astype(np.float64) * 1000 + packed.positions
    for it, got in zip(items, unpack(out_BxL, packed)):
        np.testing.assert_array_equal(got, it.tokens * 1000.0 + np.arange(len(it)))
    # Every (item, position) appears exactly once.
    ids = np.zeros(packed.shape, np.int64) - 1
    for i in range(100):
        r, o, n = packed.item_row[i], packed.item_offset[i], packed.item_length[i]
        assert np.all(ids[r, o:o + n] == -1)
        ids[r, o:o + n] = i
    assert np.count_nonzero(ids >= 0) == sum(len(it) for it in items)
    np.testing.assert_array_equal(packed.traj_ids, np.arange(100))
    assert packed.stats["policy_tokens"] == int(sum(it.loss_mask.sum() for it in items))


def test_scalar_advantage_is_broadcast():
    rng = np.random.default_rng(1)
    it = make_item(rng, 10)
    it2 = PackItem(it.tokens, it.loss_mask, it.old_logps, 0.75)
    packed = pack([it2], PackingConfig(max_len=16))
    np.testing.assert_array_equal(unpack(packed.advantages, packed)[0], np.full(10, 0.75, np.float32))
    assert packed.ref_logps is None and "ref_logps" not in packed.arrays()


def test_efficiency_on_realistic_multi_turn_mix():
    rng = np.random.default_rng(2)
    effs = []
    for _ in range(3):
        lengths = realistic_lengths(rng, 300)
        items = [PackItem(np.ones(n, np.int32), np.r_[0.0, np.ones(n - 1)], np.zeros(n), 1.0) for n in lengths]
        packed = pack(items, PackingConfig(max_len=2048))
        check_layout(packed)
        lower_bound_rows = math.ceil(lengths.sum() / 2048)
        assert packed.stats["rows"] <= lower_bound_rows + 3, (packed.stats["rows"], lower_bound_rows)
        effs.append(packed.stats["efficiency"])
    print(f"packing efficiency (300 trajectories, 200-1500 tokens, L=2048): {[round(e, 4) for e in effs]}")
    assert min(effs) >= 0.97, effs


def test_best_fit_decreasing_respects_capacity():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 100, 500)
    row, offset, used = best_fit_decreasing(lengths, 100)
    assert max(used) <= 100 and sum(used) == lengths.sum()
    for r in range(len(used)):
        idx = np.flatnonzero(row == r)
        spans = sorted(zip(offset[idx], lengths[idx]))
        assert spans[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
    assert len(used) <= math.ceil(lengths.sum() / 100) * 1.05 + 1
    # A case where packing order matters: 6+4 and 5+3+2 fill two rows exactly.
    assert len(best_fit_decreasing(np.array([3, 6, 2, 5, 4]), 10)[2]) == 2


def test_overflow_drop():
    rng = np.random.default_rng(4)
    items = [make_item(rng, 30, traj_id=0), make_item(rng, 100, traj_id=1), make_item(rng, 64, traj_id=2)]
    packed = pack(items, PackingConfig(max_len=64, overflow="drop"))
    check_layout(packed)
    s = packed.stats
    assert (s["dropped_items"], s["dropped_tokens"], s["truncated_items"], s["packed_items"]) == (1, 100, 0, 2)
    out = unpack(packed.tokens, packed)
    assert out[1] is None and packed.item_row[1] == -1
    np.testing.assert_array_equal(out[2], items[2].tokens)


def test_overflow_truncate_cuts_the_tail():
    rng = np.random.default_rng(5)
    items = [make_item(rng, 30), make_item(rng, 100)]
    packed = pack(items, PackingConfig(max_len=64, overflow="truncate"))
    check_layout(packed)
    s = packed.stats
    assert (s["truncated_items"], s["truncated_tokens"], s["dropped_items"]) == (1, 36, 0)
    lp = unpack(packed.old_logps, packed)[1]
    assert lp.shape == (100,)
    np.testing.assert_array_equal(lp[:64], items[1].old_logps[:64])
    assert np.all(np.isnan(lp[64:]))  # cut tokens are visibly absent, never silently zero
    np.testing.assert_array_equal(unpack(packed.loss_mask, packed)[1][:64], items[1].loss_mask[:64])
    assert np.all(unpack(packed.tokens, packed)[1][64:] == 0)


def test_truncated_tokens_of_bfloat16_values_unpack_as_nan():
    # NumPy does not file bfloat16 (a model's compute dtype) under np.inexact: its cut tokens
    # came back as 0, which reads as a log-prob of a certain token.
    rng = np.random.default_rng(5)
    items = [make_item(rng, 30), make_item(rng, 100)]
    packed = pack(items, PackingConfig(max_len=64, overflow="truncate"))
    lp = unpack(np.asarray(jnp.asarray(packed.old_logps, jnp.bfloat16)), packed)[1]
    assert lp.dtype == jnp.bfloat16 and lp.shape == (100,)
    np.testing.assert_array_equal(lp[:64].astype(np.float32),
                                  items[1].old_logps[:64].astype(jnp.bfloat16).astype(np.float32))
    assert np.all(np.isnan(lp[64:].astype(np.float32)))


@pytest.mark.parametrize("rounding,row_buckets", [("multiple", ()), ("pow2", ()), ("buckets", (8, 16, 32))])
def test_bucketed_shapes_are_bounded(rounding, row_buckets):
    rng = np.random.default_rng(6)
    cfg = PackingConfig(max_len=256, len_buckets=(64, 128, 256), row_multiple=4, row_rounding=rounding,
                        row_buckets=row_buckets)
    shapes = set()
    for _ in range(30):
        n_items = int(rng.integers(1, 40))
        items = [make_item(rng, int(n)) for n in rng.integers(2, 200, n_items)]
        packed = pack(items, cfg)
        B, L = packed.shape
        assert L in cfg.len_buckets and B % 4 == 0 and B >= packed.stats["rows_used"]
        assert L >= max(len(it) for it in items)
        if rounding == "pow2":
            assert (B // 4) & (B // 4 - 1) == 0
        if rounding == "buckets":
            assert B in row_buckets
        shapes.add((B, L))
    limit = {"multiple": 3 * 32 // 4 + 3, "pow2": 3 * 4, "buckets": 3 * 3}[rounding]
    assert len(shapes) <= limit, shapes


def test_short_batch_picks_small_length_bucket():
    rng = np.random.default_rng(7)
    items = [make_item(rng, 10) for _ in range(4)]
    packed = pack(items, PackingConfig(max_len=64, len_buckets=(16, 32, 64), row_multiple=4))
    assert packed.shape == (4, 16)  # 4 x 16 beats 4 x 32 (2 used rows) and 4 x 64 (1 used row)
    cfg = PackingConfig(max_len=64, len_buckets=(16, 32, 64))
    assert pack(items, cfg).shape == (4, 16)  # ties (4 x 16, 2 x 32, 1 x 64) go to the shorter rows
    items = [make_item(rng, 20) for _ in range(3)]
    assert pack(items, cfg).shape == (1, 64)  # 1 x 64 beats 3 x 32
    assert cfg.round_rows(0) == 1


def test_empty_batch_is_all_padding():
    packed = pack([], PackingConfig(max_len=32, len_buckets=(8, 32), row_multiple=2))
    assert packed.shape == (2, 8) and packed.stats["real_tokens"] == 0 and packed.stats["efficiency"] == 0.0


def test_packed_rows_feed_the_loss_like_unpacked():
    """The packer's layout is what the loss expects: per-item loss equals one item per row."""
    rng = np.random.default_rng(8)
    items = [make_item(rng, int(n), scalar_adv=False) for n in rng.integers(4, 40, 12)]
    learner = [it.old_logps + np.where(it.loss_mask > 0, rng.normal(0, 0.2, len(it)), -np.inf) for it in items]
    cfg = LossConfig(algo="gspo", agg="seq_mean_token_mean", clip_high=0.28)
    packed = pack(items, PackingConfig(max_len=64))
    lp_BxL = np.full(packed.shape, -np.inf, np.float32)
    for i, lp in enumerate(learner):
        lp_BxL[packed.item_row[i], packed.item_offset[i]:packed.item_offset[i] + len(lp)] = lp
    a = {k: jnp.asarray(v) for k, v in packed.arrays().items()}
    loss_packed, _ = policy_loss(jnp.asarray(lp_BxL), a["old_logps"], a["advantages"], a["loss_mask"],
                                 a["segment_ids"], cfg)
    per_item = []
    for it, lp in zip(items, learner):
        p = pack([it], PackingConfig(max_len=64))
        row = np.full(p.shape, -np.inf, np.float32)
        row[0, :len(lp)] = lp
        loss, m = policy_loss(jnp.asarray(row), jnp.asarray(p.old_logps), jnp.asarray(p.advantages),
                              jnp.asarray(p.loss_mask), jnp.asarray(p.segment_ids), cfg)
        per_item.append(float(loss))
    np.testing.assert_allclose(float(loss_packed), np.mean(per_item), rtol=1e-5, atol=1e-6)


def test_validation():
    with pytest.raises(ValueError, match="loss_mask\\[0\\]"):
        PackItem(np.arange(3), np.array([1, 1, 0]), np.zeros(3), 0.0)
    with pytest.raises(ValueError, match="old_logps"):
        PackItem(np.arange(3), np.zeros(3), np.zeros(2), 0.0)
    with pytest.raises(ValueError, match="tokens"):
        PackItem(np.zeros(0), np.zeros(0), np.zeros(0), 0.0)
    rng = np.random.default_rng(9)
    with pytest.raises(ValueError, match="ref_logps"):
        pack([make_item(rng, 5, ref=True), make_item(rng, 5)], PackingConfig(max_len=8))
    with pytest.raises(ValueError, match="len_buckets"):
        PackingConfig(max_len=64, len_buckets=(16, 32))
    with pytest.raises(ValueError, match="len_buckets"):
        PackingConfig(max_len=64, len_buckets=(32, 16, 64))
    with pytest.raises(ValueError, match="row_buckets"):
        PackingConfig(max_len=64, row_multiple=4, row_rounding="buckets", row_buckets=(6,))
    with pytest.raises(ValueError, match="row_buckets"):
        PackingConfig(max_len=64, row_rounding="buckets")
    with pytest.raises(ValueError, match="overflow"):
        PackingConfig(max_len=64, overflow="wrap")
    with pytest.raises(ValueError, match="shape"):
        packed = pack([make_item(rng, 5)], PackingConfig(max_len=8))
        unpack(np.zeros((2, 8)), packed)


@pytest.mark.parametrize("tokens,match", [
    (np.array([1.0, 2.7, 3.0]), r"tokens must be integer token ids; got dtype float64"),
    ([1, 2.5, 3], r"tokens must be integer token ids; got dtype float64"),
    (np.array([True, False, True]), r"tokens must be integer token ids; got dtype bool"),
    (np.array([1, 2**31 + 5, 3]), r"tokens must be token ids in \[0, 2\*\*31\); got \[2147483653\] at positions \[1\]"),
    (np.array([1, 2, -1]), r"tokens must be token ids in \[0, 2\*\*31\); got \[-1\] at positions \[2\]"),
])
def test_tokens_that_are_not_int32_token_ids_are_a_clear_error(tokens, match):
    # The int32 cast cut 2.7 to token 2, made bools ids 0 and 1 and wrapped 2**31 + 5 negative.
    with pytest.raises(ValueError, match=r"PackItem\(traj_id=5, group_id=-1\): " + match):
        PackItem(tokens, np.array([0, 1, 1]), np.array([0.0, -1.0, -1.0]), 1.0, traj_id=5)
    ok = PackItem(np.array([1, 2**31 - 1, 0], np.int64), np.array([0, 1, 1]), np.zeros(3), 1.0)
    assert ok.tokens.dtype == np.int32 and ok.tokens.tolist() == [1, 2**31 - 1, 0]


@pytest.mark.parametrize("kwargs,match", [
    # Floats failed inside `pack` ("'float' object cannot be interpreted as an integer").
    ({"max_len": 8.0}, r"PackingConfig.max_len=8.0 \(float\) must be an int"),
    ({"max_len": 8, "row_multiple": 2.0}, r"PackingConfig.row_multiple=2.0 \(float\) must be an int"),
    ({"max_len": 8, "len_buckets": (4.0, 8)}, r"PackingConfig.len_buckets=\(4.0, 8\) must be strictly increasing positive integers"),
    # A float or string pad_id was cast to some token id without a word.
    ({"max_len": 8, "pad_id": 0.5}, r"PackingConfig.pad_id=0.5 \(float\) must be an int"),
    ({"max_len": 8, "pad_id": "0"}, r"PackingConfig.pad_id='0' \(str\) must be an int"),
    ({"max_len": True}, r"PackingConfig.max_len=True \(bool\) must be an int"),
])
def test_packing_config_sizes_and_pad_id_must_be_ints(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PackingConfig(**kwargs)
    cfg = PackingConfig(max_len=np.int64(8), len_buckets=(np.int64(4), 8), row_multiple=np.int32(2))
    assert pack([make_item(np.random.default_rng(0), 5)], cfg).shape == (2, 8)


def test_best_fit_decreasing_rejects_items_longer_than_the_row():
    # An item over capacity used to open a row and overfill it (used > capacity) silently.
    with pytest.raises(ValueError, match=r"lengths \[12\] at indices \[1\] do not fit rows of capacity 10"):
        best_fit_decreasing(np.array([5, 12, 3]), 10)
    row, offset, used = best_fit_decreasing(np.array([10, 4, 6]), 10)  # exactly full rows are fine
    assert used == [10, 10]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_advantage_on_a_policy_token_is_a_clear_error(bad):
    # One such item made the loss of its whole packed batch NaN.
    with pytest.raises(ValueError, match=r"traj_id=7.*advantages must be finite on policy tokens"):
        PackItem(np.arange(4), np.array([0, 1, 1, 0]), np.zeros(4), bad, traj_id=7)
    with pytest.raises(ValueError, match=r"positions \[2\]"):
        PackItem(np.arange(4), np.array([0, 1, 1, 0]), np.zeros(4), np.array([0, 1, bad, 0]))
    # Positions without loss never reach the loss: accepted.
    PackItem(np.arange(4), np.array([0, 1, 1, 0]), np.zeros(4), np.array([bad, 1, 1, bad]))


@pytest.mark.parametrize("name", ["old_logps", "ref_logps"])
def test_positive_log_probs_on_policy_tokens_are_a_clear_error(name):
    # Negative log-likelihoods passed as log-probs were packed as they were: every importance
    # ratio (or KL term) of the trajectory then used log p = +NLL, without an error.
    lp = np.array([0.0, -0.5, -1.2, 0.0])
    base = dict(tokens=np.arange(4), loss_mask=np.array([0, 1, 1, 0]), old_logps=lp, advantages=1.0, ref_logps=lp)
    with pytest.raises(ValueError, match=rf"traj_id=3.*{name} must be log-probabilities .* positions \[1, 2\]"):
        PackItem(**{**base, name: -lp}, traj_id=3)
    # Off policy tokens anything goes; NaN (an unsampled trained token) and -inf pass; so does 0.
    PackItem(**{**base, name: np.array([5.0, np.nan, -np.inf, 7.0])})
    PackItem(**{**base, name: np.array([0.0, 0.0, 1e-6, 0.0])})


@pytest.mark.parametrize("mask,shown", [([0, 0.5, 0.5, 1], r"\[0.5, 0.5\] at positions \[1, 2\]"),
                                        ([0, 1, np.nan, 1], r"\[nan\] at positions \[2\]"),
                                        ([np.nan, 1, 1, 1], r"\[nan\] at positions \[0\]"),
                                        ([0, -1, 1, 1], r"\[-1.0\] at positions \[1\]")])
def test_loss_mask_other_than_zero_or_one_is_a_clear_error(mask, shown):
    # The loss trains every position with loss_mask > 0 at weight 1: a weight of 0.5 was trained
    # as 1 without a word, -1 was dropped, and a NaN failed in `pack` with an unrelated message.
    with pytest.raises(ValueError, match=rf"traj_id=4.*loss_mask must be 0 or 1 .*{shown}"):
        PackItem(tokens=np.arange(4), loss_mask=np.array(mask), old_logps=np.zeros(4), advantages=1.0, traj_id=4)
    PackItem(tokens=np.arange(4), loss_mask=np.array([False, True, True, False]), old_logps=np.zeros(4),
             advantages=1.0)


def test_config_from_train_names_a_bucket_that_is_not_an_int():
    """A float last bucket was told to "end with train.pack_len", which it nearly did."""
    from ml_collections import ConfigDict

    from jaxagent.rl.packing import config_from_train
    for buckets in ((64, 128.5), (64.0, 128), (128, 64, 128)):
        train = ConfigDict(dict(pack_len=128, len_buckets=buckets, micro_batches=1))
        with pytest.raises(ValueError, match=r"train.len_buckets=\(.*\) must be strictly increasing "
                           r"positive integers ending with train.pack_len=128"):
            config_from_train(train, dp=1)
    train = ConfigDict(dict(pack_len=128, len_buckets=(64, 128), micro_batches=2))
    assert config_from_train(train, dp=1).len_buckets == (64, 128)
