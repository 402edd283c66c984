"""The embedded real model end to end, and clear errors for bad checkpoints."""
import json

import jax
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
