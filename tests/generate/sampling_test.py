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
  n = 30_000  # the bound below is 5 sigma at any n
  tok, lp = _draws(probs, n)
  assert set(np.unique(tok)) <= set(support)
  freq = np.bincount(tok, minlength=v) / n
  sigma = np.sqrt(probs * (1 - probs) / n)
  assert np.all(np.abs(freq - probs) <= 5 * sigma + 1e-9), (freq[support], probs[support])
  np.testing.assert_allclose(lp, np.log(probs[tok]), atol=1e-5)


def test_truncation_is_respected():
  probs = np.array([0.4, 0.3, 0.2, 0.1] + [0.0] * 1020)
  n = 6000  # draws cost their count x the vocabulary on a CPU: 20,000 took 15 s on 2 cores
  tok, lp = _draws(probs, n, SamplingConfig(1.0, top_k=2))
  assert set(np.unique(tok)) == {0, 1}
  assert abs(np.mean(tok == 0) - 4 / 7) < 4 * np.sqrt(4 / 7 * 3 / 7 / n)
  # Reported log-probs are of the full distribution (before truncation).
  np.testing.assert_allclose(lp, np.log(probs[tok]), atol=1e-5)
  tok, _ = _draws(probs, n, SamplingConfig(1.0, top_p=0.75))
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


def test_sample_names_a_wrong_config_or_shape():
  logits = jnp.zeros((3, 16))
  keys = jax.random.split(jax.random.key(0), 3)
  with pytest.raises(TypeError, match=r"sample: cfg must be a SamplingConfig, got float \(1.0\)"):
    sample(logits, keys, 1.0)
  for lg, ks, shown in ((logits[0], keys[0], r"\(16,\) and keys of shape \(\)"),
                        (logits, keys[:2], r"\(3, 16\) and keys of shape \(2,\)")):
    with pytest.raises(ValueError, match=rf"sample: logits of shape {shown}: logits must be \[S, V\]"):
      sample(lg, ks, SamplingConfig(1.0))


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


# ---------------------------------------------------------------- exact-distribution audit
# Fixed logits over a vocabulary of 192 (three draw blocks of 64): a designed head at spread-out
# ids, with ties at the top-k and top-p boundaries of the configs below, a finite tail and
# -inf entries. Every id not listed has probability 1e-4 (before temperature).
_V = 192
_HEAD = {7: 0.30, 70: 0.20, 130: 0.12, 131: 0.12, 64: 0.08, 191: 0.06, 0: 0.05, 100: 0.04}
_NEG_INF = (3, 65, 150)


def _audit_logits():
  x = np.full(_V, np.log(1e-4))
  for i, p in _HEAD.items():
    x[i] = np.log(p)
  x[list(_NEG_INF)] = -np.inf
  return x.astype(np.float32)


def _exact(logits, t, top_k=0, top_p=1.0):
  """NumPy float64 reference of the module docstring's rules: the distribution drawn from, and
  log_softmax(logits / t) over the full vocabulary."""
  z = logits.astype(np.float64) / t
  full = z - np.max(z) - np.log(np.sum(np.exp(z - np.max(z))))
  keep = z > -np.inf
  if 0 < top_k < len(z):
    keep &= z >= np.sort(z)[::-1][top_k - 1]  # ties with the k-th largest kept
  p = np.where(keep, np.exp(z - np.max(z)), 0.0)
  p /= p.sum()
  if top_p < 1.0:
    # The smallest set of the most likely tokens whose mass reaches top_p, with every token
    # tied with its least likely member.
    mass, cut = 0.0, None
    for v in np.unique(z[keep])[::-1]:
      mass += p[z == v].sum()
      cut = v
      if mass >= top_p:
        break
    p = np.where(z >= cut, p, 0.0)
    p /= p.sum()
  return p, full


def _bernstein(n, q, delta):
  """Half-width t with P(|count - n q| >= t) <= delta for a Binomial(n, q) count (Bernstein's
  inequality: 2 exp(-t^2 / (2 (n q (1 - q) + t / 3))))."""
  l = np.log(2 / delta)
  return l / 3 + np.sqrt((l / 3) ** 2 + 2 * n * q * (1 - q) * l)


@pytest.mark.parametrize("t,top_k,top_p", [
    (0.5, 0, 1.0),
    (1.0, 3, 1.0),     # the 3rd largest ties with the 4th: 4 kept
    (1.0, 0, 0.45),    # 0.30 + 0.20 crosses 0.45: the crossing token kept, the next one not
    (1.0, 0, 0.55),    # the crossing token (0.12) ties with the next: both kept
    (0.5, 0, 0.75),    # sharper first: 0.75 is reached by the two most likely
    (1.5, 5, 0.7),     # top-p over what top-k left
    (1000.0, 0, 1.0),  # near-uniform over the finite entries, -inf still excluded
    (1.0, 500, 0.99),  # top_k >= V keeps all
])
def test_draws_match_the_exact_truncated_distribution(t, top_k, top_p):
  """Counts of 20,000 draws from fixed logits against the exact distribution of the module
  docstring (temperature first, then top-k, then top-p on what top-k left, ties at a boundary
  kept): a token of probability 0 is never drawn, every other count lies within Bernstein's
  bound at delta 1e-10 (false failure under 2e-7 over all cases), and the reported log-prob is
  log_softmax(logits / t) of the full vocabulary, which the learner computes."""
  logits = _audit_logits()
  q, full = _exact(logits, t, top_k, top_p)
  n = 20_000
  tok, lp = _draws_from_logits(logits, n, SamplingConfig(t, top_p=top_p, top_k=top_k), seed=7)
  counts = np.bincount(tok, minlength=_V)
  assert counts[q == 0].sum() == 0, np.nonzero(counts * (q == 0))
  bound = _bernstein(n, q, 1e-10)
  off = np.abs(counts - n * q) > bound
  assert not off.any(), (np.nonzero(off), counts[off], (n * q)[off], bound[off])
  np.testing.assert_allclose(lp, full[tok], rtol=0, atol=2e-5 * max(1.0, 1 / t))


def _draws_from_logits(logits, n, cfg, seed=0):
  rows = jnp.asarray(logits)[None].repeat(n, 0)
  keys = token_keys(jnp.full((n,), seed, jnp.uint32), jnp.arange(n), jnp.full((n,), 11))
  tok, lp = jax.jit(lambda l, k: sample(l, k, cfg))(rows, keys)
  return np.asarray(tok), np.asarray(lp)


def test_token_keys_are_distinct_over_seeds_requests_and_positions():
  """Every (seed, request id, position) of a grid gets its own key, swapped request id and
  position included (a key that combined them, rid + pos or rid ^ pos, or left one out, would
  repeat)."""
  s, r, p = np.meshgrid(np.array([0, 1, 2, 2**32 - 1], np.uint32), np.arange(-2, 30),
                        np.arange(32), indexing="ij")
  keys = token_keys(jnp.asarray(s.ravel()), jnp.asarray(r.ravel(), jnp.int32),
                    jnp.asarray(p.ravel(), jnp.int32))
  data = np.asarray(jax.random.key_data(keys)).reshape(s.size, -1)
  assert len(np.unique(data, axis=0)) == s.size


def test_streams_of_positions_requests_and_seeds_are_independent():
  """Tokens drawn uniformly from 16 ids at neighbouring positions of a request, at one position
  of neighbouring request ids, and of neighbouring seeds: each table of 16 x 16 pair counts
  (disjoint pairs) lies within Bernstein's bound of n / 256 per cell at delta 1e-10 (false
  failure under 1e-7). A repeated or shared key would put n / 16 in the diagonal cells."""
  seeds, rids, pos = np.meshgrid(np.array([5, 6], np.uint32), np.arange(500),
                                 np.arange(100, 120), indexing="ij")
  n_all = seeds.size
  keys = token_keys(jnp.asarray(seeds.ravel()), jnp.asarray(rids.ravel(), jnp.int32),
                    jnp.asarray(pos.ravel(), jnp.int32))
  tok, _ = jax.jit(lambda k: sample(jnp.zeros((n_all, 16)), k, SamplingConfig(1.0)))(keys)
  tok = np.asarray(tok).reshape(seeds.shape)
  pairs = {"positions": (tok[:, :, 0::2], tok[:, :, 1::2]),
           "request ids": (tok[:, 0::2], tok[:, 1::2]),
           "seeds": (tok[0], tok[1])}
  for what, (a, b) in pairs.items():
    n = a.size
    counts = np.bincount((a * 16 + b).ravel(), minlength=256)
    bound = _bernstein(n, 1 / 256, 1e-10)
    assert np.all(np.abs(counts - n / 256) <= bound), (what, counts.reshape(16, 16), bound)


def test_a_row_samples_the_same_in_any_batch_and_beside_nonfinite_rows():
  """A row's token and log-prob depend only on its logits and key: the same in a batch of 64,
  alone in another order, and next to rows of NaN, +inf and all -inf logits."""
  rng = np.random.default_rng(3)
  v = 300
  logits = jnp.asarray(rng.normal(0, 3, (64, v)), jnp.float32)
  keys = token_keys(jnp.full((64,), 9, jnp.uint32), jnp.arange(64) * 7, jnp.arange(64) + 40)
  cfg = SamplingConfig(0.8, top_p=0.9, top_k=40)
  run = jax.jit(sample, static_argnames="cfg")
  tok, lp = run(logits, keys, cfg)
  pick = np.array([17, 3, 60, 0, 41])
  bad = jnp.stack([jnp.full(v, jnp.nan), jnp.full(v, -jnp.inf), logits[0].at[5].set(jnp.inf)])
  rows = jnp.concatenate([bad[:2], logits[pick], bad[2:]])
  rkeys = jax.random.wrap_key_data(jnp.concatenate(
      [jax.random.key_data(keys)[:2], jax.random.key_data(keys)[pick],
       jax.random.key_data(keys)[:1]]))
  tok2, lp2 = run(rows, rkeys, cfg)
  assert np.asarray(tok2)[2:7].tolist() == np.asarray(tok)[pick].tolist()
  np.testing.assert_allclose(np.asarray(lp2)[2:7], np.asarray(lp)[pick], rtol=0, atol=1e-6)
  assert not np.isfinite(np.asarray(lp2)[[0, 1, 7]]).any()
