"""Low-rank adapters (LoRA) on the decoder's projection weights.

A target weight `W` (one of `wq wk wv wo w_gate w_up w_down`, stacked over layers) is read as
`W + (alpha / rank) * A @ B`, where `A` maps the weight's input axes to `rank` and `B` maps `rank`
to its output axes. Training updates `A` and `B` only; the base params stay frozen. `B` starts at
zero, so a fresh adapter leaves the model unchanged.

The adapter tree mirrors the params tree:

    {"layers": {"wq": {"a": [layers, d_model, rank], "b": [layers, rank, heads, head_dim]},
                "wo": {"a": [layers, heads, head_dim, rank], "b": [layers, rank, d_model]},
                "w_down": {"a": [layers, ffn, rank], "b": [layers, rank, d_model]}, ...}}

with `flax.linen.LogicallyPartitioned` leaves carrying the weight's own logical axis names plus
`"lora_rank"` (never sharded), so `jaxagent.sharding` places `A` and `B` like the weight itself.
Adapters are float32 whatever the base's dtype (they are what the optimizer updates).

`merge(base, lora, lcfg)` adds the low-rank product to each target in float32 and casts back to
the weight's dtype: the forward pass, the sampler and the export all read merged weights, so a
merged weight is rounded exactly as a full fine-tune's float32 master weight is when it is cast
to the compute dtype.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxagent.models import param_tree
from jaxagent.models.config import ModelConfig

# The projection weights an adapter can target, and how many of each weight's axes (after the
# leading `layers` axis) are its input axes.
INPUT_AXES = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}
ATTENTION = ("wq", "wk", "wv", "wo")
MLP = ("w_gate", "w_up", "w_down")
# The names Hugging Face / PEFT configs use for the same weights (`target_modules`).
HF_NAMES = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
            "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
_GROUPS = {"all": ATTENTION + MLP, "attention": ATTENTION, "mlp": MLP}


def parse_targets(targets: str | Sequence[str]) -> tuple[str, ...]:
  """Target weights from "all", "attention", "mlp", or a comma-separated string / sequence of
  weight names (ours, `wq`, or Hugging Face's, `q_proj`), in the order of `INPUT_AXES`."""
  if isinstance(targets, str):
    parts = [t.strip() for t in targets.split(",") if t.strip()]
  elif isinstance(targets, Sequence) and all(isinstance(t, str) for t in targets):
    parts = [t.strip() for t in targets]
  else:
    raise ValueError(f"LoRA targets must be a string or a sequence of strings, got {targets!r}")
  chosen: set[str] = set()
  for t in parts:
    if t in _GROUPS:
      chosen.update(_GROUPS[t])
    elif t in INPUT_AXES:
      chosen.add(t)
    elif t in HF_NAMES:
      chosen.add(HF_NAMES[t])
    else:
      raise ValueError(
          f"unknown LoRA target {t!r}: use 'all', 'attention', 'mlp' or weight names among "
          f"{', '.join(INPUT_AXES)} (or {', '.join(HF_NAMES)})")
  if not chosen:
    raise ValueError(f"LoRA targets name no weight: {targets!r}")
  return tuple(t for t in INPUT_AXES if t in chosen)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """A low-rank adapter's shape.

  Attributes:
    rank: the adapter's rank r (>= 1).
    alpha: the product is scaled by `alpha / rank`.
    targets: the weights adapted ("all", "attention", "mlp", or names; see `parse_targets`).
  """

  rank: int = 8
  alpha: float = 16.0
  targets: tuple[str, ...] = ATTENTION + MLP

  def __post_init__(self):
    r = self.rank
    if isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 1:
      raise ValueError(f"LoraConfig.rank must be an int >= 1, got {r!r}")
    a = self.alpha
    if isinstance(a, bool) or not isinstance(a, numbers.Real) or not 0 < a < math.inf:
      raise ValueError(f"LoraConfig.alpha must be a finite number > 0, got {a!r}")
    object.__setattr__(self, "rank", int(r))
    object.__setattr__(self, "alpha", float(a))
    object.__setattr__(self, "targets", parse_targets(self.targets))

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def from_config(section) -> LoraConfig | None:
  """The adapter of a run's `lora` section (`rank`, `alpha`, `targets`), or None when the
  section is absent or its rank is 0 (full fine-tuning)."""
  if section is None:
    return None
  rank = section.get("rank", 0)
  if rank == 0 and not isinstance(rank, bool):
    return None
  try:
    return LoraConfig(rank=rank, alpha=section.get("alpha", 16.0),
                      targets=section.get("targets", "all"))
  except ValueError as e:
    raise ValueError(str(e).replace("LoraConfig.", "lora.")) from None


def lora_specs(cfg: ModelConfig, lcfg: LoraConfig) -> dict[str, Any]:
  """The adapter tree as `(shape, logical_axes, init)` leaves (init "lora_a" or "zeros")."""
  layers = param_tree.param_specs(cfg)["layers"]
  out = {}
  for t in lcfg.targets:
    shape, names, _ = layers[t]
    k = 1 + INPUT_AXES[t]
    out[t] = {
        "a": ((*shape[:k], lcfg.rank), (*names[:k], "lora_rank"), "lora_a"),
        "b": ((shape[0], lcfg.rank, *shape[k:]), (names[0], "lora_rank", *names[k:]), "zeros"),
    }
  return {"layers": out}


def init_lora(cfg: ModelConfig, lcfg: LoraConfig, rng: jax.Array) -> dict[str, Any]:
  """A fresh adapter (float32, boxed): `A` uniform in +-1/sqrt(fan_in) per layer, `B` zero, so
  the merged model equals the base until the first update."""
  specs = lora_specs(cfg, lcfg)
  leaves, treedef = jax.tree.flatten(specs, is_leaf=param_tree._is_spec)
  keys = jax.random.split(rng, len(leaves))
  out = []
  for key, (shape, names, init) in zip(keys, leaves):
    if init == "lora_a":
      fan_in = math.prod(shape[1:-1])
      bound = 1.0 / math.sqrt(fan_in)
      val = jax.random.uniform(key, shape, jnp.float32, -bound, bound)
    else:
      val = jnp.zeros(shape, jnp.float32)
    out.append(nn.LogicallyPartitioned(val, names))
  return jax.tree.unflatten(treedef, out)


def check_lora(lora, cfg: ModelConfig, lcfg: LoraConfig, what: str) -> None:
  """Raise ValueError naming `what` when `lora`'s weights or shapes are not `lcfg`'s on `cfg`."""
  specs = lora_specs(cfg, lcfg)["layers"]
  got = param_tree.unbox(lora)
  layers = got.get("layers") if isinstance(got, dict) else None
  if not isinstance(layers, dict) or set(layers) != set(specs):
    have = sorted(layers) if isinstance(layers, dict) else None
    raise ValueError(f"{what}: the adapter targets {have}, the config's lora.targets "
                     f"{list(specs)}")
  for t, ab in specs.items():
    for part in ("a", "b"):
      want = ab[part][0]
      arr = layers[t].get(part) if isinstance(layers[t], dict) else None
      shape = tuple(getattr(arr, "shape", ()) or ())
      if shape != tuple(want):
        raise ValueError(f"{what}: adapter {t}.{part} has shape {shape}, the config's "
                         f"(lora.rank={lcfg.rank}) is {tuple(want)}")


def delta(a, b, n_in: int):
  """`A @ B` per layer for `a: [layers, *in, r]`, `b: [layers, r, *out]`, in float32, shaped as
  the weight `[layers, *in, *out]`."""
  a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  n, r = a32.shape[0], a32.shape[-1]
  ins, outs = a32.shape[1:1 + n_in], b32.shape[2:]
  prod = jnp.einsum("nir,nro->nio", a32.reshape(n, -1, r), b32.reshape(n, r, -1),
                    precision=jax.lax.Precision.HIGHEST)
  return prod.reshape(n, *ins, *outs)


def merge(base, lora, lcfg: LoraConfig, dtype=None):
  """`base` with each target weight replaced by `W + scale * A @ B` (added in float32, cast to
  `dtype`, default `W`'s dtype); other params are `base`'s own arrays (a tree holding only the
  targets under "layers" gives only the merged targets). Works on boxed and plain trees; jit it
  with the base's shardings to keep them."""
  lora = param_tree.unbox(lora)
  layers = dict(base["layers"])
  for t in lcfg.targets:
    ab = lora["layers"][t]
    w = layers[t]
    value = w.value if isinstance(w, nn.LogicallyPartitioned) else w
    new = (jnp.asarray(value, jnp.float32)
           + lcfg.scale * delta(ab["a"], ab["b"], INPUT_AXES[t])).astype(dtype or value.dtype)
    layers[t] = w.replace_boxed(new) if isinstance(w, nn.LogicallyPartitioned) else new
  return {**base, "layers": layers}


def num_params(cfg: ModelConfig, lcfg: LoraConfig) -> int:
  """Trainable parameters of the adapter."""
  specs = lora_specs(cfg, lcfg)
  return sum(math.prod(s[0]) for s in jax.tree.leaves(specs, is_leaf=param_tree._is_spec))
