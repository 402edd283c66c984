"""LoRA adapters in the Hugging Face PEFT format: the saved tensors against the merged weights,
the round trip, and the adapters `load_peft` refuses."""
import json
import math

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxagent import models
from jaxagent.models import hf, lora, param_tree

CFG = models.get_config("tiny-qwen3")
LCFG = lora.LoraConfig(rank=4, alpha=8.0)
PRE = "base_model.model.model.layers."
MODULES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
           "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
           "w_down": "mlp.down_proj"}


def random_adapter(cfg=CFG, lcfg=LCFG, seed=1):
  """An adapter with A and B both random (a fresh one has B = 0, which would hide B's layout)."""
  fresh = lora.init_lora(cfg, lcfg, jax.random.key(seed))
  keys = iter(jax.random.split(jax.random.key(seed + 100), 64))
  return jax.tree.map(lambda x: 0.05 * jax.random.normal(next(keys), x.shape), fresh)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A saved random adapter of CFG: (directory, adapter)."""
  ad = random_adapter()
  return lora.save_peft(tmp_path_factory.mktemp("peft") / "adapter", CFG, LCFG, ad), ad


# q / k / v biases (qwen2), and heads * head_dim != d_model (so q and o are not square).
@pytest.mark.parametrize("cfg", [CFG, models.get_config("tiny-qwen2"),
                                 models.get_config("tiny-qwen3", head_dim=24)],
                         ids=["qwen3", "qwen2", "qwen3_hd24"])
def test_saved_tensors_are_the_merged_weights_delta(cfg, tmp_path):
  base = models.init_params(cfg, jax.random.key(0), std=0.1)
  ad = random_adapter(cfg)
  out = lora.save_peft(tmp_path / "adapter", cfg, LCFG, ad)
  assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json",
                                                   "adapter_model.safetensors"]
  tensors = load_file(str(out / "adapter_model.safetensors"))
  conf = json.loads((out / "adapter_config.json").read_text())
  scale = conf["lora_alpha"] / conf["r"]  # PEFT's scaling, read from the saved config
  want_keys = {f"{PRE}{i}.{m}.lora_{p}.weight" for i in range(cfg.n_layers)
               for m in MODULES.values() for p in "AB"}
  assert set(tensors) == want_keys
  sd_base = hf.state_dict_from_params(cfg, base)
  sd_merged = hf.state_dict_from_params(cfg, lora.merge(base, ad, LCFG))
  for i in range(cfg.n_layers):
    for m in MODULES.values():
      name = f"model.layers.{i}.{m}.weight"
      a = tensors[f"{PRE}{i}.{m}.lora_A.weight"].astype(np.float64)
      b = tensors[f"{PRE}{i}.{m}.lora_B.weight"].astype(np.float64)
      out_dim, in_dim = sd_base[name].shape
      assert a.shape == (LCFG.rank, in_dim) and b.shape == (out_dim, LCFG.rank), name
      want = sd_base[name].astype(np.float64) + scale * b @ a
      np.testing.assert_allclose(sd_merged[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
  # What the adapter does not touch (norms, biases, embeddings) is the base's.
  for name, w in sd_base.items():
    if not name.endswith("_proj.weight"):
      np.testing.assert_array_equal(sd_merged[name], w, err_msg=name)


def test_adapter_config_is_a_plain_peft_lora(tmp_path):
  lcfg = lora.LoraConfig(rank=2, alpha=3.5, targets="v_proj,wq,down_proj")
  out = lora.save_peft(tmp_path / "a", CFG, lcfg, random_adapter(lcfg=lcfg),
                       base_model="Qwen/Qwen3-0.6B")
  conf = json.loads((out / "adapter_config.json").read_text())
  assert conf["peft_type"] == "LORA" and conf["task_type"] == "CAUSAL_LM"
  assert conf["r"] == 2 and conf["lora_alpha"] == 3.5
  assert conf["target_modules"] == ["q_proj", "v_proj", "down_proj"]
  assert conf["base_model_name_or_path"] == "Qwen/Qwen3-0.6B" and conf["inference_mode"] is True
  assert (conf["bias"], conf["lora_dropout"], conf["fan_in_fan_out"]) == ("none", 0.0, False)
  assert not (conf["use_rslora"] or conf["use_dora"] or conf["modules_to_save"]
              or conf["rank_pattern"] or conf["alpha_pattern"] or conf["layers_to_transform"])
  # An integral alpha is written as an int, as PEFT's own configs hold it.
  out2 = lora.save_peft(tmp_path / "b", CFG, LCFG, random_adapter())
  assert json.loads((out2 / "adapter_config.json").read_text())["lora_alpha"] == 8
  assert set(load_file(str(out / "adapter_model.safetensors"))) == {
      f"{PRE}{i}.{m}.lora_{p}.weight" for i in range(2)
      for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj") for p in "AB"}


def test_round_trip(saved, tmp_path):
  path, ad = saved
  lcfg, got = lora.load_peft(path, CFG)
  assert lcfg == LCFG
  lora.check_lora(got, CFG, lcfg, "loaded")
  want = param_tree.unbox(ad)
  assert jax.tree.structure(param_tree.unbox(got)) == jax.tree.structure(want)
  for (kp, g), w in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want)):
    assert g.dtype == np.float32
    np.testing.assert_array_equal(g, np.asarray(w), err_msg=jax.tree_util.keystr(kp))
  # The logical axis names are init_lora's, so the loaded adapter shards like a fresh one.
  fresh = lora.init_lora(CFG, LCFG, jax.random.key(0))
  assert ([x.names for x in jax.tree.leaves(got, is_leaf=lambda x: hasattr(x, "names"))]
          == [x.names for x in jax.tree.leaves(fresh, is_leaf=lambda x: hasattr(x, "names"))])
  # Stored in bfloat16: the file's tensors are bfloat16, read back as float32.
  sub = lora.LoraConfig(rank=4, alpha=8.0, targets="attention")
  ad16 = random_adapter(lcfg=sub)
  out = lora.save_peft(tmp_path / "bf16", CFG, sub, ad16, dtype="bfloat16")
  assert {str(t.dtype) for t in load_file(str(out / "adapter_model.safetensors")).values()} == {
      "bfloat16"}
  lcfg16, got16 = lora.load_peft(out, CFG)
  assert lcfg16 == sub
  np.testing.assert_allclose(param_tree.unbox(got16)["layers"]["wo"]["b"],
                             param_tree.unbox(ad16)["layers"]["wo"]["b"], rtol=1e-2)


def _copy(saved, tmp_path, edit=None, tensors=None):
  """A copy of the saved adapter with `edit(config)` and `tensors(dict)` applied in place."""
  path, _ = saved
  out = tmp_path / "edited"
  out.mkdir(parents=True)
  conf = json.loads((path / "adapter_config.json").read_text())
  if edit:
    edit(conf)
  (out / "adapter_config.json").write_text(json.dumps(conf))
  sd = load_file(str(path / "adapter_model.safetensors"))
  if tensors:
    tensors(sd)
  save_file(sd, str(out / "adapter_model.safetensors"))
  return out


def test_rslora_loads_with_the_same_scale(saved, tmp_path):
  out = _copy(saved, tmp_path, edit=lambda c: c.update(use_rslora=True))
  lcfg, got = lora.load_peft(out, CFG)
  assert lcfg.scale == pytest.approx(8.0 / math.sqrt(4))  # lora_alpha / sqrt(r)
  base = models.init_params(CFG, jax.random.key(0), std=0.1)
  sd = load_file(str(out / "adapter_model.safetensors"))
  merged = hf.state_dict_from_params(CFG, lora.merge(base, got, lcfg))
  name = "model.layers.1.mlp.up_proj.weight"
  want = (hf.state_dict_from_params(CFG, base)[name]
          + 4.0 * sd[f"{PRE}1.mlp.up_proj.lora_B.weight"] @ sd[f"{PRE}1.mlp.up_proj.lora_A.weight"])
  np.testing.assert_allclose(merged[name], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key,value,match", [
    ("peft_type", "IA3", r"peft_type is 'IA3'; only LoRA adapters"),
    ("use_dora", True, r"use_dora=True is not supported \(DoRA"),
    ("bias", "lora_only", r"bias='lora_only' is not supported"),
    ("lora_bias", True, r"lora_bias=True is not supported"),
    ("modules_to_save", ["lm_head"], r"modules_to_save=\['lm_head'\] is not supported"),
    ("rank_pattern", {"q_proj": 8}, r"rank_pattern=.* is not supported"),
    ("alpha_pattern", {"q_proj": 32}, r"alpha_pattern=.* is not supported"),
    ("alora_invocation_tokens", [5, 6], r"alora_invocation_tokens=.*activated LoRA"),
    ("init_lora_weights", "pissa_niter_4", r"init_lora_weights='pissa_niter_4' changes the base"),
    ("target_modules", ["q_proj", "embed_tokens"], r"target_modules names 'embed_tokens'"),
    ("target_modules", ["q_proj", "lm_head"], r"target_modules names 'lm_head'"),
    ("target_modules", ["q_proj", "k_proj"], r"holds weights for v_proj, o_proj, .*which "
                                             r"target_modules \['q_proj', 'k_proj'\] does not"),
    ("r", 0, r"r must be an int >= 1, got 0"),
    ("lora_alpha", "16", r"lora_alpha must be a finite number > 0, got '16'"),
    ("new_variant_config", {"k": 1}, r"unknown setting\(s\) \{'new_variant_config'"),
])
def test_refused_settings(saved, tmp_path, key, value, match):
  out = _copy(saved, tmp_path, edit=lambda c: c.update({key: value}))
  with pytest.raises(ValueError, match=match):
    lora.load_peft(out, CFG)


def test_settings_that_do_not_change_the_function_load(saved, tmp_path):
  # Training-time settings, records, a regex or "all-linear" target_modules, PEFT's default
  # values of the refused settings, and settings PEFT adds with their "off" values.
  def edit(c):
    c.update(lora_dropout=0.1, inference_mode=False, peft_version="0.21.2", bias="none",
             use_dora=False, modules_to_save=None, rank_pattern={}, loftq_config={},
             layers_to_transform=[0, 1], init_lora_weights="gaussian", future_flag=False,
             target_modules=r".*\.(q|k|v|o|gate|up|down)_proj")
  lcfg, _ = lora.load_peft(_copy(saved, tmp_path, edit=edit), CFG)
  assert lcfg == LCFG
  lcfg, _ = lora.load_peft(_copy(saved, tmp_path / "b",
                                 edit=lambda c: c.update(target_modules="all-linear")), CFG)
  assert lcfg == LCFG


def test_tensor_errors(saved, tmp_path):
  layer1 = f"{PRE}1.self_attn.k_proj.lora_B.weight"
  out = _copy(saved, tmp_path / "a", tensors=lambda sd: sd.pop(layer1))
  with pytest.raises(ValueError, match=rf"tensor '{layer1}' is missing: an adapter must adapt "
                     r"self_attn.k_proj in every layer"):
    lora.load_peft(out, CFG)
  out = _copy(saved, tmp_path / "b", tensors=lambda sd: sd.pop(layer1),
              edit=lambda c: c.update(layers_to_transform=[0]))
  with pytest.raises(ValueError, match=r"is missing.*\(its layers_to_transform is \[0\]\)"):
    lora.load_peft(out, CFG)
  # An incomplete file: target_modules names k_proj, the file has none of its weights.
  out = _copy(saved, tmp_path / "c", tensors=lambda sd: [
      sd.pop(k) for k in list(sd) if ".k_proj." in k])
  with pytest.raises(ValueError, match=r"holds no weights for k_proj, which target_modules"):
    lora.load_peft(out, CFG)
  # DoRA's magnitude vectors (or any tensor that is not a projection's lora_A / lora_B).
  mag = f"{PRE}0.self_attn.q_proj.lora_magnitude_vector"
  out = _copy(saved, tmp_path / "d", tensors=lambda sd: sd.update({mag: np.ones(64, np.float32)}))
  with pytest.raises(ValueError, match=rf"1 tensor\(s\) that are not LoRA weights.*{mag}"):
    lora.load_peft(out, CFG)
  out = _copy(saved, tmp_path / "e", tensors=lambda sd: sd.update(
      {f"{PRE}0.self_attn.q_proj.lora_A.weight": np.full((4, 64), np.nan, np.float32)}))
  with pytest.raises(ValueError, match=r"q_proj.lora_A.weight' holds NaN or Inf"):
    lora.load_peft(out, CFG)
  # Another model's adapter: shapes, depth.
  path, _ = saved
  with pytest.raises(ValueError, match=r"layers.0.self_attn.q_proj.lora_A.weight' has shape "
                     r"\(4, 64\), expected \(4, 96\) for r=4"):
    lora.load_peft(path, models.get_config("tiny-qwen3", d_model=96))
  with pytest.raises(ValueError, match=r"is for layer 1, the config 'tiny-qwen3' has 1 layers"):
    lora.load_peft(path, models.get_config("tiny-qwen3", n_layers=1))


def test_missing_files(saved, tmp_path):
  path, _ = saved
  with pytest.raises(FileNotFoundError, match="no adapter directory at"):
    lora.load_peft(tmp_path / "nowhere", CFG)
  with pytest.raises(ValueError, match=r"pass the adapter's directory"):
    lora.load_peft(path / "adapter_config.json", CFG)
  model = models.save_hf(tmp_path / "model", CFG, models.init_params(CFG, jax.random.key(0)))
  with pytest.raises(FileNotFoundError, match=r"has no adapter_config.json .*it is a model "
                     r"directory \(config.json\); load it with jaxagent.models.load"):
    lora.load_peft(model, CFG)
  out = _copy(saved, tmp_path)
  (out / "adapter_model.safetensors").rename(out / "adapter_model.bin")
  with pytest.raises(FileNotFoundError, match=r"has no adapter_model.safetensors: it holds "
                     r"adapter_model.bin .*safe_serialization=True"):
    lora.load_peft(out, CFG)
  (out / "adapter_config.json").write_text("{not json")
  with pytest.raises(ValueError, match="is not valid JSON"):
    lora.load_peft(out, CFG)


def test_save_checks_and_is_atomic(saved, tmp_path, monkeypatch):
  path, ad = saved
  model = models.save_hf(tmp_path / "model", CFG, models.init_params(CFG, jax.random.key(0)))
  with pytest.raises(FileExistsError, match=r"holds a model \(config.json\): transformers would "
                     "load the adapter onto that model"):
    lora.save_peft(model, CFG, LCFG, ad)
  assert not (model / "adapter_config.json").exists()
  with pytest.raises(ValueError, match=r"save_peft: adapter wq.a has shape .* \(lora.rank=8\)"):
    lora.save_peft(tmp_path / "x", CFG, lora.LoraConfig(rank=8), ad)
  with pytest.raises(ValueError, match="is a URL"):
    lora.save_peft("gs://bucket/adapter", CFG, LCFG, ad)
  with pytest.raises(ValueError, match="dtype must be a floating type"):
    lora.save_peft(tmp_path / "x", CFG, LCFG, ad, dtype="int8")
  # A save that fails part way leaves the earlier adapter as it was and no staging folder.
  out = lora.save_peft(tmp_path / "adapter", CFG, LCFG, ad)
  before = {p.name: p.read_bytes() for p in out.iterdir()}
  import safetensors.numpy

  def fail(*a, **k):
    raise OSError("No space left on device")

  monkeypatch.setattr(safetensors.numpy, "save", fail)
  with pytest.raises(OSError, match="No space left"):
    lora.save_peft(out, CFG, LCFG, random_adapter(seed=7))
  assert {p.name: p.read_bytes() for p in out.iterdir()} == before
  # Readable by whoever can read the config beside it.
  assert ((out / "adapter_model.safetensors").stat().st_mode & 0o777
          == (out / "adapter_config.json").stat().st_mode & 0o777)


def test_peft_loads_the_saved_adapter_and_saves_one_we_load(tmp_path):
  """Against PEFT itself: its logits with our adapter equal ours with the merged weights, and
  an adapter PEFT trained (rank-stabilized, random B) loads with PEFT's logits."""
  peft = pytest.importorskip("peft")
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  cfg = models.get_config("tiny-qwen2")
  base = models.init_params(cfg, jax.random.key(0), std=0.1)
  model_dir = models.save_hf(tmp_path / "model", cfg, base)
  tokens = np.arange(3, 19, dtype=np.int32)[None]

  def peft_logits(adapter_dir):
    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    m = peft.PeftModel.from_pretrained(m, adapter_dir).eval()
    with torch.no_grad():
      return m(torch.tensor(tokens, dtype=torch.long)).logits.numpy()

  ad = random_adapter(cfg)
  ours = lora.save_peft(tmp_path / "ours", cfg, LCFG, ad)
  np.testing.assert_allclose(models.forward(lora.merge(base, ad, LCFG), tokens, cfg=cfg),
                             peft_logits(ours), rtol=2e-4, atol=2e-4)

  m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
  pm = peft.get_peft_model(m, peft.LoraConfig(
      r=2, lora_alpha=5, use_rslora=True, init_lora_weights=False, task_type="CAUSAL_LM",
      target_modules=["k_proj", "o_proj", "up_proj"]))
  pm.save_pretrained(tmp_path / "theirs")
  lcfg, got = lora.load_peft(tmp_path / "theirs", cfg)
  assert lcfg.targets == ("wk", "wo", "w_up") and lcfg.rank == 2
  np.testing.assert_allclose(models.forward(lora.merge(base, got, lcfg), tokens, cfg=cfg),
                             peft_logits(tmp_path / "theirs"), rtol=2e-4, atol=2e-4)
