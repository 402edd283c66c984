"""The one token-id check behind the engine, stop sequences, the ledger, rollouts and decoding."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent._token_ids import TokenIdError, token_id, token_ids


def test_integers_in_every_form_pass_as_python_ints():
  for ids in ([1, 2], (1, 2), np.array([1, 2], np.int64), jnp.array([1, 2]),
              [np.int32(1), jnp.int32(2)], range(1, 3), (i for i in (1, 2))):
    out = token_ids(ids, "x")
    assert out == [1, 2] and all(type(i) is int for i in out)
  assert token_ids([], "x", vocab_size=4) == []
  assert token_id(np.int64(3), "x") == 3 and type(token_id(jnp.int32(3), "x")) is int


@pytest.mark.parametrize("ids,match", [
    ([1, True], r"x has a bool \(True\) at position 1 among its token ids"),
    ([np.bool_(False)], r"x has a bool \(False\) at position 0"),
    ([1, 2.0], r"x has a float \(2.0\) at position 1"),
    ([jnp.float32(2.0)], "x has an Array"),
    (["7"], r"x has a str \('7'\) at position 0"),
    ([[1, 2]], r"x has a list \(\[1, 2\]\) at position 0"),
    (np.array([True]), "x must be a flat sequence of integer token ids, got bool of shape"),
    (jnp.array([1.0, 2.5]), "got float32 of shape"),
    (np.zeros((2, 2), np.int32), r"got int32 of shape \(2, 2\)"),
    ("12", "x must be a sequence of token ids, got a str"),
    (7, "x must be a sequence of token ids, got an int"),
])
def test_anything_else_is_one_error_that_is_both_a_type_and_a_value_error(ids, match):
  # NumPy made True token 1, int() cut 2.0 and read "7" as token 7: tokens nobody chose.
  for kind in (TokenIdError, TypeError, ValueError):
    with pytest.raises(kind, match=match):
      token_ids(ids, "x")


def test_the_vocabulary_range_is_checked_when_given():
  with pytest.raises(ValueError, match=r"x has token id 4 outside the model's vocabulary \[0, 4\)"):
    token_ids([0, 4], "x", vocab_size=4)
  with pytest.raises(ValueError, match="x has token id -1 outside"):
    token_id(-1, "x", vocab_size=4)
  with pytest.raises(TypeError, match=r"x must be an integer token id, got a bool \(True\)"):
    token_id(True, "x")
