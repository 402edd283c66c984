"""Serve a jaxagent policy with JetStream: our `Engine` behind JetStream's `engine_api.Engine`.

JetStream's orchestrator (`jetstream.core.orchestrator.Driver`) runs prefill, transfer, generate
and detokenize threads over an engine; its gRPC server (`jetstream.core.server_lib`) streams the
result to clients. This module adapts `jaxagent.generate.Engine` (slots, batched prefill,
device-side stop codes) to google-jetstream 0.2.2's engine contract so that both can drive it:

    engine = JetStreamEngine.from_pretrained("/ckpt/policy-hf", slots=16, max_len=2048)
    # or JetStreamEngine(existing_engine, params, tokenizer) to share an Engine's programs
    server = serve(engine, port=9000)          # gRPC `Orchestrator.Decode`
    ...
    server.stop()

Serving only. JetStream's `ReturnSample` carries token ids and text but no log-probabilities, and
its orchestrator has no notion of tool turns, so RL rollouts use our own loop
(`jaxagent.generate.run_requests`, `jaxagent.agent`), which records sampler log-probs per token.

How our engine maps onto the contract (0.2.2):
  * Its orchestrator never returns the token sampled by prefill; it only forwards the tokens of
    `generate` calls. So each result carries, per slot, the slot's *pending* token (sampled by
    the previous call or by prefill) followed by the first `decode_steps - 1` tokens of this call;
    the last token sampled becomes the next pending token. Every token reaches the client once.
  * `ResultTokens.valid` is our engine's per-step activity: a token is valid while the slot's
    request has not stopped on device (EOS, cache length). The EOS token itself is valid and is
    in the tokenizer's `stop_tokens`, so the orchestrator ends the request without returning it;
    a length stop returns the last token, then the next result is invalid, which ends it. A
    non-finite stop (`STOP_NONFINITE`: NaN or inf in the request's logits) ends it with the
    token drawn from those logits invalid (it is no prediction of the model, so it is not
    returned); JetStream's results carry no stop reason, so the client sees a short completion.
    Each result also carries the slots' stop codes, in a column JetStream does not read; a code
    the adapter never causes (`STOP_KV_LEN`: a live-KV bound below a slot's cached length)
    makes reading the result raise (`ServingResult`) rather than end a request short.
  * `ResultTokens` lengths are "tokens returned to this request, counting this result's first",
    which the orchestrator compares with the request's `max_tokens`: with `decode_steps=1`
    (default) a request receives exactly `max_tokens` tokens; with k > 1 steps per call it may
    receive up to k - 1 more (JetStream checks the budget once per call).

Sharp edges of google-jetstream 0.2.2 handled here:
  * It calls `jax.tree_map`, which newer JAX removed: `jax.tree_map = jax.tree.map` is set on
    import.
  * Importing its orchestrator sets the root logger to DEBUG and adds a stdout handler: both are
    undone right after the import.
  * An exception in any Driver thread SIGKILLs the process, so input is checked before it reaches
    a thread: `CheckedDriver` (used by `make_driver` and `serve`) rejects bad requests with a
    ValueError in the submitting thread (for gRPC, INVALID_ARGUMENT for that call, as for a
    request with neither text nor token content, which JetStream's servicer cannot read), and
    `JetStreamEngine.prefill` turns content that still slips through (out-of-vocabulary ids, empty
    prompts) into a request that finishes with no tokens instead of raising.
  * It prepends `bos_id` to every request without a session cache. For tokenizers that add no BOS
    (SmolLM2, Qwen) the adapter's `bos_id` is the marker -1 and prefill drops it; for those that
    do (Llama 3), prefill drops it from a prompt that already starts with BOS (a chat-templated
    one), which would otherwise reach the model as BOS BOS ..., and `check_request` counts it
    only for prompts without one (a BOS-initial prompt of `max_prefill_length` tokens fits).

  * Its detokenize thread decodes text replies one token at a time, so a character split across
    byte-level tokens would arrive as U+FFFD pieces; `CheckedDriver` re-decodes each request's
    stream (`_ReturnChannel`), holding bytes back until their character is complete. It also
    frees the slot of a request whose client cancelled or whose event loop closed (JetStream
    would decode it to `max_tokens`, and delivering to a closed loop kills the process), and
    `stop` ends requests still in flight with RuntimeError (JetStream drops them silently).
  * It ends requests on the host only: a slot it frees keeps decoding until the engine stops
    it (cache length), and counts in every call's live-KV bound. `CheckedDriver` reports each
    slot handed back (`JetStreamEngine.slot_freed`) and the next `generate` deactivates it.
  * Its detokenize thread and its gRPC server's event-loop thread are not daemons, so a
    process that never stopped its driver or server hung at exit. `CheckedDriver` and `serve`
    run every thread as a daemon and stop what is still running at exit.

Not supported: session caches (`session_cache` / `existing_prefix`) and several samples per
request. Token-id requests return exact ids and no text.
"""
from __future__ import annotations

import asyncio
import atexit
import dataclasses
import itertools
import logging
import pathlib
import queue
import threading
import weakref
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxagent import sharding as shd
from jaxagent._token_ids import is_int, token_ids
from jaxagent.generate.engine import (RUNNING, STOP_BUDGET, STOP_EOS, STOP_KV_LEN, STOP_LENGTH,
                                      STOP_NONFINITE, DecodeState, Engine, EngineConfig, Prefix,
                                      PreparedParams)
from jaxagent.generate.sampling import SamplingConfig
from jaxagent.generate.scheduler import _adds_bos
from jaxagent.models import param_tree
from jaxagent.models.config import ModelConfig

def _import_jetstream():
  """Import JetStream, undoing the root-logger changes its orchestrator makes at import."""
  root = logging.getLogger()
  level, handlers = root.level, list(root.handlers)
  try:
    from jetstream.core import orchestrator, server_lib
    from jetstream.core.utils import async_multifuture
    from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2
  except ImportError as e:
    raise ImportError(
        "jaxagent.generate.jetstream needs google-jetstream 0.2.2 (and TensorFlow, which it pulls "
        f"in): pip install \"jaxagent[jetstream]\" ({e})") from e
  finally:
    # The orchestrator sets the root logger to DEBUG and adds a stdout handler at import.
    root.setLevel(level)
    for h in list(root.handlers):
      if h not in handlers:
        root.removeHandler(h)
  # Its orchestrator calls `jax.tree_map` (in `delete_pytree`, after every insert), which JAX
  # removed; alias it before any Driver runs.
  if not hasattr(jax, "tree_map"):
    jax.tree_map = jax.tree.map
  return (orchestrator, server_lib, async_multifuture, engine_api, token_utils, tokenizer_api,
          tokenizer_pb2)


(orchestrator, server_lib, async_multifuture, engine_api, token_utils, tokenizer_api,
 tokenizer_pb2) = _import_jetstream()

log = logging.getLogger(__name__)

# JetStream pads prompts to one of these lengths; `max_prefill_length` must be one of them
# (`token_utils.pad_tokens` calls `.index(max_prefill_length)` on this list).
PREFILL_LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
NO_BOS = -1  # `bos_id` marker for tokenizers that add no BOS; prefill drops it


class JetStreamTokenizer(tokenizer_api.Tokenizer):
  """A jaxagent `Tokenizer` behind JetStream's tokenizer API.

  `stop_tokens` are the engine's EOS ids (JetStream's default would also stop on the pad id).
  `bos_id` is the marker -1 when `add_bos` is False (see the module docstring).
  """

  def __init__(self, tokenizer, stop_ids: Sequence[int], add_bos: bool):
    if add_bos and tokenizer.bos_id is None:
      raise ValueError(f"add_bos=True but tokenizer {tokenizer.name!r} has no BOS token")
    self.tokenizer = tokenizer
    self.add_bos = bool(add_bos)
    self._stop = frozenset(int(i) for i in stop_ids)
    self._vocab = tokenizer.vocab_size

  def encode(self, s: str, **kwargs) -> tuple[jax.Array | np.ndarray, int]:
    """Token ids of `s`, BOS-prefixed when `is_bos`, padded as JetStream's `pad_tokens` does."""
    is_bos = kwargs.pop("is_bos", True)
    prefill_lengths = kwargs.pop("prefill_lengths", None)
    max_prefill_length = kwargs.pop("max_prefill_length", None)
    jax_padding = kwargs.pop("jax_padding", True)
    if kwargs:
      raise TypeError(f"JetStreamTokenizer.encode got unexpected arguments {sorted(kwargs)}")
    ids = np.asarray(self.tokenizer.encode(s), np.int32)
    return token_utils.pad_tokens(ids, self.bos_id, self.pad_id, is_bos=is_bos,
                                  prefill_lengths=prefill_lengths,
                                  max_prefill_length=max_prefill_length, jax_padding=jax_padding)

  def decode(self, token_ids: Sequence[int], **kwargs) -> str:
    """Text of `token_ids` (ids the tokenizer does not know are skipped)."""
    del kwargs  # JetStream passes `is_streaming` only to its SentencePiece tokenizer
    ids = [int(t) for t in token_ids if 0 <= int(t) < self._vocab]
    return self.tokenizer.decode(ids)

  @property
  def pad_id(self) -> int:
    pad = self.tokenizer.pad_id
    return 0 if pad is None else int(pad)

  @property
  def eos_id(self) -> int:
    eos = self.tokenizer.eos_id
    if eos is None:
      eos = min(self._stop) if self._stop else -1
    return int(eos)

  @property
  def bos_id(self) -> int:
    return int(self.tokenizer.bos_id) if self.add_bos else NO_BOS

  @property
  def stop_tokens(self) -> set[int]:
    return set(self._stop)


@flax.struct.dataclass
class ServingPrefix:
  """One prefilled request: our engine's `Prefix` (batch of one) plus host-known facts."""
  prefix: Prefix
  prompt_len: np.ndarray  # [] int32
  ok: np.ndarray          # [] bool; False: rejected at prefill, finishes with no tokens


@flax.struct.dataclass
class ServingState:
  """The generate engine's decode state: our `DecodeState` plus what JetStream's results need."""
  decode: DecodeState
  pending: jax.Array   # [S] int32: each slot's last sampled token, first column of the next result
  unsent: jax.Array    # [S] bool: `pending` is a real token not yet returned
  emitted: jax.Array   # [S] int32: tokens returned so far to the slot's request
  # Host upper bound on each slot's cached length; -1 for a slot that cannot be active.
  bounds: tuple[int, ...] = flax.struct.field(pytree_node=False)


def _insert_meta(pending, unsent, emitted, slot, first, first_logprob, ok):
  # A first token drawn from non-finite logits (`STOP_NONFINITE`) is never sent.
  unsent = unsent.at[slot].set(ok & jnp.isfinite(first_logprob))
  return pending.at[slot].set(first), unsent, emitted.at[slot].set(0)


def _release(active, unsent, freed):
  """Deactivate the slots flagged in `freed` (their requests ended on the host)."""
  return active & ~freed, unsent & ~freed


def _pack(tokens_KxS, logprobs_KxS, valid_KxS, done, pending, unsent, emitted):
  """This call's `ResultTokens.data` [S, 2k + 2] and the next pending / unsent / emitted.

  Per slot: k tokens, k valid flags, the length JetStream reads, then the engine's stop code
  after the call (`done`; JetStream reads only the first 2k + 1 columns, `ServingResult`
  checks the last)."""
  k = tokens_KxS.shape[0]
  # The token a slot drew from non-finite logits (its last valid one: it stopped there,
  # `STOP_NONFINITE`) is no prediction of the model: invalid, so the request ends before it.
  valid_KxS = valid_KxS & jnp.isfinite(logprobs_KxS)
  toks = jnp.concatenate([pending[:, None], tokens_KxS[:k - 1].T], axis=1)
  valid = jnp.concatenate([unsent[:, None], valid_KxS[:k - 1].T], axis=1)
  # Valid columns form a prefix (a slot stays stopped), so this counts this call's tokens.
  n_valid = jnp.sum(valid, axis=1, dtype=jnp.int32)
  lengths = emitted + 1
  data = jnp.concatenate([toks, valid.astype(jnp.int32), lengths[:, None],
                          done.astype(jnp.int32)[:, None]], axis=1)
  last_valid = valid_KxS[k - 1]
  new_pending = jnp.where(last_valid, tokens_KxS[k - 1], pending)
  return data.astype(jnp.int32), new_pending, last_valid, emitted + n_valid


# The stop codes a slot can hold in the adapter's decode state; any other (STOP_KV_LEN: the
# kv_len bound the adapter gave was below a slot's cached length) is an adapter bug.
_SERVING_CODES = (RUNNING, STOP_EOS, STOP_BUDGET, STOP_LENGTH, STOP_NONFINITE)


@flax.struct.dataclass
class ServingResult(engine_api.ResultTokens):
  """`JetStreamEngine.generate`'s `ResultTokens`, with each slot's stop code after the call as
  the last column of `data` (which JetStream does not read).

  `convert_to_numpy` (the one host read of a result, in JetStream's detokenize thread) raises
  RuntimeError where a slot holds a code the adapter never causes: STOP_KV_LEN, which the
  engine sets instead of decoding a slot on a cache cut short by too low a `kv_len` bound.
  Such a slot's tokens are invalid from there on, so JetStream would end its request as a
  short completion, with no error; the raise makes it loud (in a Driver thread it ends the
  serving process, with the message printed).
  """

  def convert_to_numpy(self) -> "ServingResult":
    data = np.array(self.data)
    codes = data[:, self.length_idx[1]]
    bad = np.flatnonzero(~np.isin(codes, _SERVING_CODES)).tolist()
    if bad:
      kv = [s for s in bad if codes[s] == STOP_KV_LEN]
      why = (f"the engine stopped slots {kv} with STOP_KV_LEN: they held more cached tokens "
             "than the kv_len bound the adapter gave from its host bounds on their lengths "
             "(ServingState.bounds)" if kv else
             f"slots {bad} hold stop codes {codes[bad].tolist()}, none of {_SERVING_CODES}")
      raise RuntimeError(f"JetStreamEngine.generate: {why}; their requests would end as short "
                         "completions with no error. The adapter's state and the engine's "
                         "disagree (a bug in jaxagent's JetStream adapter)")
    return dataclasses.replace(self, data=data)


class JetStreamEngine(engine_api.Engine):
  """Our `Engine` behind google-jetstream 0.2.2's `Engine` API (prefill, insert, generate, ...).

  Wraps an existing `Engine` (sharing its compiled programs); `create` and `from_pretrained`
  build one. The engine's `eos_ids` end requests on device and are the tokenizer's `stop_tokens`.

  Args:
    params: the model's params pytree (returned by `load_params`, which JetStream's server calls).
    tokenizer: a jaxagent `Tokenizer`, or a path / preset for `jaxagent.models.load_tokenizer`.
    max_prefill_length: longest prompt (after BOS) JetStream may send; one of `PREFILL_LENGTHS`
      and below the engine's `max_len` (default: the largest such).
    decode_steps: decode steps per `generate` call (see the module docstring on `max_tokens`).
    add_bos: whether JetStream should prepend BOS (default: whether the tokenizer adds one).
    seed: sampling seed (ignored when greedy). A request's tokens are drawn from (seed, its
      number among this adapter's requests, counted from 0, position), so the same seed gives
      the same samples again: a restarted server, or a second one with the same seed, repeats
      the first's streams request for request. For independent streams give each server (and
      each restart meant to differ) its own seed, e.g. its replica index or a random one.
  """

  def __init__(self, engine: Engine, params, tokenizer, *, max_prefill_length: int | None = None,
               decode_steps: int = 1, add_bos: bool | None = None, seed: int = 0):
    if not isinstance(engine, Engine):
      raise TypeError(f"engine must be a jaxagent.generate.Engine, got {type(engine).__name__} "
                      "(JetStreamEngine.create builds one from params and a config)")
    if isinstance(tokenizer, (str, pathlib.Path)):
      from jaxagent.models import load_tokenizer
      tokenizer = load_tokenizer(tokenizer)
    if not is_int(decode_steps) or decode_steps < 1:
      raise ValueError(f"decode_steps must be a positive int, got {decode_steps!r}")
    if add_bos is not None and not isinstance(add_bos, (bool, np.bool_)):  # "no" was True
      raise ValueError(f"add_bos must be True, False or None (the tokenizer's own), got "
                       f"{add_bos!r}")
    # Checked here: the prefill that would refuse it runs in a Driver thread, whose exception
    # kills the process.
    if (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
        or not 0 <= seed < 2 ** 32):
      raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    # Params of another model (or None) passed here and failed in the first prefill, in a
    # Driver thread: the server process was killed at its first request.
    param_tree.check_model_shapes(params.params if isinstance(params, PreparedParams) else params,
                                  engine.cfg, "JetStreamEngine")
    max_len = engine.ecfg.max_len
    if max_prefill_length is None:
      fits = [n for n in PREFILL_LENGTHS if n < max_len]
      if not fits:
        raise ValueError(f"max_len {max_len} is too small for JetStream: its shortest prefill "
                         f"length is {PREFILL_LENGTHS[0]} and one new token must fit after it")
      max_prefill_length = fits[-1]
    # A float equal to a length (32.0) passed this check, then JetStream sliced a full-length
    # prompt with it in its prefill thread: a TypeError there kills the process.
    if (not is_int(max_prefill_length) or max_prefill_length not in PREFILL_LENGTHS
        or max_prefill_length >= max_len):
      raise ValueError(f"max_prefill_length must be one of JetStream's prefill lengths "
                       f"{PREFILL_LENGTHS} and below max_len={max_len}, got {max_prefill_length!r}")
    self.engine = engine
    self.cfg = engine.cfg
    self.tokenizer = tokenizer
    self.jetstream_tokenizer = JetStreamTokenizer(
        tokenizer, engine.ecfg.eos_ids, _adds_bos(tokenizer) if add_bos is None else bool(add_bos))
    # Held prepared (`Engine.prepare`): where the engine's decode calls multiply by merged
    # q|k|v and gate|up weights, the merged copy is made once here, not at every decode call.
    self._params = engine.prepare(params)
    self._steps = int(decode_steps)
    self._max_prefill = int(max_prefill_length)
    self._seed = int(seed)
    self._request_ids = itertools.count()  # next() is atomic: prefill threads may share it
    self._jit_insert_meta = jax.jit(_insert_meta, donate_argnums=(0, 1, 2))
    self._jit_pack = jax.jit(_pack, donate_argnums=(4, 5, 6))
    self._jit_release = jax.jit(_release, donate_argnums=(0, 1))
    # Slots whose requests JetStream has ended (`slot_freed`), per thread that runs the decode
    # state holding them (JetStream's generate thread; drivers sharing this engine each have
    # their own); that thread's next `generate` deactivates them.
    self._freed: weakref.WeakKeyDictionary[threading.Thread, set[int]] = (
        weakref.WeakKeyDictionary())
    self._freed_lock = threading.Lock()

  @classmethod
  def create(cls, params, cfg: ModelConfig, tokenizer, *, slots: int = 8, max_len: int = 1024,
             sampling: SamplingConfig = SamplingConfig(), eos_ids: Sequence[int] | None = None,
             mesh: Mesh | None = None, **kw) -> "JetStreamEngine":
    """Build the `Engine` too. `eos_ids` default to the tokenizer's; `kw` go to `__init__`."""
    if isinstance(tokenizer, (str, pathlib.Path)):
      from jaxagent.models import load_tokenizer
      tokenizer = load_tokenizer(tokenizer)
    # EngineConfig refuses ids that are not ints (`int()` cut 2.5 to 2), and Engine ids
    # outside the model's vocabulary.
    eos = tokenizer.eos_ids if eos_ids is None else eos_ids
    engine = Engine(cfg, EngineConfig(slots=slots, max_len=max_len, eos_ids=eos,
                                      sampling=sampling), mesh=mesh)
    return cls(engine, params, tokenizer, **kw)

  @classmethod
  def from_pretrained(cls, path: str | pathlib.Path, *, dtype: str | None = None,
                      **kw) -> "JetStreamEngine":
    """An engine over an HF directory (e.g. written by `jaxagent.models.save_hf`) or a preset.

    `kw` go to `create` (slots, max_len, sampling, eos_ids, mesh, decode_steps, ...).
    """
    from jaxagent.models import load, load_tokenizer
    cfg, params = load(path, dtype=dtype)
    return cls.create(params, cfg, load_tokenizer(path), **kw)

  # ------------------------------------------------------------------ request checks
  def check_request(self, content: str | Sequence[int], max_tokens: int,
                    history_path: str | None = None) -> None:
    """Raise ValueError if JetStream could not serve this request (call before queueing it)."""
    if (isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer))
        or max_tokens < 1):
      raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    if history_path:
      raise ValueError("session caches (history_path / session_cache) are not supported by the "
                       "jaxagent engine; send the whole conversation as the prompt")
    if isinstance(content, str):
      # A tokenizer with more ids than the model's vocabulary (added tokens the embedding was
      # not resized for): prefill rejected such a prompt, and the client got an empty reply.
      ids = token_ids(self.tokenizer.encode(content),
                      f"the text prompt's encoding by tokenizer {self.tokenizer.name!r}",
                      self.cfg.vocab_size)
    elif isinstance(content, (list, tuple, np.ndarray)):
      ids = token_ids(content, "the prompt", self.cfg.vocab_size)
    else:
      raise ValueError(f"prompt must be a str or a sequence of token ids, got "
                       f"{type(content).__name__}")
    if not ids:
      raise ValueError("empty prompt")
    # JetStream prepends BOS and keeps the last `max_prefill_length` tokens; prefill drops
    # that BOS from a prompt that already starts with one (`_prompt`), so it counts only here.
    n = len(ids) + self._adds_a_bos(ids[0])
    if n > self._max_prefill:
      raise ValueError(f"prompt of {n} tokens exceeds max_prefill_length {self._max_prefill} "
                       "(JetStream would silently keep only its last tokens)")

  def _adds_a_bos(self, first_id) -> bool:
    """Whether the BOS JetStream prepends to a prompt starting with `first_id` reaches the
    model: not the no-BOS marker, nor a second BOS (both dropped at prefill)."""
    return self.jetstream_tokenizer.add_bos and first_id != self.jetstream_tokenizer.bos_id

  # ------------------------------------------------------------------ prefill / insert
  def _prompt(self, padded_tokens, true_length) -> tuple[list[int], str | None]:
    """The prompt ids in JetStream's padded tokens, and None or why they cannot be served."""
    arr = np.asarray(padded_tokens)
    if arr.ndim != 1 or arr.dtype.kind not in "iuf":
      return [], f"padded_tokens must be a 1-D numeric array, got {arr.dtype}{list(arr.shape)}"
    n = int(true_length)
    if n > arr.shape[0]:  # JetStream truncated a too-long prompt to its last tokens
      # A prompt of exactly `max_prefill_length` tokens loses only what JetStream prepended:
      # the no-BOS marker, or a BOS before the prompt's own (which prefill would drop).
      if n - arr.shape[0] > 1 or (arr.size and self._adds_a_bos(arr[0])):
        log.warning("prompt of %d tokens was truncated to its last %d", n, arr.shape[0])
      n = arr.shape[0]
    arr = arr[:max(n, 0)]
    if arr.size and not np.all(np.isfinite(arr) & (arr == np.round(arr))):
      return [], "non-integer token ids"
    ids = arr.astype(np.int64)
    if ids.size and ids[0] == NO_BOS:
      ids = ids[1:]
    bos = self.jetstream_tokenizer.bos_id
    if self.jetstream_tokenizer.add_bos and ids.size >= 2 and ids[0] == ids[1] == bos:
      # JetStream prepends BOS to a prompt that already starts with it: a chat-templated
      # prompt of a tokenizer that adds BOS (Llama 3) reached the model as BOS BOS ...
      ids = ids[1:]
    if ids.size == 0:
      return [], "empty prompt"
    if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
      return [], f"token ids outside [0, {self.cfg.vocab_size})"
    if ids.size >= self.engine.ecfg.max_len:
      return [], f"prompt of {ids.size} tokens does not fit max_len {self.engine.ecfg.max_len}"
    return ids.tolist(), None

  def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length) -> ServingPrefix:
    """Prefill one prompt and sample its first token; unservable input gives a rejected prefix."""
    if existing_prefix is not None:
      raise ValueError("existing_prefix (session caches) is not supported by the jaxagent engine")
    ids, why = self._prompt(padded_tokens, true_length)
    rid = next(self._request_ids) & 0x7FFFFFFF
    if why is not None:
      # Raising here would kill the process (JetStream's thread policy): reject the request.
      log.error("rejecting a JetStream request at prefill: %s", why)
      pre = self.engine.prefill(params, [[0]], [rid], self._seed)
      pre = pre.replace(done=jnp.full_like(pre.done, STOP_LENGTH))
      return ServingPrefix(pre, np.asarray(1, np.int32), np.asarray(False))
    pre = self.engine.prefill(params, [ids], [rid], self._seed)
    return ServingPrefix(pre, np.asarray(len(ids), np.int32), np.asarray(True))

  def insert(self, prefix: ServingPrefix, decode_state: ServingState, slot: int) -> ServingState:
    """Place a prefilled request into `slot`."""
    with self._freed_lock:  # the slot's previous request was freed before it could be reused
      self._freed.get(threading.current_thread(), set()).discard(int(slot))
    st = decode_state
    decode = self.engine.insert(prefix.prefix, st.decode, slot)
    pending, unsent, emitted = self._jit_insert_meta(
        st.pending, st.unsent, st.emitted, jnp.int32(slot), prefix.prefix.tokens[0],
        prefix.prefix.logprobs[0], jnp.asarray(prefix.ok))
    ok, plen = bool(np.asarray(prefix.ok)), int(np.asarray(prefix.prompt_len))
    bounds = list(st.bounds)
    bounds[slot] = plen if ok and plen < self.engine.ecfg.max_len - 1 else -1
    return ServingState(decode, pending, unsent, emitted, tuple(bounds))

  # ------------------------------------------------------------------ decode
  def slot_freed(self, slot: int, thread: threading.Thread | None = None) -> None:
    """Note that JetStream ended the request in `slot` and handed the slot back (thread-safe).

    JetStream's engine contract has no such call: its detokenize thread ends a request (its
    `max_tokens`, a stop token, a cancelled client) on the host only. Without this the slot
    went on decoding for nobody up to the cache length, and the live-KV bound of every
    `generate` call counted it. `CheckedDriver` calls this; the next `generate` call made by
    `thread` (the one that runs the decode state holding the slot; default: the caller)
    deactivates the slot unless that thread inserted a new request into it first.
    """
    with self._freed_lock:
      self._freed.setdefault(thread or threading.current_thread(), set()).add(int(slot))

  def init_decode_state(self, *args, **kwargs) -> ServingState:
    """All slots empty."""
    if args or kwargs:
      raise TypeError("init_decode_state takes no arguments")
    with self._freed_lock:
      self._freed.pop(threading.current_thread(), None)
    s = self.engine.ecfg.slots
    zi = jnp.zeros((s,), jnp.int32)
    return ServingState(self.engine.init_decode_state(), zi, jnp.zeros((s,), bool), zi + 0,
                        (-1,) * s)

  def generate(self, params, decode_state: ServingState):
    """`decode_steps` steps for every active slot; returns (state, `ServingResult`).

    Attention's live-KV bound comes from `ServingState.bounds`, host upper bounds on the slots'
    cached lengths, so the engine never finds a slot above it; if it did (STOP_KV_LEN, an
    adapter bug), the result's `convert_to_numpy` raises instead of the request ending short.
    """
    st, k = decode_state, self._steps
    with self._freed_lock:
      freed = self._freed.pop(threading.current_thread(), set())
    freed = [s for s in freed if st.bounds[s] >= 0]  # -1: not active anyway
    if freed:
      mask = np.zeros((len(st.bounds),), bool)
      mask[freed] = True
      active, unsent = self._jit_release(st.decode.active, st.unsent, mask)
      bounds = tuple(-1 if m else b for b, m in zip(st.bounds, mask))
      st = ServingState(st.decode.replace(active=active), st.pending, unsent, st.emitted, bounds)
    live = [b for b in st.bounds if b >= 0]
    # Attention reads only the cache prefix that the longest possibly-active slot can use.
    decode, out = self.engine.generate(params, st.decode, steps=k,
                                       kv_len=(max(live) if live else 0) + k)
    data, pending, unsent, emitted = self._jit_pack(out.tokens, out.logprobs, out.valid,
                                                    out.done, st.pending, st.unsent, st.emitted)
    # A slot stepped m times after a P-token prompt holds at most P + m tokens; at max_len - 1
    # it has certainly stopped (length limit), whatever else happened.
    top = self.engine.ecfg.max_len - 1
    bounds = tuple(-1 if b < 0 or b + k >= top else b + k for b in st.bounds)
    result = ServingResult(data=data, tokens_idx=(0, k), valid_idx=(k, 2 * k),
                           length_idx=(2 * k, 2 * k + 1), samples_per_slot=1)
    return ServingState(decode, pending, unsent, emitted, bounds), result

  # ------------------------------------------------------------------ the rest of the contract
  def load_params(self, *args, **kwargs):
    """The params this engine was built with, as `Engine.prepare` returns them (JetStream's
    server calls this with no arguments and hands the result back to prefill and generate)."""
    if args or kwargs:
      raise TypeError("load_params takes no arguments: pass params to JetStreamEngine(...)")
    return self._params

  def _device(self):
    leaves = [x for x in jax.tree.leaves(self._params) if isinstance(x, jax.Array)]
    devs = leaves[0].devices() if leaves else set()
    return next(iter(devs)) if len(devs) == 1 else jax.devices()[0]

  def get_prefix_destination_sharding(self) -> Any:
    """Where JetStream's transfer thread puts a `ServingPrefix` for this engine to insert."""
    mesh = self.engine.mesh
    if mesh is None:
      return jax.sharding.SingleDeviceSharding(self._device())
    rep = NamedSharding(mesh, P())
    # A prefix's K/V are `[layers, 1, T, KV, hd]`, the cache's axes with length and heads
    # swapped: the cache's spec as it stands split the prompt's length T over "tensor" instead
    # of the heads (a reshard at every insert), and failed in JetStream's transfer thread,
    # killing the process, for a prefill bucket T that the tensor axis does not divide.
    spec = tuple(shd.kv_cache_spec(self.cfg.n_kv_heads, 1, mesh))
    layers, rows, heads, length, hd = spec + (None,) * (5 - len(spec))
    kv = NamedSharding(mesh, P(layers, rows, length, heads, hd))
    fields = {f.name: rep for f in dataclasses.fields(Prefix)}
    return ServingPrefix(Prefix(**{**fields, "k": kv, "v": kv}), rep, rep)

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    return tokenizer_pb2.TokenizerParameters(path=self.tokenizer.name)

  def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> JetStreamTokenizer:
    if metadata.path in ("", self.tokenizer.name):
      return self.jetstream_tokenizer
    from jaxagent.models import load_tokenizer
    js = self.jetstream_tokenizer
    return JetStreamTokenizer(load_tokenizer(metadata.path), sorted(js.stop_tokens), js.add_bos)

  @property
  def max_concurrent_decodes(self) -> int:
    return self.engine.ecfg.slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self._max_prefill

  @property
  def mesh(self) -> Mesh:
    if self.engine.mesh is not None:
      return self.engine.mesh
    return Mesh(np.asarray([self._device()]).reshape(1, 1, 1), shd.MESH_AXES)

  @property
  def colocated_cpus(self) -> None:
    return None


class _ReturnChannel:
  """A request's return channel as `CheckedDriver`'s threads see it.

  JetStream's detokenize thread calls `add_result` and `close` on it. Three things differ from the
  `AsyncMultifuture` it wraps (which the client iterates through this object):
    * text replies are re-detokenized per request (`Tokenizer.stream_decoder`): a character split
      across tokens is held back until its last byte arrives, so no reply carries U+FFFD for
      bytes that a later token completes, and `close` sends what is still held;
    * a channel whose client cancelled (gRPC) or whose event loop has closed (a client that
      stopped reading) marks its request complete, so the detokenize thread frees the slot at
      the next result instead of decoding up to `max_tokens` for nobody;
    * delivering to a closed event loop is skipped: JetStream's `add_result` would raise
      RuntimeError in the detokenize thread, which kills the process.
  """

  def __init__(self, request, channel, decoder):
    self._request, self._channel, self._decoder = request, channel, decoder
    self.finished = False

  def _send(self, call, *args) -> bool:
    """`call(*args)` on the wrapped channel; False (request marked complete) if nobody reads."""
    if not self.finished and not self._channel.cancelled():
      try:
        call(*args)
        return True
      except RuntimeError:  # its event loop is closed
        pass
    self.finished = True
    if self._request.complete is not None:
      self._request.complete = np.ones_like(self._request.complete)
    return False

  def add_result(self, samples) -> None:
    if self._decoder is not None:
      samples = [dataclasses.replace(s, text=[t] if (t := self._decoder.push(s.token_ids)) else [])
                 for s in samples]
    self._send(self._channel.add_result, samples)

  def close(self) -> None:
    tail = self._decoder.flush() if self._decoder is not None else ""
    if tail:  # an incomplete last character, as the tokenizer decodes it (U+FFFD)
      self._send(self._channel.add_result, [orchestrator.ReturnSample(text=[tail], token_ids=[])])
    if self._send(self._channel.close):
      self.finished = True

  def abort(self, why: str) -> None:
    """End the client's iteration with RuntimeError(why) (no-op if already finished)."""
    if self._request.return_channel is None:  # `Driver.stop` unhooks requests it drains
      self._request.return_channel = self
    if self._send(self._channel.set_exception, RuntimeError(why)):
      self.finished = True

  def __getattr__(self, name):  # cancel, cancelled, done, set_exception, ...
    return getattr(self._channel, name)

  def __aiter__(self):
    return self._channel.__aiter__()

  async def __anext__(self):
    return await self._channel.__anext__()


class _FreeSlots(queue.Queue):
  """A generate engine's queue of free slots that tells the engine when a slot comes back.

  The engine is told before the slot can be taken again, so a later `insert` into the slot
  (which clears the note) always follows it. The note is for the driver's generate thread
  `idx`, which runs the decode state holding the slot.
  """

  def __init__(self, maxsize: int, engine: JetStreamEngine, driver, idx: int):
    super().__init__(maxsize)
    self._engine, self._driver, self._idx = engine, weakref.ref(driver), idx

  def _put(self, slot) -> None:
    driver = self._driver()
    threads = None if driver is None else driver.__dict__.get("_generate_threads")
    if threads:  # none yet while the Driver fills the queue: nothing runs, nothing to free
      self._engine.slot_freed(slot, threads[self._idx])
    super()._put(slot)


# Drivers and servers still running, stopped at interpreter exit (their threads are daemons).
_RUNNING: "weakref.WeakSet[Any]" = weakref.WeakSet()


@atexit.register
def _stop_running() -> None:
  for obj in sorted(_RUNNING, key=lambda o: not isinstance(o, _Server)):  # servers first
    try:
      obj.stop()
    except Exception:  # pylint: disable=broad-exception-caught
      log.exception("stopping %s at exit failed", type(obj).__name__)


class CheckedDriver(orchestrator.Driver):
  """JetStream's `Driver` that rejects unservable requests before they reach its threads.

  `place_request_on_prefill_queue` (what in-process callers and the gRPC `Decode` handler call)
  raises ValueError in the caller's thread instead of letting a Driver thread die on the request,
  and gives the request a `_ReturnChannel` (whole characters in streamed text; cancelled or
  abandoned requests free their slot). `stop` ends the iteration of requests still in flight
  with RuntimeError instead of leaving their clients waiting forever.

  Two more differences from JetStream's `Driver`: a slot that its detokenize thread hands back
  is reported to the `JetStreamEngine` (`slot_freed`), which stops decoding it; and all its
  threads are daemons (JetStream's detokenize thread is not, so a process that never called
  `stop` hung at exit), with drivers still running stopped at exit.
  """

  def __init__(self, *args, **kwargs):
    self._channels: list[_ReturnChannel] = []
    self._channels_lock = threading.Lock()  # requests may be placed from several threads
    super().__init__(*args, **kwargs)
    _RUNNING.add(self)

  # `Driver.__init__` assigns these two and starts its threads right after: the setters adjust
  # them before any thread runs.
  @property
  def _generate_slots(self) -> list[queue.Queue]:
    return self.__dict__.get("_free_slot_queues", [])

  @_generate_slots.setter
  def _generate_slots(self, queues: list[queue.Queue]) -> None:
    self.__dict__["_free_slot_queues"] = [
        _FreeSlots(q.maxsize, e, self, i) if isinstance(e, JetStreamEngine) else q
        for i, (q, e) in enumerate(zip(queues, self._generate_engines))]

  @property
  def detokenize_threads(self) -> list[threading.Thread]:
    return self.__dict__.get("_detokenize_threads", [])

  @detokenize_threads.setter
  def detokenize_threads(self, threads: list[threading.Thread]) -> None:
    for t in threads:
      if not t.is_alive():
        t.daemon = True
    self.__dict__["_detokenize_threads"] = threads

  def place_request_on_prefill_queue(self, request) -> None:
    engines = [e for e in self._prefill_engines if isinstance(e, JetStreamEngine)]
    for engine in engines:
      engine.check_request(request.prefill_content, request.max_tokens, request.history_path)
    decoder = None
    if engines and not request.is_client_side_tokenization:
      decoder = engines[0].tokenizer.stream_decoder()
    channel = _ReturnChannel(request, request.return_channel, decoder)
    request.return_channel = channel
    with self._channels_lock:
      self._channels = [c for c in self._channels if not c.finished] + [channel]
    super().place_request_on_prefill_queue(request)

  def stop(self) -> None:
    """Stop and join the threads; requests in flight end with RuntimeError."""
    _RUNNING.discard(self)
    super().stop()
    with self._channels_lock:
      channels, self._channels = self._channels, []
    for channel in channels:
      channel.abort("the JetStream driver stopped before this request finished")


def make_driver(engine: JetStreamEngine, *, interleaved: bool = False) -> CheckedDriver:
  """A `CheckedDriver` whose prefill and generate engine is `engine` (one set of params)."""
  params = engine.load_params()
  return CheckedDriver(prefill_engines=[engine], generate_engines=[engine],
                       prefill_params=[params], generate_params=[params],
                       interleaved_mode=interleaved)


def submit(driver, prompt: str | Sequence[int], max_tokens: int):
  """Queue one request on `driver`; returns its `ActiveRequest`. Call inside a running event loop.

  A str prompt is tokenized by the engine (and the reply carries text); a token-id prompt gets
  token ids only.
  """
  try:
    asyncio.get_running_loop()
  except RuntimeError:
    raise RuntimeError("submit must be called inside a running asyncio event loop: JetStream's "
                       "return channels deliver tokens to it (see `collect`)") from None
  if isinstance(prompt, (bytes, bytearray)):  # list(b"hi") would be the token ids [104, 105]
    raise ValueError(f"prompt is bytes ({bytes(prompt[:20])!r}): pass text as a str or token "
                     "ids as a sequence of ints")
  if isinstance(prompt, (np.ndarray, jax.Array)):  # list() of a JAX array: JAX scalars, refused
    prompt = np.asarray(prompt).tolist()
  token_ids = not isinstance(prompt, str)
  request = orchestrator.ActiveRequest(
      max_tokens=max_tokens, return_channel=async_multifuture.AsyncMultifuture(),
      prefill_content=list(prompt) if token_ids else prompt,
      is_client_side_tokenization=token_ids)
  driver.place_request_on_prefill_queue(request)
  return request


async def collect(request) -> tuple[list[int], str]:
  """All token ids of a submitted request (stop token excluded) and their streamed text."""
  ids, text = [], []
  async for samples in request.return_channel:
    ids.extend(samples[0].token_ids)
    text.extend(samples[0].text)
  # A `CheckedDriver` streams whole characters (`_ReturnChannel`); join them as they are.
  return ids, "".join(text)


def serve(engine: JetStreamEngine, port: int, *, threads: int | None = None,
          credentials=None, interleaved: bool = False):
  """Start JetStream's gRPC server over `engine`; returns the running `JetStreamServer`.

  Like `jetstream.core.server_lib.run`, but with a `CheckedDriver`. Stop it with `.stop()`.
  """
  import grpc
  driver = make_driver(engine, interleaved=interleaved)
  try:
    server = _Server(driver, threads or max(driver.get_total_concurrent_requests(), 64), port,
                     credentials or grpc.insecure_server_credentials())
  except BaseException:  # the port is in use, say: nothing may keep running
    driver.stop()
    raise
  server.start()
  return server


class _Orchestrator(orchestrator.LLMOrchestrator):
  """JetStream's gRPC servicer, answering a request it cannot serve with INVALID_ARGUMENT.

  JetStream's read a request with neither text nor token content as `getattr(request, None)`
  and the client got UNKNOWN "attribute name must be string"; a request our checks refuse (bad
  token ids, a prompt too long, ...) also reached the client as UNKNOWN.

  Streamed text is sent as `CheckedDriver` gives it: whole characters. JetStream's servicer
  reads any text piece spelled like a SentencePiece byte token ("<0x41>") as that byte, for
  tokenizers that stream raw bytes: a reply holding the text "<0x41>" as one piece reached the
  client as "A", and one holding "<0xZZ>" ended the stream with an int() ValueError.
  """

  def should_buffer_response(self, response) -> bool:
    del response  # pieces never end inside a character (`_ReturnChannel`): nothing to wait for
    return False

  def process_server_side_tokenization_response(self, response, buffered_response_list):
    del buffered_response_list  # always empty: nothing is buffered
    from jetstream.core.proto import jetstream_pb2
    sample = jetstream_pb2.DecodeResponse.StreamContent.Sample
    return jetstream_pb2.DecodeResponse(stream_content=jetstream_pb2.DecodeResponse.StreamContent(
        samples=[sample(text="".join(s.text), token_ids=s.token_ids) for s in response]))

  async def Decode(self, request, context=None):  # noqa: N802 (the gRPC method's name)
    import grpc
    if request.WhichOneof("content") is None:
      why = "a DecodeRequest needs text_content or token_content; it has neither"
    else:
      try:
        async for response in super().Decode(request, context):
          yield response
        return
      except ValueError as e:  # raised by `check_request` before anything was streamed
        why = str(e)
    if context is None:
      raise ValueError(why)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)


class _Server(server_lib.JetStreamServer):
  """JetStream's gRPC server with our servicer and its event loop on a daemon thread.

  JetStream's constructor runs the loop on a non-daemon thread (a process that never called
  `stop` hung at exit), started before it binds the port (a port in use left that thread
  running), and registers its own servicer; this one does the same work in an order that
  leaves nothing running on failure. `stop` may be called more than once.
  """

  def __init__(self, driver, threads, port, credentials):  # pylint: disable=super-init-not-called
    import concurrent.futures

    import grpc
    from jetstream.core.proto import jetstream_pb2_grpc
    self._driver = driver
    self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=threads)
    self._loop = asyncio.new_event_loop()
    self._loop.set_default_executor(self._executor)
    self._loop_thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                         name="jetstream-grpc-loop")
    self._loop_thread.start()

    async def make_server():
      return grpc.aio.server(self._executor)

    try:
      self._grpc_server = asyncio.run_coroutine_threadsafe(make_server(), self._loop).result()
      jetstream_pb2_grpc.add_OrchestratorServicer_to_server(_Orchestrator(driver=driver),
                                                            self._grpc_server)
      self._grpc_server.add_secure_port(f"{server_lib._HOST}:{port}", credentials)
    except BaseException as e:
      self._stop_loop()
      self._executor.shutdown(wait=False)
      if isinstance(e, RuntimeError):  # grpc's "Failed to bind to address ..."
        raise RuntimeError(f"cannot serve on port {port} (is it in use?): {e}") from e
      raise
    self._stopped = False
    _RUNNING.add(self)

  def _stop_loop(self) -> None:
    """Stop the event loop and join its thread."""
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._loop_thread.join()

  def stop(self) -> None:
    if self._stopped:  # a second JetStream `stop` would wait forever on the stopped loop
      return
    self._stopped = True
    _RUNNING.discard(self)
    super().stop()


__all__ = ["CheckedDriver", "JetStreamEngine", "JetStreamTokenizer", "PREFILL_LENGTHS",
           "ServingPrefix", "ServingResult", "ServingState", "collect", "make_driver", "serve",
           "submit"]
