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
the weight's dtype: the sampler and the export read merged weights, and so does the learner's
forward pass by default (`LoraConfig.forward="merged"`), so a merged weight is rounded exactly
as a full fine-tune's float32 master weight is when it is cast to the compute dtype. With
`forward="unmerged"` the learner computes each target's projection as
`x @ W + scale * (drop(x) @ A) @ B` (`LowRankWeight`), whose backward pass forms no gradient of
the weight's full size, and which is where `LoraConfig.dropout` acts.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import pathlib
import re
import shutil
from typing import Any, Sequence

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy

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
# Each target's index, folded into its dropout keys.
TARGET_IDS = {t: i for i, t in enumerate(INPUT_AXES)}


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


FORWARDS = ("merged", "unmerged")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """A low-rank adapter's shape, and how the learner's forward pass reads it.

  Attributes:
    rank: the adapter's rank r (>= 1).
    alpha: the product is scaled by `alpha / rank`.
    targets: the weights adapted ("all", "attention", "mlp", or names; see `parse_targets`).
    forward: how the learner's forward pass (update and `score`) reads a target.
      "merged": as one weight `W + scale * A @ B` (float32 sum cast to the compute dtype,
      rounded as the sampler's merged weights are); its backward pass forms each target's
      full weight gradient, a GEMM as large as the forward's. "unmerged": as
      `x @ W + scale * (drop(x) @ A) @ B` in the compute dtype (`LowRankWeight`), whose
      backward pass forms only the adapter's and the input's gradients (faster; the
      log-probs then differ from the merged weights' by rounding in low precision). The
      sampler and the export always read merged weights.
    dropout: the probability of zeroing each element of a target's input on the adapter's
      path (scaled by 1 / (1 - dropout)), in the update's forward pass only; needs
      forward="unmerged". In [0, 1).
  """

  rank: int = 8
  alpha: float = 16.0
  targets: tuple[str, ...] = ATTENTION + MLP
  forward: str = "merged"
  dropout: float = 0.0

  def __post_init__(self):
    r = self.rank
    if isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 1:
      raise ValueError(f"LoraConfig.rank must be an int >= 1, got {r!r}")
    a = self.alpha
    if isinstance(a, bool) or not isinstance(a, numbers.Real) or not 0 < a < math.inf:
      raise ValueError(f"LoraConfig.alpha must be a finite number > 0, got {a!r}")
    if self.forward not in FORWARDS:
      raise ValueError(f"LoraConfig.forward must be 'merged' or 'unmerged', got "
                       f"{self.forward!r}")
    p = self.dropout
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 <= p < 1:
      raise ValueError(f"LoraConfig.dropout must be a number in [0, 1), got {p!r}")
    if p > 0 and self.forward != "unmerged":
      raise ValueError(
          f"LoraConfig.dropout={p!r} needs LoraConfig.forward='unmerged': the merged forward "
          "reads W + scale * A @ B as one weight, so there is no adapter input to drop. Set "
          "LoraConfig.forward='unmerged', or LoraConfig.dropout=0")
    object.__setattr__(self, "rank", int(r))
    object.__setattr__(self, "alpha", float(a))
    object.__setattr__(self, "dropout", float(p))
    object.__setattr__(self, "targets", parse_targets(self.targets))

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def from_config(section) -> LoraConfig | None:
  """The adapter of a run's `lora` section (`rank`, `alpha`, `targets`, `forward`,
  `dropout`), or None when the section is absent or its rank is 0 (full fine-tuning). Every
  setting is checked either way, so a typo in `targets` fails whether or not LoRA is on."""
  if section is None:
    return None
  rank = section.get("rank", 0)
  # (a float 0.0 was full fine-tuning while 4.0 was refused: only the int 0 means off)
  off = isinstance(rank, numbers.Integral) and not isinstance(rank, bool) and rank == 0
  try:
    lcfg = LoraConfig(rank=1 if off else rank, alpha=section.get("alpha", 16.0),
                      targets=section.get("targets", "all"),
                      forward=section.get("forward", "merged"),
                      dropout=section.get("dropout", 0.0))
  except ValueError as e:
    raise ValueError(str(e).replace("LoraConfig.", "lora.")) from None
  if off and lcfg.dropout > 0:
    raise ValueError(f"lora.dropout={lcfg.dropout!r} drops an adapter's input, but lora.rank=0 "
                     "trains every weight (no adapter): set lora.rank > 0, or lora.dropout=0")
  return None if off else lcfg


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


def merged_weight(w, a, b, target: str, lcfg: LoraConfig, dtype=None):
  """One target weight `w + scale * a @ b`, added in float32 and cast to `dtype` (default
  `w`'s): stacked arrays (`w: [layers, *in, *out]`, `a: [layers, *in, r]`,
  `b: [layers, r, *out]`) or one layer's (the same without the `layers` axis)."""
  n_in = INPUT_AXES[target]
  one_layer = jnp.ndim(a) == n_in + 1
  if one_layer:
    w, a, b = w[None], a[None], b[None]
  new = (jnp.asarray(w, jnp.float32) + lcfg.scale * delta(a, b, n_in)).astype(dtype or w.dtype)
  return new[0] if one_layer else new


def lowrank_specs(spec: str, n_in: int) -> tuple[str, str]:
  """The einsum specs of a projection's low-rank path from its own `spec` (`x, W -> y`, the
  weight's first `n_in` axes its input axes): `x, A -> xa` and `xa, B -> y`. For
  "btd,dhk->bthk" (wq) these are "btd,dr->btr" and "btr,rhk->bthk"; for "bthk,hkd->btd"
  (wo, two input axes) "bthk,hkr->btr" and "btr,rd->btd"."""
  lhs, out = spec.replace(" ", "").split("->")
  xs, ws = lhs.split(",")
  ins, outs = ws[:n_in], ws[n_in:]
  r = next(c for c in "rzyxwvuqponmlji" if c not in spec)
  xr = "".join(c for c in xs if c not in ins) + r
  return f"{xs},{ins}{r}->{xr}", f"{xr},{r}{outs}->{out}"


def _unit_batch(spec: str, axis: str) -> str:
  """`spec` ("x,w->y") with a leading batch axis `axis` on both operands and the output."""
  lhs, out = spec.split("->")
  x, w = lhs.split(",")
  return f"{axis}{x},{axis}{w}->{axis}{out}"


def _lowrank(a_spec: str, b_spec: str, scale: float, dtype, xd, a, b):
  """`scale * (xd @ a) @ b` (einsum specs `a_spec`, `b_spec`) in `dtype`, each product a dot
  with a batch axis of size 1.

  The layer's remat policies ("dots", "dots_attention": `dots_with_no_batch_dims_saveable`)
  save the output of every dot without batch axes, and `xa @ B` has the projection's full
  output size: saved, it is a second copy of every target's output (the MLP's gate and up
  among them). An H200 compile of the Qwen2.5-1.5B r16 update (8 x 2048 tokens a
  micro-batch) held 46.2 GiB of temporaries that way, against the merged forward's 28.7.
  With the unit batch axis the policy saves neither product and the backward pass recomputes
  them (two rank-sized products); XLA drops the unit axis, so the forward's products are the
  same GEMMs. Neither a nested `jax.checkpoint` nor a custom VJP stops the outer policy from
  saving the inner dots."""
  n = next(c for c in "nmlkjigfe" if c not in a_spec + b_spec)
  xa = jnp.einsum(_unit_batch(a_spec, n), xd[None], a.astype(dtype)[None])
  # The scale multiplies the rank-sized product: the cheapest place for it.
  xa = xa * jnp.asarray(scale, dtype)
  return jnp.einsum(_unit_batch(b_spec, n), xa, b.astype(dtype)[None])[0]


@flax.struct.dataclass
class LowRankWeight:
  """A target weight read unmerged (`LoraConfig.forward="unmerged"`): the decoder's
  projection of `x` by it is `x @ W + scale * (drop(x) @ A) @ B` (`project`), each product
  in the compute dtype. `W` is frozen, so the backward pass forms the gradients of `x`, `A`
  and `B` only: no `x^T dy` of the weight's full size. `rng`: one key per row of `x` (already
  folded with the layer and the target), or None for no dropout."""

  w: Any
  a: Any
  b: Any
  rng: Any = None
  target: str = flax.struct.field(pytree_node=False, default="wq")
  scale: float = flax.struct.field(pytree_node=False, default=1.0)
  dropout: float = flax.struct.field(pytree_node=False, default=0.0)

  def project(self, spec: str, x, dtype):
    """`einsum(spec, x, W) + scale * einsum(einsum(drop(x), A), B)` in `dtype`."""
    a_spec, b_spec = lowrank_specs(spec, INPUT_AXES[self.target])
    y = jnp.einsum(spec, x, self.w.astype(dtype))
    xd = x
    if self.rng is not None and self.dropout > 0:
      keep = 1.0 - self.dropout
      mask = jax.vmap(lambda k: jax.random.bernoulli(k, keep, x.shape[1:]))(self.rng)
      xd = jnp.where(mask, x * jnp.asarray(1.0 / keep, x.dtype), jnp.zeros((), x.dtype))

    return y + _lowrank(a_spec, b_spec, self.scale, dtype, xd, self.a, self.b)


def project(spec: str, x, w, dtype):
  """The decoder's projection `einsum(spec, x, w)` in `dtype`, for a plain weight (cast to
  `dtype`) or a `LowRankWeight` (its unmerged low-rank path added)."""
  if isinstance(w, LowRankWeight):
    return w.project(spec, x, dtype)
  return jnp.einsum(spec, x, w.astype(dtype))


@flax.struct.dataclass
class LayerAdapter:
  """An adapter the decoder's layer loop applies one layer at a time: put it in a params tree
  as `params["adapter"]`, with the targets in `params["layers"]`, and `decoder.hidden_states`
  replaces each layer's targets inside its loop (inside the layer's rematerialisation too):
  with `lcfg.forward` "merged" by `merged_weight(w, a, b)` in `dtype` (the targets as stored,
  float32 masters), so no merged copy of every layer is held at once; with "unmerged" by a
  `LowRankWeight` (the targets as stored, cast to the compute dtype where used). `layers`: the adapter's
  `{target: {"a", "b"}}`, stacked over layers. `rng`: None, or one key per row of the batch
  for `lcfg.dropout` (the update's forward pass; each layer and target folds in its own
  index), unused by the merged forward."""

  layers: Any
  lcfg: LoraConfig = flax.struct.field(pytree_node=False)
  dtype: Any = flax.struct.field(pytree_node=False, default=None)
  rng: Any = None

  def scanned(self):
    """What a `lax.scan` over the layers takes per layer: the adapter's slices and the index."""
    n = jax.tree.leaves(self.layers)[0].shape[0]
    return self.layers, jnp.arange(n, dtype=jnp.int32)

  def layer(self, i: int):
    """Layer `i`'s slices of the adapter and its index (for an unrolled layer loop)."""
    return jax.tree.map(lambda x: x[i], self.layers), i

  def apply(self, lp, ab_layer):
    """One layer's weights `lp` with its targets read through their adapter slices
    (`ab_layer`: `scanned`'s or `layer`'s per-layer value).

    Merged: each merge is its own rematerialised computation that saves nothing: the
    backward pass merges again from the resident base and the adapter. Under the layer's
    remat policy the merge's product `A @ B` is a dot (saved by "dots" policies: a float32
    copy of every layer's targets), and outside any remat every layer's merged weight stayed
    alive for the backward pass. Unmerged: the rank-sized products `x @ A` are the only new
    dots a "dots" policy saves."""
    ab, layer = ab_layer
    if self.lcfg.forward == "unmerged":
      drop = self.rng is not None and self.lcfg.dropout > 0
      keys = (jax.vmap(lambda k: jax.random.fold_in(k, layer))(self.rng) if drop else None)
      def wrap(t):
        rng = (jax.vmap(lambda k: jax.random.fold_in(k, TARGET_IDS[t]))(keys) if drop
               else None)
        return LowRankWeight(lp[t], ab[t]["a"], ab[t]["b"], rng, target=t,
                             scale=self.lcfg.scale, dropout=self.lcfg.dropout if drop else 0.0)
      return {**lp, **{t: wrap(t) for t in self.lcfg.targets}}
    merge = jax.checkpoint(
        lambda w, a, b, t: merged_weight(w, a, b, t, self.lcfg, self.dtype),
        policy=jax.checkpoint_policies.nothing_saveable, static_argnums=(3,))
    return {**lp, **{t: merge(lp[t], ab[t]["a"], ab[t]["b"], t) for t in self.lcfg.targets}}


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
    new = merged_weight(value, ab["a"], ab["b"], t, lcfg, dtype)
    layers[t] = w.replace_boxed(new) if isinstance(w, nn.LogicallyPartitioned) else new
  return {**base, "layers": layers}


def num_params(cfg: ModelConfig, lcfg: LoraConfig) -> int:
  """Trainable parameters of the adapter."""
  specs = lora_specs(cfg, lcfg)
  return sum(math.prod(s[0]) for s in jax.tree.leaves(specs, is_leaf=param_tree._is_spec))


# --- Hugging Face PEFT adapter directories --------------------------------------------------
#
# A PEFT LoRA adapter is a directory with `adapter_config.json` and `adapter_model.safetensors`
# holding, per adapted projection `P` of layer `i`,
#   base_model.model.model.layers.{i}.{self_attn|mlp}.{P}.lora_A.weight   [r, in]
#   base_model.model.model.layers.{i}.{self_attn|mlp}.{P}.lora_B.weight   [out, r]
# and the weight `W_hf` ([out, in], `jaxagent.models.hf`'s layout) reads as
# `W_hf + (lora_alpha / r) * lora_B @ lora_A`. Ours is `W + scale * A @ B` with `W` laid out
# `[*in, *out]`, so `lora_A = A.reshape(-1, r).T` and `lora_B = B.reshape(r, -1).T` per layer.

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model.model.layers."
# Settings of PEFT's LoraConfig that change what the adapter computes, and what they do: an
# adapter that sets any of them is refused (each is its documented "off" value when unset).
_PEFT_REFUSED = {
    "use_dora": "DoRA rescales each adapted weight by a learned magnitude vector",
    "bias": "the layers' own biases were trained too and are saved with the adapter",
    "lora_bias": "lora_B carries a bias",
    "modules_to_save": "whole modules (such as lm_head or embed_tokens) were trained and are "
                       "saved with the adapter",
    "rank_pattern": "some modules have a rank other than r",
    "alpha_pattern": "some modules have a lora_alpha of their own",
    "layer_replication": "the layer stack is rebuilt from repeated layers",
    "target_parameters": "parameters outside the projection weights are adapted",
    "trainable_token_indices": "rows of the embedding table were trained",
    "alora_invocation_tokens": "the adapter acts only from its invocation tokens on "
                               "(activated LoRA)",
    "use_qalora": "inputs are pooled in groups before lora_A (QA-LoRA)",
    "kasa_config": "a learned diagonal sits between lora_A and lora_B (KaSA)",
    "use_bdlora": "lora_A or lora_B is block-diagonal (BD-LoRA)",
    "arrow_config": "several adapters are routed per token (Arrow)",
    "monteclora_config": "the adapter is sampled (MonteCLoRA)",
}
# Settings that do not change the function `W + scale * B @ A` (training-time options, records,
# or selections of modules and layers that the saved tensors reflect: `load_peft` requires
# every layer of each adapted projection).
_PEFT_INERT = {
    "peft_type", "task_type", "auto_mapping", "peft_version", "base_model_name_or_path",
    "revision", "inference_mode", "r", "target_modules", "exclude_modules", "lora_alpha",
    "lora_dropout", "fan_in_fan_out", "use_rslora", "init_lora_weights", "layers_to_transform",
    "layers_pattern",
    "megatron_config", "megatron_core", "loftq_config", "eva_config", "corda_config",
    "lora_ga_config", "velora_config", "qalora_group_size", "runtime_config",
    "ensure_weight_tying",
}
# Initializations that change the base weights to match the adapter's start (PEFT saves such
# an adapter for that changed base, named by base_model_name_or_path).
_PEFT_BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")


def _peft_module(t: str) -> str:
  """`self_attn.q_proj` for "wq": the module's path inside a Hugging Face decoder layer."""
  hf_name = next(hf for hf, ours in HF_NAMES.items() if ours == t)
  return f"{'self_attn' if t in ATTENTION else 'mlp'}.{hf_name}"


def peft_tensors(cfg: ModelConfig, lcfg: LoraConfig, adapter,
                 dtype: str | None = None) -> dict[str, Any]:
  """`adapter` as the tensors of a PEFT `adapter_model.safetensors` (host NumPy arrays in
  `dtype`, default float32): `lora_A` `[r, in]` and `lora_B` `[out, r]` per target and layer."""
  check_lora(adapter, cfg, lcfg, "save_peft")
  np_dtype = np.dtype(jnp.dtype(dtype or "float32"))
  if not jnp.issubdtype(np_dtype, jnp.floating):
    raise ValueError(f"save_peft: dtype must be a floating type (float32, bfloat16, float16), "
                     f"got {np_dtype.name}")
  layers = jax.device_get(param_tree.unbox(adapter))["layers"]
  r, out = lcfg.rank, {}
  for t in lcfg.targets:
    a = np.asarray(layers[t]["a"], np.float32)
    b = np.asarray(layers[t]["b"], np.float32)
    for i in range(cfg.n_layers):
      pre = f"{_PEFT_PREFIX}{i}.{_peft_module(t)}"
      out[f"{pre}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, r).T, np_dtype)
      out[f"{pre}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(r, -1).T, np_dtype)
  return out


def peft_config(lcfg: LoraConfig, base_model: str | None = None) -> dict[str, Any]:
  """The `adapter_config.json` of `lcfg`: a plain LoRA (scale lora_alpha / r) on the targets'
  Hugging Face module names, with PEFT's "off" value written out for each setting that would
  change the function, and `lcfg.dropout` as `lora_dropout` (a training setting)."""
  names = {ours: hf for hf, ours in HF_NAMES.items()}
  alpha = int(lcfg.alpha) if float(lcfg.alpha).is_integer() else lcfg.alpha
  return {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "auto_mapping": None,
      "base_model_name_or_path": base_model, "revision": None, "inference_mode": True,
      "r": lcfg.rank, "lora_alpha": alpha, "target_modules": [names[t] for t in lcfg.targets],
      "exclude_modules": None, "lora_dropout": lcfg.dropout, "fan_in_fan_out": False,
      "bias": "none",
      "use_rslora": False, "use_dora": False, "lora_bias": False, "modules_to_save": None,
      "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None,
      "rank_pattern": {}, "alpha_pattern": {},
  }


def save_peft(path, cfg: ModelConfig, lcfg: LoraConfig, adapter, *,
              base_model: str | None = None, dtype: str | None = None):
  """Write `adapter` as a Hugging Face PEFT LoRA adapter directory (`adapter_config.json` +
  `adapter_model.safetensors`) that `peft.PeftModel.from_pretrained(model, path)` loads onto
  the base model exported by `jaxagent.models.save_hf`, and that LoRA-serving engines read.

  Args:
    base_model: recorded as `base_model_name_or_path` (a hub name or directory of the base);
      PEFT's `AutoPeftModelForCausalLM` loads the base from it.
    dtype: of the stored tensors, default float32.

  The files are written under a hidden staging folder and moved into place when complete,
  `adapter_config.json` last. A directory that holds a model's `config.json` is refused:
  `transformers` would apply an adapter found there every time it loads that model. Returns
  the directory (a `pathlib.Path`)."""
  if re.match(r"[A-Za-z][A-Za-z0-9+.-]+:/", os.fspath(path)):
    raise ValueError(f"save_peft writes a local directory; {os.fspath(path)!r} is a URL. Save "
                     "to a local path, then copy it")
  if base_model is not None and not isinstance(base_model, str):
    raise TypeError(f"save_peft: base_model must be a string (a hub name or a directory), got "
                    f"{type(base_model).__name__}")
  out = pathlib.Path(path).expanduser()
  if (out / "config.json").is_file():
    raise FileExistsError(
        f"{out} holds a model (config.json): transformers would load the adapter onto that "
        "model every time it is loaded; save the adapter to a directory of its own")
  tensors = peft_tensors(cfg, lcfg, adapter, dtype)  # checks before anything is written
  config = peft_config(lcfg, base_model)
  out.mkdir(parents=True, exist_ok=True)
  stage = out / ".save_peft.partial"
  shutil.rmtree(stage, ignore_errors=True)
  stage.mkdir()
  try:
    (stage / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    # Written as bytes (not safetensors' file writer, which makes its file owner-only), so
    # the file has the mode of the config beside it.
    (stage / PEFT_WEIGHTS).write_bytes(
        safetensors.numpy.save(tensors, metadata={"format": "pt"}))
    # An earlier adapter's config goes first: a save killed between the moves leaves a
    # directory that does not load, not new weights under an old config.
    (out / PEFT_CONFIG).unlink(missing_ok=True)
    os.replace(stage / PEFT_WEIGHTS, out / PEFT_WEIGHTS)
    os.replace(stage / PEFT_CONFIG, out / PEFT_CONFIG)
  finally:
    shutil.rmtree(stage, ignore_errors=True)
  return out


def _peft_lora_config(conf: dict, source: str, forward: str = "merged") -> LoraConfig:
  """Our LoraConfig for a PEFT adapter config, refusing settings that change the function.
  With `forward="unmerged"` it keeps `lora_dropout`; the merged forward has no dropout."""
  if conf.get("peft_type") != "LORA":
    raise ValueError(f"{source}: peft_type is {conf.get('peft_type')!r}; only LoRA adapters "
                     "(peft_type 'LORA') load")
  for key, what in _PEFT_REFUSED.items():
    value = conf.get(key)
    if value and value != "none":
      raise ValueError(f"{source}: {key}={value!r} is not supported ({what}); only plain LoRA "
                       "adapters load (W + lora_alpha / r * lora_B @ lora_A on projection "
                       "weights)")
  unknown = {k: v for k, v in conf.items() if k not in _PEFT_INERT and k not in _PEFT_REFUSED
             and v not in (None, False, "", [], {})}
  if unknown:
    raise ValueError(f"{source}: unknown setting(s) {unknown} (from a newer PEFT?) that may "
                     "change what the adapter computes; only plain LoRA adapters load")
  init = conf.get("init_lora_weights")
  if isinstance(init, str) and init.lower().startswith(_PEFT_BASE_CHANGING_INITS):
    raise ValueError(
        f"{source}: init_lora_weights={init!r} changes the base model's weights to match the "
        "adapter's start, so this adapter applies to that changed base "
        f"({conf.get('base_model_name_or_path')!r}), not the original one. Save it from PEFT "
        "as a plain LoRA of the original base (PiSSA, OLoRA, CorDA: save_pretrained(..., "
        "path_initial_model_for_weight_conversion=<the initial adapter>)), or merge it into "
        "that base and load the merged model")
  targets = conf.get("target_modules")
  if isinstance(targets, (list, tuple)):  # else a regex or "all-linear": the tensors decide
    for name in targets:
      last = str(name).rsplit(".", 1)[-1]
      if last not in HF_NAMES:
        raise ValueError(
            f"{source}: target_modules names {name!r}; adapters load only on the projection "
            f"weights {', '.join(HF_NAMES)} (not embed_tokens, lm_head or other modules)")
  r, alpha = conf.get("r", 8), conf.get("lora_alpha", 8)
  if isinstance(r, bool) or not isinstance(r, int) or r < 1:
    raise ValueError(f"{source}: r must be an int >= 1, got {r!r}")
  if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < math.inf:
    raise ValueError(f"{source}: lora_alpha must be a finite number > 0, got {alpha!r}")
  if conf.get("use_rslora"):
    # rank-stabilized LoRA scales by lora_alpha / sqrt(r): the same as alpha * sqrt(r) / r.
    alpha = alpha * math.sqrt(r)
  dropout = 0.0
  if forward == "unmerged":
    dropout = conf.get("lora_dropout") or 0.0
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
      raise ValueError(f"{source}: lora_dropout must be a number in [0, 1), got {dropout!r}")
  # targets set by the caller
  return LoraConfig(rank=r, alpha=alpha, targets=ATTENTION + MLP, forward=forward,
                    dropout=dropout)


def load_peft(path, cfg: ModelConfig,
              forward: str = "merged") -> tuple[LoraConfig, dict[str, Any]]:
  """Read a Hugging Face PEFT LoRA adapter directory (written by `save_peft`, or by PEFT for a
  model of `cfg`'s architecture) as `(LoraConfig, adapter)`: the adapter boxed like
  `init_lora`'s, float32 host arrays; merge it with `merge(base, adapter, lcfg)` or train it
  further with `Learner(lora=...)`.

  The targets are the projections the file holds weights for (each for every layer). A
  rank-stabilized adapter (`use_rslora`, scale lora_alpha / sqrt(r)) loads with
  `alpha = lora_alpha * sqrt(r)`, the same scale; saved again it is a plain LoRA with that
  alpha. `forward` is the returned config's (`LoraConfig.forward`): with "unmerged" it keeps
  the adapter's `lora_dropout` (which acts in training only), with "merged" (the default)
  dropout is 0, since the merged forward cannot apply it. Adapters whose settings change
  the function otherwise (DoRA, trained biases, modules_to_save, per-module ranks or alphas,
  some layers only, ...) are refused with a ValueError naming the setting."""
  d = pathlib.Path(path).expanduser()
  if not d.is_dir():
    if d.is_file() and d.name in (PEFT_CONFIG, PEFT_WEIGHTS):
      raise ValueError(f"{d}: pass the adapter's directory ({d.parent}), not one of its files")
    raise FileNotFoundError(f"no adapter directory at {d}")
  conf_file, weights = d / PEFT_CONFIG, d / PEFT_WEIGHTS
  if not conf_file.is_file():
    hint = (": it is a model directory (config.json); load it with jaxagent.models.load"
            if (d / "config.json").is_file() else "")
    raise FileNotFoundError(f"{d} has no {PEFT_CONFIG} (expected a PEFT LoRA adapter "
                            f"directory){hint}")
  try:
    conf = json.loads(conf_file.read_text())
  except (ValueError, UnicodeDecodeError) as e:
    raise ValueError(f"{conf_file} is not valid JSON: {e}") from None
  if not isinstance(conf, dict):
    raise ValueError(f"{conf_file}: expected a JSON object")
  if forward not in FORWARDS:
    raise ValueError(f"load_peft: forward must be 'merged' or 'unmerged', got {forward!r}")
  lcfg = _peft_lora_config(conf, str(conf_file), forward)
  if not weights.is_file():
    hint = (": it holds adapter_model.bin (a PyTorch pickle); save the adapter again with "
            "safe_serialization=True" if (d / "adapter_model.bin").is_file() else "")
    raise FileNotFoundError(f"{d} has no {PEFT_WEIGHTS}{hint}")
  by_module = {_peft_module(t): t for t in INPUT_AXES}
  key_re = re.compile(re.escape(_PEFT_PREFIX) + r"(\d+)\.(\w+\.\w+)\.lora_([AB])\.weight")
  found: dict[tuple[str, int, str], np.ndarray] = {}
  other = []
  try:
    f = safetensors.safe_open(str(weights), framework="numpy")
  except Exception as e:  # safetensors raises its own error types for corrupt headers
    raise ValueError(f"cannot read safetensors file {weights}: {e}") from e
  with f:
    for k in f.keys():
      m = key_re.fullmatch(k)
      if not m or m.group(2) not in by_module:
        other.append(k)
        continue
      i, t = int(m.group(1)), by_module[m.group(2)]
      if i >= cfg.n_layers:
        raise ValueError(f"{weights}: tensor {k!r} is for layer {i}, the config {cfg.name!r} "
                         f"has {cfg.n_layers} layers (pass the config of the adapter's base)")
      found[(t, i, m.group(3))] = f.get_tensor(k)
  if other:
    shown = ", ".join(sorted(other)[:4]) + (f", and {len(other) - 4} more"
                                            if len(other) > 4 else "")
    raise ValueError(f"{weights}: {len(other)} tensor(s) that are not LoRA weights of the "
                     f"projections {', '.join(HF_NAMES)} named {_PEFT_PREFIX}<i>.<module>."
                     f"lora_A/lora_B.weight: {shown}")
  targets = tuple(t for t in INPUT_AXES if any(key[0] == t for key in found))
  if not targets:
    raise ValueError(f"{weights} holds no LoRA weights")
  listed = conf.get("target_modules")
  if isinstance(listed, (list, tuple)):
    named = {HF_NAMES[str(n).rsplit(".", 1)[-1]] for n in listed}
    names = {ours: hf for hf, ours in HF_NAMES.items()}
    if set(targets) - named:
      raise ValueError(f"{weights} holds weights for "
                       f"{', '.join(names[t] for t in targets if t not in named)}, which "
                       f"target_modules {list(listed)} does not name")
    if named - set(targets):
      raise ValueError(f"{weights} holds no weights for "
                       f"{', '.join(names[t] for t in INPUT_AXES if t in named - set(targets))}"
                       f", which target_modules {list(listed)} names (an incomplete file?)")
  lcfg = dataclasses.replace(lcfg, targets=targets)
  specs = lora_specs(cfg, lcfg)["layers"]
  r, adapter = lcfg.rank, {}
  for t in targets:
    (a_shape, a_names, _), (b_shape, b_names, _) = specs[t]["a"], specs[t]["b"]
    n_in, n_out = math.prod(a_shape[1:-1]), math.prod(b_shape[2:])
    a_rows, b_rows = [], []
    for i in range(cfg.n_layers):
      for part, want in (("A", (r, n_in)), ("B", (n_out, r))):
        name = f"{_PEFT_PREFIX}{i}.{_peft_module(t)}.lora_{part}.weight"
        w = found.get((t, i, part))
        if w is None:
          some = conf.get("layers_to_transform")
          why = f" (its layers_to_transform is {some!r})" if some is not None else ""
          raise ValueError(f"{weights}: tensor {name!r} is missing: an adapter must adapt "
                           f"{_peft_module(t)} in every layer of the config {cfg.name!r} "
                           f"({cfg.n_layers}){why}")
        if not jnp.issubdtype(w.dtype, jnp.floating):
          raise ValueError(f"{weights}: tensor {name!r} has dtype {w.dtype}; LoRA weights "
                           "must be floating point")
        if tuple(w.shape) != want:
          raise ValueError(f"{weights}: tensor {name!r} has shape {tuple(w.shape)}, expected "
                           f"{want} for r={r} on the config {cfg.name!r} (pass the config of "
                           "the adapter's base)")
        w = np.asarray(w, np.float32)
        if not np.isfinite(w).all():
          raise ValueError(f"{weights}: tensor {name!r} holds NaN or Inf values")
        (a_rows if part == "A" else b_rows).append(w)
    a = np.stack([w.T.reshape(a_shape[1:]) for w in a_rows])
    b = np.stack([w.T.reshape(b_shape[1:]) for w in b_rows])
    adapter[t] = {"a": nn.LogicallyPartitioned(a, a_names),
                  "b": nn.LogicallyPartitioned(b, b_names)}
  return lcfg, {"layers": adapter}
