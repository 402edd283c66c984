"""The embedded real model end to end, and clear errors for bad checkpoints."""
import json
import pathlib
import re

import jax
import numpy as np
import pytest

from jaxagent import models
from jaxagent.generate import generate


@pytest.fixture(scope="module")
def smollm():
  cfg, params = models.load("smollm2-135m-instruct")
  return cfg, params, models.load_tokenizer("smollm2-135m-instruct")


def test_smollm2_answers_paris(smollm):
  cfg, params, tok = smollm
  assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads) == (30, 576, 9, 3)
  prompt = tok.apply_chat_template(
      [{"role": "user", "content": "What is the capital of France?"}],
      add_generation_prompt=True)
  out = generate(params, cfg, [tok.encode(prompt)], 16, tokenizer=tok, slots=1)[0]
  assert "Paris" in out.text
  assert out.stop_reason in ("eos", "max_new_tokens")


def test_smollm2_tokenizer_round_trip(smollm):
  *_, tok = smollm
  text = "Hello, world! 12 + 30 = 42\n  def f(x):\n\treturn x ** 2  # ünïcode ✓ 东京"
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert ids[:3] == tok.encode("Hello, world")[:3]


def test_missing_file_names_the_path(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope"):
    models.load(tmp_path / "nope")
  with pytest.raises(FileNotFoundError, match="config.json"):
    models.load(tmp_path)
  # A folder a GGUF was downloaded into: the error names the file to pass.
  (tmp_path / "SmolLM2.Q4_K_M.gguf").write_bytes(b"")
  with pytest.raises(FileNotFoundError, match=r"has no config\.json .*holds SmolLM2\.Q4_K_M\."
                     r"gguf: pass that file itself"):
    models.load(tmp_path)
  (tmp_path / "SmolLM2.Q4_K_M.gguf").unlink()
  # A directory with PyTorch weights only: the error says how to convert them.
  (tmp_path / "config.json").write_text(json.dumps(models.get_config("tiny-llama").to_hf()))
  (tmp_path / "pytorch_model.bin").write_bytes(b"")
  with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights in .*holds "
                     r"pytorch_model\.bin: convert .*save_pretrained"):
    models.load(tmp_path)


def test_a_run_workdir_or_checkpoint_is_named_with_how_to_export_it(tmp_path):
  """`python -m jaxagent.generate --model=<workdir>` said only "has no config.json"."""
  (tmp_path / "checkpoints" / "6").mkdir(parents=True)
  (tmp_path / "checkpoints" / "6" / "_CHECKPOINT_METADATA").write_text("{}")
  for path in (tmp_path, tmp_path / "checkpoints" / "6"):
    with pytest.raises(FileNotFoundError, match=r"has no config\.json .*it is a jaxagent run's "
                       r"workdir or checkpoint: export its policy first with python -m "
                       r"jaxagent\.export --workdir="):
      models.load(path)
  (tmp_path / "export").mkdir()
  (tmp_path / "export" / "config.json").write_text("{}")
  with pytest.raises(FileNotFoundError, match=r"it holds a run's export: pass .*export$"):
    models.load(tmp_path)


def test_unknown_preset_lists_the_known_ones():
  with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct"):
    models.load("gpt-17-ultra")
  with pytest.raises(ValueError, match="unknown model preset 'gpt-17-ultra'.*qwen2.5-0.5b"):
    models.get_config("gpt-17-ultra")
  with pytest.raises(ValueError, match="without shipped weights"):
    models.load("qwen2.5-0.5b")


def _save_tiny(tmp_path):
  cfg = models.get_config("tiny-llama")
  params = models.init_params(cfg, jax.random.key(0))
  return cfg, models.save_hf(tmp_path / "m", cfg, params)


def test_unknown_architecture_is_named(tmp_path):
  _, path = _save_tiny(tmp_path)
  hf = json.loads((path / "config.json").read_text())
  hf["architectures"] = ["MambaForCausalLM"]
  hf["model_type"] = "mamba"
  (path / "config.json").write_text(json.dumps(hf))
  with pytest.raises(ValueError, match="unknown architecture.*Mamba"):
    models.load(path)


def test_wrong_shape_in_checkpoint_is_named(tmp_path):
  _, path = _save_tiny(tmp_path)
  hf = json.loads((path / "config.json").read_text())
  hf["intermediate_size"] = 96
  (path / "config.json").write_text(json.dumps(hf))
  with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight.*shape"):
    models.load(path)


def test_prefixed_tensor_names_are_named(tmp_path):
  # A checkpoint saved under a wrapper's names (an adapter's "base_model.model."): the error
  # only said the plain name was missing.
  from safetensors.numpy import load_file, save_file
  _, path = _save_tiny(tmp_path)
  weights = path / "model.safetensors"
  save_file({"base_model.model." + k: v for k, v in load_file(weights).items()}, weights)
  with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.input_layernorm\.weight' is "
                     r"missing .*the checkpoint has 'base_model\.model\.model\.layers\.0\."
                     r"input_layernorm\.weight': its tensors carry a prefix"):
    models.load(path)
  save_file({"x.y": np.zeros(2, np.float32)}, weights)
  with pytest.raises(ValueError, match=r"is missing .*the checkpoint's 1 tensors are named like "
                     r"\['x\.y'\]"):
    models.load(path)

def test_an_untied_config_over_tied_weights_says_to_tie_them(tmp_path):
  # A config.json without tie_word_embeddings (untied by default) over a tied model's weights
  # said only that lm_head.weight is missing and listed other tensor names.
  _, path = _save_tiny(tmp_path)
  hf = json.loads((path / "config.json").read_text())
  del hf["tie_word_embeddings"]
  (path / "config.json").write_text(json.dumps(hf))
  with pytest.raises(ValueError, match=r"'lm_head\.weight' is missing .*tie_word_embeddings is "
                     r"false \(its default when absent\).*set \"tie_word_embeddings\": true"):
    models.load(path)
  hf["tie_word_embeddings"] = True
  (path / "config.json").write_text(json.dumps(hf))
  assert models.load(path)[0].tie_embeddings


def test_a_quantized_checkpoint_says_it_is_quantized(tmp_path):
  # A GPTQ checkpoint (qweight / qzeros / scales in place of weight) was only said to miss
  # q_proj.weight, with a list of other tensor names.
  from safetensors.numpy import load_file, save_file
  _, path = _save_tiny(tmp_path)
  sd = load_file(str(path / "model.safetensors"))
  for name in [k for k in sd if k.endswith("_proj.weight")]:
    base = name.removesuffix(".weight")
    del sd[name]
    sd[base + ".qweight"] = np.zeros((8, 8), np.int32)
    sd[base + ".scales"] = np.ones((1, 8), np.float16)
  save_file(sd, str(path / "model.safetensors"))
  _edit_config(path, quantization_config={"quant_method": "gptq", "bits": 4})
  with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj\.weight' is "
                     r"missing .*The checkpoint is quantized \(config\.json's "
                     r"quantization_config: quant_method 'gptq'\), which this loader does not"):
    models.load(path)


def test_corrupt_safetensors_is_named(tmp_path):
  _, path = _save_tiny(tmp_path)
  (path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
  with pytest.raises(ValueError, match="model.safetensors"):
    models.load(path)


def test_bad_model_config_values():
  with pytest.raises(ValueError, match="n_kv_heads"):
    models.get_config("tiny-llama", n_kv_heads=3)
  with pytest.raises(ValueError, match="dtype"):
    models.get_config("tiny-llama", dtype="float8")


def _edit_config(path, **changes):
  hf = json.loads((path / "config.json").read_text())
  hf.update(changes)
  (path / "config.json").write_text(json.dumps(hf))


def test_tensors_the_config_does_not_account_for_are_named(tmp_path):
  import numpy as np
  from safetensors.numpy import load_file, save_file
  cfg, path = _save_tiny(tmp_path)
  sd = load_file(str(path / "model.safetensors"))
  # One layer more than the config says (a wrong num_hidden_layers).
  _edit_config(path, num_hidden_layers=cfg.n_layers - 1)
  with pytest.raises(ValueError, match=rf"tensor\(s\) the config does not account for: "
                                       rf"model\.layers\.{cfg.n_layers - 1}\."):
    models.load(path)
  _edit_config(path, num_hidden_layers=cfg.n_layers)
  # An output head of its own under a tied config.
  extra = dict(sd, **{"lm_head.weight": np.ones_like(sd["model.embed_tokens.weight"])})
  save_file(extra, str(path / "model.safetensors"))
  with pytest.raises(ValueError, match="tie_word_embeddings, but the checkpoint has its own"):
    models.load(path)
  # A tied head saved anyway (the same values) and rotary buffers are fine.
  same = dict(sd, **{"lm_head.weight": sd["model.embed_tokens.weight"],
                     "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)})
  save_file(same, str(path / "model.safetensors"))
  models.load(path)


@pytest.mark.parametrize("changes,match", [
    (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(attention_bias=True), r"tensor 'model\.layers\.0\.self_attn\.q_proj\.bias' is missing"),
    # (linear scaling loads: `rope_linear_factor`)
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}),
     "unsupported rope_scaling type 'dynamic'"),
    (dict(rope_parameters={"rope_type": "linear", "factor": -1.0, "rope_theta": 1e4}),
     "linear rope scaling factor=-1.0 must be a number > 0"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "lacks the field 'low_freq_factor'"),
    (dict(intermediate_size=None), None),
])
def test_unsupported_or_incomplete_configs_are_refused(tmp_path, changes, match):
  _, path = _save_tiny(tmp_path)
  if changes == dict(intermediate_size=None):
    hf = json.loads((path / "config.json").read_text())
    del hf["intermediate_size"]
    (path / "config.json").write_text(json.dumps(hf))
    match = "required field 'intermediate_size' is missing"
  else:
    _edit_config(path, **changes)
  with pytest.raises(ValueError, match=match) as e:
    models.load(path)
  assert str(path) in str(e.value)


def test_a_llama_config_with_use_sliding_window_loads_windowed(tmp_path):
  # (Refused as "sliding-window attention" before windows were supported.) Every layer is
  # windowed, as `config._windowed_layers` reads such a config.
  cfg0, path = _save_tiny(tmp_path)
  _edit_config(path, use_sliding_window=True, sliding_window=32)
  cfg, _ = models.load(path)
  assert (cfg.sliding_window, cfg.sliding_layers) == (32, tuple(range(cfg0.n_layers)))


@pytest.mark.parametrize("cls,window", [
    # transformers windows only layers >= max_window_layers: none of these 2.
    ("Qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2)),
    ("Qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2)),
    # Every layer windowed, but by a window no shorter than the sequences (max_seq_len 64).
    ("Qwen2", dict(use_sliding_window=True, sliding_window=64, max_window_layers=0,
                   max_position_embeddings=64)),
])
def test_qwen_configs_with_an_unused_window_load_and_match_transformers(tmp_path, cls, window):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  hf_cfg = getattr(transformers, cls + "Config")(**{
      **dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, rope_theta=1e6), **window})
  model = getattr(transformers, cls + "ForCausalLM")(hf_cfg).eval()
  model.save_pretrained(tmp_path, safe_serialization=True)
  cfg, params = models.load(tmp_path)  # refused as "sliding-window attention" before
  tokens = np.random.default_rng(0).integers(0, 256, (2, 40))  # 10x the 4-token window
  with torch.no_grad():
    ref = model(torch.tensor(tokens)).logits.float().numpy()
  ours = np.asarray(models.forward(params, tokens, cfg=cfg))
  assert np.abs(ours - ref).max() <= 1e-4


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_export_with_qkv_bias_reloads_and_a_nonzero_output_bias_is_refused(tmp_path, name):
  import numpy as np
  from safetensors.numpy import load_file, save_file

  cfg = models.get_config(name, qkv_bias=True)
  params = models.init_params(cfg, jax.random.key(1))
  path = models.save_hf(tmp_path / "m", cfg, params)
  loaded, again = models.load(path)
  assert loaded.qkv_bias and loaded.architecture == cfg.architecture
  for a, b in zip(jax.tree.leaves(models.unbox(params)), jax.tree.leaves(models.unbox(again))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  sd = load_file(str(path / "model.safetensors"))
  sd["model.layers.1.self_attn.o_proj.bias"] = np.full(cfg.d_model, 0.5, np.float32)
  save_file(sd, str(path / "model.safetensors"))
  with pytest.raises(ValueError, match=r"o_proj\.bias' is nonzero"):
    models.load(path)


def test_malformed_config_json_and_index_name_the_file(tmp_path):
  _, path = _save_tiny(tmp_path)
  (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
  with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: not a safetensors index"):
    models.load(path)
  (path / "model.safetensors.index.json").unlink()
  (path / "config.json").write_text("{\n  vocab_size: 3\n}")
  with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
    models.load(path)


def test_several_eos_ids_are_kept_and_exported(tmp_path):
  cfg, path = _save_tiny(tmp_path)
  _edit_config(path, eos_token_id=[5, 7, 9])
  loaded, params = models.load(path)
  assert loaded.eos_token_id == 5 and loaded.extra_eos_token_ids == (7, 9)
  assert loaded.eos_token_ids == (5, 7, 9)
  out = models.save_hf(tmp_path / "export", loaded, params)
  assert json.loads((out / "config.json").read_text())["eos_token_id"] == [5, 7, 9]
  assert models.load(out)[0].eos_token_ids == (5, 7, 9)


def test_save_hf_without_a_tokenizer_refuses_an_earlier_exports_tokenizer(tmp_path):
  """Weights written without a tokenizer over an earlier export kept its tokenizer files: the
  directory loaded the new model with the old vocabulary, chat template and stop ids."""
  import tokenizers

  from jaxagent.models.tokenizer import Tokenizer
  tok = Tokenizer(tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "</s>": 1}, "a")),
                  eos_token="</s>")
  cfg, path = _save_tiny(tmp_path)
  tok.save(path)
  before = {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}
  with pytest.raises(FileExistsError, match=r"holds tokenizer files \(generation_config.json, "
                     r"tokenizer.json, tokenizer_config.json\)"):
    models.save_hf(path, cfg, models.init_params(cfg, jax.random.key(1)))
  assert {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()} == before  # untouched
  # With the tokenizer it writes over them; a directory without tokenizer files takes weights
  # without one again and again.
  models.save_hf(path, cfg, models.init_params(cfg, jax.random.key(1)), tok)
  (path / "vocab.json").write_text("{}")
  with pytest.raises(FileExistsError, match=r"\(generation_config.json, tokenizer.json, "
                     r"tokenizer_config.json, vocab.json\)"):
    models.save_hf(path, cfg, models.init_params(cfg, jax.random.key(2)))
  weights_only = models.save_hf(tmp_path / "w", cfg, models.init_params(cfg, jax.random.key(2)))
  models.save_hf(weights_only, cfg, models.init_params(cfg, jax.random.key(3)))  # no tokenizer


def test_save_hf_refuses_a_directory_with_other_weights(tmp_path):
  # A sharded model left in the directory: our loader (and JetStream's from_pretrained) would
  # read its index and load the old shards instead of the new model.safetensors.
  cfg, path = _save_tiny(tmp_path)
  (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
  (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
  params = models.init_params(cfg, jax.random.key(1))
  with pytest.raises(FileExistsError, match="model-00001-of-00001.safetensors, "
                     "model.safetensors.index.json"):
    models.save_hf(path, cfg, params)
  # Writing over an earlier export (one model.safetensors) is fine.
  out = models.save_hf(tmp_path / "again", cfg, params)
  models.save_hf(out, cfg, params)


def test_an_export_over_an_earlier_one_killed_part_way_does_not_load(tmp_path, monkeypatch):
  # The new weights were moved in before the new config.json: a kill between the two left the
  # earlier export's config.json beside them, a folder that loads as a (wrong) model.
  import os
  cfg, path = _save_tiny(tmp_path)
  real = os.replace

  def killed_at_the_config(src, dst):
    if pathlib.Path(dst).name == "config.json":
      raise KeyboardInterrupt
    real(src, dst)

  monkeypatch.setattr(os, "replace", killed_at_the_config)
  with pytest.raises(KeyboardInterrupt):
    models.save_hf(path, cfg, models.init_params(cfg, jax.random.key(1)))
  monkeypatch.undo()
  assert not (path / "config.json").exists() and not (path / ".save_hf.partial").exists()
  with pytest.raises(FileNotFoundError):
    models.load(path)
  models.save_hf(path, cfg, models.init_params(cfg, jax.random.key(1)))  # a rerun completes it
  assert (path / "config.json").exists()


def test_exported_weights_have_the_mode_of_the_other_files(tmp_path):
  # The safetensors writer creates its file 0600; others on a shared cluster could not load it.
  import os
  import stat
  old = os.umask(0o022)
  try:
    _, path = _save_tiny(tmp_path)
  finally:
    os.umask(old)
  mode = lambda name: stat.S_IMODE((path / name).stat().st_mode)  # noqa: E731
  assert mode("model.safetensors") == mode("config.json") == 0o644


def test_a_tensor_in_two_files_is_refused(tmp_path):
  # Shards next to a stale model.safetensors (no index), or one tensor in two shards: the file
  # read last would silently win.
  import numpy as np
  from safetensors.numpy import load_file, save_file
  cfg, path = _save_tiny(tmp_path)
  sd = load_file(str(path / "model.safetensors"))
  names = sorted(sd)
  save_file({k: sd[k] for k in names[:3]}, str(path / "model-00001-of-00002.safetensors"))
  save_file({k: sd[k] for k in names[3:]}, str(path / "model-00002-of-00002.safetensors"))
  stale = {k: np.zeros_like(v) for k, v in sd.items()}
  save_file(stale, str(path / "model.safetensors"))
  with pytest.raises(ValueError, match=rf"tensor '{names[0]}' is stored in both "
                                       r"model-00001-of-00002.safetensors and model.safetensors"):
    models.load(path)
  (path / "model.safetensors").unlink()
  models.load(path)  # the two shards alone load
  index = {"weight_map": {k: f"model-0000{1 + (k in names[3:])}-of-00002.safetensors"
                          for k in names}}
  (path / "model.safetensors.index.json").write_text(json.dumps(index))
  save_file({k: sd[k] for k in names[:4]}, str(path / "model-00001-of-00002.safetensors"))
  with pytest.raises(ValueError, match=rf"'{names[3]}' is stored in both"):
    models.load(path)


def test_model_safetensors_beside_an_index_is_read_as_transformers_reads_it(tmp_path):
  # transformers reads model.safetensors and ignores the index. Its save_pretrained of a
  # smaller model into a sharded directory deletes the shards and leaves the index: that
  # directory failed to load here (shards "listed in the index but missing"); with the shards
  # still there, the old shards were loaded in place of model.safetensors, silently.
  import numpy as np
  from safetensors.numpy import load_file, save_file
  cfg, path = _save_tiny(tmp_path)
  sd = load_file(str(path / "model.safetensors"))
  names = sorted(sd)
  index = {"weight_map": {k: f"model-0000{1 + (k in names[3:])}-of-00002.safetensors"
                          for k in names}}
  (path / "model.safetensors.index.json").write_text(json.dumps(index))
  _, params = models.load(path)  # the index's shards are gone: model.safetensors
  np.testing.assert_array_equal(np.asarray(params["final_norm"].value), sd["model.norm.weight"])
  stale = {k: np.zeros_like(v) for k, v in sd.items()}
  save_file({k: stale[k] for k in names[:3]}, str(path / "model-00001-of-00002.safetensors"))
  save_file({k: stale[k] for k in names[3:]}, str(path / "model-00002-of-00002.safetensors"))
  with pytest.raises(ValueError, match="holds both model.safetensors and the shards "
                     "model.safetensors.index.json lists .*remove the stale one"):
    models.load(path)
  (path / "model.safetensors").unlink()
  _, params = models.load(path)  # the shards alone, through the index
  assert not np.asarray(params["final_norm"].value).any()


def test_non_float_weights_are_refused(tmp_path):
  import numpy as np
  from safetensors.numpy import load_file, save_file
  _, path = _save_tiny(tmp_path)
  sd = load_file(str(path / "model.safetensors"))
  name = "model.layers.0.self_attn.k_proj.weight"
  sd[name] = (sd[name] * 100).astype(np.int8)  # a quantized weight without its scales
  save_file(sd, str(path / "model.safetensors"))
  with pytest.raises(ValueError, match=rf"tensor '{name}' has dtype int8; weights must be "
                                       "floating point"):
    models.load(path)


def test_save_hf_refuses_params_that_do_not_match_the_config(tmp_path):
  # The export walked the config's layers and entries: extra layers or an untied output head
  # were dropped silently, and the directory loaded as a different model.
  cfg, path = _save_tiny(tmp_path)
  before = (path / "config.json").read_text()
  params = models.init_params(cfg, jax.random.key(1))
  with pytest.raises(ValueError, match=r"layers/attn_norm has shape \(2, 64\), the config says "
                                       r"\(1, 64\)"):
    models.save_hf(path, cfg.replace(n_layers=1), params)
  untied = models.init_params(cfg.replace(tie_embeddings=False), jax.random.key(1))
  with pytest.raises(ValueError, match=r"params without an entry in the config \['lm_head'\]"):
    models.save_hf(path, cfg, untied)
  merged = models.param_tree.merge_decode_weights(params, cfg)
  with pytest.raises(ValueError, match="merged decode weights"):
    models.save_hf(path, cfg, merged)
  # A tokenizer of another library was skipped: the export had no tokenizer files.
  with pytest.raises(TypeError, match="tokenizer must be a jaxagent Tokenizer.*got str"):
    models.save_hf(path, cfg, params, tokenizer="smollm2-135m-instruct")
  assert (path / "config.json").read_text() == before  # the earlier export is left as it was


def _tiny_tokenizer(eos="</s>"):
  import tokenizers

  from jaxagent.models.tokenizer import Tokenizer
  return Tokenizer(tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, eos: 1}, "a")),
                   eos_token=eos)


def test_a_save_hf_whose_tokenizer_fails_leaves_the_earlier_export(tmp_path, monkeypatch):
  """The tokenizer was saved after the new weights and config.json were in place: a tokenizer
  that failed to write (a full disk) or a generation_config.json it could not read left the
  new weights beside the earlier export's tokenizer."""
  cfg, path = _save_tiny(tmp_path)
  tok = _tiny_tokenizer()
  tok.save(path)
  (path / "generation_config.json").write_text("{not json")
  before = {p.name: p.read_bytes() for p in path.iterdir()}
  new = models.init_params(cfg, jax.random.key(1))
  with pytest.raises(ValueError) as e:
    models.save_hf(path, cfg, new, tok)
  assert {p.name: p.read_bytes() for p in path.iterdir()} == before
  assert re.match(re.escape(f"{path / 'generation_config.json'} is not a JSON object"),
                  str(e.value))
  (path / "generation_config.json").write_text("{}")
  before = {p.name: p.read_bytes() for p in path.iterdir()}
  other = _tiny_tokenizer("<eos>")

  def full_disk(directory):
    (pathlib.Path(directory) / "tokenizer.json").write_text("{")  # a partial file, then
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(other, "save", full_disk)
  with pytest.raises(OSError, match="No space left"):
    models.save_hf(path, cfg, new, other)
  assert {p.name: p.read_bytes() for p in path.iterdir()} == before  # nothing moved, no stage


def test_save_hf_expands_the_home_directory(tmp_path, monkeypatch):
  # `load` read "~/m"; `save_hf` wrote a folder named "~" under the working directory.
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.chdir(tmp_path)
  cfg = models.get_config("tiny-llama")
  out = models.save_hf("~/m", cfg, models.init_params(cfg, jax.random.key(0)))
  assert out == tmp_path / "home" / "m" and (out / "config.json").is_file()
  assert not (tmp_path / "~").exists()
  assert models.load("~/m")[0].replace(name=cfg.name) == cfg


def test_save_hf_stages_extra_files_with_the_weights(tmp_path, monkeypatch):
  cfg, path = _save_tiny(tmp_path)
  models.save_hf(path, cfg, models.init_params(cfg, jax.random.key(1)),
                 extra_files={"record.json": '{"step": 1}'})
  assert (path / "record.json").read_text() == '{"step": 1}'
  before = {p.name: p.read_bytes() for p in path.iterdir()}
  # Written in the stage before any move, so a failure to write one leaves the export as it was.
  write_text = pathlib.Path.write_text

  def full_disk_on_write(self, *args, **kwargs):
    if self.name == "record.json":
      raise OSError(28, "No space left on device")
    return write_text(self, *args, **kwargs)

  monkeypatch.setattr(pathlib.Path, "write_text", full_disk_on_write)
  with pytest.raises(OSError, match="No space left"):
    models.save_hf(path, cfg, models.init_params(cfg, jax.random.key(2)),
                   extra_files={"record.json": '{"step": 2}'})
  assert {p.name: p.read_bytes() for p in path.iterdir()} == before
  monkeypatch.undo()
  for bad in ("config.json", "model.safetensors", "tokenizer.json", "../x.json", "a/b.json", "",
              ".hidden"):
    with pytest.raises(ValueError, match="extra_files name"):
      models.save_hf(path, cfg, models.init_params(cfg, jax.random.key(2)),
                     extra_files={bad: "{}"})
  assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def test_save_hf_with_a_tokenizer_leaves_what_tokenizer_save_leaves(tmp_path):
  # Staged, the tokenizer still keeps generation_config.json's other keys and removes an
  # earlier tokenizer's chat templates from the export directory.
  cfg, path = _save_tiny(tmp_path)
  _tiny_tokenizer().save(path)
  (path / "generation_config.json").write_text(json.dumps({"temperature": 0.7,
                                                           "eos_token_id": 9}))
  (path / "chat_template.jinja").write_text("old")
  (path / "additional_chat_templates").mkdir()
  (path / "additional_chat_templates" / "tool_use.jinja").write_text("old")
  (path / "vocab.json").write_text("{}")
  params = models.init_params(cfg, jax.random.key(1))
  tok = _tiny_tokenizer("<eos>")
  models.save_hf(path, cfg, params, tok)
  assert json.loads((path / "generation_config.json").read_text()) == {"temperature": 0.7,
                                                                       "eos_token_id": 1}
  assert not (path / "chat_template.jinja").exists()
  assert not list((path / "additional_chat_templates").iterdir())
  assert (path / "vocab.json").read_text() == "{}"  # not the tokenizer's: kept, as save keeps it
  assert sorted(p.name for p in path.iterdir()) == [
      "additional_chat_templates", "config.json", "generation_config.json", "model.safetensors",
      "tokenizer.json", "tokenizer_config.json", "vocab.json"]
  assert models.load_tokenizer(path).eos_id == 1
  assert "<eos>" in (path / "tokenizer.json").read_text()
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(models.load(path)[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path):
  """NaN weights in a checkpoint, or float32 values past float16's range loaded as float16,
  loaded silently: every logit NaN or wrong, with no error until training or sampling."""
  from safetensors.numpy import load_file, save_file
  cfg, path = _save_tiny(tmp_path)
  good = load_file(str(path / "model.safetensors"))
  sd = dict(good)
  sd["model.layers.1.mlp.up_proj.weight"] = sd["model.layers.1.mlp.up_proj.weight"].copy()
  sd["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
  save_file(sd, str(path / "model.safetensors"))
  with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' holds 1 NaN "
                     "or Inf values: the checkpoint is corrupt"):
    models.load(path)
  sd = dict(good, **{"model.norm.weight": np.full(cfg.d_model, 1e5, np.float32)})
  save_file(sd, str(path / "model.safetensors"))
  loaded_cfg, params = models.load(path)  # float32 holds them
  np.testing.assert_array_equal(np.asarray(params["final_norm"].value), sd["model.norm.weight"])
  with pytest.raises(ValueError, match=r"'model\.norm\.weight' has values up to 100000, beyond "
                     "the range of float16"):
    models.load(path, dtype="float16")
  assert models.load(path, dtype="bfloat16")[0].param_dtype == "bfloat16"


def test_save_hf_refuses_a_url(tmp_path, monkeypatch):
  # pathlib made "gs://bucket/m" the relative path "gs:/bucket/m": the export was written to a
  # folder named "gs:" in the working directory and reported as done.
  monkeypatch.chdir(tmp_path)
  cfg = models.get_config("tiny-llama")
  params = models.init_params(cfg, jax.random.key(0))
  for url in ("gs://bucket/m", pathlib.Path("gs://bucket/m"), "s3://bucket/m"):
    with pytest.raises(ValueError, match="save_hf writes a local directory; .* is a URL"):
      models.save_hf(url, cfg, params)
  assert not list(tmp_path.iterdir())
  assert models.save_hf("m", cfg, params) == pathlib.Path("m")  # a relative local path is fine


def test_errors_name_the_file_of_a_sharded_checkpoint_that_holds_the_tensor(tmp_path):
  # A wrong shape in one of several shards, or another model's file (an adapter) beside the
  # weights, named the tensor but not the file to look at or remove.
  from safetensors.numpy import load_file, save_file
  cfg, path = _save_tiny(tmp_path)
  sd = load_file(str(path / "model.safetensors"))
  (path / "model.safetensors").unlink()
  names = sorted(sd)
  bad = "model.layers.1.mlp.up_proj.weight"
  assert bad in names[10:]
  save_file({k: sd[k] for k in names[:10]}, str(path / "model-00001-of-00002.safetensors"))
  save_file({k: (sd[k][:-1] if k == bad else sd[k]) for k in names[10:]},
            str(path / "model-00002-of-00002.safetensors"))
  with pytest.raises(ValueError, match=rf"'{re.escape(bad)}' has shape \(127, 64\), the config "
                     r"expects \(128, 64\) \(stored in model-00002-of-00002\.safetensors\)$"):
    models.load(path)
  save_file({k: sd[k] for k in names[10:]}, str(path / "model-00002-of-00002.safetensors"))
  models.load(path)
  save_file({"base_model.model.lm_head.lora_A.weight": np.zeros((4, 64), np.float32)},
            str(path / "adapter_model.safetensors"))
  with pytest.raises(ValueError, match=r"does not account for: base_model\.model\.lm_head\."
                     r"lora_A\.weight \(stored in adapter_model\.safetensors\)$"):
    models.load(path)


def test_a_tensor_the_index_places_in_a_shard_that_lacks_it_names_that_shard(tmp_path):
  # The error named the tensor with a hint about the other tensors' names, as if the checkpoint
  # were named otherwise, not the shard the index says holds it.
  from safetensors.numpy import load_file, save_file
  _, path = _save_tiny(tmp_path)
  sd = load_file(str(path / "model.safetensors"))
  (path / "model.safetensors").unlink()
  names = sorted(sd)
  shards = {"model-00001-of-00002.safetensors": names[:10],
            "model-00002-of-00002.safetensors": names[10:]}
  (path / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
  for f, ks in shards.items():
    save_file({k: sd[k] for k in ks}, str(path / f))
  models.load(path)
  lost = names[12]
  save_file({k: sd[k] for k in names[10:] if k != lost},
            str(path / "model-00002-of-00002.safetensors"))
  with pytest.raises(ValueError, match=rf"'{re.escape(lost)}' is missing .*index\.json places "
                     r"it in model-00002-of-00002\.safetensors, which does not hold it"):
    models.load(path)
