"""Token sampling with per-token rng and the sampled token's log-probability.

The rng of a token is `fold_in(fold_in(key(seed), request_id), position)`: it depends only on
the request and the token's position in its sequence, never on the slot, the batch or what
else was running, so a request's output is reproducible under any scheduling.

Reported log-probability: `log_softmax(logits / temperature)[token]` over the FULL vocabulary,
i.e. before top-k / top-p truncation (with `temperature == 0`, greedy, it is
`log_softmax(logits)[token]`). With temperature 1 and no truncation this is exactly the
training forward's `log_softmax` at the same position, which is what RL importance ratios need;
a trainer that samples at temperature T scores with the same T (`token_logprobs(...,
temperature=T)`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Static sampling settings of an engine (hashable; part of the jitted program)."""

  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"SamplingConfig.temperature must be >= 0, got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0:
      raise ValueError(f"SamplingConfig.top_k must be >= 0 (0 = off), got {self.top_k}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def token_keys(seeds, request_ids, positions):
  """Per-token rng keys from (seed, request id, position); all arrays `[S]`."""
  def one(seed, rid, pos):
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), rid), pos)
  return jax.vmap(one)(seeds.astype(jnp.uint32), request_ids.astype(jnp.uint32),
                       positions.astype(jnp.uint32))


def _truncate(scaled, cfg: SamplingConfig):
  neg = jnp.finfo(scaled.dtype).min
  if cfg.top_k > 0 and cfg.top_k < scaled.shape[-1]:
    kth = jax.lax.top_k(scaled, cfg.top_k)[0][..., -1:]
    scaled = jnp.where(scaled < kth, neg, scaled)
  if cfg.top_p < 1.0:
    sorted_desc = jnp.sort(scaled, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = before < cfg.top_p
    thresh = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    scaled = jnp.where(scaled < thresh, neg, scaled)
  return scaled


def sample(logits, keys, cfg: SamplingConfig):
  """Sample one token per row. logits: [S, V] float32; keys: [S]. Returns (tokens, logprobs)."""
  logits = logits.astype(jnp.float32)
  if cfg.greedy:
    tok = jnp.argmax(logits, axis=-1)
    lp_all = jax.nn.log_softmax(logits, axis=-1)
  else:
    scaled = logits / cfg.temperature
    lp_all = jax.nn.log_softmax(scaled, axis=-1)
    filt = _truncate(scaled, cfg)
    tok = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, filt)
  lp = jnp.take_along_axis(lp_all, tok[:, None], axis=-1)[:, 0]
  return tok.astype(jnp.int32), lp
