"""On a GPU: Gemma 3 (head size 256, sliding window) on the paths a GPU picks for it.

"auto" gives Gemma's training attention to cuDNN (the window in its dense mask, the
query_pre_attn_scalar scale) and its decoding to the XLA path with merged weights (the Pallas
decode kernels know neither the window nor Gemma's norms). Two-layer cuts of gemma3-1b, one
windowed layer and one global. Deselected by default (`gpu` marker); on a GPU machine:

    JAX_PLATFORMS=cuda XLA_FLAGS=--xla_gpu_autotune_level=0 python -m pytest -m gpu \
        tests/gpu/gemma_gpu_test.py -n 0
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent import models
from jaxagent.generate import Engine, EngineConfig, SamplingConfig
from jaxagent.generate.scheduler import run_requests
from jaxagent.models import decoder, param_tree

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, scope="module")
def _on_a_gpu():
  if jax.default_backend() != "gpu":
    pytest.fail("tests/gpu needs a GPU backend (see this module's docstring)", pytrace=False)


def _cut(dtype, window=64, vocab=4096):
  cfg = models.get_config("gemma3-1b", dtype=dtype, param_dtype=dtype).replace(
      n_layers=2, sliding_window=window, sliding_layers=(0,), vocab_size=vocab,
      eos_token_id=None, extra_eos_token_ids=())
  p = param_tree.unbox(jax.jit(lambda k: models.init_params(cfg, k, std=0.05))(
      jax.random.key(0)))
  keys = iter(jax.random.split(jax.random.key(1), 16))
  layers = {k: (v + (0.3 * jax.random.normal(next(keys), v.shape)).astype(v.dtype)
                if "norm" in k else v) for k, v in p["layers"].items()}
  return cfg, dict(p, layers=layers)


def test_cudnn_training_attention_with_the_window_equals_xla():
  cfg, p = _cut("bfloat16")
  assert decoder.attention_path(cfg, "gpu") == "cudnn"
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 256)))
  seg = jnp.asarray(np.repeat(np.array([[1] * 150 + [2] * 90 + [0] * 16]), 2, 0))
  fwd = jax.jit(lambda p, c: models.forward(p, tokens, cfg=c, segment_ids=seg),
                static_argnums=1)
  cudnn = np.asarray(fwd(p, cfg), np.float32)
  xla = np.asarray(fwd(p, cfg.replace(attention_impl="xla")), np.float32)
  unwindowed = np.asarray(fwd(p, cfg.replace(attention_impl="xla", sliding_window=None,
                                             sliding_layers=())), np.float32)
  live = np.asarray(seg) > 0
  gap = np.abs(cudnn - xla)[live].max()
  without = np.abs(unwindowed - xla)[live].max()
  print(f"gemma3 bf16 logits: cudnn vs xla max |gap| {gap:.3g}; without the window {without:.3g}")
  assert gap < 0.25 * without


def test_engine_on_a_gpu_decodes_gemma_greedily_as_the_forward():
  with jax.default_matmul_precision("highest"):
    cfg, p = _cut("float32", window=16)
    eng = Engine(cfg, EngineConfig(slots=4, max_len=128, sampling=SamplingConfig()))
    assert eng._attn == "xla" and not eng.writes_first and not eng.fold_norms
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 23, 40)]
    out = run_requests(eng, eng.prepare(p), prompts, max_new_tokens=24,
                       request_ids=[0, 1, 2], seed=0, decode_steps=8)
    for pr, o in zip(prompts, out):
      logits = models.forward(p, jnp.asarray([pr + o.tokens]), cfg=cfg.replace(
          attention_impl="xla"))[0]
      assert np.asarray(jnp.argmax(logits[len(pr) - 1:-1], -1)).tolist() == o.tokens
