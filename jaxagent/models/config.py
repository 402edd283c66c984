"""Model configuration: the one frozen dataclass every model function takes, and presets.

`ModelConfig` describes a Llama-family decoder (Llama 3.x, SmolLM2, Qwen2/2.5, Qwen3, Mistral)
or a Gemma 3 text decoder: RoPE (optionally with Llama-3 or linear frequency scaling),
grouped-query attention, RMSNorm, SwiGLU or GeGLU MLP, optional QKV bias (Qwen2) and per-head
q/k RMSNorm (Qwen3, Gemma 3), sliding-window attention in some or all layers, tied or separate
output embedding. Gemma 3 adds (1 + w) norms, four norms a layer (post-attention and
post-MLP norms), a sqrt(d_model) embedding scale, an attention scale of
`query_pre_attn_scalar ** -0.5` and a RoPE base of its own in its windowed layers.
It is hashable so it can be a static argument of jitted functions.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Literal, Mapping

import jax.numpy as jnp
import numpy as np

from jaxagent._token_ids import is_int  # NumPy ints too, as GGUF metadata gives them; no bools
from jaxagent.config_files import did_you_mean

DType = Literal["float32", "bfloat16", "float16"]
_DTYPES = ("float32", "bfloat16", "float16")
Remat = Literal["none", "full", "dots", "dots_attention"]
AttentionImpl = Literal["xla", "cudnn", "pallas", "auto"]
LogprobImpl = Literal["xla", "pallas", "auto"]
NormRopeImpl = Literal["xla", "pallas", "auto"]
Activation = Literal["silu", "gelu_tanh"]
_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture and numerics of a decoder-only transformer.

  `param_dtype` is how weights are stored; `dtype` is the compute dtype of activations and
  matmuls. Softmax, norms and logits are always computed in float32.
  """

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  ffn_dim: int
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = True
  qkv_bias: bool = False
  qk_norm: bool = False
  max_seq_len: int = 4096
  # Llama-3 style RoPE frequency scaling: (factor, low_freq_factor, high_freq_factor,
  # original_max_position_embeddings), or None.
  rope_scaling: tuple[float, float, float, int] | None = None
  architecture: Literal["llama", "qwen2", "qwen3", "gemma3"] = "llama"
  # Sliding-window attention: a query at position p sees the keys at positions p - w + 1 .. p
  # of its own sequence (w = sliding_window; a key at distance w is not seen, as in
  # transformers), in the layers `sliding_layers` lists; the other layers see the whole
  # sequence. None: no window (then sliding_layers must be empty).
  sliding_window: int | None = None
  sliding_layers: tuple[int, ...] = ()
  # RoPE base of the windowed layers (Gemma 3's rope_local_base_freq), which then use no
  # frequency scaling; None: the windowed layers rotate as the others do.
  local_rope_theta: float | None = None
  # Linear RoPE scaling (positions divided by this factor) of the layers that use `rope_theta`
  # (transformers' rope_type "linear", Gemma 3 4B and larger); None: none.
  rope_linear_factor: float | None = None
  # MLP activation: "silu" (SwiGLU, Llama / Qwen) or "gelu_tanh" (GeGLU with the tanh
  # approximation of gelu, Gemma's gelu_pytorch_tanh).
  activation: Activation = "silu"
  # Gemma-style norms: RMSNorm scales by (1 + w) (zero weights are the identity), every layer
  # also norms its attention output and its MLP output before adding them to the stream, and
  # the embeddings are multiplied by sqrt(d_model) (rounded to the compute dtype, as
  # transformers rounds it to its weights' dtype).
  norm_plus_one: bool = False
  post_norms: bool = False
  embed_scale: bool = False
  # Attention logits are scaled by query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim ** -0.5.
  query_pre_attn_scalar: float | None = None
  bos_token_id: int | None = None
  eos_token_id: int | None = None
  # Further end-of-sequence ids of checkpoints that list several (`eos_token_id: [a, b]` in
  # config.json, e.g. an instruct model's end-of-turn token besides its end of text).
  extra_eos_token_ids: tuple[int, ...] = ()
  param_dtype: DType = "float32"
  dtype: DType = "float32"
  remat: Remat = "none"
  # The training forward's loop over layers: a `lax.scan` over the stacked layer weights (one
  # layer body in the program, the fastest compile) or, with False, an unrolled Python loop
  # (`decoder.hidden_states`); the train step then differentiates per-layer weight copies
  # made once per step, and saved activations stay separate buffers, so the backward pass
  # reads them in place instead of slicing them out of the scan's stacked carries.
  scan_layers: bool = True
  # Attention over packed rows in the training forward: "xla" (einsums with a dense mask),
  # "cudnn" (fused attention with the dense segment mask as a bias), "pallas"
  # (`packed_attention`: kernels that skip the blocks across segments; GPU, interpret mode
  # elsewhere) or "auto": pallas on GPUs (cudnn for head sizes other than 16, 32, 64, 128),
  # xla elsewhere. On an H100 the Pallas kernels took half the time of cuDNN's per
  # training attention call, packed or not (benchmarks/RESULTS.md). Windowed models and Gemma's
  # query_pre_attn_scalar take cudnn (bf16 / f16; the window in its mask) or xla from "auto";
  # the Pallas kernels' window and scale (tested in interpret mode, not yet on a GPU) run them
  # only with an explicit "pallas" (`decoder.attention_path`).
  attention_impl: AttentionImpl = "auto"
  # The learner's projection onto the vocabulary for token log-probs (`token_logprobs`): "xla"
  # (a matmul to float32 logits per chunk, then passes over them), "pallas" (`vocab_kernels`:
  # the log-sum-exp and the backward pass's logit cotangent from the matmul's tiles in
  # registers, no float32 logits in HBM; GPU, interpret mode elsewhere; bf16 / f16 models) or
  # "auto": pallas on GPUs where the kernels tile the shapes and d_model <= 2048 (wider
  # models' matmul is faster on XLA; `logprobs.logprob_path`), xla elsewhere. Both paths take
  # the final-normed hidden states, so they serve every architecture here (Gemma 3 has no
  # final logit soft-cap; a soft-capped config is refused at load).
  logprob_impl: LogprobImpl = "auto"
  # Qwen3's per-head q / k norms and RoPE (`decoder.norm_rope`): "xla", "pallas"
  # (`norm_rope_kernels`: one kernel each way; GPU, interpret mode elsewhere; head counts and
  # head size powers of two) or "auto": pallas on GPUs where the kernels tile and no "tensor"
  # mesh axis splits the heads, xla elsewhere (`decoder.norm_rope_path`). Models without q / k
  # norms apply RoPE alone, as XLA operations. Gemma's (1 + w) q / k norms take xla ("pallas"
  # is an error for them).
  norm_rope_impl: NormRopeImpl = "auto"
  name: str = "custom"

  def __post_init__(self):
    for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
              "ffn_dim", "max_seq_len"):
      v = getattr(self, f)
      if not is_int(v) or v <= 0:
        raise ValueError(f"ModelConfig.{f} must be a positive int, got {v!r}")
      object.__setattr__(self, f, int(v))
    for f in ("rope_theta", "norm_eps"):
      v = getattr(self, f)
      if (isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v)
          or v < 0 or (f == "rope_theta" and v == 0)):
        raise ValueError(f"ModelConfig.{f} must be a finite number "
                         f"{'> 0' if f == 'rope_theta' else '>= 0'}, got {v!r}")
      # A NumPy float (np.float32 is no Python float) would reach to_hf and save_hf's
      # config.json, which JSON cannot write.
      object.__setattr__(self, f, float(v))
    # A truthy string ("no", "false") would silently switch the feature on.
    for f in ("tie_embeddings", "qkv_bias", "qk_norm", "scan_layers", "norm_plus_one",
              "post_norms", "embed_scale"):
      v = getattr(self, f)
      if not isinstance(v, (bool, np.bool_)):
        raise ValueError(f"ModelConfig.{f} must be a bool (True or False), got {v!r}")
      object.__setattr__(self, f, bool(v))
    # End-of-sequence ids: one outside the vocabulary is never sampled, so generation would
    # never stop on it. (The bos id is only written to exported configs, and a preset's stays
    # when the trainer resizes the vocabulary to another tokenizer's: no range check.) Lists
    # (from JSON or a config file) become tuples: the config must stay hashable.
    if self.bos_token_id is not None:
      if not is_int(self.bos_token_id) or self.bos_token_id < 0:
        raise ValueError("ModelConfig.bos_token_id must be None or a token id (an int >= 0), "
                         f"got {self.bos_token_id!r}")
      object.__setattr__(self, "bos_token_id", int(self.bos_token_id))
    if self.eos_token_id is not None:
      object.__setattr__(self, "eos_token_id", self._token_id("eos_token_id", self.eos_token_id))
    extra = self.extra_eos_token_ids
    if not isinstance(extra, (tuple, list)):
      raise ValueError("ModelConfig.extra_eos_token_ids must be a tuple of token ids, got "
                       f"{extra!r}")
    object.__setattr__(self, "extra_eos_token_ids",
                       tuple(self._token_id("extra_eos_token_ids", e) for e in extra))
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
          f"({self.n_kv_heads}) for grouped-query attention")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
    for f in ("param_dtype", "dtype"):
      if getattr(self, f) not in _DTYPES:
        raise ValueError(f"ModelConfig.{f} must be one of {_DTYPES}, got {getattr(self, f)!r}")
      # A NumPy dtype (an array's .dtype) equals its name but hashes otherwise, and JSON (the
      # checkpoint's metadata, to_hf's torch_dtype) cannot write it: stored as the name.
      object.__setattr__(self, f, jnp.dtype(getattr(self, f)).name)
    if self.remat not in ("none", "full", "dots", "dots_attention"):
      raise ValueError("ModelConfig.remat must be 'none', 'full', 'dots' or 'dots_attention', "
                       f"got {self.remat!r}")
    if self.attention_impl not in ("xla", "cudnn", "pallas", "auto"):
      raise ValueError("ModelConfig.attention_impl must be 'xla', 'cudnn', 'pallas' or 'auto', got "
                       f"{self.attention_impl!r}")
    if self.logprob_impl not in ("xla", "pallas", "auto"):
      raise ValueError("ModelConfig.logprob_impl must be 'xla', 'pallas' or 'auto', got "
                       f"{self.logprob_impl!r}")
    if self.norm_rope_impl not in ("xla", "pallas", "auto"):
      raise ValueError("ModelConfig.norm_rope_impl must be 'xla', 'pallas' or 'auto', got "
                       f"{self.norm_rope_impl!r}")
    if self.architecture not in _ARCHS:
      raise ValueError(f"ModelConfig.architecture must be one of {_ARCHS}, got "
                       f"{self.architecture!r}")
    self._check_window_and_gemma()
    if self.rope_scaling is not None:
      rs = self.rope_scaling
      what = ("ModelConfig.rope_scaling must be (factor, low_freq_factor, high_freq_factor, "
              "original_max_position_embeddings) with factor > 0, 0 < low_freq_factor < "
              f"high_freq_factor and a positive int original_max_position_embeddings, got {rs!r}")
      if not isinstance(rs, (tuple, list)) or len(rs) != 4:
        raise ValueError(what)
      factor, lo, hi, orig = rs
      if (not all(isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
                  for x in (factor, lo, hi)) or not is_int(orig)
          or not (factor > 0 and 0 < lo < hi and orig > 0)):
        raise ValueError(what)
      object.__setattr__(self, "rope_scaling", (float(factor), float(lo), float(hi), int(orig)))

  def _check_window_and_gemma(self):
    """Validates the sliding window, the local RoPE base and the Gemma 3 features."""
    w = self.sliding_window
    if w is not None:
      if not is_int(w) or w <= 0:
        raise ValueError(f"ModelConfig.sliding_window must be None or a positive int (the "
                         f"number of positions a query sees, itself included), got {w!r}")
      object.__setattr__(self, "sliding_window", int(w))
    layers = self.sliding_layers
    if not isinstance(layers, (tuple, list)) or not all(
        is_int(i) and 0 <= i < self.n_layers for i in layers):
      raise ValueError(f"ModelConfig.sliding_layers must be a tuple of layer indices in "
                       f"[0, n_layers={self.n_layers}), got {layers!r}")
    layers = tuple(sorted({int(i) for i in layers}))
    object.__setattr__(self, "sliding_layers", layers)
    if (w is None) != (not layers):
      raise ValueError(
          f"ModelConfig.sliding_window={w!r} with sliding_layers={layers!r}: set both (a window "
          "and the layers that use it) or neither")
    for f in ("local_rope_theta", "rope_linear_factor", "query_pre_attn_scalar"):
      v = getattr(self, f)
      if v is None:
        continue
      if (isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v)
          or v <= 0):
        raise ValueError(f"ModelConfig.{f} must be None or a finite number > 0, got {v!r}")
      object.__setattr__(self, f, float(v))
    if self.rope_linear_factor is not None and self.rope_scaling is not None:
      raise ValueError("ModelConfig: rope_scaling (llama3) and rope_linear_factor (linear) are "
                       "two RoPE scalings; set at most one")
    if self.activation not in ("silu", "gelu_tanh"):
      raise ValueError("ModelConfig.activation must be 'silu' (SwiGLU) or 'gelu_tanh' (GeGLU), "
                       f"got {self.activation!r}")
    # Gemma 3's features come together: transformers' Gemma3 class has all of them and the
    # Llama / Qwen classes none, so any other mix would export as another function.
    gemma = dict(qk_norm=True, norm_plus_one=True, post_norms=True, embed_scale=True,
                 activation="gelu_tanh")
    if self.architecture == "gemma3":
      wrong = {k: getattr(self, k) for k, v in gemma.items() if getattr(self, k) != v}
      if wrong:
        raise ValueError(f"ModelConfig: architecture 'gemma3' needs {gemma}; got {wrong}")
      if self.qkv_bias:
        raise ValueError("ModelConfig: architecture 'gemma3' has no q/k/v biases "
                         "(qkv_bias=False)")
    else:
      wrong = {k: getattr(self, k) for k in gemma if k != "qk_norm"
               and getattr(self, k) != ModelConfig.__dataclass_fields__[k].default}
      if self.query_pre_attn_scalar is not None:
        wrong["query_pre_attn_scalar"] = self.query_pre_attn_scalar
      if wrong:
        raise ValueError(f"ModelConfig: {wrong} are Gemma 3 features; use architecture='gemma3' "
                         f"(architecture {self.architecture!r} has none of them)")

  @property
  def attn_scale(self) -> float:
    """The factor on the attention logits: query_pre_attn_scalar ** -0.5 (computed as
    transformers' Gemma 3 does), else 1 / sqrt(head_dim)."""
    if self.query_pre_attn_scalar is None:
      return 1.0 / math.sqrt(self.head_dim)
    return self.query_pre_attn_scalar ** -0.5

  @property
  def windowed(self) -> bool:
    """Whether some layer attends within a sliding window."""
    return self.sliding_window is not None

  def layer_window(self, layer: int) -> int | None:
    """The window of `layer` (None: it sees the whole sequence)."""
    return self.sliding_window if layer in self.sliding_layers else None

  @property
  def per_layer_rope(self) -> bool:
    """Whether the layers rotate with different RoPE frequencies (a local RoPE base)."""
    return self.local_rope_theta is not None and bool(self.sliding_layers)

  def _token_id(self, field: str, v) -> int:
    if not is_int(v) or not 0 <= v < self.vocab_size:
      raise ValueError(f"ModelConfig.{field}: {v!r} is not a token id of the vocabulary "
                       f"(an int in [0, vocab_size={self.vocab_size}))")
    return int(v)

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def q_per_kv(self) -> int:
    return self.n_heads // self.n_kv_heads

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def num_params(self) -> int:
    """Parameter count (embedding counted once when tied)."""
    d, h, kv, hd, f, v = (self.d_model, self.n_heads, self.n_kv_heads, self.head_dim,
                          self.ffn_dim, self.vocab_size)
    per_layer = d * hd * (h + 2 * kv) + h * hd * d + 3 * d * f + 2 * d
    if self.qkv_bias:
      per_layer += hd * (h + 2 * kv)
    if self.qk_norm:
      per_layer += 2 * hd
    if self.post_norms:
      per_layer += 2 * d
    total = self.n_layers * per_layer + v * d + d
    if not self.tie_embeddings:
      total += v * d
    return total

  def flops_per_token(self, seq_len: int, training: bool = True) -> float:
    """Matmul FLOPs per token (6N + attention for training, 2N + attention for inference).

    The embedding lookup is excluded, the output projection included; attention counts the
    causal half of the score and value matmuls.
    """
    n = self.num_params() - self.vocab_size * self.d_model * (0 if self.tie_embeddings else 1)
    attn = 2 * self.n_layers * self.n_heads * self.head_dim * seq_len  # causal: QK + PV halves
    if self.windowed and seq_len > self.sliding_window:
      # A windowed layer's query sees min(t, w) keys, not t: per token (L^2 / 2 - the keys
      # beyond the window) / L where the full causal count takes L / 2.
      w, length = self.sliding_window, seq_len
      seen = (w * (w + 1) / 2 + (length - w) * w) / length
      per_layer = 2 * self.n_heads * self.head_dim * seq_len
      attn -= len(self.sliding_layers) * (per_layer - 4 * self.n_heads * self.head_dim * seen)
    mult = 3 if training else 1
    return mult * (2 * n + attn)

  # ---- HF config.json interop -------------------------------------------------------
  @classmethod
  def from_hf(cls, hf: Mapping[str, Any], **overrides) -> "ModelConfig":
    """Build from an HF `config.json` dict (Llama, Qwen2, Qwen3 naming)."""
    archs = hf.get("architectures") or []
    if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
      raise ValueError(f"HF config: architectures={archs!r} must be a list of class names, "
                       "e.g. [\"LlamaForCausalLM\"]")
    model_type = hf.get("model_type", "")
    if "Gemma3ForConditionalGeneration" in archs or (model_type == "gemma3"
                                                       and "text_config" in hf):
      raise ValueError(
          "HF config: a Gemma 3 vision-language checkpoint (Gemma3ForConditionalGeneration, "
          "model_type 'gemma3'); jaxagent loads the text-only Gemma3ForCausalLM "
          "(model_type 'gemma3_text', e.g. google/gemma-3-1b-it): extract the text tower first")
    if "Gemma3ForCausalLM" in archs or model_type == "gemma3_text":
      kw = _gemma3_kw(hf)
      kw.update(overrides)
      return cls(**kw)
    known = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3", "MistralForCausalLM": "llama"}
    arch = None
    for a in archs:
      if a in known:
        arch = known[a]
    if arch is None:
      arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
              "mistral": "llama"}.get(model_type)
    if arch is None:
      raise ValueError(
          f"unknown architecture {archs or model_type!r}: jaxagent supports "
          f"{sorted(known)} (model_type llama, qwen2, qwen3)")
    def need(key):  # a required size: a positive int
      if hf.get(key) is None:
        raise ValueError(f"HF config: required field {key!r} is "
                         f"{'null' if key in hf else 'missing'}")
      if not is_int(hf[key]) or hf[key] <= 0:
        raise ValueError(f"HF config: {key}={hf[key]!r} must be a positive int")
      return hf[key]

    def number(key, default):  # an optional numeric field; null is an error
      v = hf.get(key, default)
      if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"HF config: {key}={v!r} must be a number (or left out: default {default})")
      return v

    # Features of these architectures that the model here does not implement: loading such a
    # checkpoint would run and give wrong logits, so it is refused.
    if hf.get("mlp_bias"):
      raise ValueError("HF config: mlp_bias=True (biases on the MLP projections) is not supported")
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
      raise ValueError(f"HF config: hidden_act={act!r} is not supported (SwiGLU with silu only)")
    # Llama / Qwen3 with attention_bias=True also bias the output projection, which the model
    # here lacks: such a config loads as qkv_bias=True, and the weight loader accepts an
    # o_proj.bias only when it is all zeros (as save_hf writes it) and refuses any other.
    mistral = model_type == "mistral" or "MistralForCausalLM" in archs
    # transformers' Mistral, Qwen2 and Qwen3 configs default sliding_window to 4096: a
    # config.json without the key gets that window there (Qwen's only with use_sliding_window).
    window = hf.get("sliding_window", 4096 if mistral or arch in ("qwen2", "qwen3") else None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, (int, float))):
      raise ValueError(f"HF config: sliding_window={window!r} must be a number or null")
    # transformers 5.x writes rope settings under `rope_parameters`; released checkpoints
    # keep a top-level `rope_theta` / `rope_scaling`. transformers reads `rope_scaling` in place
    # of `rope_parameters` when both are given, and a `rope_theta` inside that dict before the
    # top-level one (older releases read the top-level one): a file whose places disagree is
    # refused rather than read one way or the other.
    given = {k: hf.get(k) for k in ("rope_scaling", "rope_parameters")}
    for k, v in given.items():
      if v is not None and not isinstance(v, Mapping):
        raise ValueError(f"HF config: {k}={v!r} must be an object (or null)")

    def spelled_one_way(d):  # `type` is the older spelling of `rope_type`
      out = {k: v for k, v in d.items() if k != "type"}
      out["rope_type"] = d.get("rope_type", d.get("type")) or "default"
      return out
    if given["rope_scaling"] and given["rope_parameters"]:
      if spelled_one_way(given["rope_scaling"]) != spelled_one_way(given["rope_parameters"]):
        raise ValueError(
            f"HF config: rope_scaling={dict(given['rope_scaling'])!r} and rope_parameters="
            f"{dict(given['rope_parameters'])!r} disagree (transformers 5 reads rope_scaling "
            "alone); keep one of them")
    rope_params = given["rope_scaling"] or given["rope_parameters"] or {}
    theta = number("rope_theta", 10_000.0)
    if rope_params.get("rope_theta") is not None:
      inner = rope_params["rope_theta"]
      if isinstance(inner, bool) or not isinstance(inner, (int, float)):
        raise ValueError(f"HF config: rope_theta={inner!r} (in the rope settings) must be a number")
      if hf.get("rope_theta") is not None and float(inner) != float(theta):
        raise ValueError(
            f"HF config: rope_theta={hf['rope_theta']!r} at the top level and rope_theta="
            f"{inner!r} in the rope settings disagree (transformers 5 reads the latter, older "
            "releases the former); keep one of them")
      theta = inner
    scaling = (rope_params if rope_params.get("rope_type", rope_params.get("type"))
               not in (None, "default") else None)
    rope_scaling = linear = None
    if scaling:
      rtype = scaling.get("rope_type", scaling.get("type"))
      if rtype == "linear":  # positions divided by the factor (`rope_linear_factor`)
        linear = scaling.get("factor")
        if isinstance(linear, bool) or not isinstance(linear, (int, float)) or not (
            math.isfinite(linear) and linear > 0):
          raise ValueError(f"HF config: linear rope scaling factor={linear!r} must be a "
                           "number > 0")
        linear = float(linear)
      elif rtype == "llama3":
        fields = ("factor", "low_freq_factor", "high_freq_factor",
                  "original_max_position_embeddings")
        for field in fields:
          if field not in scaling:
            raise ValueError(f"HF config: llama3 rope scaling lacks the field {field!r}")
          v = scaling[field]
          # A null or a string here used to escape as a bare TypeError from float(), and a
          # fractional context length was truncated silently.
          if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (
              field == fields[-1] and v != int(v)):
            raise ValueError(f"HF config: llama3 rope scaling {field}={v!r} must be "
                             f"{'an int' if field == fields[-1] else 'a number'}")
        rope_scaling = (float(scaling["factor"]), float(scaling["low_freq_factor"]),
                        float(scaling["high_freq_factor"]),
                        int(scaling["original_max_position_embeddings"]))
      elif rtype not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {rtype!r} (supported: llama3, linear)")
    n_heads = need("num_attention_heads")
    # transformers' Qwen3 config defaults head_dim to 128 (not hidden_size / heads).
    head_dim = hf.get("head_dim") or (128 if arch == "qwen3" and "head_dim" not in hf
                                      else need("hidden_size") // n_heads)
    # A null num_key_value_heads means one per query head (plain multi-head attention); a
    # missing one takes the default of transformers' config class, which is 32 for Qwen2 / Qwen3
    # and 8 for Mistral, not the head count.
    if "num_key_value_heads" in hf:
      n_kv_heads = hf["num_key_value_heads"] or n_heads
    else:
      n_kv_heads = 8 if mistral else {"qwen2": 32, "qwen3": 32}.get(arch, n_heads)
    eos = hf.get("eos_token_id")
    extra_eos: tuple[int, ...] = ()
    if isinstance(eos, (list, tuple)):
      # As given: ModelConfig checks each is a token id, as it checks a single one (int() made
      # 2.5 the id 2 and true the id 1, and a null a bare TypeError).
      eos, extra_eos = (eos[0], tuple(eos[1:])) if eos else (None, ())
    kw = dict(
        vocab_size=need("vocab_size"), d_model=need("hidden_size"),
        n_layers=need("num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=n_kv_heads, head_dim=head_dim,
        ffn_dim=need("intermediate_size"), rope_theta=float(theta),
        norm_eps=float(number("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=bool(hf.get("attention_bias", arch == "qwen2")),
        qk_norm=(arch == "qwen3"),
        # A config.json without the key takes the default of transformers' config class.
        max_seq_len=int(number("max_position_embeddings",
                               131072 if mistral else {"llama": 2048}.get(arch, 32768))),
        rope_scaling=rope_scaling, rope_linear_factor=linear, architecture=arch,
        bos_token_id=hf.get("bos_token_id"), eos_token_id=eos, extra_eos_token_ids=extra_eos,
        name=hf.get("_name_or_path", "hf") or "hf")
    windowed, window = _windowed_layers(hf, arch, mistral, hf["num_hidden_layers"], window)
    # A window at least as long as the longest sequence served here (max_seq_len) never masks
    # anything: such layers are full attention.
    seq = overrides.get("max_seq_len", kw["max_seq_len"])
    if windowed and not (is_int(seq) and window >= seq):
      if window != int(window) or window < 1:
        raise ValueError(f"HF config: sliding_window={window!r} must be a positive int (layers "
                         f"{windowed} use it)")
      kw.update(sliding_window=int(window), sliding_layers=tuple(windowed))
    kw.update(overrides)
    return cls(**kw)

  def to_hf(self) -> dict[str, Any]:
    """An HF `config.json` dict that `transformers` loads."""
    if self.architecture == "gemma3":
      return self._gemma3_to_hf()
    # transformers' Qwen3 always has q / k norms and its Llama and Qwen2 never do: written
    # under the wrong architecture, the checkpoint would load as another function.
    if self.qk_norm != (self.architecture == "qwen3"):
      raise ValueError(f"ModelConfig.to_hf: qk_norm={self.qk_norm} with architecture "
                       f"{self.architecture!r} has no HF equivalent (q / k norms are Qwen3's: "
                       "use architecture='qwen3' with qk_norm=True, else qk_norm=False)")
    arch = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
            "qwen3": ("Qwen3ForCausalLM", "qwen3")}[self.architecture]
    if self.per_layer_rope:
      # transformers' Llama, Mistral and Qwen rotate every layer alike: the windowed layers'
      # own base would be dropped from the export, which would load as another function.
      raise ValueError(
          f"ModelConfig.to_hf: local_rope_theta={self.local_rope_theta} (a RoPE base of the "
          f"windowed layers' own) has no HF equivalent for architecture {self.architecture!r} "
          "(only Gemma 3 has one): use local_rope_theta=None")
    if self.windowed and self.architecture == "llama":
      # transformers' Llama has no window; its Mistral is Llama with one in every layer.
      if len(self.sliding_layers) != self.n_layers or self.qkv_bias or self.rope_scaling:
        raise ValueError(
            "ModelConfig.to_hf: a windowed llama-architecture model exports as Mistral, which "
            "windows every layer and has no q/k/v biases nor llama3 RoPE scaling; this one "
            f"windows layers {list(self.sliding_layers)} of {self.n_layers} (qkv_bias="
            f"{self.qkv_bias}, rope_scaling={self.rope_scaling}): it has no HF equivalent")
      arch = ("MistralForCausalLM", "mistral")
    hf: dict[str, Any] = {
        "architectures": [arch[0]], "model_type": arch[1],
        "vocab_size": self.vocab_size, "hidden_size": self.d_model,
        "intermediate_size": self.ffn_dim, "num_hidden_layers": self.n_layers,
        "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads,
        "head_dim": self.head_dim, "rms_norm_eps": self.norm_eps,
        "rope_theta": self.rope_theta, "max_position_embeddings": self.max_seq_len,
        "tie_word_embeddings": self.tie_embeddings, "hidden_act": "silu",
        "torch_dtype": self.param_dtype, "attention_dropout": 0.0,
    }
    if self.architecture == "llama" and not self.windowed:
      hf["attention_bias"] = self.qkv_bias
      hf["mlp_bias"] = False
    if self.windowed:
      hf["sliding_window"] = self.sliding_window
      if self.architecture != "llama":
        hf["use_sliding_window"] = True
        hf["layer_types"] = ["sliding_attention" if i in self.sliding_layers
                             else "full_attention" for i in range(self.n_layers)]
        # Releases that predate layer_types window the layers from max_window_layers on.
        first = self.sliding_layers[0]
        if self.sliding_layers == tuple(range(first, self.n_layers)):
          hf["max_window_layers"] = first
    if self.architecture == "qwen3":
      hf["attention_bias"] = self.qkv_bias
    if self.rope_scaling is not None:
      f, lo, hi, orig = self.rope_scaling
      hf["rope_scaling"] = {"rope_type": "llama3", "factor": f, "low_freq_factor": lo,
                            "high_freq_factor": hi, "original_max_position_embeddings": orig}
    if self.rope_linear_factor is not None:
      hf["rope_scaling"] = {"rope_type": "linear", "factor": self.rope_linear_factor}
    if self.bos_token_id is not None:
      hf["bos_token_id"] = self.bos_token_id
    # Every id generation stops on (`eos_token_ids`): the extra ones too where eos_token_id is
    # None, which were dropped from the export.
    ids = self.eos_token_ids
    if ids:
      hf["eos_token_id"] = list(ids) if len(ids) > 1 else ids[0]
    return hf

  def _gemma3_to_hf(self) -> dict[str, Any]:
    """`to_hf` of a Gemma 3 text model (Gemma3ForCausalLM, model_type gemma3_text), in the
    released checkpoints' spelling (top-level rope_theta / rope_local_base_freq /
    rope_scaling), which transformers 4.50+ and 5.x both read."""
    scalar = self.query_pre_attn_scalar or self.head_dim
    if not float(scalar).is_integer():
      # Written as a float, the export would fail only when transformers loads it.
      raise ValueError(f"ModelConfig.to_hf: query_pre_attn_scalar={scalar!r} has no HF "
                       "equivalent: transformers' Gemma3TextConfig takes a whole number")
    hf: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": self.vocab_size, "hidden_size": self.d_model,
        "intermediate_size": self.ffn_dim, "num_hidden_layers": self.n_layers,
        "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads,
        "head_dim": self.head_dim, "rms_norm_eps": self.norm_eps,
        "rope_theta": self.rope_theta,
        "rope_local_base_freq": (self.local_rope_theta if self.local_rope_theta is not None
                                 else self.rope_theta),
        "max_position_embeddings": self.max_seq_len,
        "tie_word_embeddings": self.tie_embeddings, "hidden_activation": "gelu_pytorch_tanh",
        # (an int in transformers' config class, which refuses a float)
        "query_pre_attn_scalar": int(scalar),
        "attention_bias": False, "attention_dropout": 0.0,
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "torch_dtype": self.param_dtype,
        # transformers needs a window even with no windowed layer; it is then unused.
        "sliding_window": self.sliding_window or self.max_seq_len,
        "layer_types": ["sliding_attention" if i in self.sliding_layers else "full_attention"
                        for i in range(self.n_layers)],
        "rope_scaling": (None if self.rope_linear_factor is None else
                         {"rope_type": "linear", "factor": self.rope_linear_factor}),
    }
    if self.rope_scaling is not None:
      raise ValueError("ModelConfig.to_hf: a gemma3 config with llama3 RoPE scaling "
                       f"(rope_scaling={self.rope_scaling}) has no HF equivalent here (Gemma 3 "
                       "scales its global layers linearly: rope_linear_factor)")
    if self.local_rope_theta is None and self.sliding_layers and (
        self.rope_linear_factor is not None):
      raise ValueError("ModelConfig.to_hf: Gemma 3's windowed layers use no RoPE scaling; a "
                       "gemma3 config whose windowed layers share the scaled global RoPE "
                       "(local_rope_theta=None with rope_linear_factor) has no HF equivalent")
    if self.bos_token_id is not None:
      hf["bos_token_id"] = self.bos_token_id
    ids = self.eos_token_ids
    if ids:
      hf["eos_token_id"] = list(ids) if len(ids) > 1 else ids[0]
    return hf

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    """Every end-of-sequence id of the config (`eos_token_id`, then the extra ones)."""
    return (() if self.eos_token_id is None else (self.eos_token_id,)) + tuple(
        self.extra_eos_token_ids)


_QWEN_MAX_WINDOW_LAYERS = 28  # transformers' Qwen2Config / Qwen3Config default


def _windowed_layers(hf: Mapping[str, Any], arch: str, mistral: bool, n_layers: int,
                     window) -> tuple[list[int], Any]:
  """The layers transformers runs with a sliding window, and that window, for an HF config.

  Mistral applies `sliding_window` to every layer whenever it is set (it reads neither
  use_sliding_window nor layer_types). Qwen2 / Qwen3 use the window only with
  use_sliding_window, and then only in the layers `layer_types` calls "sliding_attention"; with
  no layer_types those are the layers from `max_window_layers` (default 28) on, so a config whose
  layers all come before it is full attention. transformers' Llama has no window; a Llama config
  that asks for one with use_sliding_window is read as windowing every layer.
  """
  if mistral:
    return (list(range(n_layers)) if window is not None else []), window
  if not hf.get("use_sliding_window"):
    window = None
  if arch == "llama":
    return (list(range(n_layers)) if window is not None else []), window
  types = hf.get("layer_types")
  if types is None:
    if window is None:
      return [], None
    first = hf.get("max_window_layers", _QWEN_MAX_WINDOW_LAYERS)
    if not is_int(first):
      raise ValueError(f"HF config: max_window_layers={first!r} must be an int (or left out: "
                       f"default {_QWEN_MAX_WINDOW_LAYERS})")
    return [i for i in range(n_layers) if i >= first], window
  allowed = ("full_attention", "sliding_attention")
  if not (isinstance(types, list) and len(types) == n_layers
          and all(isinstance(t, str) and t in allowed for t in types)):
    raise ValueError(f"HF config: layer_types={types!r} must list one of {allowed} for each of "
                     f"the num_hidden_layers={n_layers} layers")
  windowed = [i for i, t in enumerate(types) if t == "sliding_attention"]
  if windowed and window is None:
    raise ValueError(
        f"HF config: layer_types makes layer(s) {windowed} 'sliding_attention' but no window is "
        f"set (use_sliding_window={hf.get('use_sliding_window')!r}, sliding_window="
        f"{hf.get('sliding_window')!r}); transformers cannot run such a config: make those "
        "layers 'full_attention' or set the window")
  return windowed, window


def _int_if_whole(v):
  return int(v) if float(v).is_integer() else v


def _gemma3_kw(hf: Mapping[str, Any]) -> dict[str, Any]:
  """`ModelConfig` fields of an HF Gemma 3 text config (Gemma3ForCausalLM, model_type
  gemma3_text), with transformers' Gemma3TextConfig defaults for the keys it leaves out. Reads
  both spellings of the rope settings: the released checkpoints' top-level rope_theta /
  rope_local_base_freq / rope_scaling, and transformers 5's rope_parameters keyed by layer
  type ({"full_attention": {...}, "sliding_attention": {...}})."""
  def need(key):
    v = hf.get(key)
    if not is_int(v) or v <= 0:
      raise ValueError(f"HF config: {key}={v!r} must be a positive int"
                       + ("" if key in hf else " (the field is missing)"))
    return int(v)

  def number(key, default, where=hf):
    v = where.get(key, default)
    if v is None:
      v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
      raise ValueError(f"HF config: {key}={v!r} must be a number > 0 (or left out: default "
                       f"{default})")
    return float(v)

  for key in ("final_logit_softcapping", "attn_logit_softcapping"):
    if hf.get(key) is not None:
      raise ValueError(f"HF config: {key}={hf[key]!r}: logit soft-capping (Gemma 2) is not "
                       "supported; Gemma 3 sets it to null")
  if hf.get("use_bidirectional_attention"):
    raise ValueError("HF config: use_bidirectional_attention=True (an encoder variant of Gemma 3) "
                     "is not supported; jaxagent's decoder is causal")
  if hf.get("attention_bias"):
    raise ValueError("HF config: attention_bias=True is not supported for Gemma 3")
  act = hf.get("hidden_activation", hf.get("hidden_act")) or "gelu_pytorch_tanh"
  if act not in ("gelu_pytorch_tanh", "gelu_new"):
    raise ValueError(f"HF config: hidden_activation={act!r} is not supported for Gemma 3 (GeGLU "
                     "with the tanh approximation of gelu: gelu_pytorch_tanh)")
  n_layers = need("num_hidden_layers")
  types = hf.get("layer_types")
  if types is None:
    pattern = hf.get("sliding_window_pattern", 6)
    if not is_int(pattern) or pattern <= 0:
      raise ValueError(f"HF config: sliding_window_pattern={pattern!r} must be a positive int")
    types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
             for i in range(n_layers)]
  allowed = ("full_attention", "sliding_attention")
  if not (isinstance(types, list) and len(types) == n_layers
          and all(isinstance(t, str) and t in allowed for t in types)):
    raise ValueError(f"HF config: layer_types={types!r} must list one of {allowed} for each of "
                     f"the num_hidden_layers={n_layers} layers")
  windowed = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
  window = hf.get("sliding_window", 4096)
  if windowed:
    if not is_int(window) or window <= 0:
      raise ValueError(f"HF config: sliding_window={window!r} must be a positive int (layers "
                       f"{list(windowed)} are 'sliding_attention')")
  # Rope settings: per layer type under rope_parameters (transformers 5), or top level.
  given = {k: hf.get(k) for k in ("rope_scaling", "rope_parameters")}
  for k, v in given.items():
    if v is not None and not isinstance(v, Mapping):
      raise ValueError(f"HF config: {k}={v!r} must be an object (or null)")
  params = given["rope_parameters"] or {}
  kinds = ("full_attention", "sliding_attention")
  flat = {k: v for k, v in params.items() if k not in kinds}
  if flat:
    # Settings not keyed by layer type: transformers 5 leaves them unread for Gemma 3 (both
    # layer types keep rope_theta / rope_local_base_freq, unscaled), so reading them as the
    # global layers' would load another function than transformers runs.
    if any(k not in ("rope_type", "type") for k in flat) or flat.get(
        "rope_type", flat.get("type")) not in (None, "default"):
      raise ValueError(
          f"HF config: rope_parameters={dict(params)!r} is not keyed by layer type; "
          "transformers 5 does not read such settings for Gemma 3 (its layers keep "
          "rope_theta / rope_local_base_freq, unscaled): key them by layer type "
          '({"full_attention": {...}, "sliding_attention": {...}}) or use the top-level '
          "rope_theta / rope_local_base_freq / rope_scaling")
    params = {k: v for k, v in params.items() if k in kinds}
  full = dict(params.get("full_attention") or {})
  local = dict(params.get("sliding_attention") or {})
  if given["rope_scaling"]:
    full.update(given["rope_scaling"])
  for d, what in ((full, "full_attention"), (local, "sliding_attention")):
    if not isinstance(d, Mapping):
      raise ValueError(f"HF config: the {what} rope settings {d!r} must be an object")

  def theta_of(d, key, default):
    inner, top = d.get("rope_theta"), hf.get(key)
    if inner is not None and top is not None and float(inner) != float(top):
      raise ValueError(f"HF config: {key}={top!r} at the top level and rope_theta={inner!r} in "
                       "the rope settings disagree; keep one of them")
    return number("rope_theta", default, {"rope_theta": inner if inner is not None else top})
  theta = theta_of(full, "rope_theta", 1_000_000.0)
  local_theta = theta_of(local, "rope_local_base_freq", 10_000.0)
  if local.get("rope_type", local.get("type")) not in (None, "default"):
    raise ValueError(f"HF config: RoPE scaling of the sliding-window layers ({local!r}) is not "
                     "supported (Gemma 3 scales only its global layers)")
  rtype = full.get("rope_type", full.get("type"))
  linear = None
  if rtype == "linear":
    linear = number("factor", None, full) if "factor" in full else None
    if linear is None:
      raise ValueError("HF config: linear rope scaling lacks its 'factor'")
  elif rtype not in (None, "default"):
    raise ValueError(f"unsupported rope_scaling type {rtype!r} for Gemma 3 (supported: linear)")
  eos = hf.get("eos_token_id", 1)
  extra: tuple[int, ...] = ()
  if isinstance(eos, (list, tuple)):
    eos, extra = (eos[0], tuple(eos[1:])) if eos else (None, ())
  head_dim = hf.get("head_dim", 256)
  return dict(
      architecture="gemma3", vocab_size=need("vocab_size"), d_model=need("hidden_size"),
      n_layers=n_layers, n_heads=need("num_attention_heads"),
      # (transformers' default is 4; a null means one per query head)
      n_kv_heads=hf.get("num_key_value_heads", 4) or need("num_attention_heads"),
      head_dim=head_dim, ffn_dim=need("intermediate_size"), rope_theta=theta,
      norm_eps=number("rms_norm_eps", 1e-6),
      tie_embeddings=bool(hf.get("tie_word_embeddings", True)), qk_norm=True,
      max_seq_len=int(number("max_position_embeddings", 131072)),
      sliding_window=int(window) if windowed else None, sliding_layers=windowed,
      local_rope_theta=local_theta if windowed else None, rope_linear_factor=linear,
      activation="gelu_tanh", norm_plus_one=True, post_norms=True, embed_scale=True,
      query_pre_attn_scalar=number("query_pre_attn_scalar", 256),
      bos_token_id=hf.get("bos_token_id", 2), eos_token_id=eos, extra_eos_token_ids=extra,
      name=hf.get("_name_or_path", "hf") or "hf")


_LLAMA3_SCALING = (32.0, 1.0, 4.0, 8192)

PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        name="smollm2-135m", vocab_size=49152, d_model=576, n_layers=30, n_heads=9,
        n_kv_heads=3, head_dim=64, ffn_dim=1536, rope_theta=100_000.0, norm_eps=1e-5,
        tie_embeddings=True, max_seq_len=8192, bos_token_id=1, eos_token_id=2),
    "qwen2.5-0.5b": ModelConfig(
        name="qwen2.5-0.5b", architecture="qwen2", vocab_size=151936, d_model=896,
        n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64, ffn_dim=4864,
        rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=True, qkv_bias=True,
        max_seq_len=32768, eos_token_id=151643),
    "qwen2.5-1.5b": ModelConfig(
        name="qwen2.5-1.5b", architecture="qwen2", vocab_size=151936, d_model=1536,
        n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128, ffn_dim=8960,
        rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=True, qkv_bias=True,
        max_seq_len=32768, eos_token_id=151643),
    "qwen2.5-3b": ModelConfig(
        name="qwen2.5-3b", architecture="qwen2", vocab_size=151936, d_model=2048,
        n_layers=36, n_heads=16, n_kv_heads=2, head_dim=128, ffn_dim=11008,
        rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=True, qkv_bias=True,
        max_seq_len=32768, eos_token_id=151643),
    "qwen2.5-7b": ModelConfig(
        name="qwen2.5-7b", architecture="qwen2", vocab_size=152064, d_model=3584,
        n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128, ffn_dim=18944,
        rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=False, qkv_bias=True,
        max_seq_len=32768, eos_token_id=151643),
    "qwen3-0.6b": ModelConfig(
        name="qwen3-0.6b", architecture="qwen3", vocab_size=151936, d_model=1024,
        n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072,
        rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=True, qk_norm=True,
        max_seq_len=32768, eos_token_id=151645),
    "qwen3-1.7b": ModelConfig(
        name="qwen3-1.7b", architecture="qwen3", vocab_size=151936, d_model=2048,
        n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=6144,
        rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=True, qk_norm=True,
        max_seq_len=32768, eos_token_id=151645),
    "llama3.2-1b": ModelConfig(
        name="llama3.2-1b", vocab_size=128256, d_model=2048, n_layers=16, n_heads=32,
        n_kv_heads=8, head_dim=64, ffn_dim=8192, rope_theta=500_000.0, norm_eps=1e-5,
        tie_embeddings=True, rope_scaling=_LLAMA3_SCALING, max_seq_len=131072 // 4,
        bos_token_id=128000, eos_token_id=128001),
    "llama3.2-3b": ModelConfig(
        name="llama3.2-3b", vocab_size=128256, d_model=3072, n_layers=28, n_heads=24,
        n_kv_heads=8, head_dim=128, ffn_dim=8192, rope_theta=500_000.0, norm_eps=1e-5,
        tie_embeddings=True, rope_scaling=_LLAMA3_SCALING, max_seq_len=131072 // 4,
        bos_token_id=128000, eos_token_id=128001),
    # google/gemma-3-1b-pt / -it (text only): every 6th layer global, the others windowed.
    "gemma3-1b": ModelConfig(
        name="gemma3-1b", architecture="gemma3", vocab_size=262144, d_model=1152,
        n_layers=26, n_heads=4, n_kv_heads=1, head_dim=256, ffn_dim=6912,
        rope_theta=1_000_000.0, local_rope_theta=10_000.0, norm_eps=1e-6,
        tie_embeddings=True, qk_norm=True, max_seq_len=32768, sliding_window=512,
        sliding_layers=tuple(i for i in range(26) if (i + 1) % 6), activation="gelu_tanh",
        norm_plus_one=True, post_norms=True, embed_scale=True, query_pre_attn_scalar=256,
        bos_token_id=2, eos_token_id=1, extra_eos_token_ids=(106,)),
    # Tiny configs of each architecture for tests and CPU smoke runs.
    "tiny-llama": ModelConfig(
        name="tiny-llama", vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
        head_dim=16, ffn_dim=128, rope_theta=10_000.0, max_seq_len=512),
    "tiny-qwen2": ModelConfig(
        name="tiny-qwen2", architecture="qwen2", vocab_size=512, d_model=64, n_layers=2,
        n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, rope_theta=1_000_000.0,
        norm_eps=1e-6, qkv_bias=True, max_seq_len=512),
    "tiny-qwen3": ModelConfig(
        name="tiny-qwen3", architecture="qwen3", vocab_size=512, d_model=64, n_layers=2,
        n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, rope_theta=1_000_000.0,
        norm_eps=1e-6, qk_norm=True, max_seq_len=512),
    "tiny-gemma3": ModelConfig(
        name="tiny-gemma3", architecture="gemma3", vocab_size=512, d_model=64, n_layers=3,
        n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, rope_theta=1_000_000.0,
        local_rope_theta=10_000.0, norm_eps=1e-6, qk_norm=True, max_seq_len=512,
        sliding_window=16, sliding_layers=(0, 1), activation="gelu_tanh", norm_plus_one=True,
        post_norms=True, embed_scale=True, query_pre_attn_scalar=16),
}
# Presets that name a checkpoint shipped inside a pip package (resolved by `models.load`).
EMBEDDED = {"smollm2-135m-instruct": "smollm2-135m"}


def get_config(name: str, **overrides) -> ModelConfig:
  """A preset by name (see `PRESETS`), with field overrides."""
  key = EMBEDDED.get(name, name)
  if key not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known presets: "
                     f"{sorted(PRESETS) + sorted(EMBEDDED)}")
  return PRESETS[key].replace(**overrides) if overrides else PRESETS[key]


# Every key of a run's `config.model` section (`configs/quickstart.py` sets them all).
RUN_MODEL_KEYS = ("path", "tokenizer", "param_dtype", "dtype", "remat", "init_std", "init_seed",
                  "scan_layers", "attention", "logprob", "norm_rope")


def run_overrides(model) -> dict:
  """The `ModelConfig` fields a run's `config.model` section sets (numerics, remat, layer loop,
  kernel paths), as overrides of a preset's or a checkpoint's architecture. The trainer and the
  planner both build the model's config from these. Raises ValueError on a key the section
  does not have (a typo would otherwise be silently ignored)."""
  unknown = sorted(k for k in model.keys() if k not in RUN_MODEL_KEYS)
  if unknown:
    raise ValueError("unknown config key(s): "
                     + ", ".join(did_you_mean(k, RUN_MODEL_KEYS, "model.") for k in unknown)
                     + f"; config.model takes {', '.join(RUN_MODEL_KEYS)}")
  return dict(param_dtype=model.param_dtype, dtype=model.dtype, remat=model.remat,
              scan_layers=model.get("scan_layers", True),
              attention_impl=model.get("attention", "auto"),
              logprob_impl=model.get("logprob", "auto"),
              norm_rope_impl=model.get("norm_rope", "auto"))
