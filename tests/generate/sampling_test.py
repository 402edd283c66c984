"""The sampler's draws: the right distribution, truncation respected, zero-mass entries never."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.generate.sampling import SamplingConfig, _first_above, sample, token_keys


def _draws(probs, n, cfg=SamplingConfig(1.0), seed=0):
  logits = jnp.log(jnp.asarray(probs, jnp.float32) + 1e-38)[None].repeat(n, 0)
  keys = token_keys(jnp.full((n,), seed, jnp.uint32), jnp.arange(n), jnp.full((n,), 5))
  tok, lp = jax.jit(lambda l, k: sample(l, k, cfg))(logits, keys)
  return np.asarray(tok), np.asarray(lp)


@pytest.mark.parametrize("v", [2048, 1000])  # blocks of 1024; padded blocks of 256
def test_draws_follow_the_distribution(v):
  rng = np.random.default_rng(0)
  probs = np.zeros(v)
  support = rng.choice(v, 12, replace=False)  # spread over several blocks
  probs[support] = rng.dirichlet(np.ones(12))
  probs[support[0]] = 0.002  # a small mass: still drawn at its rate
  probs /= probs.sum()
  n = 60_000
  tok, lp = _draws(probs, n)
  assert set(np.unique(tok)) <= set(support)
  freq = np.bincount(tok, minlength=v) / n
  sigma = np.sqrt(probs * (1 - probs) / n)
  assert np.all(np.abs(freq - probs) <= 5 * sigma + 1e-9), (freq[support], probs[support])
  np.testing.assert_allclose(lp, np.log(probs[tok]), atol=1e-5)


def test_truncation_is_respected():
  probs = np.array([0.4, 0.3, 0.2, 0.1] + [0.0] * 1020)
  tok, lp = _draws(probs, 20_000, SamplingConfig(1.0, top_k=2))
  assert set(np.unique(tok)) == {0, 1}
  assert abs(np.mean(tok == 0) - 4 / 7) < 0.02
  # Reported log-probs are of the full distribution (before truncation).
  np.testing.assert_allclose(lp, np.log(probs[tok]), atol=1e-5)
  tok, _ = _draws(probs, 20_000, SamplingConfig(1.0, top_p=0.75))
  assert set(np.unique(tok)) == {0, 1, 2}


def test_rounding_at_the_end_picks_a_positive_entry():
  # r at (or rounded past) the total mass: the last entry of positive weight, never a
  # zero-weight tail entry.
  w = jnp.array([[0.5, 0.5, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 2.0]])
  cum = jnp.cumsum(w, -1)
  got = _first_above(cum, w, cum[:, -1])
  assert np.asarray(got).tolist() == [1, 1, 3]
  got = _first_above(cum, w, jnp.array([0.0, 0.0, 0.999]))
  assert np.asarray(got).tolist() == [0, 1, 0]
  got = _first_above(cum, w, jnp.array([0.5, 0.7, 1.5]))
  assert np.asarray(got).tolist() == [1, 1, 3]


def test_same_key_same_token_and_keys_differ():
  probs = np.full(4096, 1 / 4096)
  a, _ = _draws(probs, 256, seed=3)
  b, _ = _draws(probs, 256, seed=3)
  c, _ = _draws(probs, 256, seed=4)
  assert (a == b).all() and (a != c).mean() > 0.9
  assert len(np.unique(a)) > 200  # 256 draws from 4096 equally likely tokens


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(temperature=float("inf")), "temperature must be >= 0 and finite"),
    (dict(temperature="1"), "temperature must be a number"),
    (dict(temperature=True), "temperature must be a number"),
    (dict(temperature=1e-39), "below 1e-06.*use temperature=0"),
    (dict(temperature=5e-7), "below 1e-06"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=float("nan")), "top_p must be a number"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(top_k=2.5), "top_k must be an int"),
])
def test_bad_sampling_config_is_a_clear_error(kw, match):
  with pytest.raises(ValueError, match=match):
    SamplingConfig(**kw)


def test_sampling_config_takes_numpy_scalars():
  cfg = SamplingConfig(np.float32(0.7), np.float64(0.9), np.int64(5))
  assert not cfg.greedy and cfg.top_k == 5


@pytest.mark.parametrize("v", [1000, 3])  # vocabularies the draw pads to whole blocks
@pytest.mark.parametrize("cfg", [SamplingConfig(1.0), SamplingConfig(0.7, top_p=0.9, top_k=2),
                                 SamplingConfig(1e-6)])
def test_a_nonfinite_row_still_samples_a_token_in_the_vocabulary(v, cfg):
  """Rows whose logits hold a NaN or +inf, or are all -inf, get a non-finite log-prob (the engine's "nonfinite" stop),
  but a token id inside [0, v): it is recorded, and one past the vocabulary (the draw's padding,
  id 1023 or 255) broke whatever read it next."""
  logits = jnp.array([[jnp.nan] * v, [-jnp.inf] * v, [1.0] * (v - 1) + [jnp.inf],
                      [5.0] + [1.0] * (v - 1)], jnp.float32)
  keys = token_keys(jnp.zeros(4, jnp.uint32), jnp.arange(4), jnp.zeros(4))
  tok, lp = sample(logits, keys, cfg)
  tok, lp = np.asarray(tok), np.asarray(lp)
  assert ((tok >= 0) & (tok < v)).all(), tok
  assert not np.isfinite(lp[:3]).any()
  if cfg.temperature >= 0.5:
    assert np.isfinite(lp[3])


def test_documented_tie_rules():
  """Greedy takes the lowest id among tied maxima; top-k and top-p keep every token tied with
  the boundary one (module docstring), and the draw is uniform over tied tokens."""
  logits = np.log(np.array([0.1, 0.3, 0.3, 0.3]))
  keys = token_keys(jnp.zeros(1, jnp.uint32), jnp.zeros(1), jnp.zeros(1))
  tok, _ = sample(jnp.asarray(logits, jnp.float32)[None], keys, SamplingConfig(0.0))
  assert int(tok[0]) == 1
  n = 6000
  for cfg in (SamplingConfig(1.0, top_k=1), SamplingConfig(1.0, top_k=2),
              SamplingConfig(1.0, top_p=1e-6), SamplingConfig(1.0, top_p=0.5)):
    tok, lp = _draws(np.exp(logits), n, cfg)
    freq = np.bincount(tok, minlength=4) / n
    assert freq[0] == 0 and np.all(np.abs(freq[1:] - 1 / 3) < 0.03), (cfg, freq)
    np.testing.assert_allclose(lp, np.log(0.3), atol=1e-5)
  tok, _ = _draws(np.exp(logits), n, SamplingConfig(1.0, top_p=0.95))
  assert np.bincount(tok, minlength=4)[0] > 0
