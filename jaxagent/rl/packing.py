"""Packing trajectories into fixed `[B, L]` training rows, and unpacking per-token results.

Place in the data flow: after `rl/advantages.py` gives each trajectory its advantage, this file
lays the trajectories' token ledgers end to end into rows (best-fit decreasing bin packing), so
the learner (`rl/step.py`) runs one dense, jittable program instead of padding every trajectory
to the longest one. Attention must not cross segments; positions restart at 0 per segment.

Conventions (shared with `rl/losses.py`): position t of a trajectory holds token t and, for
per-token values, the log-prob of token t given tokens < t. So position 0 has no log-prob and its
`loss_mask` must be 0; `loss_mask` is 1 only on policy-generated tokens.

Shapes are bucketed so jit compiles a bounded number of programs:
  * L is one of `PackingConfig.len_buckets` (largest = `max_len`): for each bucket that fits the
    longest trajectory we pack with that row capacity and keep the (rows x L) layout with the
    fewest padded tokens; L is then the smallest bucket holding the longest packed row.
  * B is rounded per `row_rounding`: "multiple" (up to a multiple of `row_multiple`; choose
    `row_multiple` = micro-batch rows x data-parallel devices and the step only ever sees
    `[row_multiple, L]` micro-batches, so programs = number of L buckets), "pow2"
    (`row_multiple` x a power of two) or "buckets" (smallest of `row_buckets`; beyond the largest,
    a multiple of it).

A trajectory longer than `max_len` is dropped or truncated from the right (`overflow`); both are
counted in the stats, and `unpack` returns None for dropped items and `fill_value` on cut tokens.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import numbers
from typing import Literal, get_args

import ml_dtypes  # a jax dependency: NumPy's view of bfloat16 and float8
import numpy as np

Overflow = Literal["drop", "truncate"]

# Largest log-prob a PackItem accepts on a policy token: 0 plus float rounding.
_MAX_LOGP = 1e-3
RowRounding = Literal["multiple", "pow2", "buckets"]


@dataclasses.dataclass
class PackItem:
    """One trajectory's token ledger (validated and converted to NumPy on construction).

    Attributes:
      tokens: int32 `[n]`.
      loss_mask: `[n]`, 1 on policy-generated tokens, else 0; position 0 must be 0.
      old_logps: float32 `[n]`, sampler log-prob (<= 0) of token t at position t (0 where mask is
        0; NaN on trained tokens the sampler did not sample, for the trainer to fill in).
      advantages: a scalar (broadcast to all n positions) or a float32 `[n]` array; finite on
        policy tokens.
      ref_logps: optional float32 `[n]` reference-policy log-probs.
      group_id, traj_id: bookkeeping ids, carried into the packed batch (-1 when unknown).
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    old_logps: np.ndarray
    advantages: float | np.ndarray
    ref_logps: np.ndarray | None = None
    group_id: int = -1
    traj_id: int = -1

    def __post_init__(self):
        tokens = np.asarray(self.tokens)
        n = tokens.shape[0] if tokens.ndim == 1 else -1
        who = f"PackItem(traj_id={self.traj_id}, group_id={self.group_id})"
        if n < 1:
            raise ValueError(f"{who}: tokens must be a non-empty 1-D array; got shape {tokens.shape}")
        # The int32 cast cut a float id to another token and wrapped one past 2**31 - 1 to a
        # negative id, without a word (bools became ids 0 and 1).
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"{who}: tokens must be integer token ids; got dtype {tokens.dtype} (build "
                             "them as ints, e.g. np.asarray(ids, np.int32))")
        bad = np.flatnonzero((tokens < 0) | (tokens > np.iinfo(np.int32).max))
        if bad.size:
            raise ValueError(f"{who}: tokens must be token ids in [0, 2**31); got {tokens[bad[:5]].tolist()} "
                             f"at positions {bad[:5].tolist()}")
        self.tokens = tokens.astype(np.int32)
        self.loss_mask = np.asarray(self.loss_mask, dtype=np.float32)
        self.old_logps = np.asarray(self.old_logps, dtype=np.float32)
        if np.ndim(self.advantages) == 0:
            self.advantages = np.full(n, float(self.advantages), np.float32)
        else:
            self.advantages = np.asarray(self.advantages, dtype=np.float32)
        if self.ref_logps is not None:
            self.ref_logps = np.asarray(self.ref_logps, dtype=np.float32)
        for name in ("loss_mask", "old_logps", "advantages", "ref_logps"):
            x = getattr(self, name)
            if x is not None and x.shape != (n,):
                raise ValueError(f"{who}: {name} has shape {x.shape}; expected ({n},) like tokens")
        # The loss trains every position with loss_mask > 0 at weight 1: a weight such as 0.5
        # would be trained as 1 without a word, and NaN or negative values break the counts.
        bad = np.flatnonzero((self.loss_mask != 0) & (self.loss_mask != 1))
        if bad.size:
            raise ValueError(f"{who}: loss_mask must be 0 or 1 (1 on policy-generated tokens); got "
                             f"{self.loss_mask[bad[:5]].tolist()} at positions {bad[:5].tolist()} "
                             "(per-token loss weights are not supported)")
        # A non-finite advantage on a trained token makes the whole batch's loss NaN.
        bad = np.flatnonzero((self.loss_mask > 0) & ~np.isfinite(self.advantages))
        if bad.size:
            raise ValueError(f"{who}: advantages must be finite on policy tokens (loss_mask > 0); got "
                             f"{self.advantages[bad[:5]].tolist()} at positions {bad[:5].tolist()} "
                             "(check the rewards and the advantage computation upstream)")
        # A log-prob is <= 0; a positive one on a trained token is almost surely a negative
        # log-likelihood passed for a log-prob, which would skew every ratio without an error.
        for name in ("old_logps", "ref_logps"):
            x = getattr(self, name)
            pos = np.flatnonzero((self.loss_mask > 0) & (x > _MAX_LOGP)) if x is not None else ()
            if len(pos):
                raise ValueError(f"{who}: {name} must be log-probabilities (<= 0) on policy tokens; got "
                                 f"{x[pos[:5]].tolist()} at positions {pos[:5].tolist()} (negative "
                                 "log-likelihoods? pass log p, not -log p)")
        if self.loss_mask[0] != 0:
            raise ValueError(f"{who}: loss_mask[0] must be 0 (position 0 has no log-prob); "
                             "the ledger is probably shifted by one")

    def __len__(self) -> int:
        return self.tokens.shape[0]


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_buckets(name: str, buckets: tuple[int, ...], more: str = "") -> None:
    # 4.0 passed as an integer and failed in `pack` ("'float' object cannot be interpreted as an
    # integer", naming no field).
    if any(not _is_int(b) or b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
        raise ValueError(f"{name}={buckets} must be strictly increasing positive integers{more}")


@dataclasses.dataclass(frozen=True)
class PackingConfig:
    """Row layout settings (see the module docstring).

    Attributes:
      max_len: the longest row; trajectories longer than this overflow.
      len_buckets: allowed L values, increasing, ending at max_len (default: only max_len).
      row_multiple: B is always a multiple of this (e.g. micro-batch rows x data-parallel size).
      row_rounding: "multiple", "pow2" or "buckets".
      row_buckets: allowed B values for row_rounding="buckets", each a multiple of row_multiple.
      overflow: "drop" or "truncate" trajectories longer than max_len.
      pad_id: token id of padding.
    """

    max_len: int
    len_buckets: tuple[int, ...] = ()
    row_multiple: int = 1
    row_rounding: RowRounding = "multiple"
    row_buckets: tuple[int, ...] = ()
    overflow: Overflow = "drop"
    pad_id: int = 0

    def __post_init__(self):
        # A float size failed inside `pack` with a TypeError naming no field, and a float or
        # string pad_id was cast to some token without a word.
        for field in ("max_len", "row_multiple", "pad_id"):
            v = getattr(self, field)
            if not _is_int(v):
                raise ValueError(f"PackingConfig.{field}={v!r} ({type(v).__name__}) must be an int")
            object.__setattr__(self, field, int(v))
        if self.max_len < 2:
            raise ValueError(f"PackingConfig.max_len={self.max_len} must be >= 2")
        object.__setattr__(self, "len_buckets", tuple(self.len_buckets) or (self.max_len,))
        object.__setattr__(self, "row_buckets", tuple(self.row_buckets))
        _check_buckets("PackingConfig.len_buckets", self.len_buckets)
        if self.len_buckets[-1] != self.max_len:
            raise ValueError(f"PackingConfig.len_buckets={self.len_buckets} must end with max_len={self.max_len}")
        if self.row_multiple < 1:
            raise ValueError(f"PackingConfig.row_multiple={self.row_multiple} must be >= 1")
        if self.row_rounding not in get_args(RowRounding):
            raise ValueError(f"PackingConfig.row_rounding={self.row_rounding!r} is not supported; "
                             f"allowed values: {get_args(RowRounding)}")
        if self.overflow not in get_args(Overflow):
            raise ValueError(f"PackingConfig.overflow={self.overflow!r} is not supported; "
                             f"allowed values: {get_args(Overflow)}")
        if self.row_rounding == "buckets":
            if not self.row_buckets:
                raise ValueError("PackingConfig.row_buckets must be non-empty when row_rounding='buckets'")
            _check_buckets("PackingConfig.row_buckets", self.row_buckets)
            if any(b % self.row_multiple for b in self.row_buckets):
                raise ValueError(f"PackingConfig.row_buckets={self.row_buckets} must all be multiples of "
                                 f"row_multiple={self.row_multiple}")
        elif self.row_buckets:
            raise ValueError(f"PackingConfig.row_buckets is only used with row_rounding='buckets'; "
                             f"got row_rounding={self.row_rounding!r}")

    def round_rows(self, rows: int) -> int:
        """The bucketed number of rows B >= rows (at least one granule, even for rows = 0)."""
        m = self.row_multiple
        if self.row_rounding == "multiple":
            return max(1, math.ceil(rows / m)) * m
        if self.row_rounding == "pow2":
            return (1 << max(0, math.ceil(rows / m) - 1).bit_length()) * m
        i = bisect.bisect_left(self.row_buckets, rows)
        if i < len(self.row_buckets):
            return self.row_buckets[i]
        top = self.row_buckets[-1]
        return math.ceil(rows / top) * top

    def bucket_len(self, length: int) -> int:
        """The smallest length bucket >= length (length <= max_len)."""
        return self.len_buckets[bisect.bisect_left(self.len_buckets, length)]


def config_from_train(train, dp: int) -> PackingConfig:
    """The packing of a run's RL batch from its `train` config (the trainer and the planner
    both use this): rows of `train.pack_len` tokens, `len_buckets`, and a row count rounded per
    `row_rounding` to a multiple of `train.mini_batches` (1 when left out) x `micro_batches` x
    the `dp` data-parallel devices: the rows split into equal mini-batches (one update each),
    each into micro-batches that split evenly over the devices."""
    buckets = tuple(train.get("len_buckets", ())) or (train.pack_len,)
    # Before the last-bucket check: (64, 128.5) was told to end with pack_len=128.
    _check_buckets("train.len_buckets", buckets, f" ending with train.pack_len={train.pack_len}")
    if buckets[-1] != train.pack_len:
        raise ValueError(f"train.len_buckets={buckets} must end with train.pack_len={train.pack_len}: "
                         "set both (e.g. --config.train.len_buckets='(..., PACK_LEN)')")
    rounding = train.get("row_rounding", "multiple")
    if rounding == "buckets":
        # PackingConfig's error named PackingConfig.row_buckets, which no run config key sets.
        raise ValueError("train.row_rounding='buckets' needs a list of row counts, which the run "
                         "config does not take: use 'multiple' or 'pow2' (row buckets are for "
                         "PackingConfig(row_rounding='buckets', row_buckets=...) in your own code)")
    minis = train.get("mini_batches", 1)
    if isinstance(minis, bool) or not isinstance(minis, numbers.Integral) or minis < 1:
        raise ValueError(f"train.mini_batches must be an int >= 1, got {minis!r}")
    # Every mini-batch (an update of its own) has the same row count, split in turn into
    # micro-batches over the data-parallel devices.
    return PackingConfig(max_len=train.pack_len, len_buckets=buckets,
                         row_multiple=minis * train.micro_batches * dp, row_rounding=rounding)


@dataclasses.dataclass
class PackedBatch:
    """Packed rows `[B, L]` plus where each input item went.

    Attributes:
      tokens, segment_ids, positions: int32 `[B, L]`; segment ids 1.. per row, 0 on padding;
        positions restart at 0 per segment (0 on padding).
      loss_mask, old_logps, advantages: float32 `[B, L]`, zero on padding.
      ref_logps: float32 `[B, L]` when the items carry reference log-probs, else None.
      item_row, item_offset, item_segment: int32 `[N]` per input item (-1 when dropped).
      item_length: int32 `[N]` tokens of the item placed in the batch (0 when dropped).
      item_orig_length: int32 `[N]` the item's full length.
      group_ids, traj_ids: int `[N]` copied from the items.
      stats: counts and efficiency (see `pack`).
    """

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    loss_mask: np.ndarray
    old_logps: np.ndarray
    advantages: np.ndarray
    ref_logps: np.ndarray | None
    item_row: np.ndarray
    item_offset: np.ndarray
    item_segment: np.ndarray
    item_length: np.ndarray
    item_orig_length: np.ndarray
    group_ids: np.ndarray
    traj_ids: np.ndarray
    stats: dict[str, float]

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape

    def arrays(self) -> dict[str, np.ndarray]:
        """The `[B, L]` arrays the learner consumes (ref_logps only when present)."""
        out = {k: getattr(self, k) for k in ("tokens", "segment_ids", "positions", "loss_mask", "old_logps",
                                              "advantages")}
        if self.ref_logps is not None:
            out["ref_logps"] = self.ref_logps
        return out


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Bin-packs items of `lengths` (each <= capacity) into rows of `capacity` tokens.

    Items go in order of decreasing length (ties: input order) into the open row with the least
    room that still fits them, else into a new row. Returns (row, offset) per item and the used
    length of each row; within a row, items sit in placement order.
    """
    lengths = np.asarray(lengths)
    bad = np.flatnonzero((lengths < 0) | (lengths > capacity))
    if bad.size:
        raise ValueError(f"best_fit_decreasing: lengths {lengths[bad[:5]].tolist()} at indices {bad[:5].tolist()} "
                         f"do not fit rows of capacity {capacity}; each length must be in [0, capacity] "
                         "(drop or truncate longer items first, as `pack` does)")
    order = np.argsort(-lengths, kind="stable")
    row = np.full(len(lengths), -1, np.int64)
    offset = np.zeros(len(lengths), np.int64)
    used: list[int] = []
    open_rows: list[tuple[int, int]] = []  # sorted (room left, row index) of rows with room
    for i in order:
        n = int(lengths[i])
        j = bisect.bisect_left(open_rows, (n, -1))
        if j < len(open_rows):
            room, r = open_rows.pop(j)
        else:
            room, r = capacity, len(used)
            used.append(0)
        row[i], offset[i] = r, used[r]
        used[r] += n
        if room - n > 0:
            bisect.insort(open_rows, (room - n, r))
    return row, offset, used


def pack(items: list[PackItem], cfg: PackingConfig) -> PackedBatch:
    """Packs trajectories into bucketed `[B, L]` rows (best-fit decreasing).

    `stats` holds: num_items, packed_items, dropped_items, dropped_tokens, truncated_items,
    truncated_tokens, real_tokens, policy_tokens, rows (B), rows_used, seq_len (L),
    padded_tokens (B * L), efficiency (real_tokens / (B * L)), row_fill (real tokens over the
    used rows only: the bin packing's own efficiency, before row rounding), max_segments_per_row.
    """
    n_items = len(items)
    orig_len = np.array([len(it) for it in items], np.int64)
    has_ref = [it.ref_logps is not None for it in items]
    if any(has_ref) and not all(has_ref):
        missing = [items[i].traj_id for i, h in enumerate(has_ref) if not h][:5]
        raise ValueError(f"ref_logps must be given for all items or none; missing for traj_ids {missing}")
    use_ref = bool(has_ref) and all(has_ref)

    over = orig_len > cfg.max_len
    if cfg.overflow == "drop":
        keep = ~over
        length = np.where(over, 0, orig_len)
    else:
        keep = np.ones(n_items, bool)
        length = np.minimum(orig_len, cfg.max_len)
    kept = np.flatnonzero(keep)
    kept_len = length[kept]

    # Try every length bucket that fits the longest item; keep the layout with the least padding.
    longest = int(kept_len.max()) if kept.size else 1
    best = None
    for cap in cfg.len_buckets:
        if cap < longest:
            continue
        row, offset, used = best_fit_decreasing(kept_len, cap)
        seq_len = cfg.bucket_len(max(used, default=1))
        rows = cfg.round_rows(len(used))
        area = rows * seq_len
        if best is None or area < best[0]:
            best = (area, rows, seq_len, row, offset, used)
    _, B, L, row_k, offset_k, used = best

    tokens = np.full((B, L), cfg.pad_id, np.int32)
    segment_ids = np.zeros((B, L), np.int32)
    positions = np.zeros((B, L), np.int32)
    loss_mask = np.zeros((B, L), np.float32)
    old_logps = np.zeros((B, L), np.float32)
    advantages = np.zeros((B, L), np.float32)
    ref_logps = np.zeros((B, L), np.float32) if use_ref else None
    item_row = np.full(n_items, -1, np.int32)
    item_offset = np.full(n_items, -1, np.int32)
    item_segment = np.full(n_items, -1, np.int32)
    item_row[kept], item_offset[kept] = row_k, offset_k
    # Segment ids follow the offsets within each row: 1, 2, ... left to right.
    for r_items in _items_by_row(kept, row_k, offset_k):
        item_segment[r_items] = np.arange(1, len(r_items) + 1)

    for i in kept:
        it, r, o, n = items[i], item_row[i], item_offset[i], int(length[i])
        sl = np.s_[r, o:o + n]
        tokens[sl] = it.tokens[:n]
        segment_ids[sl] = item_segment[i]
        positions[sl] = np.arange(n, dtype=np.int32)
        loss_mask[sl] = it.loss_mask[:n]
        old_logps[sl] = it.old_logps[:n]
        advantages[sl] = it.advantages[:n]
        if use_ref:
            ref_logps[sl] = it.ref_logps[:n]

    real = int(length.sum())
    stats = {
        "num_items": n_items,
        "packed_items": int(kept.size),
        "dropped_items": int(np.sum(over & ~keep)),
        "dropped_tokens": int(np.sum(np.where(over & ~keep, orig_len, 0))),
        "truncated_items": int(np.sum(over & keep)),
        "truncated_tokens": int(np.sum(np.where(over & keep, orig_len - length, 0))),
        "real_tokens": real,
        "policy_tokens": int(loss_mask.sum()),
        "rows": B,
        "rows_used": len(used),
        "seq_len": L,
        "padded_tokens": B * L,
        "efficiency": real / (B * L),
        "row_fill": real / (len(used) * L) if used else 0.0,
        "max_segments_per_row": int(segment_ids.max(initial=0)),
    }
    return PackedBatch(
        tokens=tokens, segment_ids=segment_ids, positions=positions, loss_mask=loss_mask, old_logps=old_logps,
        advantages=advantages, ref_logps=ref_logps, item_row=item_row, item_offset=item_offset,
        item_segment=item_segment, item_length=length.astype(np.int32), item_orig_length=orig_len.astype(np.int32),
        group_ids=np.array([it.group_id for it in items], np.int64),
        traj_ids=np.array([it.traj_id for it in items], np.int64), stats=stats,
    )


def _items_by_row(kept: np.ndarray, row: np.ndarray, offset: np.ndarray) -> list[np.ndarray]:
    """Item indices grouped by row, each group sorted by offset."""
    order = np.lexsort((offset, row))
    splits = np.flatnonzero(np.diff(row[order])) + 1
    return [kept[g] for g in np.split(order, splits)] if order.size else []


def _is_inexact(dtype) -> bool:
    """NumPy's floating and complex types and ml_dtypes' (bfloat16, float8), which NumPy files
    under np.void, not np.inexact."""
    try:
        ml_dtypes.finfo(dtype)
    except ValueError:
        return False
    return True


def unpack(values_BxL: np.ndarray, packed: PackedBatch, fill_value=None) -> list[np.ndarray | None]:
    """Per-item arrays from a per-token `[B, L]` result (e.g. learner log-probs), in input order.

    Each array has the item's original length; positions cut by truncation hold `fill_value`
    (default NaN for floats, 0 otherwise). Dropped items give None.
    """
    values = np.asarray(values_BxL)
    if values.shape[:2] != packed.shape:
        raise ValueError(f"values have shape {values.shape}; expected leading dims {packed.shape} of the packed batch")
    if fill_value is None:
        fill_value = np.nan if _is_inexact(values.dtype) else 0
    out: list[np.ndarray | None] = []
    for r, o, n, n0 in zip(packed.item_row, packed.item_offset, packed.item_length, packed.item_orig_length):
        if r < 0:
            out.append(None)
            continue
        x = np.full((int(n0),) + values.shape[2:], fill_value, values.dtype)
        x[:n] = values[r, o:o + n]
        out.append(x)
    return out
