"""Jitted learner steps over packed rows: `score` (per-token log-probs) and `train_step`.

Place in the data flow: `rl/packing.py` builds `[B, L]` rows; `score` gives the reference
(and, when needed, old) log-probs of those rows; `train_step` computes the masked loss of
`rl/losses.py`, accumulates gradients over micro-batches so that the normalisation equals one
big batch, clips, applies the optax update and reports metrics. Both run under `jax.jit` with
explicit shardings (rows over `data`/`fsdp`, params by their logical axes) and the train state
donated.

Batches are dicts of `[B, L]` arrays: `tokens`, `segment_ids`, `positions`, `loss_mask`,
`old_logps`, `advantages` and optionally `ref_logps` and `behavior_logps` (the sampler's
log-probs, required with `LossConfig.tis_cap`; `old_logps` are then the learner's own log-probs
of the batch before the update: see `rl/losses.py`). Position t's log-prob is that of token t
given the tokens before it in its segment. The jitted programs are traced once per set of keys.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Literal, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxagent import sharding as shd
from jaxagent.models import decoder, logprobs, lora as lora_lib, param_tree
from jaxagent.models.config import ModelConfig
from jaxagent.rl import losses

Batch = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Static settings of the learner step.

  Attributes:
    objective: "rl" (the policy loss of `loss`) or "sft" (cross-entropy on `loss_mask` tokens,
      token mean, for the warm start).
    micro_batches: the batch's rows are split into this many micro-batches whose gradients are
      accumulated (rows must divide evenly; packing rounds rows accordingly).
    temperature: logits are divided by it before the softmax (match the sampler's; the warm
      start of `learner_parts` uses 1.0).
    logprob_chunk: sequence chunk for the vocabulary projection (bounds `[B, chunk, V]`).
    logprob_chunk_tokens: most tokens (rows x positions) per chunk; bounds the float32 logits
      of one chunk to `logprob_chunk_tokens * V * 4` bytes however many rows a batch packs.
    logprob_save_probs: keep each chunk's `softmax - onehot(target)` (compute dtype) from the
      forward pass for the backward pass instead of recomputing the logits there
      (`logprobs.token_logprobs(save_probs=True)`): saves one vocabulary matmul and a pass
      over the float32 logits per chunk, costs `tokens per micro-batch x vocab x 2` bytes
      of memory (5 GB for 16k tokens of a 152k vocabulary in bf16). Off by default.
    entropy: compute per-token entropies (needed for `loss.entropy_coef`; else a metric only,
      not differentiated).
    nonfinite: what to do when the loss, the gradient norm or the optimizer's update
      (`update_norm`) is not finite: "raise" stops with an error naming the step and metric;
      "skip" leaves params and optimizer state unchanged for that step and reports
      `nonfinite=1`. The optimizer's update count stays too, so the learning-rate schedule
      (warmup, decay) and Adam's bias correction count applied updates: a skipped step delays
      the rest of the schedule by one update, while `TrainState.step` counts every step (a
      resume restores both as saved).
    gather_weights: with fsdp and several micro-batches, all-gather the weights once per step
      (kept split over tensor) instead of letting every micro-batch gather them again in its
      forward and backward pass. Costs one unsharded copy of the params per device (their
      own dtype, so gradients are bitwise those of the default path up to summation order);
      each micro-batch's gradients are still reduce-scattered back to the fsdp shards.
    seed: the run's seed. A LoRA adapter's dropout (`LoraConfig.dropout`) draws its masks
      from (seed, objective, `TrainState.step`, row of the batch, layer, target) inside the
      jitted step: a resumed run repeats them, and they do not depend on micro-batching.
  """

  loss: losses.LossConfig = losses.LossConfig()
  objective: Literal["rl", "sft"] = "rl"
  micro_batches: int = 1
  temperature: float = 1.0
  logprob_chunk: int = 512
  logprob_chunk_tokens: int = 4096
  logprob_save_probs: bool = False
  entropy: bool = True
  nonfinite: Literal["raise", "skip"] = "raise"
  gather_weights: bool = False
  seed: int = 0

  def __post_init__(self):
    if self.objective not in ("rl", "sft"):
      raise ValueError(f"StepConfig.objective must be 'rl' or 'sft', got {self.objective!r}")
    # A float (2.0 from a config override) failed inside the step as "Shapes must be 1D
    # sequences of concrete values of integer type".
    for name in ("micro_batches", "logprob_chunk", "logprob_chunk_tokens"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"StepConfig.{name} must be an int >= 1, got {value!r}")
    if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
      raise ValueError(f"StepConfig.seed must be an int, got {self.seed!r}")
    if not 0 < self.temperature < float("inf"):  # NaN fails too
      raise ValueError(f"StepConfig.temperature must be a finite number > 0, got {self.temperature}")
    if self.nonfinite not in ("raise", "skip"):
      raise ValueError(f"StepConfig.nonfinite must be 'raise' or 'skip', got {self.nonfinite!r}")


def make_optimizer(learning_rate: float = 1e-6, *, weight_decay: float = 0.0, b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-8, max_grad_norm: float | None = 1.0,
                   warmup_steps: int = 0, total_steps: int | None = None,
                   schedule: Literal["constant", "cosine", "linear"] = "constant"):
  """AdamW with optional global-norm clipping (`max_grad_norm` None or 0: off) and a warmup +
  decay schedule over the updates applied (`warmup_steps`, `total_steps` count updates; an
  update skipped by `StepConfig.nonfinite="skip"` or not made for lack of signal is not one)."""
  def real(name, value, ok, what):
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
        or not ok(value)):
      raise ValueError(f"{name} must be a finite number {what}, got {value!r}")
  real("learning_rate", learning_rate, lambda v: v > 0, "> 0")
  if max_grad_norm is not None:
    # A negative norm would flip the clipped gradient's sign: gradient ascent.
    real("max_grad_norm", max_grad_norm, lambda v: v >= 0, ">= 0 (or None; 0 turns clipping off)")
  real("weight_decay", weight_decay, lambda v: v >= 0, ">= 0")
  real("b1", b1, lambda v: 0 <= v < 1, "in [0, 1)")
  real("b2", b2, lambda v: 0 <= v < 1, "in [0, 1)")
  real("eps", eps, lambda v: v >= 0, ">= 0")
  if (isinstance(warmup_steps, bool) or not isinstance(warmup_steps, numbers.Integral)
      or warmup_steps < 0):
    raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
  if schedule == "constant":
    lr = (optax.linear_schedule(0.0, learning_rate, warmup_steps) if warmup_steps else
          learning_rate)
    if warmup_steps:
      lr = optax.join_schedules([lr, optax.constant_schedule(learning_rate)], [warmup_steps])
  elif schedule in ("cosine", "linear"):
    if (isinstance(total_steps, bool) or not isinstance(total_steps, numbers.Integral)
        or total_steps <= warmup_steps):
      raise ValueError(f"schedule={schedule!r} needs an int total_steps > warmup_steps "
                       f"({warmup_steps}) to decay over, got total_steps={total_steps!r}")
    # warmup_steps=0 starts at the full rate: a one-step warmup would make the first update 0.
    decay = (optax.cosine_decay_schedule(learning_rate, total_steps - warmup_steps)
             if schedule == "cosine" else
             optax.linear_schedule(learning_rate, 0.0, total_steps - warmup_steps))
    lr = (optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warmup_steps), decay],
                               [warmup_steps]) if warmup_steps else decay)
  else:
    raise ValueError(f"schedule must be 'constant', 'cosine' or 'linear', got {schedule!r}")
  parts = []
  if max_grad_norm:
    parts.append(optax.clip_by_global_norm(max_grad_norm))
  parts.append(optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
  return optax.chain(*parts)


def sequence_logprobs(params, batch: Batch, *, cfg: ModelConfig, temperature: float = 1.0,
                      chunk: int = 512, with_entropy: bool = False,
                      chunk_tokens: int = 4096, entropy_grad: bool = True,
                      save_probs: bool = False):
  """Per-token log-probs `[B, L]` (position t: log p(token t | tokens < t); 0 at t = 0).

  Also returns the entropies of the predictive distributions at the same positions (zeros
  unless `with_entropy`; not differentiated unless `entropy_grad`). `save_probs`: see
  `logprobs.token_logprobs`.
  """
  tokens = batch["tokens"]
  h = decoder.hidden_states(params, tokens, cfg=cfg, positions=batch.get("positions"),
                            segment_ids=batch["segment_ids"])
  nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
  out = logprobs.token_logprobs(params, h, nxt, cfg=cfg, temperature=temperature, chunk=chunk,
                               with_entropy=with_entropy, max_chunk_tokens=chunk_tokens,
                               entropy_grad=entropy_grad, save_probs=save_probs)
  lp, ent = out if with_entropy else (out, jnp.zeros_like(out))
  shift = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
  return shift(lp), shift(ent)


def _sft_parts(logps, batch):
  mask = batch["loss_mask"] > 0
  nll = jnp.where(mask, -logps, 0.0)
  n = jnp.sum(mask.astype(jnp.float32))
  return losses.LossParts(
      numerator=jnp.sum(nll), denominator=n,
      sums={"nll": jnp.sum(nll), "num_policy_tokens": n, "ratio_mean": n},
      counts={"nll": n, "ratio_mean": n},
      ratio_min=jnp.asarray(1.0), ratio_max=jnp.asarray(1.0))


def _micro_parts(params, mb: Batch, cfg: ModelConfig, scfg: StepConfig):
  # The entropy bonus is a term of the RL loss only: the SFT warm start keeps the run's loss
  # config, and its entropy_coef made every SFT step compute entropies and their gradient.
  ent_grad = scfg.objective == "rl" and scfg.loss.entropy_coef > 0
  want_ent = scfg.entropy or ent_grad
  logps, ents = sequence_logprobs(params, mb, cfg=cfg, temperature=scfg.temperature,
                                  chunk=scfg.logprob_chunk, with_entropy=want_ent,
                                  chunk_tokens=scfg.logprob_chunk_tokens,
                                  entropy_grad=ent_grad,
                                  save_probs=scfg.logprob_save_probs)
  if scfg.objective == "sft":
    parts = _sft_parts(logps, mb)
  else:
    behavior = mb.get("behavior_logps")
    parts = losses.policy_loss_parts(
        logps, mb["old_logps"], mb["advantages"], mb["loss_mask"], mb["segment_ids"],
        scfg.loss, ref_logps=mb.get("ref_logps"), entropies=ents if want_ent else None,
        behavior_logps=behavior)
    # Sampler-vs-learner gap: |learner logp - sampler logp| on policy tokens. On the first
    # update after a rollout the params are the sampler's (without behavior_logps; with them,
    # the sampler is theirs and the params may be steps ahead), so this measures their
    # disagreement.
    sampler = mb["old_logps"] if behavior is None else behavior
    mask = mb["loss_mask"] > 0
    gap = jnp.where(mask, jnp.abs(jax.lax.stop_gradient(logps) - sampler), 0.0)
    parts.sums["logprob_gap"] = jnp.sum(gap)
    parts.counts["logprob_gap"] = jnp.sum(mask.astype(jnp.float32))
  if want_ent:
    mask = (mb["loss_mask"] > 0).astype(jnp.float32)
    parts.sums["entropy"] = jnp.sum(ents * mask)
    parts.counts["entropy"] = jnp.sum(mask)
  return parts.numerator, parts


def split_micro_batches(batch: Batch, m: int) -> Batch:
  """`[B, ...]` -> `[m, B/m, ...]`, micro-batch i = rows i, i+m, i+2m, ... (each micro-batch
  draws rows from every data-parallel shard, so no rows move between devices)."""
  def one(x):
    b = x.shape[0]
    if b % m:
      raise ValueError(f"batch rows ({b}) must be divisible by micro_batches ({m})")
    return x.reshape(b // m, m, *x.shape[1:]).swapaxes(0, 1)
  return jax.tree.map(one, batch)


def _constrain_params(tree, rules):
  """Constrain a (boxed) params-shaped tree to `sharding.shardings(tree, mesh, rules)` under
  the current (abstract) mesh; identity outside a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return tree
  return jax.lax.with_sharding_constraint(tree, shd.shardings(tree, mesh, rules))


# The library's sharding rules with the fsdp axis dropped: the weights as one step computes with.
_GATHERED_RULES = tuple((k, None if v == "fsdp" else v) for k, v in shd.RULES)


def _lora_weights(targets, frozen, adapter, lcfg: lora_lib.LoraConfig, cfg: ModelConfig,
                  gather: bool = False, rng=None):
  """The weights one forward pass reads with an adapter.

  `lcfg.forward == "unmerged"`: `frozen` and `targets` (as stored, cast to the compute dtype
  per layer where they are used) with the adapter riding along as `"adapter"` (a
  `lora.LayerAdapter` with `rng`, one dropout key per row, or None): each layer's targets
  become `lora.LowRankWeight`s inside the loop, scanned or unrolled (per-layer weights cut
  here, as for the merged unrolled loop).

  `"merged"`: `frozen` (the base in the compute dtype) with each target merged
  (`W + scale * A @ B` of the base's own `targets` in float32, cast to the compute dtype) one
  layer at a time. For the scanned layer loop the targets stay
  as stored and the adapter rides along as `"adapter"` (a `lora.LayerAdapter`): the loop's body
  merges its layer inside the layer's rematerialisation (compiled temporaries of tiny-qwen3
  widened to 4 layers of d_model 256, float32, 4 micro-batches, remat "dots_attention": update
  40.1 -> 10.5 MB, score 19.0 -> 5.9 MB against merging the stacked targets before the scan).
  For the unrolled loop, per-layer weights, each layer merged from its own slices.

  With `gather` (`targets` and `frozen` already gathered over fsdp), the adapter is gathered
  too (it is small) and the merge computes the gathered weights in place: left to itself, the
  partitioner merged on the adapter's fsdp shards and all-gathered every merged weight again
  in every micro-batch."""
  if gather:
    adapter = _constrain_params(adapter, _GATHERED_RULES)
  if lcfg.forward == "unmerged":
    ad = lora_lib.LayerAdapter(param_tree.unbox(adapter)["layers"], lcfg, cfg.jnp_dtype, rng)
    w = {**frozen, "layers": {**frozen["layers"], **targets["layers"]}}
    return {**(w if cfg.scan_layers else param_tree.unstack_layers(w)), "adapter": ad}
  if cfg.scan_layers:
    ad = lora_lib.LayerAdapter(param_tree.unbox(adapter)["layers"], lcfg, cfg.jnp_dtype)
    return {**frozen, "layers": {**frozen["layers"], **targets["layers"]}, "adapter": ad}
  # The unrolled loop: each layer merged from its own slices here, before the loop (merging
  # inside the unrolled layers' rematerialisation held more: with remat "dots_attention" and 4
  # micro-batches, 54.9 MB of temporaries against 29.0 MB on the widened tiny-qwen3).
  w = param_tree.unstack_layers(frozen)
  base_layers = param_tree.unstack_layers(targets)["layers"]
  adapter_layers = param_tree.unstack_layers(param_tree.unbox(adapter))["layers"]
  w["layers"] = tuple(
      {**f, **{t: lora_lib.merged_weight(tw[t], ab[t]["a"], ab[t]["b"], t, lcfg, cfg.jnp_dtype)
               for t in lcfg.targets}}
      for f, tw, ab in zip(w["layers"], base_layers, adapter_layers))
  return w


# The batch key `train_step` adds for LoRA dropout: each row's index in the step's batch.
_DROPOUT_ROWS = "lora_dropout_rows"
_DROPOUT_TAG = 0x10AD0


def _dropout_key(scfg: StepConfig, step):
  """The LoRA dropout key of optimizer step `step` (traced): from the run's seed and the
  objective (the warm start's steps count from 0 too), then `step`."""
  key = jax.random.key(scfg.seed % 2**32)
  key = jax.random.fold_in(key, _DROPOUT_TAG + (scfg.objective == "sft"))
  return jax.random.fold_in(key, step)


def _lora_parts(adapter, mb, cfg, scfg, *, targets, frozen, lcfg, gather=False, key=None):
  rng = None
  if key is not None:  # dropout: one key per row, from its index in the step's batch
    mb = dict(mb)
    rows = mb.pop(_DROPOUT_ROWS)
    rng = jax.vmap(lambda r: jax.random.fold_in(key, r))(rows)
  return _micro_parts(_lora_weights(targets, frozen, adapter, lcfg, cfg, gather, rng), mb,
                      cfg, scfg)


def train_step(state: TrainState, batch: Batch, *, cfg: ModelConfig, scfg: StepConfig,
               optimizer: optax.GradientTransformation, base=None,
               lora: lora_lib.LoraConfig | None = None):
  """One optimizer step over `batch` (pure; jit it with `Learner` or your own shardings).

  With `lora`, `state.params` is a low-rank adapter (`jaxagent.models.lora`) over the frozen
  params `base`: each micro-batch's forward pass reads the merged weights (or the unmerged
  low-rank paths, `LoraConfig.forward`, with `LoraConfig.dropout` on their inputs), and the
  optimizer updates the adapter only."""
  m = scfg.micro_batches
  gather = scfg.gather_weights and m > 1
  if (lora is None) != (base is None):
    raise ValueError("train_step: pass both base (the frozen params) and lora (their adapter's "
                     "LoraConfig), or neither")
  _check_behavior_key(batch, scfg)
  if lora is not None:
    key = None
    if lora.dropout > 0:
      key = _dropout_key(scfg, state.step)
      rows = batch["tokens"].shape[0]
      row_ids = decoder.constrain_batch(jnp.arange(rows, dtype=jnp.int32))
      batch = {**batch, _DROPOUT_ROWS: row_ids}
    grad_fn = jax.value_and_grad(_lora_step_parts(base, lora, cfg, gather, key), has_aux=True)
    to_adapter = lambda g: jax.tree.map(lambda a, p: a.astype(p.dtype), g, state.params)
    return _apply(state, _accumulate(state.params, batch, m, grad_fn, cfg, scfg, to_adapter),
                  optimizer)
  grad_fn = jax.value_and_grad(_micro_parts, has_aux=True)
  # The weights as the model computes with them (matmul weights in the compute dtype), cast
  # once per step rather than at every use in every micro-batch: the layer loop then slices
  # half the bytes out of the stacked layers. The gradients are the same, since each use cast
  # its weight anyway; they come back in the compute dtype and are accumulated in the params'.
  weights = param_tree.compute_copy(state.params, cfg)
  if gather:
    weights = _constrain_params(weights, _GATHERED_RULES)
  restack = lambda g: g
  like = state.params  # the tree (and dtypes) gradients are accumulated in
  if not cfg.scan_layers:
    # Per-layer weights cut out of the stacked ones once per step (the unrolled layer loop
    # then reads them in place in every micro-batch). Their gradients are accumulated per
    # layer and stacked back once (stacking every micro-batch's cost 80 ms per step for
    # Qwen2.5-1.5B on an H100), except with gathered weights, whose gradients go back to the
    # fsdp shards of the stacked layout after each micro-batch.
    weights = param_tree.unstack_layers(weights)
    restack = lambda g: param_tree.stack_layers(g, state.params)
    if not gather:
      like = jax.eval_shape(param_tree.unstack_layers, state.params)
  to_master = lambda g: jax.tree.map(lambda a, p: a.astype(p.dtype), g, like)
  # Gradients w.r.t. gathered weights go back to the fsdp shards after each micro-batch.
  home = ((lambda g: _constrain_params(to_master(restack(g)), shd.RULES)) if gather
          else to_master)
  grads, parts = _accumulate(weights, batch, m, grad_fn, cfg, scfg, home)
  if not gather:
    grads = restack(grads)
  return _apply(state, (grads, parts), optimizer)


def _check_behavior_key(batch, scfg: StepConfig) -> None:
  """A ValueError naming the batch key when the loss weights by the sampler's log-probs
  (`LossConfig.tis_cap`) and the batch has none (the SFT objective reads no log-probs)."""
  if (scfg.objective == "rl" and scfg.loss.tis_cap is not None
      and batch.get("behavior_logps") is None):
    raise ValueError(
        f"LossConfig.tis_cap={scfg.loss.tis_cap} needs the batch key 'behavior_logps' (the "
        f"sampler's log-probs [B, L]), with 'old_logps' the learner's own log-probs of the batch "
        f"before this update (`Learner.score`); the batch has {sorted(batch)}. Set "
        f"loss.tis_cap=None to train on the sampler's log-probs as old_logps.")


def _lora_base_parts(base, lcfg, cfg: ModelConfig):
  """`(targets, frozen)`: the base's target weights (their stored dtype: for the float32 merge,
  or cast per layer where the unmerged forward uses them) and the rest of the base in the
  compute dtype (`param_tree.compute_copy`).

  The unmerged forward's targets are not copied to the compute dtype once per step: on the
  widened tiny-qwen3 (4 layers, d_model 512, float32 params, bfloat16 compute, 4
  micro-batches, remat "dots_attention") such a copy took the update's compiled temporaries
  from 18.7 to 58.0 MB scanned (merged: 19.7) and from 87.2 to 106.7 MB unrolled (merged:
  108.6)."""
  targets = {"layers": {t: base["layers"][t] for t in lcfg.targets}}
  rest = {k: v for k, v in base["layers"].items() if k not in lcfg.targets}
  return targets, param_tree.compute_copy({**base, "layers": rest}, cfg)


def _lora_step_parts(base, lcfg, cfg: ModelConfig, gather: bool, key=None):
  """`_micro_parts` as a function of the adapter: the base's targets and the rest of the base
  in the compute dtype are prepared once per step (gathered over fsdp with `gather`), the
  merge (or the unmerged low-rank paths) runs in every micro-batch's forward pass. `key`: the
  step's dropout key (`_dropout_key`; the batch then holds `_DROPOUT_ROWS`), or None."""
  targets, frozen = _lora_base_parts(base, lcfg, cfg)
  if gather:
    targets = _constrain_params(targets, _GATHERED_RULES)
    frozen = _constrain_params(frozen, _GATHERED_RULES)
  def parts(adapter, mb, cfg, scfg):
    return _lora_parts(adapter, mb, cfg, scfg, targets=targets, frozen=frozen, lcfg=lcfg,
                       gather=gather, key=key)
  return parts


def _accumulate(wrt, batch, m: int, grad_fn, cfg, scfg, home):
  """Gradients of `grad_fn` w.r.t. `wrt` summed over `m` micro-batches of `batch` (each
  micro-batch's mapped by `home`), and the summed loss parts."""
  if m == 1:
    (_, parts), grads = grad_fn(wrt, batch, cfg, scfg)
    return home(grads), parts
  mbs = split_micro_batches(batch, m)
  first = jax.tree.map(lambda x: x[0], mbs)
  rest = jax.tree.map(lambda x: x[1:], mbs)
  (_, parts), grads = grad_fn(wrt, first, cfg, scfg)
  grads = home(grads)

  def body(carry, mb):
    g_acc, p_acc = carry
    (_, p), g = grad_fn(wrt, mb, cfg, scfg)
    return (jax.tree.map(jnp.add, g_acc, home(g)), losses.combine_parts(p_acc, p)), None

  (grads, parts), _ = jax.lax.scan(body, (grads, parts), rest)
  return grads, parts


def _apply(state: TrainState, grads_parts, optimizer):
  """The optimizer update of `state` from summed gradients and loss parts, kept only when the
  loss, the gradient norm and the update norm are finite."""
  grads, parts = grads_parts
  denom = jnp.maximum(parts.denominator, 1.0)
  grads = jax.tree.map(lambda g: g / denom, grads)
  loss, metrics = losses.finalize_parts(parts)
  grad_norm = optax.global_norm(grads)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  new_params = optax.apply_updates(state.params, updates)
  # The update is checked too: finite gradients can still give a non-finite update (Adam with
  # eps=0 divides 0 by 0 on every parameter whose gradient is exactly 0, e.g. all of them for a
  # batch whose advantages are all 0), which would write NaN params without a word.
  update_norm = optax.global_norm(updates)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
  new_state = TrainState(step=state.step + 1, params=keep(new_params, state.params),
                         opt_state=keep(opt_state, state.opt_state))
  metrics = dict(metrics)
  metrics["grad_norm"] = grad_norm
  metrics["update_norm"] = update_norm
  metrics["nonfinite"] = 1.0 - finite.astype(jnp.float32)
  return new_state, metrics


def has_gradient(loss_cfg: losses.LossConfig, batch: Mapping[str, Any]) -> bool:
  """Whether the RL loss of `batch` (host arrays) can have a non-zero gradient: a trained token
  (`loss_mask`) has a non-zero advantage, or the loss has a KL or an entropy term. Otherwise
  every term is 0 times a finite ratio and the gradient is exactly 0, yet an optimizer step
  would still move the params (Adam's moments, weight decay) and count an update of the
  learning-rate schedule: the trainer makes none (`train/skipped_no_signal`)."""
  if loss_cfg.kl_coef or loss_cfg.entropy_coef:
    return True
  adv = np.asarray(batch["advantages"])
  mask = batch.get("loss_mask")
  if mask is not None:
    adv = adv[np.asarray(mask) != 0]
  return bool(np.any(adv != 0))  # (a NaN advantage counts: the step then reports nonfinite)


def learner_parts(config):
  """(StepConfig, optimizer) of the RL update and of the SFT warm start, as the trainer builds
  them from `config.loss`, `config.train`, `config.optimizer` and `config.sft`."""
  c, t, opt = config, config.train, config.optimizer
  loss_cfg = losses.LossConfig(
      algo=c.loss.algo, agg=c.loss.agg, clip_low=c.loss.clip_low, clip_high=c.loss.clip_high,
      dual_clip=c.loss.get("dual_clip"), kl_coef=c.loss.kl_coef,
      kl_estimator=c.loss.kl_estimator, entropy_coef=c.loss.entropy_coef,
      max_len_norm=c.loss.get("max_len_norm"), tis_cap=c.loss.get("tis_cap"),
      tis_level=c.loss.get("tis_level", "token"))
  scfg = StepConfig(loss=loss_cfg, micro_batches=t.micro_batches,
                    temperature=c.rollout.temperature or 1.0,
                    nonfinite=t.get("nonfinite", "raise"),
                    gather_weights=bool(t.get("gather_weights", False)),
                    logprob_save_probs=bool(t.get("logprob_save_probs", False)),
                    seed=c.get("seed", 0))
  rl_opt = _in_section(
      "optimizer", make_optimizer, opt.lr, weight_decay=opt.weight_decay, b1=opt.b1, b2=opt.b2,
      max_grad_norm=opt.max_grad_norm, warmup_steps=opt.warmup_steps,
      # One update per mini-batch per epoch (`Trainer.rl_step`): the schedule counts them all.
      total_steps=c.total_steps * max(1, t.epochs) * t.get("mini_batches", 1),
      schedule=opt.schedule)
  s = c.sft
  # The warm start fits the model's own distribution to the demonstrations (temperature 1),
  # whatever temperature the rollouts then sample at.
  sft_scfg = dataclasses.replace(scfg, objective="sft", entropy=False, temperature=1.0)
  # Adam's default moments and no weight decay: optimizer.b1 / b2 / weight_decay are the RL
  # updates' (README, "Your own task").
  sft_opt = _in_section("sft (lr, warmup_steps; optimizer.max_grad_norm)", make_optimizer,
                        s.lr, max_grad_norm=opt.max_grad_norm,
                        warmup_steps=s.get("warmup_steps", 0))
  return (scfg, rl_opt), (sft_scfg, sft_opt)


def _in_section(section: str, fn, *args, **kwargs):
  """`fn(*args, **kwargs)` with a ValueError naming the config section its arguments came
  from ("learning_rate must be ..." said neither optimizer.lr nor sft.lr)."""
  try:
    return fn(*args, **kwargs)
  except ValueError as e:
    raise ValueError(f"config section {section}: {e}") from None


def _check_segment_ids(segment_ids) -> None:
  """Raises ValueError unless every row of `segment_ids` `[B, L]` is a valid packing: ids in
  [0, L] (0 = padding) and each id > 0 one contiguous run.

  Attention and positions treat every contiguous run as its own trajectory, while the losses
  reduce per (row, id) and have room for ids up to L only; so a repeated id would silently
  join two trajectories into one sequence of the GSPO ratio and of the per-sequence means,
  and a larger id would make the loss NaN.
  """
  seg = np.asarray(segment_ids)
  if seg.ndim != 2 or not np.issubdtype(seg.dtype, np.integer):
    raise ValueError(f"segment_ids must be a [B, L] integer array, got {seg.dtype} {seg.shape}")
  n = seg.shape[1]
  bad = (seg < 0) | (seg > n)
  if bad.any():
    row, col = np.argwhere(bad)[0]
    raise ValueError(f"segment_ids[{row}, {col}] = {seg[row, col]} is outside [0, {n}] (0 is "
                     f"padding, trajectories are numbered 1, 2, ... per row); pack rows with "
                     f"`rl.packing.pack`")
  first = np.ones(seg.shape, bool)
  first[:, 1:] = seg[:, 1:] != seg[:, :-1]
  first &= seg > 0
  rows, cols = np.nonzero(first)
  ids = seg[rows, cols]
  key = rows.astype(np.int64) * (n + 1) + ids
  _, idx, counts = np.unique(key, return_index=True, return_counts=True)
  if (counts > 1).any():
    k = idx[np.argmax(counts > 1)]
    again = cols[(key == key[k])][1]
    raise ValueError(f"segment_ids row {rows[k]}: id {ids[k]} starts at column {cols[k]} and "
                     f"again at column {again}; each trajectory must be one contiguous run with "
                     f"its own id in its row (number them 1, 2, ... as `rl.packing.pack` does)")


def _check_tokens(tokens, vocab_size: int) -> None:
  """Raises ValueError for a token id outside [0, vocab_size): the embedding lookup gives NaN
  for one past the table (the whole trajectory's log-probs, hence the step's loss, go NaN) and
  wraps a negative one onto another token."""
  tok = np.asarray(tokens)
  bad = (tok < 0) | (tok >= vocab_size)
  if bad.any():
    row, col = np.argwhere(bad)[0]
    raise ValueError(f"tokens[{row}, {col}] = {tok[row, col]} is outside the model's vocabulary "
                     f"[0, {vocab_size}); {int(bad.sum())} such tokens in the batch: the tokenizer "
                     f"(or an observation template) does not match the model, or PackingConfig.pad_id "
                     f"is not a token id")


def _check_loss_mask(loss_mask, segment_ids) -> None:
  """Raises ValueError where `loss_mask` trains a position that has no log-prob of its own
  segment: a segment's first token (its log-prob is the previous segment's prediction of it, or
  0 in column 0) or padding."""
  mask = np.asarray(loss_mask) > 0
  seg = np.asarray(segment_ids)
  if mask.shape != seg.shape:
    raise ValueError(f"loss_mask has shape {mask.shape}; expected {seg.shape} like segment_ids")
  start = np.ones(seg.shape, bool)
  start[:, 1:] = seg[:, 1:] != seg[:, :-1]
  bad = mask & (start | (seg == 0))
  if bad.any():
    row, col = np.argwhere(bad)[0]
    what = "padding (segment id 0)" if seg[row, col] == 0 else "the first token of its segment"
    raise ValueError(f"loss_mask[{row}, {col}] > 0 on {what}, which has no log-prob to train: "
                     f"position t holds log p(token t | tokens < t) of its own trajectory, so a "
                     f"trajectory's first token and padding must have loss_mask 0 (the ledger is "
                     f"probably shifted by one; pack rows with `rl.packing.pack`)")


class Learner:
  """Owns the jitted `train_step` / `score` of one model on one mesh.

      learner = Learner(cfg, scfg, optimizer, mesh)
      state = learner.init(params)
      state, metrics = learner.train_step(state, batch)
      logps, entropies = learner.score(state.params, batch)

  With a low-rank adapter (`jaxagent.models.lora`), the learner holds the frozen base params
  and the train state holds the adapter: `Learner(..., lora=LoraConfig(...), base=params)`,
  `learner.init(lora.init_lora(cfg, lcfg, key))`; `score` and `train_step` take adapters where
  they took params, and `merged_params(adapter)` gives the params the sampler and the export
  read. The jitted programs take the base as their last argument.
  """

  def __init__(self, cfg: ModelConfig, scfg: StepConfig, optimizer, mesh: Mesh | None = None,
               *, lora: lora_lib.LoraConfig | None = None, base=None):
    self.cfg, self.scfg, self.optimizer = cfg, scfg, optimizer
    self.mesh = (shd.check_mesh(mesh, "Learner") if mesh is not None
                 else shd.make_mesh(devices=jax.devices()[:1]))
    if (lora is None) != (base is None):
      raise ValueError("Learner: pass both lora (a LoraConfig) and base (the frozen params "
                       "its adapter is trained over), or neither")
    self.lora = lora
    self.base = base
    if base is not None:
      param_tree.check_model_shapes(base, cfg, "Learner base")
      # Abstract bases (jax.ShapeDtypeStruct leaves, as `jaxagent.plan` lowers with) stay so.
      if not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(base)):
        self.base = jax.device_put(base, shd.shardings(base, self.mesh))
    self._train = None
    self._score = {}
    self._merge = {}

  def _base_args(self) -> tuple:
    return () if self.lora is None else (self.base,)

  def _base_shardings(self) -> tuple:
    return () if self.lora is None else (shd.shardings(self.base, self.mesh),)

  def merged_params(self, params, dtype=None):
    """The params the model reads: `params` itself without an adapter; with one, the base
    with `params` (an adapter) merged in (`lora.merge`, jitted, the base's shardings; in
    `dtype` when given, e.g. the compute dtype for the sampler)."""
    if self.lora is None:
      return params
    self._check_adapter(params, "Learner.merged_params")
    key = None if dtype is None else jnp.dtype(dtype).name
    if key not in self._merge:
      lcfg = self.lora
      def merge(adapter, base):
        out = lora_lib.merge(base, adapter, lcfg, dtype=key)
        return out if key is None else param_tree.compute_copy(out, self.cfg.replace(
            dtype=key))
      out_sh = shd.shardings(self.base, self.mesh)
      self._merge[key] = jax.jit(merge, out_shardings=out_sh)
    return self._merge[key](params, self.base)

  def batch_sharding(self, ndim: int = 2) -> NamedSharding:
    return shd.batch_sharding(self.mesh, ndim)

  def state_shardings(self, state):
    return TrainState(step=NamedSharding(self.mesh, P()),
                      params=shd.shardings(state.params, self.mesh),
                      opt_state=shd.shardings(state.opt_state, self.mesh))

  def _check_adapter(self, params, what: str) -> None:
    """With an adapter, a ValueError naming `what` unless `params` has the adapter's targets
    and shapes (else a KeyError or a pytree mismatch came from inside the jitted program)."""
    if self.lora is not None:
      lora_lib.check_lora(params, self.cfg, self.lora, what)

  def init(self, params, *, optimizer: bool = True) -> TrainState:
    """A sharded train state (step 0) around `params` (host or device arrays; an adapter of
    the learner's `LoraConfig` when it has one).

    optimizer: False leaves the optimizer state out (`opt_state` None), for a state that is
      only read (evaluation): Adam's two float32 moments are twice the params' memory.
      `train_step` refuses such a state."""
    self._check_adapter(params, "Learner.init")
    def make(p):
      return TrainState(step=jnp.zeros((), jnp.int32), params=p,
                        opt_state=self.optimizer.init(p) if optimizer else None)
    abstract = jax.eval_shape(make, params)
    shardings = self.state_shardings(abstract)
    params = jax.device_put(params, shardings.params)
    return jax.jit(make, out_shardings=shardings)(params)

  def put_batch(self, batch) -> Batch:
    """Place host arrays on the mesh, rows split over the data axes (token ids checked by
    `_check_tokens`, segment ids by `_check_segment_ids`, the loss mask by `_check_loss_mask`)."""
    if batch.get("tokens") is not None:
      _check_tokens(batch["tokens"], self.cfg.vocab_size)
    if batch.get("segment_ids") is not None:
      _check_segment_ids(batch["segment_ids"])
      if batch.get("loss_mask") is not None:
        _check_loss_mask(batch["loss_mask"], batch["segment_ids"])
    dp = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    for k, v in batch.items():
      rows = np.shape(v)[0] if v is not None and np.ndim(v) else None
      if rows is not None and rows % dp:
        raise ValueError(
            f"put_batch: {k!r} has {rows} rows, not a multiple of the {dp} data-parallel devices "
            f"(mesh data x fsdp = {self.mesh.shape['data']} x {self.mesh.shape['fsdp']}); pack with "
            f"PackingConfig(row_multiple=mini_batches * micro_batches * {dp}) "
            "(`packing.config_from_train`)")
    return {k: jax.device_put(np.asarray(v), self.batch_sharding(np.ndim(v)))
            for k, v in batch.items() if v is not None}

  def train_step_fn(self, state):
    """The jitted `train_step` for states shaped like `state` (arrays or abstract
    `jax.ShapeDtypeStruct`s), built once; `jaxagent.plan` lowers it ahead of time."""
    if self._train is None:
      ss = self.state_shardings(state)
      def fn(s, b, *base):
        return train_step(s, b, cfg=self.cfg, scfg=self.scfg, optimizer=self.optimizer,
                          base=base[0] if base else None, lora=self.lora)
      fn.__name__ = fn.__qualname__ = "train_step"  # the program's name in compile logs
      self._train = jax.jit(shd.on_mesh(fn, self.mesh),
                            in_shardings=(ss, self.batch_sharding(), *self._base_shardings()),
                            out_shardings=(ss, NamedSharding(self.mesh, P())),
                            donate_argnums=(0,))
    return self._train

  def train_step(self, state: TrainState, batch) -> tuple[TrainState, dict[str, float]]:
    if state.opt_state is None:
      raise ValueError("Learner.train_step: this state has no optimizer state (it was made by "
                       "init(params, optimizer=False), to be read only)")
    _check_behavior_key(batch, self.scfg)  # before the batch moves to the devices
    train = self.train_step_fn(state)
    step = int(state.step)
    state, metrics = train(state, self.put_batch(batch), *self._base_args())
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if metrics["nonfinite"] and self.scfg.nonfinite == "raise":
      bad = [k for k, v in metrics.items() if not np.isfinite(v)]
      hint = ("Lower the learning rate, check the batch, or set nonfinite='skip'."
              if bad != ["update_norm"] else
              "The loss and gradients are finite but the optimizer's update (or its norm, in "
              "float32) is not: a learning rate far too large, or Adam with eps=0 dividing by "
              "zero where a gradient is exactly 0 (use eps > 0).")
      err = FloatingPointError(
          f"non-finite values at train step {step}: {bad or ['grad_norm']}; params were not "
          f"updated (the state passed in was donated to the step: the error's `state` holds "
          f"the unchanged params and optimizer state). {hint}")
      err.state = state
      raise err
    return state, metrics

  def score_fn(self, with_entropy: bool = False):
    """The jitted `sequence_logprobs` behind `score` (built once per `with_entropy`)."""
    if with_entropy not in self._score:
      lcfg = self.lora

      def one(p, b):
        return sequence_logprobs(p, b, cfg=self.cfg, temperature=self.scfg.temperature,
                                 chunk=self.scfg.logprob_chunk,
                                 chunk_tokens=self.scfg.logprob_chunk_tokens,
                                 with_entropy=with_entropy)

      def fn(p, b, *base):
        if lcfg is not None:
          # The weights as the update step reads them (merged in the compute dtype), made
          # once for all micro-batches: not a merged copy in the base's dtype per micro-batch.
          targets, frozen = _lora_base_parts(base[0], lcfg, self.cfg)
          p = _lora_weights(targets, frozen, p, lcfg, self.cfg)
        # Rows in the update's micro-batches: the same activation memory as an update step.
        m = self.scfg.micro_batches
        rows = b["tokens"].shape[0]
        if m == 1 or rows % m:
          return one(p, b)
        lp, ent = jax.lax.map(lambda mb: one(p, mb), split_micro_batches(b, m))
        merge = lambda x: x.swapaxes(0, 1).reshape(rows, *x.shape[2:])
        return merge(lp), merge(ent)
      fn.__name__ = fn.__qualname__ = "score_entropy" if with_entropy else "score"
      self._score[with_entropy] = jax.jit(shd.on_mesh(fn, self.mesh),
                                          out_shardings=(self.batch_sharding(),) * 2)
    return self._score[with_entropy]

  def score(self, params, batch, with_entropy: bool = False):
    """Per-token log-probs (and entropies) `[B, L]` of packed rows, e.g. reference log-probs
    (`params`: an adapter when the learner has one)."""
    self._check_adapter(params, "Learner.score")
    b = self.put_batch({k: batch[k] for k in ("tokens", "segment_ids", "positions")
                        if k in batch})
    return self.score_fn(with_entropy)(params, b, *self._base_args())
