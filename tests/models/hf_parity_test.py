"""Logits parity with the PyTorch `transformers` models, import and export, packed inputs."""
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxagent import models  # noqa: E402

ARCHS = {
    "llama": dict(cls="LlamaForCausalLM", cfg="LlamaConfig",
                  extra=dict(rope_theta=10000.0, tie_word_embeddings=True)),
    "llama_untied_scaled": dict(cls="LlamaForCausalLM", cfg="LlamaConfig",
                                extra=dict(rope_theta=500000.0, tie_word_embeddings=False,
                                           rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                         "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64})),
    "qwen2": dict(cls="Qwen2ForCausalLM", cfg="Qwen2Config",
                  extra=dict(rope_theta=1e6, tie_word_embeddings=True)),
    "qwen3": dict(cls="Qwen3ForCausalLM", cfg="Qwen3Config",
                  extra=dict(rope_theta=1e6, tie_word_embeddings=False, head_dim=16)),
    # Mistral is Llama's function when its window (4096 by default) masks nothing: here
    # sequences are at most max_position_embeddings (512) long.
    "mistral": dict(cls="MistralForCausalLM", cfg="MistralConfig",
                    extra=dict(rope_theta=1e6, tie_word_embeddings=False, head_dim=8)),
}


def make_hf_model(arch: str, path, seed=0):
  spec = ARCHS[arch]
  torch.manual_seed(seed)
  hf_cfg = getattr(transformers, spec["cfg"])(
      vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
      rms_norm_eps=1e-6, **spec["extra"])
  model = getattr(transformers, spec["cls"])(hf_cfg).eval()
  # Random (not default zero/one) norms and biases so every parameter is exercised.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight") or name.endswith(".bias"):
        p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
  model.save_pretrained(path, safe_serialization=True)
  return model


def torch_logits(model, tokens, position_ids=None):
  with torch.no_grad():
    kw = {} if position_ids is None else {"position_ids": torch.tensor(position_ids)}
    return model(torch.tensor(tokens), **kw).logits.float().numpy()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_transformers(arch, tmp_path):
  model = make_hf_model(arch, tmp_path)
  cfg, params = models.load(tmp_path)
  assert cfg.architecture == {"mistral": "llama"}.get(arch, arch.split("_")[0])
  tokens = np.random.default_rng(0).integers(0, 256, (2, 40))
  ref = torch_logits(model, tokens)
  ours = np.asarray(models.forward(params, jnp.asarray(tokens), cfg=cfg))
  assert np.abs(ours - ref).max() <= 1e-4


@pytest.mark.parametrize("arch", list(ARCHS))
def test_packed_logits_match_transformers_per_segment(arch, tmp_path):
  model = make_hf_model(arch, tmp_path, seed=1)
  cfg, params = models.load(tmp_path)
  rng = np.random.default_rng(1)
  lens = [13, 20, 7]
  segs = [rng.integers(0, 256, n) for n in lens]
  L = 48
  tokens = np.zeros((1, L), np.int64)
  seg_ids = np.zeros((1, L), np.int32)
  off = 0
  for i, s in enumerate(segs):
    tokens[0, off:off + len(s)] = s
    seg_ids[0, off:off + len(s)] = i + 1
    off += len(s)
  ours = np.asarray(models.forward(params, jnp.asarray(tokens), cfg=cfg,
                                   segment_ids=jnp.asarray(seg_ids)))
  assert np.isfinite(ours).all()
  off = 0
  for s in segs:
    ref = torch_logits(model, s[None])[0]
    assert np.abs(ours[0, off:off + len(s)] - ref).max() <= 1e-4
    off += len(s)


def test_packed_forward_takes_nested_lists_as_it_takes_arrays():
  # tokens could be nested lists, segment ids and positions not: the attention sliced the ids
  # ("list indices must be integers or slices, not tuple") and RoPE cast the positions.
  cfg = models.get_config("tiny-llama", n_layers=1)
  rng = np.random.default_rng(0)
  params = models.box(cfg, jax.tree.map(lambda s: (0.2 * rng.standard_normal(s[0])).astype(
      np.float32), models.param_specs(cfg), is_leaf=lambda s: isinstance(s, tuple)))
  tokens, seg, pos = [[5, 6, 7, 8, 9, 0]], [[1, 1, 1, 2, 2, 0]], [[0, 1, 2, 0, 1, 0]]
  run = jax.jit(lambda p: (
      models.forward(p, jnp.asarray(tokens), cfg=cfg, segment_ids=jnp.asarray(seg)),
      models.forward(p, tokens, cfg=cfg, segment_ids=seg),
      models.forward(p, tokens, cfg=cfg, segment_ids=seg, positions=pos)))
  want, *got = run(params)
  for g in got:
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_segment_ids_and_positions_not_shaped_like_the_tokens_are_named():
  # Segment ids of shape [B, 1] broadcast silently (every token of a row at position 0);
  # [B, L - 1] failed in RoPE ("mul got incompatible shapes"), 1-D tokens with an IndexError.
  cfg = models.get_config("tiny-llama", n_layers=1)
  params = models.box(cfg, jax.tree.map(lambda s: np.zeros(s[0], np.float32),
                                        models.param_specs(cfg),
                                        is_leaf=lambda s: isinstance(s, tuple)))
  tokens = np.arange(12).reshape(2, 6)
  for name, bad in (("segment_ids", np.ones((2, 1), int)), ("positions", np.zeros((2, 5), int))):
    with pytest.raises(ValueError, match=rf"{name} of shape \({bad.shape[0]}, {bad.shape[1]}\) "
                       rf"for tokens of shape \(2, 6\): {name} must be \[B, L\] = \(2, 6\)"):
      models.forward(params, tokens, cfg=cfg, **{name: bad})
  with pytest.raises(ValueError, match=r"tokens of shape \(6,\): tokens must be \[B, L\]"):
    models.forward(params, tokens[0], cfg=cfg)


def test_eager_forward_names_a_token_outside_the_vocabulary():
  # An id past the embedding table gave NaN logits, a negative one another token's, silently.
  cfg = models.get_config("tiny-llama", n_layers=1)
  params = models.box(cfg, jax.tree.map(lambda s: np.zeros(s[0], np.float32),
                                        models.param_specs(cfg),
                                        is_leaf=lambda s: isinstance(s, tuple)))
  for bad, shown in ((512, 512), (-1, -1), (2**31 + 5, -(2**31) + 5)):  # wrapped by the int32 cast
    tokens = np.array([[5, 6, 7], [8, bad, 9]], np.int64)
    with pytest.raises(ValueError, match=rf"tokens\[1, 1\] = {shown} is outside the model's "
                       r"vocabulary \[0, 512\) \(1 such tokens\)"):
      models.forward(params, tokens, cfg=cfg)
  with pytest.raises(ValueError, match=r"tokens\[0, 0\] = 600 .* \(2 such tokens\)"):
    models.hidden_states(params, [[600, 700]], cfg=cfg)
  assert models.forward(params, [[0, 511]], cfg=cfg).shape == (1, 2, 512)


def test_prefill_takes_lengths_as_a_list_and_names_lengths_not_one_per_row():
  # Tokens could be nested lists, the lengths not ("list indices must be integers or slices,
  # not tuple"); a single int with "'int' object is not subscriptable".
  cfg = models.get_config("tiny-llama", n_layers=1)
  rng = np.random.default_rng(0)
  params = models.box(cfg, jax.tree.map(lambda s: (0.2 * rng.standard_normal(s[0])).astype(
      np.float32), models.param_specs(cfg), is_leaf=lambda s: isinstance(s, tuple)))
  tokens = [[5, 6, 7, 0], [8, 9, 10, 11]]
  want, got = jax.jit(lambda p: (
      models.prefill(p, jnp.asarray(tokens), jnp.asarray([3, 4]), cfg=cfg),
      models.prefill(p, tokens, [3, 4], cfg=cfg)))(params)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  with pytest.raises(ValueError, match=r"tokens of shape \(2, 4\) and lengths of shape \(\): "
                     r"tokens must be \[B, T\] and lengths \[B\]"):
    models.prefill(params, tokens, 4, cfg=cfg)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_save_hf_reloads_in_transformers(arch, tmp_path):
  make_hf_model(arch, tmp_path / "src", seed=2)
  cfg, params = models.load(tmp_path / "src")
  # Perturb so the export cannot pass by copying the source files.
  params = jax.tree.map(lambda x: x * 1.01, params)
  out = models.save_hf(tmp_path / "out", cfg, params)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tokens = np.random.default_rng(2).integers(0, 256, (2, 24))
  ref = torch_logits(reloaded, tokens)
  ours = np.asarray(models.forward(params, jnp.asarray(tokens), cfg=cfg))
  assert np.abs(ours - ref).max() <= 1e-4
  cfg2, params2 = models.load(out)
  assert cfg2.replace(name=cfg.name) == cfg
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_failed_save_hf_leaves_the_earlier_export(tmp_path, monkeypatch):
  """config.json was written before the weights: a write that failed (disk full, a kill) left
  the new config beside the earlier export's weights, a directory that loads neither model."""
  import safetensors.numpy
  cfg = models.get_config("tiny-llama")
  params = models.init_params(cfg, jax.random.key(0))
  out = models.save_hf(tmp_path / "out", cfg, params)
  before = {p.name: p.read_bytes() for p in out.iterdir()}
  bigger = cfg.replace(n_layers=cfg.n_layers + 1)

  def full_disk(tensors, filename, metadata=None):
    pathlib.Path(filename).write_bytes(b"\0" * 100)  # a partial file, then the failure
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(safetensors.numpy, "save_file", full_disk)
  with pytest.raises(OSError, match="No space left"):
    models.save_hf(out, bigger, models.init_params(bigger, jax.random.key(1)))
  assert {p.name: p.read_bytes() for p in out.iterdir()} == before
  monkeypatch.undo()
  cfg2, params2 = models.load(out)
  assert cfg2.n_layers == cfg.n_layers
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_compute_is_close(tmp_path):
  model = make_hf_model("qwen2", tmp_path, seed=3)
  cfg, params = models.load(tmp_path, param_dtype="float32", dtype="bfloat16")
  tokens = np.random.default_rng(3).integers(0, 256, (1, 32))
  ref = torch_logits(model, tokens)
  ours = np.asarray(models.forward(params, jnp.asarray(tokens), cfg=cfg))
  rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
  assert rel < 2e-2


def test_transformers5_rope_parameters_are_read(tmp_path):
  make_hf_model("qwen2", tmp_path, seed=4)
  hf = json.loads((tmp_path / "config.json").read_text())
  theta = hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta"))
  cfg, _ = models.load(tmp_path)
  assert cfg.rope_theta == pytest.approx(float(theta)) == pytest.approx(1e6)


@pytest.mark.parametrize("name,overrides", [("tiny-qwen2", dict(qkv_bias=False)),
                                            ("tiny-llama", dict(qkv_bias=True)),
                                            ("tiny-qwen3", dict(qkv_bias=True))])
def test_save_hf_writes_every_tensor_transformers_expects(name, overrides, tmp_path):
  # transformers' Qwen2 always has q / k / v biases, its Llama and Qwen3 with attention_bias an
  # output bias too: the export writes them as zeros instead of leaving transformers to create
  # them as newly initialized weights.
  cfg = models.get_config(name, **overrides)
  params = models.init_params(cfg, jax.random.key(0), std=0.2)
  params = jax.tree.map(lambda x: x + 0.1 * np.sign(np.asarray(x)), params)  # non-zero biases
  out = models.save_hf(tmp_path / "out", cfg, params)
  reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
      out, output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 24))
  ours = np.asarray(models.forward(params, jnp.asarray(tokens), cfg=cfg))
  assert np.abs(ours - torch_logits(reloaded.eval(), tokens)).max() <= 1e-4
  if name == "tiny-qwen2":  # and it loads back here, with zero biases
    cfg2, params2 = models.load(out)
    again = np.asarray(models.forward(params2, jnp.asarray(tokens), cfg=cfg2))
    np.testing.assert_allclose(again, ours, atol=1e-5)


def test_qwen2_config_with_attention_bias_false_keeps_its_biases(tmp_path):
  # transformers' Qwen2 has q / k / v biases whatever attention_bias says; such a config was
  # refused here ("tensors the config does not account for: ...q_proj.bias").
  model = make_hf_model("qwen2", tmp_path, seed=6)
  hf = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**hf, "attention_bias": False}))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  cfg, params = models.load(tmp_path)
  assert cfg.qkv_bias
  tokens = np.random.default_rng(6).integers(0, 256, (2, 24))
  ours = np.asarray(models.forward(params, jnp.asarray(tokens), cfg=cfg))
  assert np.abs(ours - torch_logits(reloaded, tokens)).max() <= 1e-4
  assert np.abs(torch_logits(model, tokens) - torch_logits(reloaded, tokens)).max() == 0


@pytest.mark.parametrize("arch,heads,kv_heads", [("mistral", 16, 8), ("qwen3", 64, 32),
                                                 ("llama", 8, 8)])
def test_a_missing_num_key_value_heads_takes_transformers_default(arch, heads, kv_heads,
                                                                  tmp_path):
  # transformers' config classes default a missing num_key_value_heads to 8 (Mistral) or 32
  # (Qwen2 / Qwen3), not to the head count (Llama's): such a Mistral or Qwen3 file was read
  # here as full multi-head attention and refused for its k_proj shape.
  spec = ARCHS[arch]
  torch.manual_seed(7)
  hf_cfg = getattr(transformers, spec["cfg"])(
      vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8,
      max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
  getattr(transformers, spec["cls"])(hf_cfg).save_pretrained(tmp_path)
  hf = json.loads((tmp_path / "config.json").read_text())
  del hf["num_key_value_heads"]
  (tmp_path / "config.json").write_text(json.dumps(hf))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  assert reloaded.config.num_key_value_heads == kv_heads
  cfg, params = models.load(tmp_path)
  assert (cfg.n_heads, cfg.n_kv_heads) == (heads, kv_heads)
  tokens = np.random.default_rng(7).integers(0, 256, (2, 24))
  ours = np.asarray(models.forward(params, jnp.asarray(tokens), cfg=cfg))
  assert np.abs(ours - torch_logits(reloaded, tokens)).max() <= 1e-4


@pytest.mark.slow  # about 12 s: two tokenizers of 49k tokens, a forward compile
def test_export_with_tokenizer_runs_transformers_generate_greedily_as_our_logits(tmp_path):
  # save_hf with a tokenizer writes a directory transformers serves on its own: AutoTokenizer
  # renders and encodes the chat as ours does, generation_config holds our stop ids, and each
  # token of greedy generate from AutoModelForCausalLM is the argmax of our logits.
  tok = models.load_tokenizer("smollm2-135m-instruct")
  torch.manual_seed(3)  # random weights over the tokenizer's vocabulary, made fast by torch
  transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
      bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)).save_pretrained(tmp_path / "src")
  cfg, params = models.load(tmp_path / "src")
  out = models.save_hf(tmp_path / "out", cfg, params, tokenizer=tok)
  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  messages = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "What is 2 + 2?"}]
  ids = tok.encode_chat(messages)
  assert ids == hf_tok.apply_chat_template(messages, add_generation_prompt=True,
                                           tokenize=True)["input_ids"]
  assert set(hf_model.generation_config.eos_token_id) == set(tok.eos_ids)
  with torch.no_grad():
    new = hf_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                            pad_token_id=tok.pad_id)[0, len(ids):].tolist()
  full = ids + new
  logits = np.asarray(models.forward(params, jnp.asarray([full]), cfg=cfg))[0]
  steps = logits[len(ids) - 1:-1]
  assert steps.argmax(-1).tolist() == new
  top2 = np.sort(steps, -1)[:, -2:]
  assert (top2[:, 1] - top2[:, 0]).min() > 1e-3  # no near-tie that rounding could flip
  assert hf_tok.decode(new) == tok.decode(new)
