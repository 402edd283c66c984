"""Decoder pieces that have no model-level test elsewhere."""
import jax.numpy as jnp
import numpy as np

from jaxagent.models import decoder


def test_segment_runs_offsets_and_lengths():
  """The packed cuDNN path's segment table: every run of equal id (padding included) with its
  start and length, -1 after the last, and the run count that sends a row to the dense path."""
  rng = np.random.default_rng(0)
  rows = []
  for _ in range(20):
    lens = rng.integers(1, 9, rng.integers(1, 7))
    ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lens)])[:24]
    rows.append(np.pad(ids, (0, 24 - len(ids))))  # trailing padding (id 0) is a run too
  seg = np.stack(rows).astype(np.int32)
  m = 5
  offs, lens, runs = decoder.segment_runs(jnp.asarray(seg), m)
  offs, lens = np.asarray(offs), np.asarray(lens)
  assert offs.shape == (20, m + 1) and lens.shape == (20, m)
  want_max = 0
  for r, row in enumerate(seg):
    starts = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1]]
    sizes = [b - a for a, b in zip(starts, starts[1:] + [len(row)])]
    want_max = max(want_max, len(starts))
    if len(starts) <= m:
      np.testing.assert_array_equal(offs[r], starts + [-1] * (m + 1 - len(starts)))
      np.testing.assert_array_equal(lens[r], sizes + [-1] * (m - len(sizes)))
  assert int(runs) == want_max and want_max > m  # some rows exceed m: the dense fallback
