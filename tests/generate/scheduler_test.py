"""The scheduler's host-side logic: input checks before any work, stop reasons, slot reuse.

(The engine-level tests of `generate` and `run_requests` are in engine_test.py.)
"""
import jax
import numpy as np
import pytest

from jaxagent import models
from jaxagent.generate import Engine, EngineConfig, generate, run_requests

CFG = models.get_config("tiny-qwen2")


@pytest.fixture(scope="module")
def params():
  return models.init_params(CFG, jax.random.key(0), std=0.2)


@pytest.fixture(scope="module")
def engine():
  return Engine(CFG, EngineConfig(slots=1, max_len=32))


@pytest.mark.parametrize("bad,match", [
    ([[1, 2], [3, 4], [5, CFG.vocab_size]], rf"prompt 2 has token id {CFG.vocab_size} outside"),
    ([[1, 2], [3, 4], []], "prompt 2 is empty"),
    ([[1, 2], [3, 4], [5, 1.5]], "prompt 2 must be a flat sequence of integer token ids"),
])
def test_a_bad_prompt_in_the_queue_is_refused_before_anything_runs(params, engine, monkeypatch,
                                                                   bad, match):
  """With one slot, prompts 0 and 1 would be generated before prompt 2 is prefilled: its error
  must come first, and name its index among all prompts (not within its prefill batch)."""
  calls = []
  real = engine.prefill_insert
  monkeypatch.setattr(engine, "prefill_insert", lambda *a, **k: calls.append(1) or real(*a, **k))
  with pytest.raises(ValueError, match=match):
    run_requests(engine, params, bad, max_new_tokens=4, request_ids=[0, 1, 2])
  assert calls == []


def test_bad_request_ids_and_seed_are_refused_before_anything_runs(params, engine, monkeypatch):
  calls = []
  real = engine.prefill_insert
  monkeypatch.setattr(engine, "prefill_insert", lambda *a, **k: calls.append(1) or real(*a, **k))
  with pytest.raises(ValueError, match=r"request_ids must be integers in \[.*got \[2147483648\]"):
    run_requests(engine, params, [[1], [2], [3]], max_new_tokens=2, request_ids=[0, 1, 2 ** 31])
  for seed in (-1, 2 ** 32):
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*32\)"):
      run_requests(engine, params, [[1], [2]], max_new_tokens=2, request_ids=[0, 1], seed=seed)
  assert calls == []


def test_numpy_and_jax_array_prompts(params):
  """A `[B, T]` array is B prompts, a `[T]` array one prompt, as the same nested lists are."""
  batch = np.asarray([[1, 2, 3], [4, 5, 6]])
  want = [c.tokens for c in generate(params, CFG, batch.tolist(), 3)]
  assert [c.tokens for c in generate(params, CFG, batch, 3)] == want
  assert [c.tokens for c in generate(params, CFG, jax.numpy.asarray(batch), 3)] == want
  assert generate(params, CFG, batch[1], 3)[0].tokens == want[1]
