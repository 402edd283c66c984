"""One check for token ids that come from a caller, an env or a tokenizer.

NumPy casts a bool among ints to 0 or 1, `int()` cuts a float to another id, and a string is
iterated character by character: each turns a caller's mistake into a token nobody chose, which
the model then decodes from or trains on. Every entry point that takes token ids (the engine,
stop sequences, the trajectory ledger, the rollout driver, the tokenizer's decoders, the
JetStream adapter) checks them here, so they refuse the same things with the same error.
"""

from __future__ import annotations

import numbers

import numpy as np


class TokenIdError(TypeError, ValueError):
  """Token ids that are not integers (a bool, a float, a string, a nested sequence).

  Both a TypeError and a ValueError: callers that catch either one see it.
  """


def is_int(x) -> bool:
  """A Python or NumPy integer, not a bool."""
  return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _a(x) -> str:
  """'a bool', 'an int', 'an Array': the kind of `x` with its article."""
  name = type(x).__name__
  return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def scalar_int(x) -> int | None:
  """`x` as an int if it is one (a 0-d integer array, e.g. a JAX scalar, counts), else None."""
  if is_int(x):
    return int(x)
  if getattr(x, "ndim", None) == 0 and np.issubdtype(np.asarray(x).dtype, np.integer):
    return int(x)
  return None


def token_id(x, what: str, vocab_size: int | None = None) -> int:
  """One token id as an int; a bool, a float or anything else raises `TokenIdError`."""
  v = scalar_int(x)
  if v is None:
    raise TokenIdError(f"{what} must be an integer token id, got {_a(x)} ({x!r:.80})")
  _check_range([v], what, vocab_size)
  return v


def token_ids(ids, what: str, vocab_size: int | None = None) -> list[int]:
  """`ids` (a sequence of ints, or a 1-D integer array, NumPy or JAX) as a list of ints.

  Anything else raises `TokenIdError` naming `what` and the first bad entry; with `vocab_size`,
  an id outside [0, vocab_size) is a ValueError.
  """
  if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
    raise TokenIdError(f"{what} must be a sequence of token ids, got {_a(ids)} "
                       f"({ids!r:.80})")
  if hasattr(ids, "dtype") and hasattr(ids, "ndim"):  # an array: its dtype says it all
    a = np.asarray(ids)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
      raise TokenIdError(f"{what} must be a flat sequence of integer token ids, got {a.dtype} "
                         f"of shape {a.shape}")
    out = a.tolist()
  else:
    out = list(ids)
    if all(type(t) is int for t in out):  # the common case, fast (a bool's type is bool)
      _check_range(out, what, vocab_size)
      return out
    ids, out = out, []
    for j, t in enumerate(ids):
      v = scalar_int(t)
      if v is None:
        shown = t.item() if isinstance(t, np.generic) else t  # False, not np.False_
        raise TokenIdError(f"{what} has {_a(t)} ({shown!r:.80}) at position {j} among "
                           "its token ids; token ids must be integers")
      out.append(v)
  _check_range(out, what, vocab_size)
  return out


def _check_range(ids: list[int], what: str, vocab_size: int | None) -> None:
  if vocab_size is None or not ids:
    return
  lo, hi = min(ids), max(ids)
  if lo < 0 or hi >= vocab_size:
    raise ValueError(f"{what} has token id {lo if lo < 0 else hi} outside the model's "
                     f"vocabulary [0, {vocab_size})")
