"""RL kernels: advantages -> packing -> losses (the jitted step lives in `rl/step.py`).

`advantages` and `packing` run on the host in NumPy; `losses` is pure JAX over packed `[B, L]`
rows and returns (numerator, denominator) parts so micro-batches normalise like one batch.
"""

from jaxagent.rl.advantages import AdvantageInfo, DynamicSampler, compute_advantages
from jaxagent.rl.losses import (
    LossConfig,
    LossParts,
    combine_parts,
    finalize_parts,
    policy_loss,
    policy_loss_parts,
)
from jaxagent.rl.packing import PackedBatch, PackingConfig, PackItem, best_fit_decreasing, pack, unpack

__all__ = [
    "AdvantageInfo",
    "DynamicSampler",
    "compute_advantages",
    "LossConfig",
    "LossParts",
    "combine_parts",
    "finalize_parts",
    "policy_loss",
    "policy_loss_parts",
    "PackedBatch",
    "PackingConfig",
    "PackItem",
    "best_fit_decreasing",
    "pack",
    "unpack",
]
