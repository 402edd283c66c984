"""`token_logprobs` (chunked, custom VJP) against log_softmax of the full logits."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent import models
from jaxagent.models import decoder


def _reference(params, h, targets, cfg, temperature):
  logits = decoder.logits_from_hidden(params, h, cfg) / temperature
  logp = jax.nn.log_softmax(logits, axis=-1)
  lp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  return lp, ent


@pytest.mark.parametrize("preset,tied", [("tiny-qwen3", None), ("tiny-llama", False),
                                         ("tiny-llama", True)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_values_and_grads_equal_full_log_softmax(preset, tied, temperature):
  kw = {} if tied is None else {"tie_embeddings": tied}
  cfg = models.get_config(preset, **kw)
  params = models.init_params(cfg, jax.random.key(0), std=0.5)
  h = jax.random.normal(jax.random.key(1), (3, 11, cfg.d_model))
  targets = jax.random.randint(jax.random.key(2), (3, 11), 0, cfg.vocab_size)
  wl, we = jax.random.normal(jax.random.key(3), (2, 3, 11))

  def ours(p, h):
    # chunk 4 over 11 positions: chunks are padded; 8 tokens per chunk at most.
    lp, ent = decoder.token_logprobs(p, h, targets, cfg=cfg, temperature=temperature,
                                     chunk=4, with_entropy=True, max_chunk_tokens=8)
    return jnp.sum(lp * wl) + jnp.sum(ent * we), (lp, ent)

  def ref(p, h):
    lp, ent = _reference(p, h, targets, cfg, temperature)
    return jnp.sum(lp * wl) + jnp.sum(ent * we), (lp, ent)

  (_, got), g_got = jax.value_and_grad(ours, argnums=(0, 1), has_aux=True)(params, h)
  (_, want), g_want = jax.value_and_grad(ref, argnums=(0, 1), has_aux=True)(params, h)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
  # Entropy as lse - E_p[z] (a difference of two terms of a few units): float32 rounding.
  np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-4)
  moved = 0
  for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    moved += float(jnp.abs(b).max()) > 0
  assert moved >= 2  # the hidden states and the output embedding both get gradients
  # Without entropies: log-probs only, same values and log-prob gradients.
  lp = decoder.token_logprobs(params, h, targets, cfg=cfg, temperature=temperature, chunk=4)
  np.testing.assert_allclose(lp, want[0], rtol=1e-5, atol=1e-5)
  gh = jax.grad(lambda h: jnp.sum(decoder.token_logprobs(params, h, targets, cfg=cfg,
                                                         temperature=temperature) * wl))(h)
  gh_ref = jax.grad(lambda h: jnp.sum(_reference(params, h, targets, cfg, temperature)[0]
                                      * wl))(h)
  np.testing.assert_allclose(gh, gh_ref, rtol=1e-4, atol=1e-5)
