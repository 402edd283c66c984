"""Gemma 3 text models and sliding-window attention, against transformers' Gemma3ForCausalLM.

Tiny random models with several layers, a mix of windowed ("sliding_attention") and global
layers, a window shorter than the test sequences, GQA and non-zero (1 + w) norm weights: the
training forward (plain and packed rows), HF import and export, the decode engine (greedy
decode, sampler log-probs, append), LoRA, sharding and the refusals of the fast paths that do
not compute Gemma's attention.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxagent import models, sharding  # noqa: E402
from jaxagent.generate import (Engine, EngineConfig, SamplingConfig, generate,  # noqa: E402
                               run_requests)
from jaxagent.models import ModelConfig, decoder, lora, param_tree  # noqa: E402

TOL = 2e-5  # float32 logits, max abs difference to transformers'
WINDOW = 6
TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def make_hf_gemma(path=None, seed=0, **changes):
  """A random Gemma3ForCausalLM (norm weights random, not zero), saved to `path` if given."""
  torch.manual_seed(seed)
  kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, sliding_window=WINDOW, layer_types=TYPES,
            query_pre_attn_scalar=24, rope_theta=1e6, rope_local_base_freq=1e4,
            rope_scaling={"rope_type": "linear", "factor": 8.0}, rms_norm_eps=1e-6)
  kw.update(changes)
  model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**kw)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(torch.randn_like(p) * 0.5)
  if path is not None:
    model.save_pretrained(path, safe_serialization=True)
  return model


def torch_logits(model, tokens, position_ids=None):
  with torch.no_grad():
    kw = {} if position_ids is None else {"position_ids": torch.tensor(position_ids)}
    return model(torch.tensor(np.asarray(tokens)), **kw).logits.float().numpy()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("gemma")
  return path, make_hf_gemma(path)


@pytest.fixture(scope="module")
def loaded(hf_dir):
  return models.load(hf_dir[0])


# ---------------------------------------------------------------------------- config
def test_config_from_hf_reads_gemma3(loaded):
  cfg, _ = loaded
  assert cfg.architecture == "gemma3"
  assert (cfg.sliding_window, cfg.sliding_layers) == (WINDOW, (0, 1, 3))
  assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_linear_factor) == (1e6, 1e4, 8.0)
  assert cfg.attn_scale == 24 ** -0.5 and cfg.tie_embeddings and cfg.qk_norm
  assert ModelConfig.from_hf(cfg.to_hf()) == cfg.replace(name="hf")


def test_both_spellings_of_the_rope_settings_load_alike(hf_dir):
  saved = json.loads((hf_dir[0] / "config.json").read_text())
  assert "rope_parameters" in saved  # transformers 5 writes them per layer type
  ours = models.get_config("gemma3-1b").replace(rope_linear_factor=8.0)
  released = ours.to_hf()  # the released checkpoints' top-level spelling
  assert "rope_local_base_freq" in released and "rope_parameters" not in released
  new = {k: v for k, v in released.items()
         if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")}
  new["rope_parameters"] = {
      "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
  assert ModelConfig.from_hf(new) == ModelConfig.from_hf(released)
  # The older sliding_window_pattern (every 6th layer global) gives the preset's layers.
  old = {k: v for k, v in released.items() if k != "layer_types"}
  old["sliding_window_pattern"] = 6
  assert ModelConfig.from_hf(old).sliding_layers == ours.sliding_layers
  assert len(ours.sliding_layers) == 22 and 5 not in ours.sliding_layers


def test_the_1b_preset_has_google_gemma_3_1b_shapes():
  cfg = models.get_config("gemma3-1b")
  assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim,
          cfg.vocab_size, cfg.sliding_window) == (1152, 26, 4, 1, 256, 6912, 262144, 512)
  assert round(cfg.num_params() / 1e6) == 1000  # 999.9M, tied embeddings


# google/gemma-3-1b-it's config.json as released (transformers 4.50 spelling).
_GEMMA_3_1B_IT = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
    "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144}


def test_the_released_gemma_3_1b_it_config_loads_as_the_preset():
  cfg = ModelConfig.from_hf(_GEMMA_3_1B_IT)
  assert cfg == models.get_config("gemma3-1b").replace(name="hf")
  # transformers reads it alike: the same layer types.
  hf = transformers.Gemma3TextConfig(**{k: v for k, v in _GEMMA_3_1B_IT.items()
                                        if k not in ("architectures", "model_type")})
  assert [i for i, t in enumerate(hf.layer_types) if t == "sliding_attention"] == list(
      cfg.sliding_layers)


def test_windowed_layers_count_only_the_keys_they_see_in_the_flops():
  cfg = models.get_config("gemma3-1b")
  full = cfg.replace(sliding_window=None, sliding_layers=())
  assert cfg.flops_per_token(512) == full.flops_per_token(512)  # the window cuts nothing
  # At 4096 tokens a windowed layer's query sees about 480 keys on average, not 2048.
  per_key = 4 * cfg.n_heads * cfg.head_dim * 3  # QK and PV, forward and backward
  seen = (512 * 513 / 2 + (4096 - 512) * 512) / 4096
  saved = 22 * per_key * (4096 / 2 - seen)
  assert full.flops_per_token(4096) - cfg.flops_per_token(4096) == pytest.approx(saved)


@pytest.mark.parametrize("changes,match", [
    ({"final_logit_softcapping": 30.0}, "soft-capping .*not supported"),
    ({"attn_logit_softcapping": 50.0}, "soft-capping .*not supported"),
    ({"hidden_activation": "relu"}, "hidden_activation='relu' is not supported"),
    ({"sliding_window": 0}, r"sliding_window=0 must be a positive int"),
    ({"sliding_window": None}, r"sliding_window=None must be a positive int"),
    ({"layer_types": ["full_attention"]}, "must list one of"),
    ({"use_bidirectional_attention": True}, "bidirectional"),
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_scaling type"),
    ({"rope_local_base_freq": 0}, "must be a number > 0"),
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"},
     "vision-language"),
])
def test_bad_gemma_configs_are_refused_clearly(changes, match):
  hf = {**models.get_config("tiny-gemma3").to_hf(), **changes}
  with pytest.raises(ValueError, match=match):
    ModelConfig.from_hf(hf)


@pytest.mark.parametrize("changes,match", [
    (dict(sliding_window=0), "sliding_window must be None or a positive int"),
    (dict(sliding_window=-3), "sliding_window must be None or a positive int"),
    (dict(sliding_window=None), "set both"),
    (dict(sliding_layers=(0, 7)), r"sliding_layers must be a tuple of layer indices"),
    (dict(activation="relu"), "activation must be 'silu'"),
    (dict(norm_plus_one=False), "architecture 'gemma3' needs"),
    (dict(query_pre_attn_scalar=0.0), "query_pre_attn_scalar must be None or a finite"),
    (dict(local_rope_theta=float("nan")), "local_rope_theta must be None"),
    (dict(architecture="llama", qk_norm=False), "are Gemma 3 features"),
    (dict(rope_scaling=(8.0, 1.0, 4.0, 64)), "set at most one"),
])
def test_bad_model_configs_are_refused_clearly(changes, match):
  base = models.get_config("tiny-gemma3").replace(rope_linear_factor=8.0)
  with pytest.raises(ValueError, match=match):
    base.replace(**changes)


# ---------------------------------------------------------------------------- forward
def test_logits_match_transformers(hf_dir, loaded):
  cfg, params = loaded
  tokens = np.random.default_rng(0).integers(0, 256, (2, 40))  # the window cuts at 6
  ref = torch_logits(hf_dir[1], tokens)
  ours = np.asarray(models.forward(params, tokens, cfg=cfg))
  assert np.abs(ours - ref).max() <= TOL
  # The unrolled layer loop computes the same.
  unrolled = np.asarray(models.forward(params, tokens, cfg=cfg.replace(scan_layers=False)))
  assert np.abs(unrolled - ref).max() <= TOL
  # Without the window (every layer global), the logits would differ: the test can fail.
  full = cfg.replace(sliding_window=None, sliding_layers=())
  assert np.abs(np.asarray(models.forward(params, tokens, cfg=full)) - ref).max() > 1e-3


@pytest.mark.parametrize("changes", [
    # Untied head, no rope scaling, a window of 1 (each token sees only itself locally).
    dict(tie_word_embeddings=False, rope_scaling=None, sliding_window=1),
    # The older pattern spelling, query_pre_attn_scalar = head_dim, every layer windowed.
    dict(layer_types=None, sliding_window_pattern=5, num_hidden_layers=5,
         query_pre_attn_scalar=16),
])
def test_logits_match_transformers_other_configs(tmp_path, changes):
  model = make_hf_gemma(tmp_path, seed=3, **changes)
  cfg, params = models.load(tmp_path)
  tokens = np.random.default_rng(3).integers(0, 256, (1, 24))
  ours = np.asarray(models.forward(params, tokens, cfg=cfg))
  assert np.abs(ours - torch_logits(model, tokens)).max() <= TOL


def test_packed_logits_match_transformers_per_segment(hf_dir, loaded):
  cfg, params = loaded
  rng = np.random.default_rng(1)
  lens, L = [13, 20, 7], 48
  segs = [rng.integers(0, 256, n) for n in lens]
  tokens = np.zeros((1, L), np.int64)
  seg_ids = np.zeros((1, L), np.int32)
  off = 0
  for i, s in enumerate(segs):
    tokens[0, off:off + len(s)] = s
    seg_ids[0, off:off + len(s)] = i + 1
    off += len(s)
  ours = np.asarray(models.forward(params, tokens, cfg=cfg, segment_ids=seg_ids))[0]
  off = 0
  for s in segs:
    ref = torch_logits(hf_dir[1], s[None])[0]
    assert np.abs(ours[off:off + len(s)] - ref).max() <= TOL
    off += len(s)


def test_bfloat16_embedding_scale_is_rounded_as_transformers_does(loaded):
  cfg, params = loaded
  # sqrt(64) = 8 is exact; a width of 1152 (gemma-3-1b) gives 33.94, which bfloat16 holds as 34.
  wide = models.get_config("tiny-gemma3").replace(d_model=1152, param_dtype="bfloat16",
                                                  dtype="bfloat16")
  p = param_tree.unbox(models.init_params(wide, jax.random.key(0)))
  x = decoder.embed(p, jnp.asarray([[3]]), wide)[0, 0]
  ref = p["embed"][3] * jnp.asarray(34.0, jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(ref, np.float32))


def test_the_pallas_packed_attention_runs_gemma_windows(loaded):
  """attention_impl='pallas' (interpret mode here): the kernels take each scanned layer's
  window (a traced scalar) and Gemma's scale; values and gradients equal the XLA path's."""
  cfg, params = loaded
  rng = np.random.default_rng(8)
  tokens = jnp.asarray(rng.integers(0, 256, (2, 48)))
  seg = jnp.asarray(np.array([[1] * 20 + [2] * 28, [1] * 40 + [0] * 8], np.int32))

  def loss(p, c):
    return (models.forward(p, tokens, cfg=c, segment_ids=seg) ** 2).mean()

  xla = jax.value_and_grad(loss)(params, cfg.replace(attention_impl="xla"))
  pallas = jax.value_and_grad(loss)(params, cfg.replace(attention_impl="pallas"))
  np.testing.assert_allclose(float(pallas[0]), float(xla[0]), rtol=1e-5)
  for a, e in zip(jax.tree.leaves(pallas[1]), jax.tree.leaves(xla[1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e),
                               atol=1e-5 * float(jnp.abs(e).max()) + 1e-7)


# ---------------------------------------------------------------------------- HF I/O
def test_save_hf_loads_in_transformers_with_the_same_logits(loaded, tmp_path):
  cfg, params = loaded
  models.save_hf(tmp_path, cfg, params)
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  assert type(back).__name__ == "Gemma3ForCausalLM"
  tokens = np.random.default_rng(2).integers(0, 256, (2, 30))
  ours = np.asarray(models.forward(params, tokens, cfg=cfg))
  assert np.abs(torch_logits(back, tokens) - ours).max() <= TOL
  cfg2, params2 = models.load(tmp_path)
  assert cfg2 == cfg.replace(name=cfg2.name)
  np.testing.assert_array_equal(np.asarray(models.forward(params2, tokens, cfg=cfg2)), ours)


# ---------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def peaked(loaded):
  """The loaded model's config (no eos, so every request runs to its budget) with larger
  random weights (peaked, input-dependent next-token distributions) and random norms."""
  cfg = loaded[0].replace(eos_token_id=None)
  p = param_tree.unbox(models.init_params(cfg, jax.random.key(0), std=0.2))
  keys = iter(jax.random.split(jax.random.key(1), 16))
  layers = {k: (v + 0.3 * jax.random.normal(next(keys), v.shape) if "norm" in k else v)
            for k, v in p["layers"].items()}
  return cfg, dict(p, layers=layers)


def _prompts(n, seed=0, lo=3, hi=14):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, rng.integers(lo, hi)).tolist() for _ in range(n)]


def _assert_greedy(cfg, params, prompt, tokens):
  logits = models.forward(params, jnp.asarray([list(prompt) + list(tokens)]), cfg=cfg)[0]
  argmax = np.asarray(jnp.argmax(logits[len(prompt) - 1:-1], axis=-1))
  assert argmax.tolist() == list(tokens)


def test_greedy_decode_equals_argmax_of_the_full_forward(peaked):
  cfg, params = peaked
  prompts = _prompts(3)
  out = generate(params, cfg, prompts, 20, slots=2, max_len=64)  # past the window of 6
  for p, o in zip(prompts, out):
    assert len(o.tokens) == 20
    _assert_greedy(cfg, params, p, o.tokens)


@pytest.mark.parametrize("layout", ["stacked", "per_layer"])
def test_sampler_logprobs_match_the_training_forward(peaked, layout):
  cfg, params = peaked
  eng = Engine(cfg, EngineConfig(slots=4, max_len=64, sampling=SamplingConfig(1.0),
                                 cache_layout=layout))
  prompts = _prompts(4, seed=1)
  out = run_requests(eng, params, prompts, max_new_tokens=24, request_ids=list(range(4)),
                     seed=3, decode_steps=8)
  gaps = []
  for p, o in zip(prompts, out):
    logp = jax.nn.log_softmax(models.forward(params, jnp.asarray([p + o.tokens]), cfg=cfg)[0])
    ref = logp[len(p) - 1:-1][jnp.arange(len(o.tokens)), jnp.asarray(o.tokens)]
    gaps.append(np.abs(np.asarray(ref) - np.asarray(o.logprobs)))
  gap = float(np.mean(np.concatenate(gaps)))
  print(f"gemma3 sampler-vs-learner mean |logprob gap| (float32, {layout}): {gap:.2e}")
  assert gap <= 1e-4


@pytest.mark.parametrize("layout", ["stacked", "per_layer"])
def test_append_then_decode_equals_prefill_of_the_history(peaked, layout):
  cfg, params = peaked
  eng = Engine(cfg, EngineConfig(slots=3, max_len=96, sampling=SamplingConfig(),
                                 cache_layout=layout))
  prompt = _prompts(1, seed=2)[0]
  obs = [5, 17, 99, 3, 250, 7, 7, 11, 12]  # longer than the window
  state = eng.init_decode_state()
  state = eng.insert(eng.prefill(params, [_prompts(1, seed=9)[0]], [7]), state, 0)
  pre = eng.prefill(params, [prompt], [1])
  state = eng.insert(pre, state, 2)
  gen = [int(pre.tokens[0])]
  state, out = eng.generate(params, state, steps=5)
  gen += np.asarray(out.tokens[:, 2]).tolist()
  state, (tok, lp, _) = eng.append(params, state, [2], [obs], cached_lens=[len(prompt) + 5])
  after = [int(tok[0])]
  state, out = eng.generate(params, state, steps=8)
  after += np.asarray(out.tokens[:, 2]).tolist()

  history = prompt + gen + obs
  fresh = eng.insert(eng.prefill(params, [history], [1]), eng.init_decode_state(), 1)
  pre2 = eng.prefill(params, [history], [1])
  ref = [int(pre2.tokens[0])]
  fresh, out2 = eng.generate(params, fresh, steps=8)
  ref += np.asarray(out2.tokens[:, 1]).tolist()
  assert after == ref
  np.testing.assert_allclose(float(lp[0]), float(pre2.logprobs[0]), atol=1e-4)
  _assert_greedy(cfg, params, history, after)


def test_merged_decode_weights_decode_the_same(peaked):
  cfg, params = peaked
  eng = Engine(cfg, EngineConfig(slots=2, max_len=64, decode_merge_weights=True))
  assert not eng.fold_norms and not eng.chain_weights
  prompts = _prompts(2, seed=5)
  out = run_requests(eng, eng.prepare(params), prompts, max_new_tokens=12,
                     request_ids=[0, 1], seed=0, decode_steps=8)
  for p, o in zip(prompts, out):
    _assert_greedy(cfg, params, p, o.tokens)


# ---------------------------------------------------------------------------- fast paths
def test_fast_paths_refuse_gemma_or_are_not_taken(loaded):
  cfg, params = loaded
  for backend in ("gpu", "cpu", "tpu"):
    assert decoder.attention_path(cfg, backend) != "pallas"
    assert decoder.norm_rope_path(cfg, backend) == "xla"
  # On GPUs cuDNN (the window in its dense mask) in bfloat16; it refuses float32 inputs.
  assert decoder.attention_path(cfg.replace(dtype="bfloat16"), "gpu") == "cudnn"
  assert decoder.attention_path(cfg, "gpu") == "xla"
  # The Pallas packed-attention kernels take the window and the scale when asked.
  assert decoder.attention_path(cfg.replace(attention_impl="pallas"), "gpu") == "pallas"
  with pytest.raises(ValueError, match="norm_rope_impl='pallas' is for plain RMSNorm"):
    decoder.norm_rope_path(cfg.replace(norm_rope_impl="pallas"), "gpu")
  assert not decoder.decode_kernels_fit(cfg)
  assert Engine(cfg, EngineConfig(slots=2, max_len=32))._attn == "xla"
  with pytest.raises(ValueError, match="decode_attention='pallas'.*no sliding"):
    Engine(cfg, EngineConfig(slots=2, max_len=32, decode_attention="pallas"))
  with pytest.raises(ValueError, match="fold_norms=True folds plain RMSNorm"):
    param_tree.merge_decode_weights(params, cfg, fold_norms=True)
  p = param_tree.unbox(params)
  cache = tuple(jnp.zeros((1, cfg.n_kv_heads, 8, cfg.head_dim)) for _ in range(cfg.n_layers))
  with pytest.raises(ValueError, match="decode_in_place: the Pallas decode kernels"):
    decoder.decode_in_place(p, cache, cache, jnp.zeros((1,), jnp.int32),
                            jnp.zeros((1,), jnp.int32), cfg=cfg)
  with pytest.raises(ValueError, match="extend: the Pallas decode kernel"):
    decoder.extend(p, cache, cache, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32),
                   cfg=cfg, attn_impl="pallas")
  # Every existing model still takes them.
  qwen3 = models.get_config("tiny-qwen3")
  assert decoder.decode_kernels_fit(qwen3) and decoder.attention_path(qwen3, "gpu") == "pallas"


# ---------------------------------------------------------------------------- LoRA, sharding
def test_lora_targets_work_on_a_gemma_model(loaded):
  cfg, params = loaded
  lcfg = lora.LoraConfig(rank=4, alpha=8.0)
  fresh = lora.init_lora(cfg, lcfg, jax.random.key(1))
  keys = iter(jax.random.split(jax.random.key(2), 64))
  adapter = jax.tree.map(lambda x: 0.05 * jax.random.normal(next(keys), x.shape), fresh)
  merged = lora.merge(params, adapter, lcfg)
  tokens = np.random.default_rng(4).integers(0, 256, (1, 20))
  base = np.asarray(models.forward(params, tokens, cfg=cfg))
  out = np.asarray(models.forward(merged, tokens, cfg=cfg))
  assert np.abs(out - base).max() > 1e-3  # the adapter changes the function
  # The learner's per-layer adapter (`lora.LayerAdapter`), merged and unmerged, computes it.
  for fwd in ("merged", "unmerged"):
    layer_ad = lora.LayerAdapter(param_tree.unbox(adapter)["layers"],
                                 lora.LoraConfig(rank=4, alpha=8.0, forward=fwd), cfg.jnp_dtype)
    got = np.asarray(models.forward(dict(params, adapter=layer_ad), tokens, cfg=cfg))
    assert np.abs(got - out).max() <= 1e-5, fwd
  # ... and gradients reach every target through the Gemma layer.
  def loss(ad):
    return jnp.sum(models.forward(lora.merge(params, ad, lcfg), tokens, cfg=cfg)[0, -1] ** 2)
  grads = jax.grad(loss)(adapter)
  assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


def test_sharded_forward_equals_unsharded_with_gemma_norms_on_the_norm_axis(loaded):
  cfg, params = loaded
  axes = param_tree.logical_axes(params)["layers"]
  for name in ("post_attn_norm", "post_mlp_norm", "attn_norm", "mlp_norm"):
    assert tuple(axes[name]) == ("layers", "norm")
  mesh = sharding.make_mesh(2, 2, 2)
  sp = sharding.shard(params, mesh)
  assert models.unbox(sp)["layers"]["post_attn_norm"].sharding.spec == P(None, None)
  tokens = np.random.default_rng(5).integers(0, 256, (8, 24))
  seg = np.repeat(np.array([[1] * 10 + [2] * 11 + [0] * 3]), 8, 0)
  ref = models.forward(params, tokens, cfg=cfg, segment_ids=seg)
  bs = sharding.batch_sharding(mesh)
  fwd = jax.jit(lambda p, t, s: models.forward(p, t, cfg=cfg, segment_ids=s),
                in_shardings=(sharding.shardings(sp, mesh), bs, bs))
  out = fwd(sp, jax.device_put(jnp.asarray(tokens), bs), jax.device_put(jnp.asarray(seg), bs))
  assert len(out.sharding.device_set) == 8
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- other windows
def _windowed_hf(arch, path, seed=0):
  """A random windowed Mistral (every layer) or Qwen2 (layers 1 and 2 of 3) model."""
  torch.manual_seed(seed)
  common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-6, sliding_window=5, tie_word_embeddings=False)
  if arch == "mistral":
    model = transformers.MistralForCausalLM(transformers.MistralConfig(head_dim=16, **common))
  else:
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        use_sliding_window=True, max_window_layers=1,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"], **common))
  model.eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight") or name.endswith(".bias"):
        p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
  model.save_pretrained(path, safe_serialization=True)
  return model


@pytest.mark.parametrize("arch,layers", [("mistral", (0, 1, 2)), ("qwen2", (1, 2))])
def test_windowed_mistral_and_qwen2_match_transformers(arch, layers, tmp_path):
  model = _windowed_hf(arch, tmp_path / "hf")
  cfg, params = models.load(tmp_path / "hf")
  assert (cfg.sliding_window, cfg.sliding_layers) == (5, layers)
  tokens = np.random.default_rng(6).integers(0, 256, (2, 32))
  ref = torch_logits(model, tokens)
  ours = np.asarray(models.forward(params, tokens, cfg=cfg))
  assert np.abs(ours - ref).max() <= TOL
  # Exported, transformers loads the same windowed model.
  models.save_hf(tmp_path / "out", cfg, params)
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  assert np.abs(torch_logits(back, tokens) - ours).max() <= TOL
  # Greedy decode through the engine past the window equals the full forward's argmax.
  prompt = tokens[0, :9].tolist()
  out = generate(params, cfg.replace(eos_token_id=None), [prompt], 12, max_len=64)[0]
  _assert_greedy(cfg, params, prompt, out.tokens)


def test_a_llama_window_on_some_layers_has_no_hf_export():
  cfg = models.get_config("tiny-llama").replace(sliding_window=4, sliding_layers=(1,))
  with pytest.raises(ValueError, match="exports as Mistral, which windows every layer"):
    cfg.to_hf()
  every = cfg.replace(sliding_layers=(0, 1))
  assert every.to_hf()["architectures"] == ["MistralForCausalLM"]


# ---------------------------------------------------------------------------- trainer
def test_one_rl_step_of_a_gemma_model_through_the_trainer(tmp_path):
  """A tiny random Gemma 3 model saved as an HF directory trains through the trainer
  (`model.path=<HF dir>`): an RL step (rollouts on the engine, the update) and its eval."""
  from jaxagent.trainer import Trainer, load_model
  from tests.trainer_test import _tiny
  c = _tiny(tmp_path, **{"model.path": "tiny-gemma3", "eval.size": 1})
  cfg, params, tok = load_model(c.model)
  assert cfg.architecture == "gemma3"
  hf = tmp_path / "gemma"
  models.save_hf(hf, cfg, param_tree.unbox(params), tok)
  c = _tiny(tmp_path, **{"model.path": str(hf), "model.tokenizer": "", "eval.size": 1})
  t = Trainer(c)
  try:
    assert t.cfg.architecture == "gemma3" and t.cfg.sliding_window == 16
    summary = t.run()
  finally:
    t.close()
  assert "pass@1/after_rl" in summary
  rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  step = next(r for r in rows if r["step"] == 1 and "reward/mean" in r)
  assert all(np.isfinite(v) for v in step.values() if isinstance(v, float))


# ---------------------------------------------------------------------------- RoPE export
def test_linear_rope_scaling_of_a_llama_model_exports_and_loads(tmp_path):
  """`rope_linear_factor` outside Gemma: written as transformers' linear rope_scaling (it was
  left out of config.json, so transformers ran the model unscaled) and read back."""
  cfg = models.get_config("tiny-llama").replace(rope_linear_factor=4.0, vocab_size=256)
  params = models.init_params(cfg, jax.random.key(0), std=0.2)
  assert cfg.to_hf()["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
  models.save_hf(tmp_path, cfg, params)
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  tokens = np.random.default_rng(9).integers(0, 256, (1, 40))
  ours = np.asarray(models.forward(params, tokens, cfg=cfg))
  assert np.abs(torch_logits(back, tokens) - ours).max() <= TOL
  # Unscaled, the logits differ: the check can fail.
  plain = np.asarray(models.forward(params, tokens, cfg=cfg.replace(rope_linear_factor=None)))
  assert np.abs(plain - ours).max() > 1e-3
  cfg2, _ = models.load(tmp_path)
  assert cfg2.rope_linear_factor == 4.0


@pytest.mark.parametrize("cfg,match", [
    # A windowed Qwen2 whose windowed layers have a RoPE base of their own.
    (models.get_config("tiny-qwen2").replace(sliding_window=4, sliding_layers=(1,),
                                             local_rope_theta=1e4), "local_rope_theta"),
    (models.get_config("tiny-gemma3").replace(rope_scaling=(8.0, 1.0, 4.0, 64)),
     "llama3 RoPE scaling"),
    # transformers' Gemma3TextConfig takes a whole number: a float failed only at its load.
    (models.get_config("tiny-gemma3").replace(query_pre_attn_scalar=16.5),
     "query_pre_attn_scalar=16.5 has no HF equivalent"),
])
def test_rope_settings_without_an_hf_equivalent_are_refused_at_export(cfg, match):
  with pytest.raises(ValueError, match=match):
    cfg.to_hf()


def test_the_compute_copy_gives_bitwise_the_same_gemma_logits():
  """float32 params, bfloat16 compute: `param_tree.compute_copy` (the generator's and the
  update's weights) promises the logits of the float32 params bitwise. The embedding scale
  sqrt(72) = 8.485 is 8.5 in bfloat16: scaling the float32 table before the cast to bfloat16
  gave other embeddings than scaling the bfloat16 copy."""
  cfg = models.get_config("tiny-gemma3").replace(d_model=72, param_dtype="float32",
                                                 dtype="bfloat16")
  params = models.init_params(cfg, jax.random.key(0), std=0.2)
  tokens = np.random.default_rng(10).integers(0, cfg.vocab_size, (2, 24))
  ref = np.asarray(models.forward(params, tokens, cfg=cfg))
  got = np.asarray(models.forward(param_tree.compute_copy(params, cfg), tokens, cfg=cfg))
  np.testing.assert_array_equal(got, ref)
  # Both scale the bfloat16 embeddings by bfloat16 sqrt(d_model), as transformers' bfloat16
  # model does.
  p = param_tree.unbox(params)
  x = decoder.embed(p, jnp.asarray([[3]]), cfg)[0, 0]
  want = p["embed"][3].astype(jnp.bfloat16) * jnp.asarray(8.5, jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(want, np.float32))


def test_rope_parameters_not_keyed_by_layer_type_are_refused():
  """transformers 5 leaves a flat rope_parameters unread on a Gemma 3 config (the layers keep
  their default bases, unscaled); reading it as the global layers' settings loaded another
  function than transformers runs."""
  released = models.get_config("tiny-gemma3").to_hf()
  # (the old reading: linear scaling by 8 of the global layers)
  flat = dict(released, rope_parameters={"rope_type": "linear", "factor": 8.0})
  with pytest.raises(ValueError, match="rope_parameters=.* is not keyed by layer type"):
    ModelConfig.from_hf(flat)
  hf = transformers.Gemma3TextConfig(**{k: v for k, v in flat.items()
                                        if k not in ("architectures", "model_type")})
  assert hf.rope_parameters["full_attention"] == {"rope_type": "default", "rope_theta": 1e6}
  # A flat default type alone changes nothing either way.
  same = dict(released, rope_parameters={"rope_type": "default"})
  assert ModelConfig.from_hf(same) == ModelConfig.from_hf(released)
