"""The generator engine: JetStream's contract over a fixed number of KV-cache slots, in pure JAX.

    state = engine.init_decode_state()
    prefix = engine.prefill(params, prompts, request_ids)      # batched, bucketed
    state = engine.insert(prefix, state, slots)
    state, out = engine.generate(params, state, steps=8)       # every active slot, k steps
    state, out = engine.append(params, state, slots, obs)      # tool output into live slots

Each slot holds the K/V of `lengths[s]` tokens plus one *pending* token `tokens[s]`: the last
sampled token, not yet in the cache. A decode step feeds the pending token, writes its K/V,
and samples the next one. `append` feeds the pending token followed by observation tokens at
the slot's current position (no re-prefill of the history) and samples the first token of the
next turn.

Termination is tracked on device so that multi-step decoding stays exact: a slot stops (is
frozen, its length no longer advances) when it samples an EOS id, exhausts its per-turn
budget `remaining`, or would exceed its total `limit`. Stop *strings* need text and are
checked by the host scheduler, which rewinds the slot with `update_slots`.

Params are an argument of every call (never captured), so after an optimizer step the caller
passes the new params pytree and nothing is copied (colocated mode). A run of calls with one
policy version may pass `engine.prepare(params)` instead (`PreparedParams`): where decode calls
multiply by merged weights, the merge is then made once for the run instead of at the start of
every decode call.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxagent import sharding as shd
from jaxagent._token_ids import is_int, token_ids
from jaxagent.generate.sampling import SamplingConfig, sample, token_keys
from jaxagent.models import decoder, param_tree
from jaxagent.models.config import ModelConfig

log = logging.getLogger(__name__)

# Why a slot stopped (device-side codes; host-side stop strings are reported by the scheduler).
# STOP_NONFINITE: the sampled token's log-prob is NaN or infinite, so the logits it was drawn
# from held a NaN or +inf (diverged params, a numerical fault); the slot stops rather than go
# on sampling from them, and that token is not to be trusted.
# STOP_KV_LEN: a caller's error, not an end of the request: the slot held more cached tokens
# than the `kv_len` bound given to `Engine.generate` lets attention read, so it is stopped
# before that step instead of decoding on a truncated cache (see `Engine.generate`).
RUNNING, STOP_EOS, STOP_BUDGET, STOP_LENGTH, STOP_NONFINITE, STOP_KV_LEN = 0, 1, 2, 3, 4, 5


@flax.struct.dataclass
class DecodeState:
  k: Any               # [layers, S, KV, Lmax, hd] (head-major: each head's run is contiguous),
  v: Any               # or a tuple of per-layer [S, KV, Lmax, hd] (`cache_layout="per_layer"`)
  lengths: jax.Array    # [S] tokens whose K/V are cached
  tokens: jax.Array     # [S] pending (last sampled) token
  active: jax.Array     # [S] bool
  done: jax.Array       # [S] int32 stop code (RUNNING while active)
  remaining: jax.Array  # [S] new tokens still allowed in the current turn
  limit: jax.Array      # [S] max total sequence length (cache + pending)
  request_ids: jax.Array  # [S] int32
  seeds: jax.Array      # [S] uint32
  # Prompt sharing (`EngineConfig.share_prompts`): the first `share_len[s]` cached K/V of slot
  # s equal those of slot `share_src[s]` (samples of one prompt inserted together); itself and
  # 0 when none. Each slot still holds its own copy; the decode kernel reads the shared rows
  # from the source slot, so that the samples of one prompt read them from the L2 cache.
  share_src: jax.Array  # [S] int32
  share_len: jax.Array  # [S] int32


@flax.struct.dataclass
class Prefix:
  """Prefill result for B prompts: their K/V and first sampled token."""
  k: jax.Array          # [layers, B, T, KV, hd]
  v: jax.Array
  lengths: jax.Array    # [B]
  tokens: jax.Array     # [B] first sampled token
  logprobs: jax.Array   # [B]
  done: jax.Array       # [B] stop code after the first token
  remaining: jax.Array  # [B]
  limit: jax.Array      # [B]
  request_ids: jax.Array
  seeds: jax.Array


@flax.struct.dataclass
class PreparedParams:
  """The params of a run of engine calls with one policy version (`Engine.prepare`).

  `params`: the model's params, as given (prefill and append use them, so their numerics do
  not change); `decode`: the same params with each layer's q|k|v and gate|up weights merged
  (`param_tree.merge_decode_weights`; the norm weights folded in where `Engine.fold_norms`,
  the matrices chained where `Engine.chain_weights`), which decode calls use instead of
  merging at their start, or None where the engine's decode calls do not merge. Every `Engine`
  method that takes params takes this too. It holds a copy of the merged weights for as long
  as it is kept: drop it when the params it was made from are replaced.
  """
  params: Any
  decode: Any = None


@flax.struct.dataclass
class StepOutput:
  tokens: jax.Array     # [steps, S] sampled tokens
  logprobs: jax.Array   # [steps, S]
  valid: jax.Array      # [steps, S] whether the slot was active and this token is real
  done: jax.Array       # [S] stop code after the last step


def _bucket(n: int, buckets: Sequence[int]) -> int:
  for b in buckets:
    if n <= b:
      return b
  raise ValueError(f"length {n} exceeds the largest bucket {buckets[-1]}")


def _per_request(x, n: int, dtype, what: str, name: str, unit: str,
                 least: int | None = None) -> np.ndarray:
  """`x`, one value for all `n` requests or a sequence of one per request, as `n` values of
  `dtype`. A wrong count, or a value that is not an integer (a bool, a float) in range, is a
  ValueError naming `what` and `name`: NumPy would otherwise truncate a float and wrap a value
  that `dtype` cannot hold (a budget of 2**32 + 5 became 5)."""
  vals = np.asarray(x, object).reshape(-1).tolist()
  if np.ndim(x) and len(vals) != n:
    raise ValueError(f"{what}: {len(vals)} {name} for {n} {unit}")
  info = np.iinfo(dtype)
  lo = info.min if least is None else least
  bad = [v for v in vals if isinstance(v, bool) or not isinstance(v, (int, np.integer))
         or not lo <= v <= info.max]
  if bad:
    span = f"in [{lo}, {info.max}]" if least is None else f">= {least} (at most {info.max})"
    bad = [int(v) if isinstance(v, np.integer) else v for v in bad[:5]]
    raise ValueError(f"{what}: {name} must be integers {span}, got {bad}")
  return np.broadcast_to(np.asarray(vals, dtype), (n,)).copy()


def _refuse_bools(x, what: str) -> None:
  """A ValueError naming `what` when `x` (a number or a nested sequence) holds a bool: NumPy's
  integer cast would make it 0 or 1."""
  if any(isinstance(t, (bool, np.bool_)) for t in np.ravel(np.asarray(x, dtype=object))):
    raise ValueError(f"{what} must be integers, not bools, got "
                     f"{np.asarray(x, dtype=object).tolist()}")


def pow2_at_least(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1)."""
  return 1 << max(0, n - 1).bit_length()


def _geometric_buckets(lo: int, hi: int, factor: int = 2) -> tuple[int, ...]:
  out, b = [], lo
  while b < hi:
    out.append(b)
    b *= factor
  out.append(hi)
  return tuple(out)


def _count_bucket(n: int, limit: int) -> int:
  """Rows a batch of `n` requests is padded to: powers of 4 up to the power of two >= `limit`
  (1, 4, 16, 64, 256, ...). Every distinct row count is a separate compiled program of the
  whole model, and a rollout sees nearly every count from 1 to the slot count as requests
  finish, so coarse row buckets bound compilation (padded rows cost little compute)."""
  cap = pow2_at_least(max(n, limit))
  return _bucket(n, _geometric_buckets(1, cap, factor=4))


# XLA options of the decode program on GPUs. A decode step multiplies a few hundred rows by
# each weight matrix, so it is bound by reading the weights (benchmarks/RESULTS.md, H100, 256
# slots):
#  * XLA's Triton GEMM emitter, which it picks for dots with a fused elementwise operand, read
#    the weights at a sixth of HBM bandwidth there, where cuBLAS streams them: off
#    (SmolLM2-135M 2.94 -> 2.54 ms per step, Qwen2.5-1.5B 7.41 -> 5.63 ms);
#  * XLA's dot merger turns the gate and up projections (and q, k, v), which share their
#    input, into one GEMM by concatenating their weights, a copy of both at every step: kept
#    for small weights, where one GEMM launch instead of two wins, and off above 4 MB
#    (threshold 32 MB -> 0: Qwen2.5-1.5B 5.63 -> 4.78 ms, Qwen3-0.6B 6.99 -> 6.82 ms, but
#    SmolLM2-135M, 1.8 MB weights, 2.54 -> 2.67 ms).
DECODE_GPU_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("xla_gpu_enable_triton_gemm", False),
    ("xla_gpu_dot_merger_threshold_mb", 4),
)


# The largest per-device copy of merged decode weights that `decode_merge_weights=None` makes.
# Measured gains (H100, 256 slots): SmolLM2-135M 7.5% per step for a 0.1 GB copy,
# Qwen2.5-1.5B 3-5% for 1.7 GB, Qwen3-0.6B 1.7% for 0.6 GB; a 7B model's copy would be about
# 8.5 GB, beyond what a few percent are worth beside a learner on the same card.
MERGE_WEIGHTS_MAX_BYTES = 4 << 30
# ... and only for decode calls of at least this many steps: the copy is made once per call.
# From the step times at 8 and 16 steps per call (H100), Qwen2.5-1.5B's copy costs about
# 1.0 ms and saves about 0.26 ms a step, so it pays from about 4 steps a call; the rollout
# and the scheduler decode 8 a call, the JetStream adapter 1 by default.
MERGE_MIN_STEPS = 8
# `EngineConfig.decode_chain_weights=None` chains where one layer's chained matrices
# (`param_tree.chained_layer_bytes`) take at most this many bytes. The chain trades two GEMM
# launches a layer for about twice the matrices' products. In the engine's step at 256 slots
# on an H200 (benchmarks/RESULTS.md) it took SmolLM2-135M (14 MiB a chained layer) from 1.623
# to 1.514 ms and made Qwen2.5-0.5B (59 MiB) and Qwen3-0.6B (82 MiB) slower: 1.916 -> 1.976
# ms and 4.932 -> 5.309 ms.
CHAIN_MAX_LAYER_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static shape and stopping settings of an `Engine`."""

  slots: int = 8
  max_len: int = 1024            # cache length per slot (prompt + all turns)
  eos_ids: tuple[int, ...] = ()
  sampling: SamplingConfig = SamplingConfig()
  kv_page: int = 0               # granularity of the live-KV buckets (0 = max_len // 16, >= 64)
  min_prefill_len: int = 16
  # Cached attention of decode steps: "xla" (einsums) or "pallas" (the flash-decoding kernel
  # of `models/decode_attention.py`); "auto" picks "pallas" on GPUs (4-10% faster end to end
  # on an H200, benchmarks/RESULTS.md) and "xla" elsewhere. Models the kernels do not compute
  # (`decoder.decode_kernels_fit`: a sliding window, Gemma 3's attention scale and norms) get
  # "xla" from "auto", and an error from "pallas"; so do the write-first step, the fused
  # q|k|v, folded norms and chained matrices built on the kernels.
  decode_attention: str = "auto"
  # KV cache buffers: "stacked" (one `[layers, ...]` array per K and V; the layer loop is a
  # `lax.scan`) or "per_layer" (one buffer per layer; the layer loop is unrolled, and the
  # Pallas kernel reads each layer's cache in place instead of a sliced copy: a trace of the
  # stacked layout on an H200 spent half of each decode step copying live K/V). "auto" picks
  # "per_layer" with the Pallas kernel (2.4x the stacked layout's decode tokens/s on an H200,
  # Qwen3-0.6B shape, 256 slots; benchmarks/RESULTS.md) and "stacked" with XLA attention
  # (there the two measured the same, and the scan compiles faster).
  cache_layout: str = "auto"
  # Per-layer cache with the Pallas kernel: each layer writes the decoded token's K/V into its
  # buffer before the kernel reads it (`decoder.decode_in_place`), instead of attending to the
  # new token separately and merging the two softmaxes. False: the `extend` + `write_kv` path.
  decode_write_first: bool = True
  # The decode program multiplies by each layer's q|k|v and gate|up weights merged into one
  # matrix each (`param_tree.merge_decode_weights`): a copy made once per run by
  # `Engine.prepare` (the scheduler and rollouts do that), or else a transient one at the start
  # of each decode call. None (auto) merges on GPUs without a "tensor" mesh axis over more than
  # one device, when the copy takes at most `MERGE_WEIGHTS_MAX_BYTES` per device, in decode
  # calls of at least `MERGE_MIN_STEPS` steps (any with prepared params); True merges in every
  # call.
  decode_merge_weights: bool | None = None
  # With merged weights, the decode kernel takes each layer's raw q|k|v projection and applies
  # the bias, q / k norms and RoPE itself (`decoder.decode_in_place(fused_qkv=True)`), one XLA
  # fusion a layer fewer; False: XLA prepares q, k and v for the kernel.
  decode_fused_qkv: bool = True
  # With the raw q|k|v projection in the kernel, each layer's two RMS-norm weights are folded
  # into the merged matrices (`param_tree.merge_decode_weights(fold_norms=True)`): the decode
  # kernel applies the attention norm's row scale and one kernel the MLP norm's scale with the
  # SwiGLU (`decode_mlp.swiglu_rms`), so the layer runs no norm kernel. False: XLA norms.
  decode_fold_norms: bool = True
  # With folded norms, `Engine.prepare` also chains the decode matrices
  # (`param_tree.chain_decode_weights`): each layer runs two GEMMs instead of four, each taking
  # the residual stream through with the next projection. None (auto): for models whose chained
  # layer takes at most `CHAIN_MAX_LAYER_BYTES` (small ones, where GEMM launches cost more than
  # the extra products); True: wherever the norms fold and d_model is a multiple of head_dim;
  # False: never. Decode calls on params that were not prepared merge and fold at their start
  # but do not chain (the products of weights cost more than a call saves).
  decode_chain_weights: bool | None = None
  # XLA compiler options of the decode program on GPUs, as (name, value) pairs; None: the
  # library's `DECODE_GPU_OPTIONS`; (): XLA's defaults.
  decode_gpu_options: tuple[tuple[str, Any], ...] | None = None
  # Samples of one prompt in one `prefill_insert` batch (a GRPO group) are prefilled once, and
  # the Pallas decode kernel reads their common prompt K/V from one slot's rows
  # (`DecodeState.share_src`); False: every slot reads only its own rows.
  share_prompts: bool = True

  def __post_init__(self):
    # A NumPy int (as `max_len` takes) was refused as "not a positive int".
    if not is_int(self.slots) or self.slots <= 0:
      raise ValueError(f"EngineConfig.slots must be a positive int, got {self.slots!r}")
    object.__setattr__(self, "slots", int(self.slots))
    # Else the first prefill failed on it (an AttributeError; in a JetStream Driver thread it
    # killed the server process).
    if not isinstance(self.sampling, SamplingConfig):
      raise TypeError("EngineConfig.sampling must be a jaxagent.generate.SamplingConfig, got "
                      f"{self.sampling!r}")
    # A float or a string was cast to some other id, and a bool to 0 or 1, by the device-side
    # comparison; one int or any sequence becomes a tuple (the config must stay hashable).
    # The vocabulary range is checked by `Engine`, which knows the model.
    ids = [self.eos_ids] if is_int(self.eos_ids) else self.eos_ids
    if (not isinstance(ids, (list, tuple, set, frozenset, np.ndarray))
        or not all(is_int(e) for e in ids)):
      raise ValueError("EngineConfig.eos_ids must be an int or a sequence of int token ids, "
                       f"got {self.eos_ids!r}")
    ids = sorted(ids) if isinstance(ids, (set, frozenset)) else ids
    object.__setattr__(self, "eos_ids", tuple(int(e) for e in ids))
    # A float length failed deep in the cache's shape; a negative page or a prefill bucket
    # below one made the bucket loops (`_geometric_buckets`) run forever.
    if not is_int(self.max_len) or self.max_len <= 1:
      raise ValueError(f"EngineConfig.max_len must be an int > 1, got {self.max_len!r}")
    if not is_int(self.kv_page) or self.kv_page < 0:
      raise ValueError(f"EngineConfig.kv_page must be an int >= 0 (0: max_len // 16, at least "
                       f"64), got {self.kv_page!r}")
    if not is_int(self.min_prefill_len) or self.min_prefill_len < 1:
      raise ValueError(f"EngineConfig.min_prefill_len must be an int >= 1, got "
                       f"{self.min_prefill_len!r}")
    if self.decode_attention not in ("auto", "xla", "pallas"):
      raise ValueError("EngineConfig.decode_attention must be 'auto', 'xla' or 'pallas', got "
                       f"{self.decode_attention!r}")
    if self.cache_layout not in ("auto", "stacked", "per_layer"):
      raise ValueError("EngineConfig.cache_layout must be 'auto', 'stacked' or 'per_layer', got "
                       f"{self.cache_layout!r}")
    # A truthy string ("no") switched the setting on.
    for name in ("decode_fused_qkv", "decode_fold_norms", "decode_write_first", "share_prompts"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
    for name in ("decode_merge_weights", "decode_chain_weights"):
      if not any(getattr(self, name) is v for v in (None, True, False)):
        raise ValueError(f"EngineConfig.{name} must be None (auto), True or False, got "
                         f"{getattr(self, name)!r}")

  @property
  def page(self) -> int:
    return self.kv_page or max(64, self.max_len // 16)

  @property
  def kv_buckets(self) -> tuple[int, ...]:
    p = self.page
    return tuple(sorted({min(self.max_len, p * i) for i in range(1, -(-self.max_len // p) + 1)}))

  @property
  def prefill_buckets(self) -> tuple[int, ...]:
    return _geometric_buckets(min(self.min_prefill_len, self.max_len), self.max_len)


def _plain(params):
  """The model's params of `params` (plain, or `PreparedParams`)."""
  return params.params if isinstance(params, PreparedParams) else params


class Engine:
  """Prefill / insert / generate / append over `slots` KV-cache slots of one model."""

  def __init__(self, cfg: ModelConfig, ecfg: EngineConfig | None = None, *,
               mesh: Mesh | None = None, **kw):
    # A preset name or a config dict failed at its first attribute read, an AttributeError
    # that named neither the argument nor what to pass.
    if not isinstance(cfg, ModelConfig):
      raise TypeError(f"Engine: cfg must be a jaxagent.models.ModelConfig (the config "
                      f"`models.load(path)` returns, or `models.get_config(name)`), got "
                      f"{type(cfg).__name__} {cfg!r:.60}")
    if mesh is not None and not isinstance(mesh, Mesh):
      raise TypeError(f"Engine: mesh must be a jax.sharding.Mesh (`sharding.make_mesh(...)`) "
                      f"or None, got {type(mesh).__name__} {mesh!r:.60}")
    if ecfg is not None and not isinstance(ecfg, EngineConfig):  # a dict: an AttributeError
      raise TypeError(f"Engine: ecfg must be an EngineConfig (or pass its settings as keywords: "
                      f"Engine(cfg, slots=8, max_len=1024)), got {type(ecfg).__name__} "
                      f"{ecfg!r:.60}")
    self.cfg = cfg
    self.ecfg = ecfg if ecfg is not None else EngineConfig(**kw)
    if ecfg is not None and kw:
      raise ValueError("pass either an EngineConfig or keyword settings, not both")
    if self.ecfg.max_len > cfg.max_seq_len:
      raise ValueError(f"EngineConfig.max_len {self.ecfg.max_len} exceeds the model's "
                       f"max_seq_len {cfg.max_seq_len}")
    bad = [e for e in self.ecfg.eos_ids if not 0 <= e < cfg.vocab_size]
    if bad:
      raise ValueError(f"eos_ids {bad} are outside the model's vocabulary [0, {cfg.vocab_size}) "
                       "and would never end a request: pass the ids of the tokenizer that "
                       "matches the model")
    self.mesh = mesh
    if mesh is not None:
      # The cache's own spec decides: its slot axis left unsplit on a mesh with batch devices.
      rows = math.prod(mesh.shape.get(a, 1) for a in ("data", "fsdp"))
      if rows > 1 and shd.kv_cache_spec(cfg.n_kv_heads, self.ecfg.slots, mesh)[1] is None:
        log.warning("EngineConfig.slots=%d does not divide the %d devices of the mesh's data x "
                    "fsdp axes: the KV cache and the decoding are replicated on every one of "
                    "them instead of split; use a multiple of %d slots", self.ecfg.slots, rows,
                    rows)
      tp = mesh.shape.get("tensor", 1)
      if tp > 1 and shd.kv_cache_spec(cfg.n_kv_heads, self.ecfg.slots, mesh)[2] is None:
        log.warning("the model's %d KV heads do not divide the mesh's tensor=%d devices: the KV "
                    "cache is replicated over them instead of split by heads (each holds the "
                    "whole cache of its slots); use a tensor size that divides %d",
                    cfg.n_kv_heads, tp, cfg.n_kv_heads)
    self._eos = jnp.asarray(sorted(set(self.ecfg.eos_ids)) or [-1], jnp.int32)
    choice = self.ecfg.decode_attention
    backend = jax.default_backend()
    fits = decoder.decode_kernels_fit(cfg)
    if choice == "auto":
      choice = "pallas" if backend == "gpu" and fits else "xla"
    elif choice == "pallas" and not fits:
      raise ValueError(
          "EngineConfig.decode_attention='pallas': the Pallas decode kernels have no sliding "
          "window, no attention scale but head_dim ** -0.5 and no (1 + w) norms or post-norms, "
          f"which this model uses (architecture {cfg.architecture!r}, sliding_window="
          f"{cfg.sliding_window}); use decode_attention='xla' or 'auto'")
    elif choice == "pallas" and backend not in ("gpu", "cpu"):
      # The kernel is a Triton (GPU) kernel; CPUs run it in Pallas interpret mode (tests).
      raise ValueError(f"EngineConfig.decode_attention='pallas' is a GPU kernel and cannot run "
                       f"on {backend!r}: use 'auto' or 'xla' there")
    self._attn = choice
    layout = self.ecfg.cache_layout
    self.cache_layout = (("per_layer" if choice == "pallas" else "stacked") if layout == "auto"
                         else layout)
    # The cache's length axis: the kernel reads blocks of up to 64 keys (a power of two
    # dividing the length), so round up to 64.
    m = 64 if self._attn == "pallas" else 1
    self.cache_len = -(-self.ecfg.max_len // m) * m
    page = -(-self.ecfg.page // m) * m
    self.kv_buckets = tuple(sorted({min(self.cache_len, page * i)
                                    for i in range(1, -(-self.cache_len // page) + 1)}))
    # Append (a tool observation into some slots) is rarer than a decode step and its program
    # is bucketed on rows and chunk length too: doubling live-KV buckets keep its compiles few.
    self.append_kv_buckets = _geometric_buckets(min(page, self.cache_len), self.cache_len)
    merge = self.ecfg.decode_merge_weights
    axes = {} if mesh is None else dict(mesh.shape)
    copy = param_tree.merged_decode_weight_bytes(cfg) / axes.get("fsdp", 1)
    small = copy <= MERGE_WEIGHTS_MAX_BYTES
    # Whether decode calls merge the weights (auto: those of `MERGE_MIN_STEPS` or more steps).
    self.merge_weights = ((backend == "gpu" and axes.get("tensor", 1) == 1 and small)
                          if merge is None else bool(merge))
    on_mesh = lambda fn: shd.on_mesh(fn, mesh)
    opts = (DECODE_GPU_OPTIONS if self.ecfg.decode_gpu_options is None
            else self.ecfg.decode_gpu_options)
    opts = dict(opts) if jax.default_backend() == "gpu" else {}
    self._jit_merge = jax.jit(on_mesh(self._merge_for_run))
    self._jit_generate = jax.jit(on_mesh(self._generate), static_argnames=("steps", "kv_len"),
                                 compiler_options=opts or None,
                                 donate_argnames=("state",))
    self._jit_prefill = jax.jit(on_mesh(self._prefill))
    self._jit_insert = jax.jit(self._insert, donate_argnames=("state",))
    self._jit_append = jax.jit(on_mesh(self._append), static_argnames=("kv_len",),
                               donate_argnames=("state",))
    self._jit_update = jax.jit(self._update, donate_argnames=("state",))
    self._jit_empty = None
    self._state_sig = None  # the decode state's tree and (shape, dtype)s (`_check_state`)

  # ------------------------------------------------------------------ sharding helpers
  @property
  def per_layer(self) -> bool:
    return self.cache_layout == "per_layer"

  def _kv_sharding(self, rows: int):
    """Sharding of a `[layers, rows, KV, len, hd]` cache (per-layer: of each `[rows, ...]`
    buffer): rows over the batch axes, heads over tensor, where they divide."""
    spec = tuple(shd.kv_cache_spec(self.cfg.n_kv_heads, rows, self.mesh))
    spec = spec + (None,) * (5 - len(spec))
    spec = list(spec[1:] if self.per_layer else spec)
    # Without trailing Nones, as the programs return it: `init_decode_state`'s cache spelled
    # them, so the first call of each program compiled for it and the next ones again.
    while spec and spec[-1] is None:
      spec.pop()
    return NamedSharding(self.mesh, P(*spec))

  def _cache_sharding(self):
    """Sharding of the cache (a tuple of per-layer shardings in the per-layer layout)."""
    if self.mesh is None:
      return None
    one = self._kv_sharding(self.ecfg.slots)
    return (one,) * self.cfg.n_layers if self.per_layer else one

  def _constrain(self, state: DecodeState) -> DecodeState:
    """`state` with `decode_state_shardings()`, the per-slot vectors too: a decode step
    returned them split over the slots' devices while `init_decode_state` made them
    replicated, so the next call of each program compiled again for those inputs (and
    differed from the programs `jaxagent.plan` lowers)."""
    ss = self.decode_state_shardings()
    return state if ss is None else jax.lax.with_sharding_constraint(state, ss)

  # ------------------------------------------------------------------ state
  def _empty_state(self) -> DecodeState:
    c, e = self.cfg, self.ecfg
    shape = (c.n_layers, e.slots, c.n_kv_heads, self.cache_len, c.head_dim)
    s = e.slots
    if self.per_layer:
      zk = tuple(jnp.zeros(shape[1:], c.jnp_dtype) for _ in range(c.n_layers))
      zv = tuple(jnp.zeros(shape[1:], c.jnp_dtype) for _ in range(c.n_layers))
    else:
      zk = zv = jnp.zeros(shape, c.jnp_dtype)
    zi = jnp.zeros((s,), jnp.int32)
    return DecodeState(k=zk, v=zv, lengths=zi, tokens=zi, active=jnp.zeros((s,), bool),
                       done=zi, remaining=zi, limit=jnp.full((s,), e.max_len, jnp.int32),
                       request_ids=zi, seeds=jnp.zeros((s,), jnp.uint32),
                       share_src=jnp.arange(s, dtype=jnp.int32), share_len=zi)

  def decode_state_shardings(self) -> DecodeState | None:
    """Shardings of the decode state's arrays on the engine's mesh (None without a mesh)."""
    if self.mesh is None:
      return None
    cs = self._cache_sharding()
    # The per-slot vectors split like the cache's slots: a decode step computes them so (and
    # replicating them would gather them after every call).
    axes = shd.kv_cache_spec(self.cfg.n_kv_heads, self.ecfg.slots, self.mesh)[1]
    row = NamedSharding(self.mesh, P() if axes is None else P(axes))
    return DecodeState(k=cs, v=cs, lengths=row, tokens=row, active=row, done=row,
                       remaining=row, limit=row, request_ids=row, seeds=row, share_src=row,
                       share_len=row)

  def abstract_decode_state(self) -> DecodeState:
    """`jax.ShapeDtypeStruct`s (with shardings) of `init_decode_state()`, allocating nothing."""
    shapes = jax.eval_shape(self._empty_state)
    ss = self.decode_state_shardings()
    if ss is None:
      return shapes
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        shapes, ss)

  def _check_state(self, state, what: str) -> None:
    """A clear error for a `state` that is not this engine's decode state: the `(state,
    output)` pair `generate` / `append` return, or the state of an engine of another slot
    count, `max_len`, cache layout, model or dtype. Such a state failed in a broadcast deep in
    `insert`, or ran in `generate` (a program compiled for its shapes) reading only the
    first `max_len` cached tokens of each slot."""
    if not isinstance(state, DecodeState):
      hint = (" (generate and append return (state, output): unpack them)"
              if isinstance(state, tuple) else "")
      raise TypeError(f"{what}: state must be a DecodeState (`init_decode_state()`), got "
                      f"{type(state).__name__}{hint}")
    if self._state_sig is None:
      want = jax.eval_shape(self._empty_state)
      leaves, tree = jax.tree.flatten(want)
      self._state_sig = (tree, [(a.shape, a.dtype) for a in leaves], want)
    tree, sig, want = self._state_sig
    leaves, got_tree = jax.tree.flatten(state)
    if got_tree == tree and all(getattr(a, "shape", None) == shape and
                                getattr(a, "dtype", None) == dtype
                                for a, (shape, dtype) in zip(leaves, sig)):
      return
    def show(x):  # a per-layer cache: one array per layer
      arrays = [(tuple(getattr(a, "shape", np.shape(a))), getattr(a, "dtype", None))
                for a in jax.tree.leaves(x)]
      if len(arrays) > 1 and len(set(arrays)) == 1:
        return f"{len(arrays)} arrays of {arrays[0][0]} {arrays[0][1]}"
      return ", ".join(f"{shape} {dtype}" for shape, dtype in arrays)
    name = next((f.name for f in dataclasses.fields(DecodeState)
                 if show(getattr(state, f.name)) != show(getattr(want, f.name))), "k")
    raise ValueError(
        f"{what}: the decode state is not this engine's: its {name} is "
        f"{show(getattr(state, name))}, where this engine ({self.cfg.name}, "
        f"slots={self.ecfg.slots}, max_len={self.ecfg.max_len}, cache layout "
        f"{self.cache_layout!r}) holds {show(getattr(want, name))}; pass a state from this "
        "engine's init_decode_state()")

  def init_decode_state(self) -> DecodeState:
    """Empty slots (all inactive)."""
    if self._jit_empty is None:  # built once: a fresh `jax.jit` per call compiled every rollout
      self._jit_empty = (jax.jit(self._empty_state) if self.mesh is None else
                         jax.jit(self._empty_state, out_shardings=self.decode_state_shardings()))
    return self._jit_empty()

  def program(self, name: str):
    """The jitted function behind `prefill`, `insert`, `generate`, `append` or `update_slots`
    ("update"), for ahead-of-time lowering (`jaxagent.plan`)."""
    names = ("prefill", "insert", "generate", "append", "update")
    if name not in names:
      raise ValueError(f"Engine.program: unknown program {name!r}; expected one of {names}")
    return getattr(self, f"_jit_{name}")

  # ------------------------------------------------------------------ stopping
  def _stop_code(self, tok, lp, lengths, remaining, limit):
    is_eos = jnp.any(tok[:, None] == self._eos[None, :], axis=-1)
    code = jnp.where(is_eos, STOP_EOS, RUNNING)
    code = jnp.where((code == RUNNING) & (remaining <= 0), STOP_BUDGET, code)
    # The pending token sits at position `lengths`; the sequence is full at `limit`.
    code = jnp.where((code == RUNNING) & (lengths + 1 >= limit), STOP_LENGTH, code)
    # Before any other reason: `sample` propagates a NaN or +inf anywhere in a row's logits
    # (through its maximum and normaliser) into the sampled token's log-prob.
    return jnp.where(jnp.isfinite(lp), code, STOP_NONFINITE)

  # ------------------------------------------------------------------ prefill / insert
  def _prefill(self, params, tokens, lengths, request_ids, seeds, budgets, limits, rows=None):
    param_tree.check_model_shapes(params, self.cfg, "prefill")  # (at trace time only)
    # rows: None, or for each request the row of `tokens` / `lengths` (the distinct prompts)
    # that it takes its K/V and logits from; `request_ids` and the rest are per request.
    logits, k, v = decoder.prefill(params, tokens, lengths, cfg=self.cfg)
    if rows is not None:
      logits, k, v, lengths = logits[rows], k[:, rows], v[:, rows], lengths[rows]
    keys = token_keys(seeds, request_ids, lengths)
    tok, lp = sample(logits, keys, self.ecfg.sampling)
    remaining = budgets - 1
    done = self._stop_code(tok, lp, lengths, remaining, limits)
    return Prefix(k=k, v=v, lengths=lengths, tokens=tok, logprobs=lp, done=done,
                  remaining=remaining, limit=limits, request_ids=request_ids, seeds=seeds)

  def prefill(self, params, prompts: Sequence[Sequence[int]], request_ids: Sequence[int],
              seeds: Sequence[int] | int = 0, max_new_tokens: Sequence[int] | int | None = None,
              max_total_len: Sequence[int] | int | None = None) -> Prefix:
    """Prefill a batch of prompts (padded to length and count buckets); samples each first token.

    `max_new_tokens` is the budget of the first turn (default: until the cache is full);
    `max_total_len` caps the whole sequence (default, and at most: `max_len`). A request's
    random numbers derive from (its seed, its request id, the position), so requests of one
    batch under one id and seed are refused; one already in another slot is not checked (that
    would read the device), so give every request its own id.
    """
    pre, n = self._prefill_padded(params, prompts, request_ids, seeds, max_new_tokens,
                                  max_total_len)
    return jax.tree.map(lambda x: x[:, :n] if x.ndim == 5 else x[:n], pre)

  def prefill_insert(self, params, state: DecodeState, prompts: Sequence[Sequence[int]],
                     slots, request_ids: Sequence[int], seeds: Sequence[int] | int = 0,
                     max_new_tokens: Sequence[int] | int | None = None,
                     max_total_len: Sequence[int] | int | None = None):
    """`prefill` then `insert` into `slots`, without cutting the padded batch to `len(prompts)`
    rows in between (padding rows are dropped by the insert): one prefill and one insert
    program per bucket instead of an insert per distinct prompt count. Returns
    (state, (first tokens, logprobs, stop codes)) as host arrays of `len(prompts)` rows."""
    slots = self._slot_array(slots, "prefill_insert")
    if len(slots) != len(prompts):
      raise ValueError(f"prefill_insert: {len(prompts)} prompts but {len(slots)} slots")
    self._check_state(state, "prefill_insert")
    self._check_slots(slots, "prefill_insert")
    pre, n = self._prefill_padded(params, prompts, request_ids, seeds, max_new_tokens,
                                  max_total_len)
    rows = np.full((pre.lengths.shape[0],), self.ecfg.slots, np.int32)  # out of range: dropped
    rows[:n] = slots
    share = self._share(prompts, slots, len(rows)) if self.ecfg.share_prompts else None
    state = self._jit_insert(pre, state, rows, share)
    tok, lp, done = jax.device_get((pre.tokens, pre.logprobs, pre.done))
    return state, (tok[:n], lp[:n], done[:n])

  def _prefill_padded(self, params, prompts, request_ids, seeds, max_new_tokens, max_total_len):
    n = len(prompts)
    if n == 0:
      raise ValueError("prefill needs at least one prompt")
    self._check_prompts(prompts, "prefill")
    lens = [len(p) for p in prompts]
    t = _bucket(max(lens), self.ecfg.prefill_buckets)
    b = _count_bucket(n, self.ecfg.slots)
    # Repeated prompts (the samples of a group) run through the model once.
    first: dict[tuple[int, ...], int] = {}
    distinct = [first.setdefault(tuple(p), len(first)) for p in prompts]
    u = len(first)
    ub = _count_bucket(u, self.ecfg.slots) if u < n else b
    toks = np.zeros((ub, t), np.int32)
    lengths = np.ones((ub,), np.int32)
    for p, i in zip(prompts, distinct):
      toks[i, :len(p)] = p
      lengths[i] = len(p)

    def per(x, default, dtype, name, least=None):  # padding rows (past n) take `default`
      arr = np.full((b,), default, dtype)
      if x is not None:
        arr[:n] = _per_request(x, n, dtype, "prefill", name, "prompts", least)
      return arr

    full = self.ecfg.max_len
    # A budget below one would still sample (and return) a token.
    budgets = per(max_new_tokens, full, np.int32, "max_new_tokens", least=1)
    limits = np.minimum(per(max_total_len, full, np.int32, "max_total_len"), full)
    # One id per prompt, never one for all: samples of one prompt under one id are identical.
    try:
      request_ids = list(request_ids)
    except TypeError:  # a bare "'int' object is not iterable"
      raise ValueError(f"prefill: request_ids must be a sequence of one id per prompt, got "
                       f"{request_ids!r}") from None
    rids = per(request_ids, 0, np.int32, "request_ids")
    sds = per(seeds, 0, np.uint32, "seeds")
    # A request's random numbers derive from (seed, request id, position): two requests of a
    # batch under one id and seed draw the same ones (the samples of one prompt came out
    # identical). Requests already in other slots are not read back to check.
    pairs = collections.Counter(zip(rids[:n].tolist(), sds[:n].tolist()))
    repeated = sorted(r for (r, _), c in pairs.items() if c > 1)
    if repeated:
      raise ValueError(f"prefill: request_ids {repeated[:5]} repeat with the same seed: a "
                       "request's random numbers derive from (seed, request id, position), so "
                       "such requests draw the same ones (one prompt's samples would be "
                       "identical); give each request its own id")
    # As with max_len: the first token is sampled whatever the cap, and would exceed it.
    short = [i for i in range(n) if lens[i] >= limits[i]]
    if short:
      i = short[0]
      raise ValueError(f"prefill: prompt {i} has {lens[i]} tokens; its max_total_len "
                       f"{int(limits[i])} leaves no room for a new token")
    rows = None
    if u < n:  # padding requests take the last distinct prompt's row (never inserted)
      rows = np.full((b,), u - 1, np.int32)
      rows[:n] = distinct
    return self._jit_prefill(_plain(params), toks, lengths, rids, sds, budgets, limits,
                             rows), n

  def _row_shards(self) -> int:
    """How many ways the mesh splits the cache's slots."""
    if self.mesh is None:
      return 1
    axes = shd.kv_cache_spec(self.cfg.n_kv_heads, self.ecfg.slots, self.mesh)[1]
    axes = (axes,) if isinstance(axes, str) else (axes or ())
    return int(np.prod([self.mesh.shape[a] for a in axes]))

  def _share(self, prompts, slots, rows: int):
    """(src, shared) of each inserted row (`DecodeState.share_src` / `share_len`): the first
    slot of the batch holding the same prompt on the same shard, and the prompt's length (0
    for the first). Padding rows (`rows > len(prompts)`) point past the last slot."""
    per = self.ecfg.slots // self._row_shards()
    src = np.full((rows,), self.ecfg.slots, np.int32)
    shared = np.zeros((rows,), np.int32)
    leader: dict = {}
    for i, (p, slot) in enumerate(zip(prompts, slots)):
      src[i] = leader.setdefault((tuple(p), int(slot) // per), int(slot))
      shared[i] = len(p) if src[i] != slot else 0
    return src, shared

  def _clear_nonfinite_slots(self, state: DecodeState, slots, starts=None):
    """The cache (k, v) with the rows from `starts` on (each slot's; all rows when None) of
    every slot of `slots` whose last request stopped on non-finite logits (`STOP_NONFINITE`)
    zeroed. Such a request may leave NaN or inf K/V rows past the live ones of the slot's next
    user (a shorter prompt, or its own rewind to a host-side stop before the non-finite step);
    attention gives those rows zero weight, but 0 * NaN is NaN, so that user stopped as
    "nonfinite" too. Under a `cond`: calls on other slots make no pass over the cache."""
    s = self.ecfg.slots
    hit = jnp.zeros((s,), bool).at[slots].set(True, mode="drop") & (state.done == STOP_NONFINITE)
    first = jnp.zeros((s,), jnp.int32)
    if starts is not None:
      first = first.at[slots].set(jnp.asarray(starts, jnp.int32), mode="drop")
    rows = hit[:, None] & (jnp.arange(self.cache_len)[None, :] >= first[:, None])  # [S, C]

    def clear(kv):
      # [S, KV, C, hd] per layer, or [layers, S, KV, C, hd].
      mask = rows[:, None, :, None] if self.per_layer else rows[None, :, None, :, None]
      return jax.tree.map(lambda c: jnp.where(mask, jnp.zeros((), c.dtype), c), kv)

    return jax.lax.cond(hit.any(), clear, lambda kv: kv, (state.k, state.v))

  def _insert(self, prefix: Prefix, state: DecodeState, slots, share=None):
    t = prefix.k.shape[2]
    if t > self.cache_len:
      raise ValueError("prefix longer than the cache")
    k, v = self._clear_nonfinite_slots(state, slots)
    if self.per_layer:
      put = lambda cache, new: tuple(
          c.at[slots, :, :t].set(new[l].transpose(0, 2, 1, 3).astype(c.dtype), mode="drop")
          for l, c in enumerate(cache))
      k, v = put(k, prefix.k), put(v, prefix.v)
    else:
      head_major = lambda x: x.transpose(0, 1, 3, 2, 4).astype(state.k.dtype)
      k = k.at[:, slots, :, :t].set(head_major(prefix.k), mode="drop")
      v = v.at[:, slots, :, :t].set(head_major(prefix.v), mode="drop")
    # Slot index `slots` (one past the last) marks a padding row: "drop" discards its writes.
    upd = lambda a, b: a.at[slots].set(b.astype(a.dtype), mode="drop")
    # Slots that read shared rows of a slot overwritten here read their own rows again.
    stale = jnp.zeros((self.ecfg.slots,), bool).at[slots].set(True, mode="drop")
    share_src, share_len = self._unshare(state, stale[state.share_src])
    src, shared = (slots, jnp.zeros_like(slots)) if share is None else share
    share_src, share_len = upd(share_src, src), upd(share_len, shared)
    return self._constrain(state.replace(
        share_src=share_src, share_len=share_len,
        k=k, v=v, lengths=upd(state.lengths, prefix.lengths),
        tokens=upd(state.tokens, prefix.tokens),
        active=upd(state.active, prefix.done == RUNNING), done=upd(state.done, prefix.done),
        remaining=upd(state.remaining, prefix.remaining), limit=upd(state.limit, prefix.limit),
        request_ids=upd(state.request_ids, prefix.request_ids),
        seeds=upd(state.seeds, prefix.seeds)))

  def insert(self, prefix: Prefix, state: DecodeState, slots) -> DecodeState:
    """Place prefilled prompts into `slots` (an int for one prompt, or a sequence)."""
    slots = self._slot_array(slots, "insert")
    if len(slots) != prefix.lengths.shape[0]:
      raise ValueError(f"insert: {prefix.lengths.shape[0]} prefixes but {len(slots)} slots")
    self._check_slots(slots, "insert")
    self._check_state(state, "insert")
    if prefix.k.shape[2] > self.cache_len:
      raise ValueError(f"insert: the prefix holds {prefix.k.shape[2]} positions, more than this "
                       f"engine's cache of {self.cache_len} (a prefix of an engine with a larger "
                       "max_len?)")
    return self._jit_insert(prefix, state, slots)

  @staticmethod
  def _slot_array(slots, what: str) -> np.ndarray:
    """`slots` (an int or a sequence) as an int32 array; a bool or a non-integer slot raises
    before the cast, which made True slot 1 and cut slot 0.5 to slot 0."""
    _refuse_bools(slots, f"{what}: slots")
    a = np.atleast_1d(np.asarray(slots))
    if a.size and not np.issubdtype(a.dtype, np.integer):
      raise ValueError(f"{what}: slots must be integers, got {a.tolist()}")
    return a.astype(np.int32)

  def _check_slots(self, slots: np.ndarray, what: str) -> None:
    if slots.min() < 0 or slots.max() >= self.ecfg.slots:
      raise ValueError(f"{what}: slot out of range [0, {self.ecfg.slots}): {slots.tolist()}")
    # Two rows scattered into one slot: one row's tokens would be lost while a sampled token
    # is still returned for it.
    if len(np.unique(slots)) != len(slots):
      raise ValueError(f"{what}: a slot appears more than once: {slots.tolist()}")

  def _check_prompts(self, prompts, what: str) -> None:
    """A clear error, naming the prompt's index, for a prompt that is empty, leaves no room
    for a new token within `max_len`, or holds ids that are not in the vocabulary."""
    for i, p in enumerate(prompts):
      if len(p) == 0:
        raise ValueError(f"{what}: prompt {i} is empty (a prompt needs at least one token to "
                         "predict the next one from)")
      if len(p) + 1 > self.ecfg.max_len:
        # At the model's max_seq_len already, raising max_len is no way out.
        fix = ("shorten the prompt" if self.ecfg.max_len >= self.cfg.max_seq_len else
               f"raise max_len, up to the model's max_seq_len {self.cfg.max_seq_len}, or "
               "shorten the prompt")
        raise ValueError(f"{what}: prompt {i} has {len(p)} tokens; the engine's max_len is "
                         f"{self.ecfg.max_len} (prompt plus at least one new token must fit: "
                         f"{fix})")
    self._check_tokens(prompts, what, "prompt")

  def _check_tokens(self, seqs, what: str, item: str) -> None:
    """A clear error for token ids that are not integers in [0, vocab_size), bools included: the
    embedding gather would otherwise wrap negative ids and fill out-of-range ones with NaN, and
    the request would decode on from a token nobody sampled."""
    for i, seq in enumerate(seqs):
      token_ids(seq, f"{what}: {item} {i}", self.cfg.vocab_size)

  # ------------------------------------------------------------------ decode
  def _step(self, params, state: DecodeState, kv_len: int):
    if self.writes_first:
      share = (state.share_src, state.share_len) if self.ecfg.share_prompts else None
      logits, k, v = decoder.decode_in_place(params, state.k, state.v, state.tokens,
                                             state.lengths, cfg=self.cfg, share=share,
                                             fused_qkv=self.ecfg.decode_fused_qkv)
    else:
      logits, k_new, v_new = decoder.extend(params, state.k, state.v, state.tokens[:, None],
                                            state.lengths, cfg=self.cfg, kv_len=kv_len,
                                            attn_impl=self._attn)
      logits = logits[:, 0]
      slot_ids = jnp.arange(self.ecfg.slots, dtype=jnp.int32)
      k = decoder.write_kv(state.k, k_new, slot_ids, state.lengths)
      v = decoder.write_kv(state.v, v_new, slot_ids, state.lengths)
    valid = state.active
    over = None
    if kv_len < self.cache_len:
      # Attention read only the first `kv_len` cached entries: a slot holding more (a `kv_len`
      # below the caller's promise) stops here, its token from that truncated read dropped and
      # its length kept (`Engine.generate`). Elementwise on [S]; no host read.
      over = valid & (state.lengths > kv_len)
      valid = valid & ~over
    lengths = state.lengths + valid.astype(jnp.int32)
    keys = token_keys(state.seeds, state.request_ids, lengths)
    tok, lp = sample(logits, keys, self.ecfg.sampling)
    remaining = state.remaining - valid.astype(jnp.int32)
    code = self._stop_code(tok, lp, lengths, remaining, state.limit)
    done = jnp.where(valid, code, state.done)
    if over is not None:
      done = jnp.where(over, STOP_KV_LEN, done)
    new = state.replace(
        k=k, v=v, lengths=lengths, tokens=jnp.where(valid, tok, state.tokens),
        remaining=remaining, active=valid & (code == RUNNING), done=done)
    return new, (tok, lp, valid)

  def _generate(self, params, state: DecodeState, steps: int, kv_len: int):
    param_tree.check_model_shapes(params, self.cfg, "generate")
    if self.merges(steps) and not param_tree.is_merged(params):
      params = param_tree.merge_decode_weights(params, self.cfg, fold_norms=self.fold_norms)

    def body(st, _):
      return self._step(params, st, kv_len)
    state, (tok, lp, valid) = jax.lax.scan(body, state, None, length=steps)
    return self._constrain(state), StepOutput(tokens=tok, logprobs=lp, valid=valid,
                                              done=state.done)

  def merges(self, steps: int, params=None) -> bool:
    """Whether a decode call of `steps` steps multiplies by merged q|k|v and gate|up weights
    (`EngineConfig.decode_merge_weights`): merged at its start, or, given `params` from
    `prepare` that hold them, merged once for the run."""
    if isinstance(params, PreparedParams) and params.decode is not None:
      return True
    return self.merge_weights and (self.ecfg.decode_merge_weights is True
                                   or steps >= MERGE_MIN_STEPS)

  def fuses_qkv(self, steps: int, params=None) -> bool:
    """Whether a decode call of `steps` steps (with `params`, as `merges`) hands the decode
    kernel the raw q|k|v projection (`EngineConfig.decode_fused_qkv`;
    `decoder.decode_in_place`): the write-first step with merged weights, no "tensor" axis over
    more than one device, a head size the kernel takes (`decoder.fused_qkv_fits`)."""
    return self.merges(steps, params) and self._raw_qkv

  @property
  def _raw_qkv(self) -> bool:
    """Whether the write-first step with merged weights hands the kernel the raw q|k|v
    projection (`fuses_qkv` given merged weights)."""
    fits = shd.on_mesh(decoder.fused_qkv_fits, self.mesh)  # under the decode program's mesh
    return (self.ecfg.decode_fused_qkv and self.writes_first
            and fits(self.cfg, interpret=jax.default_backend() == "cpu"))

  @property
  def fold_norms(self) -> bool:
    """Whether the merged decode weights this engine makes (`merge_weights`) carry the layer
    norms' weights (`EngineConfig.decode_fold_norms`, where the kernel takes the raw q|k|v
    projection)."""
    return self.ecfg.decode_fold_norms and self.merge_weights and self._raw_qkv

  @property
  def chain_weights(self) -> bool:
    """Whether `prepare` chains the folded decode matrices (`EngineConfig.decode_chain_weights`;
    `param_tree.chain_decode_weights`): a model whose width is a multiple of its head size, and
    in auto mode one whose chained layer takes at most `CHAIN_MAX_LAYER_BYTES`."""
    chain = self.ecfg.decode_chain_weights
    fits = self.cfg.d_model % self.cfg.head_dim == 0
    small = param_tree.chained_layer_bytes(self.cfg) <= CHAIN_MAX_LAYER_BYTES
    return bool(self.fold_norms and fits and chain is not False and (chain or small))

  def _merge_for_run(self, params):
    param_tree.check_model_shapes(params, self.cfg, "prepare")
    merged = param_tree.merge_decode_weights(params, self.cfg, fold_norms=self.fold_norms)
    return param_tree.chain_decode_weights(merged, self.cfg) if self.chain_weights else merged

  def prepare(self, params) -> PreparedParams:
    """The params for a run of calls with one policy version (a rollout, a batch of requests):
    where this engine's decode calls multiply by merged q|k|v and gate|up weights
    (`merge_weights`), the merged copy is made here once instead of at the start of every
    decode call of at least `MERGE_MIN_STEPS` steps (on an H100, 1.06 ms a call for
    Qwen2.5-1.5B, 0.13 ms a step at 8 steps a call; benchmarks/RESULTS.md), chained where
    `chain_weights`. Every method that takes params takes the result. It keeps that copy alive
    while it is kept: make a new one after each params update. Params already prepared are
    returned as they are."""
    if isinstance(params, PreparedParams):
      return params
    if not self.merge_weights or param_tree.is_merged(params):
      return PreparedParams(params)
    return PreparedParams(params, self._jit_merge(params))

  @property
  def writes_first(self) -> bool:
    """Whether the decode step is the write-first one (`EngineConfig.decode_write_first` with
    the per-layer cache and the Pallas kernel: `decoder.decode_in_place`)."""
    return self.per_layer and self._attn == "pallas" and self.ecfg.decode_write_first

  def kv_len_for(self, max_cached: int) -> int:
    """The live-KV bucket covering `max_cached` cached tokens."""
    return _bucket(max(1, min(max_cached, self.cache_len)), self.kv_buckets)

  def generate(self, params, state: DecodeState, steps: int = 1,
               kv_len: int | None = None) -> tuple[DecodeState, StepOutput]:
    """`steps` decode steps for every active slot.

    `kv_len` (default None: the whole cache) bounds the cached entries that attention reads, so
    that a step reads the live part of the cache only; the engine rounds it up to its live-KV
    bucket (`kv_len_for`). It promises that every slot decoding in this call holds at most
    `kv_len - steps + 1` cached tokens (`DecodeState.lengths`, the pending token excluded): the
    longest such slot's cached length plus `steps - 1` is enough. The scheduler, the rollout
    driver and the JetStream adapter pass it from their host copies of the lengths. A slot
    that a step finds holding more cached tokens than the bucket is not decoded on the
    truncated cache: it stops before that step, with `done` STOP_KV_LEN, that step's token
    not valid and its length and pending token kept, so the state stays consistent (make it
    active again with `update_slots` and decode with a larger bound). The check runs on the
    device, with no host read; where the bound changes nothing (the Pallas kernel over the
    per-layer cache reads each slot up to its own length) there is nothing to check.
    """
    if not is_int(steps) or steps < 1:  # (True ran as one step)
      raise ValueError(f"Engine.generate: steps must be a positive int, got {steps!r}")
    if kv_len is not None and (not is_int(kv_len) or kv_len < 1):
      # (a jax array failed as an unhashable static argument; a float or 0 picked a bucket)
      raise ValueError("Engine.generate: kv_len must be a positive int (the longest active slot's "
                       f"cached tokens plus steps - 1) or None for the whole cache, got {kv_len!r}")
    self._check_state(state, "Engine.generate")
    if kv_len is None or (self.per_layer and self._attn == "pallas"):
      # The kernel reads each per-layer buffer in place and stops at each slot's length, so
      # the bound changes nothing there: one program instead of one per live-KV bucket (each
      # a compile of the unrolled layer loop, seconds on a GPU).
      kv_len = self.cache_len
    else:
      kv_len = self.kv_len_for(kv_len)
    if isinstance(params, PreparedParams):
      params = params.params if params.decode is None else params.decode
    return self._jit_generate(params, state, steps=steps, kv_len=kv_len)

  # ------------------------------------------------------------------ append
  def _append(self, params, state: DecodeState, slots, chunk, chunk_lens, budgets, kv_len):
    param_tree.check_model_shapes(params, self.cfg, "append")
    # chunk[:, 0] is the slot's pending token; observation tokens follow.
    cache_lens = state.lengths[slots]
    chunk = chunk.at[:, 0].set(state.tokens[slots])
    # The appended slots' cache rows are gathered one layer at a time inside `extend`.
    # Only each row's last position is projected to the vocabulary (the next-token logits).
    last, k_new, v_new = decoder.extend(params, state.k, state.v, chunk, cache_lens,
                                        cfg=self.cfg, kv_len=kv_len, attn_impl=self._attn,
                                        rows=slots, logit_index=chunk_lens - 1)
    k = decoder.write_kv(state.k, k_new, slots, cache_lens)
    v = decoder.write_kv(state.v, v_new, slots, cache_lens)
    lengths = cache_lens + chunk_lens
    keys = token_keys(state.seeds[slots], state.request_ids[slots], lengths)
    tok, lp = sample(last, keys, self.ecfg.sampling)
    remaining = budgets - 1
    limit = state.limit[slots]
    code = self._stop_code(tok, lp, lengths, remaining, limit)
    # A chunk that does not fit leaves the slot at its limit: report a length stop.
    code = jnp.where(lengths >= limit, STOP_LENGTH, code)
    upd = lambda a, b: a.at[slots].set(b.astype(a.dtype))
    new = state.replace(k=k, v=v, lengths=upd(state.lengths, lengths),
                        tokens=upd(state.tokens, tok), remaining=upd(state.remaining, remaining),
                        active=upd(state.active, code == RUNNING), done=upd(state.done, code))
    return self._constrain(new), (tok, lp, code)

  def append(self, params, state: DecodeState, slots, observations: Sequence[Sequence[int]],
             max_new_tokens: Sequence[int] | int | None = None, cached_lens=None):
    """Feed each slot's pending token plus observation tokens, then sample the next token.

    Any slot that holds a request may be appended to, whether it stopped (at EOS, its budget,
    a host-side stop rewound with `update_slots`) or is still decoding: its pending token is
    cached as the last token of the turn, whatever it is (an EOS id, or a token past a
    host-side stop that was not rewound), then the observation, and the token sampled after
    them starts a new turn. That turn's budget is `max_new_tokens` (default: `max_len`, so only
    the total-length cap bounds it), counting the token sampled here; what was left of the
    previous turn's budget is dropped. The slot decodes on (active) exactly when that token
    does not stop it, and its `done` code is that token's, whatever they were before. Host
    `cached_lens` behind the device's lengths (a host that stopped a slot mid-call and did not
    rewind it) are refused, below.

    `cached_lens` (host-known cache lengths of `slots`, or bounds above them) picks the live-KV
    bucket (without it attention reads the whole cache). The slots' cached lengths and
    total-length caps are read from the device for the checks: a slot that holds no request,
    `cached_lens` below the slots' cached lengths, an observation that leaves no room for a
    next token within `max_len` or within the slot's `max_total_len` (given to its prefill),
    or a token id outside the vocabulary is a ValueError, raised before anything runs. Returns
    (state, (first tokens, logprobs, stop codes)), the three as host NumPy arrays, one entry
    per slot.
    """
    slots = self._slot_array(slots, "append")
    if len(slots) != len(observations):
      raise ValueError("append: one observation per slot")
    if len(slots) == 0:
      raise ValueError("append needs at least one slot")
    self._check_slots(slots, "append")
    self._check_state(state, "append")
    if max_new_tokens is not None:
      if np.size(max_new_tokens) == 1:  # a one-element sequence is one value for all slots
        max_new_tokens = np.asarray(max_new_tokens, object).reshape(-1)[0]
      # As in prefill: a budget below one would still sample (and return) a token.
      budget = _per_request(max_new_tokens, len(slots), np.int32, "append", "max_new_tokens",
                            "slots", least=1)
    self._check_tokens(observations, "append", "observation")
    # The slots' cached lengths, and their total-length caps, which only the device holds:
    # an observation past a cap was cached whole and a token sampled beyond it.
    held, limits = (np.asarray(a)[slots] for a in jax.device_get((state.lengths, state.limit)))
    if cached_lens is not None:
      given = np.asarray(cached_lens).reshape(-1).tolist()
      if len(given) != len(slots):
        raise ValueError(f"append: {len(given)} cached_lens for {len(slots)} slots")
      if any(isinstance(g, bool) or not isinstance(g, int) for g in given):
        raise ValueError(f"append: cached_lens must be ints (token counts), got {given}")
      # They pick the live-KV bucket (a bound above a length is fine): a length below the
      # slot's own made attention skip the slot's last cached tokens, silently.
      if any(not g >= h for g, h in zip(given, held.tolist())):
        raise ValueError(f"append: cached_lens {given} of slots {slots.tolist()} are below "
                         f"their cached lengths {held.tolist()} (a slot caches its prompt, its "
                         "observations and every sampled token but the pending last one)")
    for slot, c, lim, o in zip(slots.tolist(), held.tolist(), limits.tolist(), observations):
      if c == 0:
        raise ValueError(f"append: slot {slot} holds no request (insert a prefix into it first)")
      # The pending token and the observation are cached; the next token must still fit.
      name, cap = (("max_len", self.ecfg.max_len) if lim >= self.ecfg.max_len
                   else ("its max_total_len", lim))
      if c + 1 + len(o) >= cap:
        raise ValueError(
            f"append: slot {slot} holds {c} cached tokens and a pending one; {len(o)} "
            f"observation tokens more leave no room for a next token within {name} {cap} "
            "(end the request or shorten the observation)")
    n = max(len(o) for o in observations) + 1
    nb = _bucket(n, _geometric_buckets(8, max(8, pow2_at_least(n))))
    b = len(slots)
    bb = _count_bucket(b, self.ecfg.slots)
    chunk = np.zeros((bb, nb), np.int32)
    lens = np.ones((bb,), np.int32)
    for i, o in enumerate(observations):
      chunk[i, 1:1 + len(o)] = o
      lens[i] = 1 + len(o)
    # Padding rows repeat the first slot with an identical chunk: duplicate writes are equal.
    pad_slots = np.full((bb,), slots[0], np.int32)
    pad_slots[:b] = slots
    chunk[b:] = chunk[0]
    lens[b:] = lens[0]
    budgets = np.full((bb,), self.ecfg.max_len, np.int32)
    if max_new_tokens is not None:
      budgets[:b] = budget
    budgets[b:] = budgets[0]
    kv_len = (self.cache_len if cached_lens is None
              else _bucket(max(1, min(int(np.max(given)), self.cache_len)),
                           self.append_kv_buckets))
    state, (tok, lp, code) = self._jit_append(_plain(params), state, pad_slots, chunk, lens,
                                              budgets, kv_len=kv_len)
    # Host copies, then the real rows: slicing the device arrays compiled a program per count.
    tok, lp, code = jax.device_get((tok, lp, code))
    return state, (tok[:b], lp[:b], code[:b])

  # ------------------------------------------------------------------ host control
  def _unshare(self, state: DecodeState, stale):
    """`share_src` / `share_len` with the slots flagged in `stale` back on their own rows."""
    own = jnp.arange(self.ecfg.slots, dtype=jnp.int32)
    return jnp.where(stale, own, state.share_src), jnp.where(stale, 0, state.share_len)

  def _update(self, state: DecodeState, slots, lengths, tokens, active, remaining):
    upd = lambda a, b: a.at[slots].set(b.astype(a.dtype))
    # A pending token at `lengths` fills the sequence at the slot's cap when lengths + 1 >=
    # limit (as `_stop_code` reads it): made active, the slot would sample past its cap. It
    # stays inactive with the stop code of a length stop instead; decided here, on the
    # device, so that a rewind needs no host read of the caps.
    full = active & (lengths + 1 >= state.limit[slots])
    active = active & ~full
    done = jnp.where(active, RUNNING, jnp.where(full, STOP_LENGTH, state.done[slots]))
    k, v = self._clear_nonfinite_slots(state, slots, lengths)
    lengths = upd(state.lengths, lengths)
    # A slot rewound below shared rows overwrites them (its own copy, or the rows that others
    # read from it): such readers read their own rows again.
    stale = (lengths[state.share_src] < state.share_len) | (lengths < state.share_len)
    share_src, share_len = self._unshare(state, stale)
    return self._constrain(state.replace(
        k=k, v=v, lengths=lengths, tokens=upd(state.tokens, tokens),
        share_src=share_src, share_len=share_len, active=upd(state.active, active),
        remaining=upd(state.remaining, remaining), done=upd(state.done, done)))

  def update_slots(self, state: DecodeState, slots, *, lengths, tokens, active,
                   remaining=None) -> DecodeState:
    """Set slots' cached length, pending token and activity (rewind after a host-side stop).

    `lengths` are taken as given, checked only against the cache (`[0, max_len)`): the engine
    keeps no host copy of the slots' lengths and does not read the device's here. The caller
    promises that each slot's first `lengths` cache rows hold its request's K/V, that is, a
    length at most the slot's cached length (`DecodeState.lengths`): a rewind to a token the
    slot sampled there (the rows past it are overwritten by the next steps), or the length
    unchanged. A length above it is not refused: the next steps read the rows in between as
    the request's history (zeros, or K/V that an earlier request or a rewound turn left there)
    and sample from them with no error. The engine's tests set such lengths on purpose to put
    a slot next to a cap; the rollout driver rewinds to lengths it counted from the engine's
    own outputs, and `free_slots` passes the device's lengths back.

    A slot asked to be active whose pending token leaves no room for a next one under its
    total-length cap (`lengths + 1 >= ` its `max_total_len` given to prefill, or `max_len`) is
    left inactive with `done` STOP_LENGTH, the code a length stop gives: the next `generate`
    samples nothing for it and reports that code. This is decided on the device, without a
    host read of the caps. An inactive slot keeps its `done` code; an active one is RUNNING.
    """
    # NumPy casts a bool among ints to 0 / 1 (tokens=[True] became token 1): a caller bug,
    # refused before any conversion (slots: `_slot_array`; tokens: `token_ids`, below).
    for name, x in (("lengths", lengths), ("remaining", remaining)):
      if x is not None:
        _refuse_bools(x, f"update_slots: {name}")
    slots = self._slot_array(slots, "update_slots")
    k = len(slots)
    if k == 0:
      return state
    # A negative slot would wrap onto another request's slot; a length past the cache would
    # have the next steps' writes dropped and attention read stale rows.
    self._check_slots(slots, "update_slots")
    self._check_state(state, "update_slots")
    # One value for all slots or one per slot; NumPy's broadcast error named neither the
    # argument nor the call.
    for name, x in (("lengths", lengths), ("active", active), ("remaining", remaining)):
      if x is not None and np.size(x) not in (1, k):
        raise ValueError(f"update_slots: {np.size(x)} {name} for {k} slots (give one value "
                         f"for all or one per slot), got {np.asarray(x).tolist()}")
    lens = np.broadcast_to(np.asarray(lengths), (k,))
    if (not np.issubdtype(lens.dtype, np.integer) or lens.min() < 0
        or lens.max() >= self.ecfg.max_len):
      raise ValueError(f"update_slots: lengths must be integers in [0, {self.ecfg.max_len}) "
                       f"(the pending token must fit), got {np.asarray(lengths).tolist()}")
    # The pending token is fed at the next step: an id outside the vocabulary would be
    # wrapped (negative) or read as NaN by the embedding gather, as in `prefill`.
    tokens = token_ids([tokens] if np.ndim(tokens) == 0 else tokens, "update_slots: tokens",
                       self.cfg.vocab_size)
    if len(tokens) not in (1, k):
      raise ValueError(f"update_slots: {len(tokens)} tokens for {k} slots")
    # A truthy string ("no") became True; an active slot with a budget below one would still
    # sample (and return) a token, which prefill and append refuse.
    act = np.broadcast_to(np.asarray(active), (k,))
    if act.dtype != bool:
      raise ValueError(f"update_slots: active must be bools, got {np.asarray(active).tolist()}")
    if remaining is not None:
      rem = np.broadcast_to(np.asarray(remaining), (k,))
      if not np.issubdtype(rem.dtype, np.integer) or (act & (rem < 1)).any():
        raise ValueError(f"update_slots: remaining must be integers, at least 1 for an active "
                         f"slot, got {np.asarray(remaining).tolist()} (active "
                         f"{np.asarray(active).tolist()})")
    kb = pow2_at_least(k)  # one program per power of two

    def arr(x, dt):
      a = np.broadcast_to(np.asarray(x, dt), (k,))
      return np.concatenate([a, np.repeat(a[:1], kb - k)])  # duplicates write equal values

    rem = arr(self.ecfg.max_len if remaining is None else remaining, np.int32)
    return self._jit_update(state, arr(slots, np.int32), arr(lengths, np.int32),
                            arr(tokens, np.int32), arr(active, bool), rem)

  def free_slots(self, state: DecodeState, slots) -> DecodeState:
    """Deactivate slots (their cache is reused by the next insert)."""
    slots = self._slot_array(slots, "free_slots")
    if len(slots) == 0:
      return state
    # Before the host reads below: a slot past the last was an IndexError, and a negative one
    # read another slot's values.
    self._check_slots(slots, "free_slots")
    self._check_state(state, "free_slots")
    lengths = np.asarray(state.lengths)[slots]
    tokens = np.asarray(state.tokens)[slots]
    return self.update_slots(state, slots, lengths=lengths, tokens=tokens, active=False,
                             remaining=0)
