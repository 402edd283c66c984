"""Weight import and export in Hugging Face layout (safetensors + config.json).

`load` is the single entry for weights: an HF directory, a `.gguf` file (through
`jaxagent.models.gguf`, which yields the same HF-named state dict), or the name of a checkpoint
shipped in a pip package (`"smollm2-135m-instruct"`). `save_hf` writes a directory that
`transformers` loads with the same logits.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
from typing import Any, Mapping

import jax
import numpy as np

from jaxagent.models import param_tree
from jaxagent.models.config import EMBEDDED, PRESETS, ModelConfig

_LAYER_KEYS = {
    # ours: (hf suffix, kind)
    "attn_norm": ("input_layernorm.weight", "vec"),
    "mlp_norm": ("post_attention_layernorm.weight", "vec"),
    "wq": ("self_attn.q_proj.weight", "q"),
    "wk": ("self_attn.k_proj.weight", "kv"),
    "wv": ("self_attn.v_proj.weight", "kv"),
    "wo": ("self_attn.o_proj.weight", "o"),
    "bq": ("self_attn.q_proj.bias", "qb"),
    "bk": ("self_attn.k_proj.bias", "kvb"),
    "bv": ("self_attn.v_proj.bias", "kvb"),
    "q_norm": ("self_attn.q_norm.weight", "vec"),
    "k_norm": ("self_attn.k_norm.weight", "vec"),
    "w_gate": ("mlp.gate_proj.weight", "t"),
    "w_up": ("mlp.up_proj.weight", "t"),
    "w_down": ("mlp.down_proj.weight", "t"),
}
# Gemma 3 names its four layer norms otherwise: its post_attention_layernorm norms the
# attention's output (Llama's is the MLP's input norm, here pre_feedforward_layernorm).
_GEMMA_LAYER_KEYS = {
    **_LAYER_KEYS,
    "mlp_norm": ("pre_feedforward_layernorm.weight", "vec"),
    "post_attn_norm": ("post_attention_layernorm.weight", "vec"),
    "post_mlp_norm": ("post_feedforward_layernorm.weight", "vec"),
}


def layer_keys(cfg: ModelConfig) -> dict[str, tuple[str, str]]:
  """Our layer weight names -> (HF name after `model.layers.{i}.`, layout kind) for `cfg`."""
  return _GEMMA_LAYER_KEYS if cfg.post_norms else _LAYER_KEYS


def _to_ours(kind: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  if kind == "vec":
    return w
  if kind == "t":
    return w.T
  if kind == "q":
    return w.T.reshape(d, h, hd)
  if kind == "kv":
    return w.T.reshape(d, kv, hd)
  if kind == "o":
    return w.T.reshape(h, hd, d)
  if kind == "qb":
    return w.reshape(h, hd)
  if kind == "kvb":
    return w.reshape(kv, hd)
  raise AssertionError(kind)


def _to_hf(kind: str, w: np.ndarray) -> np.ndarray:
  if kind == "vec":
    return w
  if kind == "t":
    return w.T
  if kind in ("q", "kv"):
    return w.reshape(w.shape[0], -1).T
  if kind == "o":
    return w.reshape(-1, w.shape[-1]).T
  return w.reshape(-1)


def _expected_hf_shape(kind: str, cfg: ModelConfig, ours_shape: tuple[int, ...]):
  return tuple(_to_hf(kind, np.empty(ours_shape, np.int8)).shape)


def params_from_state_dict(cfg: ModelConfig, sd: Mapping[str, np.ndarray],
                           dtype: str | None = None, source: str = "checkpoint",
                           files: Mapping[str, str] | None = None,
                           listed: Mapping[str, str] | None = None):
  """Map an HF-named state dict to boxed params (host NumPy arrays), validating shapes.

  `files`: the file each tensor was read from; errors name it when there were several.
  `listed`: the file a safetensors index places each tensor in; a missing tensor's error names
  it."""
  specs = param_tree.param_specs(cfg)
  np_dtype = np.dtype(jax.numpy.dtype(dtype or cfg.param_dtype))
  used: set[str] = set()
  several = files is not None and len(set(files.values())) > 1

  def in_file(*names: str) -> str:  # which of a sharded checkpoint's files hold `names`
    got = sorted({files[n] for n in names if n in files}) if several else []
    more = f" and {len(got) - 4} more" if len(got) > 4 else ""
    return f" (stored in {', '.join(got[:4])}{more})" if got else ""

  def take(name: str, expected: tuple[int, ...]):
    used.add(name)
    if name not in sd:
      if listed and name in listed:
        # The index names the file, which lacks it: a hint about the other tensors' names
        # would send the reader after a naming problem there is not.
        raise ValueError(
            f"{source}: tensor {name!r} is missing (expected shape {expected}): "
            f"model.safetensors.index.json places it in {listed[name]}, which does not hold it "
            "(an incomplete download, or a file of another checkpoint): re-download or re-export "
            "that file")
      raise ValueError(f"{source}: tensor {name!r} is missing (expected shape {expected})"
                       f"{_missing_hint(name, sd)}")
    w = np.asarray(sd[name])
    # An integer or bool tensor (a quantized weight without its scales) would be cast to
    # floats of the wrong values.
    if not jax.numpy.issubdtype(w.dtype, jax.numpy.floating):
      raise ValueError(f"{source}: tensor {name!r} has dtype {w.dtype}; weights must be "
                       "floating point (float32, float16 or bfloat16): dequantize the "
                       f"checkpoint first{in_file(name)}")
    if tuple(w.shape) != tuple(expected):
      raise ValueError(f"{source}: tensor {name!r} has shape {tuple(w.shape)}, the config "
                       f"expects {tuple(expected)}{in_file(name)}")
    return w

  def cast(name: str, w: np.ndarray) -> np.ndarray:
    """`w` in the param dtype; NaN / Inf (a corrupt file, or values past float16's range)
    would make every logit NaN, or wrong, with no error until training or sampling."""
    with np.errstate(over="ignore", invalid="ignore"):
      out = w.astype(np_dtype)
    if not np.isfinite(out).all():
      stored = np.asarray(sd[name]).astype(np.float32)
      if not np.isfinite(stored).all():
        raise ValueError(f"{source}: tensor {name!r} holds {np.sum(~np.isfinite(stored))} NaN "
                         f"or Inf values{in_file(name)}: the checkpoint is corrupt (re-download or "
                         "re-export it)")
      raise ValueError(f"{source}: tensor {name!r} has values up to {np.abs(stored).max():g}, "
                       f"beyond the range of {np_dtype.name}; load it in a wider param dtype "
                       f"(dtype= / param_dtype='float32' or 'bfloat16'){in_file(name)}")
    return out

  layers = {}
  names = layer_keys(cfg)
  for key, (shape, _, _) in specs["layers"].items():
    suffix, kind = names[key]
    per = []
    for i in range(cfg.n_layers):
      name = f"model.layers.{i}.{suffix}"
      w = take(name, _expected_hf_shape(kind, cfg, shape[1:]))
      per.append(cast(name, _to_ours(kind, w.astype(np.float32), cfg)))
    layers[key] = np.stack(per)
  arrays: dict[str, Any] = {
      "embed": cast("model.embed_tokens.weight",
                    take("model.embed_tokens.weight", (cfg.vocab_size, cfg.d_model))),
      "layers": layers,
      "final_norm": cast("model.norm.weight", take("model.norm.weight", (cfg.d_model,))),
  }
  if not cfg.tie_embeddings:
    arrays["lm_head"] = cast("lm_head.weight",
                             take("lm_head.weight", (cfg.vocab_size, cfg.d_model)).T)
  if cfg.architecture in ("llama", "qwen3") and cfg.qkv_bias:
    # transformers' class for this config has an output projection bias; the model here has
    # none, so only zeros (what save_hf writes) compute the same function.
    for i in range(cfg.n_layers):
      name = f"model.layers.{i}.self_attn.o_proj.bias"
      if name in sd:
        if np.any(take(name, (cfg.d_model,))):
          raise ValueError(f"{source}: tensor {name!r} is nonzero; a bias on the attention "
                           "output projection (attention_bias=True) is not supported"
                           f"{in_file(name)}")
  # A tensor the config does not account for (more layers, an untied output head, biases of a
  # variant not implemented here) would otherwise be dropped and the logits silently wrong.
  unused = sorted(k for k in sd if k not in used and not k.endswith("rotary_emb.inv_freq"))
  if cfg.tie_embeddings and "lm_head.weight" in unused and np.array_equal(
      np.asarray(sd["lm_head.weight"]), np.asarray(sd["model.embed_tokens.weight"])):
    unused.remove("lm_head.weight")  # a tied head saved anyway: the same values
  if unused:
    shown = ", ".join(unused[:8]) + (f", and {len(unused) - 8} more" if len(unused) > 8 else "")
    why = (" (the config says tie_word_embeddings, but the checkpoint has its own output head)"
           if "lm_head.weight" in unused else "")
    raise ValueError(f"{source}: {len(unused)} tensor(s) the config does not account for: "
                     f"{shown}{why}{in_file(*unused)}")
  return param_tree.box(cfg, arrays)


def _missing_hint(name: str, sd: Mapping[str, Any]) -> str:
  """What the checkpoint holds instead of `name`: the same tensor under a prefix (an adapter or
  multimodal wrapper's naming), or a few of its names."""
  suffix = name.removeprefix("model.")
  alike = sorted(k for k in sd if k.endswith("." + suffix))
  if alike:
    return (f"; the checkpoint has {alike[0]!r}: its tensors carry a prefix this loader does not "
            "read (rename them to the plain Hugging Face names, e.g. merge and unload an "
            "adapter and save_pretrained the base model)")
  if name == "lm_head.weight" and "model.embed_tokens.weight" in sd:
    # Read only under an untied config; transformers' Llama / Qwen classes default to untied.
    return ("; the config says tie_word_embeddings is false (its default when absent), so the "
            "output head is a tensor of its own: if this model shares it with "
            "model.embed_tokens.weight, set \"tie_word_embeddings\": true in config.json")
  shown = sorted(sd)[:3]
  return f"; the checkpoint's {len(sd)} tensors are named like {shown}" if shown else ""


def state_dict_from_params(cfg: ModelConfig, params) -> dict[str, np.ndarray]:
  """The inverse of `params_from_state_dict`: HF-named host arrays."""
  if param_tree.is_merged(params):
    raise ValueError("the params hold merged decode weights (merge_decode_weights); pass the "
                     "plain params")
  p = jax.tree.map(np.asarray, param_tree.unbox(params))
  _check_against_config(cfg, p)
  sd = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["final_norm"]}
  names = layer_keys(cfg)
  for key, stacked in p["layers"].items():
    suffix, kind = names[key]
    for i in range(cfg.n_layers):
      sd[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(_to_hf(kind, stacked[i]))
  if not cfg.tie_embeddings:
    sd["lm_head.weight"] = np.ascontiguousarray(p["lm_head"].T)
  return sd


def _check_against_config(cfg: ModelConfig, p: Mapping[str, Any]) -> None:
  """Params laid out as `cfg` says; otherwise the export would drop what the config does not
  name (layers past n_layers, an untied output head) or write a config that does not load."""
  specs = param_tree.param_specs(cfg)
  layers = p.get("layers") if isinstance(p.get("layers"), Mapping) else {}
  have = {k for k in p if k != "layers"} | {f"layers/{k}" for k in layers}
  want = {k for k in specs if k != "layers"} | {f"layers/{k}" for k in specs["layers"]}
  if have != want:
    raise ValueError(
        f"the params do not match the config {cfg.name!r}: params without an entry in the "
        f"config {sorted(have - want)}, config entries missing from the params "
        f"{sorted(want - have)} (check tie_embeddings, qkv_bias and qk_norm; pass the config "
        "the params were made with)")
  for name in sorted(want):
    shape, _, _ = specs["layers"][name[7:]] if name.startswith("layers/") else specs[name]
    arr = layers[name[7:]] if name.startswith("layers/") else p[name]
    if tuple(arr.shape) != tuple(shape):
      raise ValueError(f"the params do not match the config {cfg.name!r}: {name} has shape "
                       f"{tuple(arr.shape)}, the config says {tuple(shape)} (pass the config "
                       "the params were made with)")


def _zero_tensors_hf_expects(cfg: ModelConfig, sd: Mapping[str, np.ndarray]):
  """Zero tensors that transformers' class for `cfg.to_hf()` has and these params lack: its
  Qwen2 always has q / k / v biases, and its Llama and Qwen3 with attention_bias also an output
  projection bias. Written out, the export is complete (transformers would otherwise create
  them as newly initialized weights) and computes the same function."""
  dtype = sd["model.norm.weight"].dtype
  out = {}
  for i in range(cfg.n_layers):
    pre = f"model.layers.{i}.self_attn."
    if cfg.architecture == "qwen2" and not cfg.qkv_bias:
      for proj, heads in (("q", cfg.n_heads), ("k", cfg.n_kv_heads), ("v", cfg.n_kv_heads)):
        out[f"{pre}{proj}_proj.bias"] = np.zeros(heads * cfg.head_dim, dtype)
    if cfg.architecture in ("llama", "qwen3") and cfg.qkv_bias:
      out[f"{pre}o_proj.bias"] = np.zeros(cfg.d_model, dtype)
  return out


def _read_safetensors(directory: pathlib.Path
                      ) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, str]]:
  """The tensors of a model directory, the file each was read from, and the file the
  safetensors index places each in (empty without an index, or when it is not read)."""
  from safetensors import safe_open

  index = directory / "model.safetensors.index.json"
  listed: dict[str, str] = {}
  if index.exists():
    try:
      listed = dict(json.loads(index.read_text())["weight_map"])
      files = sorted(set(listed.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise ValueError(f"{index}: not a safetensors index with a 'weight_map' object "
                       f"({type(e).__name__}: {e})") from None
    single = "model.safetensors"
    if (directory / single).exists() and files != [single]:
      # transformers reads model.safetensors when there is one and ignores the index; a later
      # single-file save_pretrained into a sharded directory removes the shards but leaves the
      # index. With the shards still there, either file set may be the stale one.
      if files and all((directory / f).exists() for f in files):
        raise ValueError(
            f"{directory} holds both {single} and the shards {index.name} lists ({files[0]}, "
            f"...), two copies of the weights (transformers loads {single}); remove the stale "
            "one")
      files, listed = [single], {}
  else:
    files = sorted(p.name for p in directory.glob("*.safetensors"))
  if not files:
    if index.exists():
      raise FileNotFoundError(f"{index} lists no weight files")
    other = sorted(p.name for p in directory.iterdir()
                   if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".gguf"))
    hint = (f"; it holds {', '.join(other[:4])}: convert a PyTorch checkpoint once with "
            "transformers (AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir)), or "
            "pass a .gguf file itself" if other else "")
    raise FileNotFoundError(f"no *.safetensors weights in {directory}{hint}")
  sd, where = {}, {}
  for name in files:
    path = directory / name
    if not path.exists():
      raise FileNotFoundError(f"{path} is listed in the safetensors index but missing")
    try:
      f = safe_open(str(path), framework="numpy")
    except Exception as e:  # safetensors raises its own error types for corrupt headers
      raise ValueError(f"cannot read safetensors file {path}: {e}") from e
    with f:
      for k in f.keys():
        # Two files holding one tensor (a stale model.safetensors beside the shards, a shard
        # written twice): whichever was read last would win, silently.
        if k in where:
          raise ValueError(
              f"{directory}: tensor {k!r} is stored in both {where[k]} and {name}; remove the "
              "stale file (a directory holds either model.safetensors or the shards its "
              "model.safetensors.index.json lists)")
        try:
          sd[k] = f.get_tensor(k)
        except Exception as e:  # a dtype NumPy cannot hold (float8, ...) or a corrupt body
          raise ValueError(
              f"cannot read tensor {k!r} ({f.get_slice(k).get_dtype()}) of {path}: {e}. "
              f"Weights must be float32, float16 or bfloat16; convert quantized (float8, int) "
              "checkpoints to one of these first") from e
        where[k] = name
  return sd, where, listed


def resolve(path_or_preset: str | os.PathLike) -> pathlib.Path:
  """A local path for a checkpoint: an existing path, or an embedded preset's file."""
  s = os.fspath(path_or_preset)
  if s in EMBEDDED:
    from jaxagent.models.gguf import find_embedded_gguf
    return find_embedded_gguf()
  p = pathlib.Path(s).expanduser()
  if p.exists():
    return p
  if s in PRESETS:
    raise ValueError(
        f"{s!r} is an architecture preset without shipped weights; build random params with "
        f"jaxagent.models.init_params(jaxagent.models.get_config({s!r}), rng), or pass a local "
        f"HF directory / .gguf file. Presets with weights: {sorted(EMBEDDED)}")
  raise FileNotFoundError(
      f"no checkpoint at {s!r}: pass an HF directory (config.json + *.safetensors), a .gguf "
      f"file, or one of the embedded presets {sorted(EMBEDDED)}")


def no_config_json(path: pathlib.Path) -> FileNotFoundError:
  """The error for a model directory without config.json, saying what the directory holds
  instead where that is something loadable: GGUF files, a run's export, a run's checkpoints."""
  ggufs = sorted(p.name for p in path.glob("*.gguf"))
  hint = (f"; it holds {', '.join(ggufs[:3])}: pass that file itself "
          f"({path / ggufs[0]})" if ggufs else "")
  # A training run's workdir (or one of its checkpoints) is not a model directory: the
  # bare "no config.json" did not say that its policy loads once exported.
  if not hint and (path / "export" / "config.json").is_file():
    hint = f"; it holds a run's export: pass {path / 'export'}"
  elif not hint and ((path / "checkpoints").is_dir()
                     or (path / "_CHECKPOINT_METADATA").is_file()):
    hint = ("; it is a jaxagent run's workdir or checkpoint: export its policy first with "
            "python -m jaxagent.export --workdir=<the run's workdir> (add --step=N for a "
            "given checkpoint) and pass the directory it writes (<workdir>/export)")
  return FileNotFoundError(f"{path} has no config.json (expected an HF model directory){hint}")


def load(path_or_preset: str | os.PathLike, dtype: str | None = None, **cfg_overrides):
  """Load `(cfg, params)` from an HF directory, a `.gguf` file or an embedded preset.

  `dtype` sets both the stored param dtype and the compute dtype unless `cfg_overrides`
  say otherwise (e.g. `dtype="bfloat16"`, or `param_dtype="float32", dtype="bfloat16"`).
  Params come back as host arrays; place them with `jaxagent.sharding.shard`.
  """
  path = resolve(path_or_preset)
  if dtype is not None:
    cfg_overrides.setdefault("param_dtype", dtype)
    cfg_overrides.setdefault("dtype", dtype)
  if path.is_file() and path.suffix == ".gguf":
    from jaxagent.models.gguf import read_gguf
    hf_cfg, sd = read_gguf(path)
    files = listed = None
  elif path.is_dir():
    cfg_file = path / "config.json"
    if not cfg_file.exists():
      raise no_config_json(path)
    try:
      hf_cfg = json.loads(cfg_file.read_text())
    except ValueError as e:
      raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
    if not isinstance(hf_cfg, dict):
      raise ValueError(f"{cfg_file}: expected a JSON object")
    sd, files, listed = _read_safetensors(path)
  else:
    raise ValueError(f"{path}: expected an HF model directory or a .gguf file")
  try:
    cfg = ModelConfig.from_hf(hf_cfg, **cfg_overrides)
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from None
  if (cfg.architecture == "qwen2" and not cfg.qkv_bias and "qkv_bias" not in cfg_overrides
      and "model.layers.0.self_attn.q_proj.bias" in sd):
    # transformers' Qwen2 has q / k / v biases whatever `attention_bias` says (configs written
    # by some tools carry attention_bias=false): the checkpoint's biases are part of the model.
    cfg = cfg.replace(qkv_bias=True)
  if os.fspath(path_or_preset) in EMBEDDED:
    cfg = cfg.replace(name=os.fspath(path_or_preset))
  elif cfg.name in ("hf", "custom"):
    cfg = cfg.replace(name=path.stem if path.is_file() else path.name)
  try:
    return cfg, params_from_state_dict(cfg, sd, source=str(path), files=files, listed=listed)
  except ValueError as e:
    quant = hf_cfg.get("quantization_config")
    if not quant:
      raise
    # A quantized checkpoint's errors name tensors (q_proj.qweight, weight_scale, int weights)
    # without saying why they are there.
    method = quant.get("quant_method", "unknown") if isinstance(quant, Mapping) else quant
    raise ValueError(f"{e}. The checkpoint is quantized (config.json's quantization_config: "
                     f"quant_method {method!r}), which this loader does not read: load the "
                     "unquantized model, or dequantize it and save_pretrained it first") from None


def _umask() -> int:
  """The process's umask, read without changing it where the OS shows it (Linux)."""
  try:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
      if line.startswith("Umask:"):
        return int(line.split()[1], 8)
  except OSError:
    pass
  mask = os.umask(0o022)  # elsewhere: set and restore (briefly process-wide)
  os.umask(mask)
  return mask


# Tokenizer files that loaders read from a model directory (`Tokenizer.save` writes or removes
# the first seven; the folder holds named chat templates); `save_hf` without a tokenizer refuses
# a directory that holds any of them.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                    "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                    "additional_chat_templates", "tokenizer.model", "vocab.json", "merges.txt")


def save_hf(path: str | os.PathLike, cfg: ModelConfig, params, tokenizer=None, *,
            extra_files: Mapping[str, str] | None = None) -> pathlib.Path:
  """Write `config.json` + `model.safetensors` (+ tokenizer files when given) to `path`.

  `path` may start with `~`. Without a tokenizer, a `path` that already holds tokenizer files
  (an earlier export's) is refused with FileExistsError before anything is written.
  `extra_files` maps file names to text written beside them (e.g. a record of which checkpoint
  the weights came from). Every file is written in full under a hidden staging folder first
  and moved into place only when all are complete, so an export that fails (a full disk, an
  unreadable generation_config.json there) leaves `path` as it was. Returns the directory."""
  from safetensors.numpy import save_file

  # pathlib reads "gs://bucket/x" as the local relative path "gs:/bucket/x": the export would
  # land in a folder named "gs:" under the working directory, not in the bucket.
  if re.match(r"[A-Za-z][A-Za-z0-9+.-]+:/", os.fspath(path)):
    raise ValueError(f"save_hf writes a local directory; {os.fspath(path)!r} is a URL. Export to "
                     "a local path, then copy it (e.g. gsutil -m cp -r DIR gs://...)")
  out = pathlib.Path(path).expanduser()
  extra_files = dict(extra_files or {})
  for name in extra_files:
    if (not isinstance(name, str) or not name or name in ("config.json", "model.safetensors", *_TOKENIZER_FILES)
        or pathlib.PurePath(name).name != name or name.startswith(".")):
      raise ValueError(f"save_hf: extra_files name {name!r} must be a plain file name other than "
                       "the model's and tokenizer's own files")
  # Loaders read a safetensors index (or every *.safetensors file) in preference to, or
  # together with, model.safetensors: weights left by an earlier model would be loaded.
  other = sorted(p.name for p in out.glob("*.safetensors*")
                 if p.name != "model.safetensors") if out.is_dir() else []
  if other:
    raise FileExistsError(f"{out} already holds other weights ({', '.join(other)}) that loaders "
                          "would read instead of or along with the new model.safetensors; "
                          "write to an empty directory or remove them")
  # Without a tokenizer nothing replaces the tokenizer files of an earlier export there: the
  # directory would pair the new weights with another model's vocabulary, chat template and
  # stop ids (generation_config.json), and loaders and servers would read them.
  stale = sorted(p.name for p in map(out.joinpath, _TOKENIZER_FILES)
                 if p.is_file() or any(p.glob("*.jinja"))) if tokenizer is None else []
  if stale:
    raise FileExistsError(f"{out} holds tokenizer files ({', '.join(stale)}) that the new weights "
                          "would be loaded with; pass tokenizer= to write the model's own, write "
                          "to an empty directory, or remove them")
  # Checked (and converted) before anything is written: a refused export must not leave a
  # new config.json beside an earlier export's weights.
  hf_cfg, sd = cfg.to_hf(), state_dict_from_params(cfg, params)
  sd.update(_zero_tensors_hf_expects(cfg, sd))
  if tokenizer is not None and not hasattr(tokenizer, "save"):
    raise TypeError(f"save_hf: tokenizer must be a jaxagent Tokenizer (load_tokenizer), got "
                    f"{type(tokenizer).__name__}; its files would not be written")
  gen = out / "generation_config.json"
  if tokenizer is not None and gen.is_file():  # the tokenizer adds its stop ids to it
    try:
      gen_ok = isinstance(json.loads(gen.read_text(encoding="utf-8")), dict)
    except (ValueError, UnicodeDecodeError):
      gen_ok = False
    if not gen_ok:
      raise ValueError(f"{gen} is not a JSON object: the tokenizer writes its stop ids into it "
                       "(keeping its other keys); fix or remove it")
  out.mkdir(parents=True, exist_ok=True)
  # A hidden folder inside `out` (no loader looks into it; renames out of it stay on one file
  # system). One left by an export that was killed is ours to replace.
  stage = out / ".save_hf.partial"
  shutil.rmtree(stage, ignore_errors=True)
  stage.mkdir()
  try:
    (stage / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    save_file(sd, str(stage / "model.safetensors"), metadata={"format": "pt"})
    # The safetensors writer creates its file owner-only (0600) whatever the umask; give it the
    # mode of the other files written here, so others who can read config.json can load it.
    (stage / "model.safetensors").chmod(0o666 & ~_umask())
    if tokenizer is not None:
      # The tokenizer writes into copies of the tokenizer files `out` holds, so the stage ends
      # up as `tokenizer.save(out)` would leave them (other keys of generation_config.json kept,
      # an earlier tokenizer's chat templates removed), and its errors come before any move.
      for name in _TOKENIZER_FILES:
        if (out / name).is_dir():
          shutil.copytree(out / name, stage / name)
        elif (out / name).is_file():
          shutil.copy2(out / name, stage / name)
      tokenizer.save(stage)
    for name, text in extra_files.items():
      (stage / name).write_text(text, encoding="utf-8")
    # config.json last: until it is in place the directory does not load as a model. An earlier
    # export's goes first, so that an export killed part way through its moves leaves a folder
    # that does not load, not new weights or tokenizer files beside the old config.
    (out / "config.json").unlink(missing_ok=True)
    if tokenizer is not None:
      _move_tokenizer_files(stage, out, keep={"config.json", "model.safetensors", *extra_files})
    os.replace(stage / "model.safetensors", out / "model.safetensors")
    for name in extra_files:
      os.replace(stage / name, out / name)
    os.replace(stage / "config.json", out / "config.json")
  finally:
    shutil.rmtree(stage, ignore_errors=True)
  return out


def _move_tokenizer_files(stage: pathlib.Path, out: pathlib.Path, keep: set[str]) -> None:
  """The staged tokenizer files into `out`, and any other file of the stage but those named in
  `keep`; those the tokenizer removed from the stage (copies of `out`'s) are removed from
  `out`."""
  for name in _TOKENIZER_FILES:
    src, dst = stage / name, out / name
    if src.is_dir():  # a folder of named chat templates
      dst.mkdir(exist_ok=True)
      for p in dst.iterdir():
        if p.is_file() and not (src / p.name).exists():
          p.unlink()
      for p in src.iterdir():
        if p.is_file():
          os.replace(p, dst / p.name)
    elif src.is_file():
      os.replace(src, dst)
    elif dst.is_file():
      dst.unlink()
  for p in stage.iterdir():  # any other file the tokenizer writes
    if p.is_file() and p.name not in keep:
      os.replace(p, out / p.name)
