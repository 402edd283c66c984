"""Continuous batching over the engine's slots, and the `generate` convenience function.

Requests wait in a queue; whenever slots are free, the waiting prompts are prefilled together
and inserted; every active slot decodes `decode_steps` tokens per device call (fewer when
every budget is shorter); finished slots are refilled at once. The host checks stop strings /
token sequences after each call and rewinds a slot that stopped in the middle of a multi-step
call.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import math
import os
from typing import Sequence

import jax
import numpy as np

from jaxagent._token_ids import TokenIdError, is_int, token_ids
from jaxagent.generate.engine import (RUNNING, STOP_BUDGET, STOP_EOS, STOP_KV_LEN, STOP_LENGTH,
                                      STOP_NONFINITE, Engine, EngineConfig, _per_request,
                                      pow2_at_least)
from jaxagent.generate.sampling import SamplingConfig
from jaxagent.models.config import ModelConfig

STOP_REASONS = {STOP_EOS: "eos", STOP_BUDGET: "max_new_tokens", STOP_LENGTH: "max_length",
                STOP_NONFINITE: "nonfinite"}


@dataclasses.dataclass
class Completion:
  """One request's output: new token ids, their sampler log-probs, and why it stopped.

  `stop_reason` is one of "eos", "stop" (a stop string / token sequence; it is included in
  `tokens`), "max_new_tokens", "max_length", or "nonfinite": the logits of the last token held
  a NaN or +inf (its log-prob in `logprobs` is not finite; diverged params or a numerical
  fault), and the request stopped there. Other requests of the batch are unaffected.
  `tokens` end with the token that ended the request (the EOS id, the last token of the stop
  match). Where several reasons hold at one token, the first of "nonfinite", "eos", "stop",
  "max_new_tokens", "max_length" is reported: an EOS id ends the request as "eos" (with
  `stop_match` None) even where it also completes a stop string (one that spells the EOS
  token's text, such as "<|im_end|>") or a stop token sequence, as the rollout driver reports
  such a turn (`Turn.ended_by`). `text` (set by `generate` when it has a
  tokenizer) is `tokens` decoded without special tokens (the EOS, chat-template markers) unless
  `generate(skip_special_tokens=False)`; `tokens` always keep them.
  """
  request_id: int
  tokens: list[int]
  logprobs: list[float]
  stop_reason: str
  stop_match: str | tuple[int, ...] | None = None
  text: str | None = None


class StopChecker:
  """Host-side stop detection on a turn's generated tokens (strings need a tokenizer)."""

  def __init__(self, stop=None, tokenizer=None):
    self.strings: list[str] = []
    self.sequences: list[tuple[int, ...]] = []
    if stop is None:
      stop = []
    elif isinstance(stop, str):
      stop = [stop]
    elif not isinstance(stop, (list, tuple)):
      raise ValueError(f"unknown stop spec {stop!r}: expected a string, a list of strings, or a "
                       "list of token-id sequences")
    for s in stop:
      if isinstance(s, str):
        if not s:
          raise ValueError("stop strings must be non-empty")
        self.strings.append(s)
      elif isinstance(s, (list, tuple)) and s:
        try:
          self.sequences.append(tuple(token_ids(s, "the stop sequence")))
        except TokenIdError as e:
          raise TokenIdError(f"unknown stop spec entry {s!r}: {e}") from None
      else:
        raise ValueError(f"unknown stop spec entry {s!r}: expected a non-empty string or a "
                         "non-empty sequence of token ids")
    if self.strings and tokenizer is None:
      raise ValueError("stop strings need a tokenizer (pass tokenizer=...), or give stop token "
                       "id sequences instead")
    self.tokenizer = tokenizer
    # The window is counted in tokens. A byte-level tokenizer's token decodes to at least one
    # UTF-8 byte, so a stop string of n bytes lies within its last n tokens; a non-ASCII
    # character can take up to 4 tokens, so the string's character count would be too small.
    # Two more tokens cover a token that straddles the string's start.
    self._window = max((len(s.encode("utf-8")) for s in self.strings), default=0) + 2

  def __bool__(self):
    return bool(self.strings or self.sequences)

  def check(self, tokens: Sequence[int]):
    """The stop matched by the turn ending at `tokens[-1]`, or None."""
    for seq in self.sequences:
      if len(tokens) >= len(seq) and tuple(tokens[-len(seq):]) == seq:
        return seq
    if self.strings:
      text = self.tokenizer.decode(list(tokens[-self._window:]))
      for s in self.strings:
        if s in text:
          return s
    return None


@dataclasses.dataclass
class _Live:
  req_index: int
  request_id: int
  cached: int                       # host mirror of the slot's cache length
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)


def _budgets(max_new_tokens, n: int) -> list[int]:
  """Per-prompt budgets from one int or one per prompt; a float (2.7 would be cut to 2) or
  anything else is a clear error."""
  if isinstance(max_new_tokens, (np.ndarray, jax.Array)) and np.ndim(max_new_tokens) <= 1:
    # One budget (0-d; it failed with "iteration over a 0-d array") or one per prompt, as
    # Python numbers (a JAX array was refused).
    max_new_tokens = np.asarray(max_new_tokens).tolist()
  if is_int(max_new_tokens):
    return [int(max_new_tokens)] * n
  if (isinstance(max_new_tokens, (list, tuple, np.ndarray))
      and all(is_int(b) for b in max_new_tokens)):
    return [int(b) for b in max_new_tokens]
  raise ValueError(f"max_new_tokens must be an int or a sequence of one int per prompt, got "
                   f"{max_new_tokens!r}")


def _checked_budgets(max_new_tokens, n: int, what: str) -> list[int]:
  """`_budgets`, refusing a count other than `n` and a budget below one (which would still
  sample, and return, a token) or past int32: the one budget check of `generate` and
  `run_requests`, made before anything runs."""
  budgets = _budgets(max_new_tokens, n)
  if len(budgets) != n:
    raise ValueError(f"max_new_tokens: {len(budgets)} budgets for {n} prompts (give one int "
                     "or one per prompt)")
  _per_request(budgets, n, np.int32, what, "max_new_tokens", "prompts", least=1)
  return budgets


def _ids_list(ids):
  """A 1-D NumPy or JAX array of ids as a list of Python ints (a JAX array's elements are JAX
  scalars, which the integer checks refuse); anything else as it is."""
  if isinstance(ids, (np.ndarray, jax.Array)) and np.ndim(ids) == 1:
    return np.asarray(ids).tolist()
  return ids


@functools.lru_cache(maxsize=16)
def _engine(cfg, ecfg: EngineConfig, mesh) -> Engine:
  return Engine(cfg, ecfg, mesh=mesh)


def run_requests(engine: Engine, params, prompts: Sequence[Sequence[int]], *,
                 max_new_tokens: int | Sequence[int], request_ids: Sequence[int],
                 seed: int = 0, stop=None, decode_steps: int = 8) -> list[Completion]:
  """Run all prompts through `engine` with continuous batching; results in prompt order.

  `stop`: a `StopChecker`, or a spec it takes (token-id sequences; strings need the checker's
  tokenizer).
  """
  # JAX arrays as Python ints: prefill hashes each prompt's ids (a JAX scalar is unhashable).
  prompts = [np.asarray(p).tolist() if isinstance(p, (np.ndarray, jax.Array)) else p
             for p in prompts]
  n = len(prompts)
  request_ids = _ids_list(request_ids)
  # Prefill's rule, for every prompt before anything runs (a budget prefill refuses, waiting
  # in the queue, ended the run after the requests before it were generated).
  budgets = _checked_budgets(max_new_tokens, n, "run_requests")
  if len(request_ids) != n:
    raise ValueError(f"request_ids: {len(request_ids)} ids for {n} prompts")
  if not is_int(decode_steps) or decode_steps < 1:  # (True ran as one step)
    raise ValueError(f"decode_steps must be a positive int, got {decode_steps!r}")
  if n == 0:
    return []
  # Each call decodes all its steps, even past every budget (prefill samples the first token):
  # decode_steps=512 for 4-token replies ran 512 model steps a call for 3 tokens. At most the
  # power of two covering the longest budget: one program per run, the same tokens.
  decode_steps = min(int(decode_steps), pow2_at_least(max(budgets) - 1))
  stop = stop if isinstance(stop, StopChecker) else StopChecker(stop)
  v = engine.cfg.vocab_size
  for seq in stop.sequences:  # the model never samples such an id: the stop could never match
    if min(seq) < 0 or max(seq) >= v:
      raise ValueError(f"stop token-id sequence {list(seq)} has ids outside the model's "
                       f"vocabulary [0, {v}), so it could never match (a tokenizer that does "
                       "not match the model?)")
  ecfg = engine.ecfg
  # Every prompt, id and the seed are checked before anything runs, by prefill's rules:
  # prefill checks only the batch it is given, so a bad prompt waiting in the queue would end
  # the run after the requests before it were generated, its error naming its index within
  # that batch.
  engine._check_prompts(prompts, "run_requests")
  _per_request(list(request_ids), n, np.int32, "run_requests", "request_ids", "prompts")
  repeated = sorted(r for r, c in collections.Counter(int(r) for r in request_ids).items()
                    if c > 1)
  if repeated:
    raise ValueError(f"request_ids {repeated[:5]} repeat: a request's random numbers derive "
                     "from (seed, request id, position), so one prompt sent twice under one "
                     "id would give the same sample twice; give each request its own id")
  if (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
      or not 0 <= seed < 2 ** 32):
    raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
  params = engine.prepare(params)  # merged decode weights made once for all the calls below
  results: list[Completion | None] = [None] * n
  queue = collections.deque(range(n))
  free = list(range(ecfg.slots))[::-1]
  live: dict[int, _Live] = {}
  state = engine.init_decode_state()

  def check_codes(slots, codes, call):
    """A RuntimeError for a stop code that is neither RUNNING nor one a request ends with
    (`STOP_REASONS`). Such a code was reported as a "stop" completion where its token
    completed a stop string, and otherwise ended the run with a KeyError."""
    bad = [(s, int(c)) for s, c in zip(slots, codes) if int(c) != RUNNING
           and int(c) not in STOP_REASONS]
    if bad:
      raise RuntimeError(
          f"run_requests: the engine's {call} reported stop codes {[c for _, c in bad]} for "
          f"slots {[s for s, _ in bad]} (requests {[live[s].request_id for s, _ in bad]}), "
          f"neither RUNNING ({RUNNING}) nor a code a request ends with {STOP_REASONS}: the "
          "engine and the scheduler disagree about the engine's stop codes")

  def finish(slot, reason, match=None):
    lv = live.pop(slot)
    results[lv.req_index] = Completion(lv.request_id, lv.tokens, lv.logprobs, reason, match)
    free.append(slot)

  def take(slot, tok, lp, code) -> bool:
    """Record a sampled token (`code`: the device's stop code after it); True when a host-side
    stop matched."""
    lv = live[slot]
    lv.tokens.append(int(tok))
    lv.logprobs.append(float(lp))
    # A non-finite log-prob is the device's "nonfinite" stop, and an EOS id its "eos" stop,
    # whatever stop it also completes (`Completion`).
    if stop and math.isfinite(lp) and code != STOP_EOS:
      m = stop.check(lv.tokens)
      if m is not None:
        finish(slot, "stop", m)
        return True
    return False

  inflight = None  # a decode call dispatched before the previous one's results were read

  def dispatch(ahead: int):
    """Decode `steps` tokens for every active slot; `ahead` calls are not yet on the host."""
    kv = max(lv.cached for lv in live.values()) + (ahead + 1) * decode_steps
    return engine.generate(params, state, steps=decode_steps, kv_len=kv)

  while queue or live:
    if queue and free and inflight is None:
      batch = [queue.popleft() for _ in range(min(len(free), len(queue)))]
      slots = [free.pop() for _ in batch]
      state, (toks, lps, done) = engine.prefill_insert(
          params, state, [prompts[i] for i in batch], slots, [request_ids[i] for i in batch],
          seed, [budgets[i] for i in batch])
      host_stopped = []
      for slot, i in zip(slots, batch):
        live[slot] = _Live(i, request_ids[i], cached=len(prompts[i]))
      check_codes(slots, done[:len(slots)], "prefill")
      for j, slot in enumerate(slots):
        if take(slot, toks[j], lps[j], done[j]):
          if done[j] == RUNNING:
            host_stopped.append(slot)
        elif done[j] != RUNNING:
          finish(slot, STOP_REASONS[int(done[j])])
      if host_stopped:
        state = engine.free_slots(state, host_stopped)
      continue
    if not live:
      continue
    if inflight is None:
      state, out = dispatch(0)
    else:
      (state, out), inflight = inflight, None
    # Dispatch the next call before reading this one's tokens, so that the device decodes
    # while the host takes them, when nothing the host does next can change the state: no
    # host-side stops (which rewind slots) and no waiting prompts (which refill slots). Only
    # when some slot has budget left after this call; EOS in this call can still make the
    # next one idle.
    if not stop and not queue and any(
        min(budgets[lv.req_index] - len(lv.tokens), ecfg.max_len - lv.cached - 1) > decode_steps
        for lv in live.values()):
      inflight = dispatch(1)
    toks, lps, valid, done = jax.device_get((out.tokens, out.logprobs, out.valid, out.done))
    short = [s for s in live if done[s] == STOP_KV_LEN]
    if short:  # the bound `dispatch` gave (from `cached`) was below a slot's cached length
      raise RuntimeError(
          f"run_requests: the engine stopped slots {short} (STOP_KV_LEN): they held more cached "
          f"tokens than the kv_len bound the scheduler gave, from its host copies of their "
          f"lengths {[live[s].cached for s in short]}; the scheduler and the engine disagree "
          "about the slots' state")
    check_codes(list(live), [done[s] for s in live], "decode call")
    host_stopped = []
    for slot in list(live):
      stopped = False
      for j in range(decode_steps):
        if not valid[j, slot]:
          break
        live[slot].cached += 1
        # `done` is the code after the slot's last valid token; before it, the slot ran on.
        last = j + 1 == decode_steps or not valid[j + 1, slot]
        if take(slot, toks[j, slot], lps[j, slot], done[slot] if last else RUNNING):
          stopped = True
          break
      if stopped:
        if done[slot] == RUNNING:  # the device kept going past the host-side stop
          host_stopped.append(slot)
      elif done[slot] != RUNNING:
        finish(slot, STOP_REASONS[int(done[slot])])
    if host_stopped:
      state = engine.free_slots(state, host_stopped)
  return results  # type: ignore[return-value]


def _takes_keyword(fn, name: str) -> bool:
  """Whether `fn` accepts the keyword argument `name` (True when its signature is unknown)."""
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):  # a builtin or C extension: let the call tell
    return True
  return any(p.kind is p.VAR_KEYWORD or (p.name == name and p.kind is not p.POSITIONAL_ONLY)
             for p in params)


def _adds_bos(tokenizer) -> bool:
  """Whether the tokenizer's own encoding of a text starts with its BOS token."""
  bos = getattr(tokenizer, "bos_id", None)
  if bos is None or not _takes_keyword(tokenizer.encode, "add_special_tokens"):
    return False
  ids = tokenizer.encode("a", add_special_tokens=True)
  return bool(ids) and ids[0] == bos and tokenizer.encode("a")[:1] != [bos]


def _bos_to_add(tokenizer) -> int | None:
  return tokenizer.bos_id if _adds_bos(tokenizer) else None


def _with_bos(ids: list[int], bos: int | None) -> list[int]:
  return ids if bos is None or ids[:1] == [bos] else [bos] + ids


def text_prompt_ids(tokenizer, text: str) -> list[int]:
  """A text prompt's token ids as the model is fed them (by `generate` and by
  `Env.render_prompt`): with the tokenizer's BOS first where its own encoding adds one (a
  Llama 3 base model expects it), unless the text already starts with it (a chat-templated
  prompt); special tokens spelled in the text are parsed."""
  return _with_bos(list(tokenizer.encode(text)), _bos_to_add(tokenizer))


def generate(params, cfg, prompts, max_new_tokens: int | Sequence[int] = 64, *,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
             stop=None, slots: int = 8, max_len: int | None = None,
             eos_ids: Sequence[int] | None = None, tokenizer=None,
             request_ids: Sequence[int] | None = None, decode_steps: int = 8,
             mesh=None, skip_special_tokens: bool = True) -> list[Completion]:
  """Generate continuations for many prompts with continuous batching over `slots` slots.

  Args:
    prompts: token-id lists, or strings (then `tokenizer` is required). A string starts with
      the tokenizer's BOS where its own encoding adds one (a Llama 3 base model expects it),
      unless the text already starts with it (a chat-templated prompt).
    temperature, top_p, top_k: the sampler's `SamplingConfig`: temperature 0 is greedy (top-p
      and top-k ignored); top_k 0, or at least the vocabulary size, keeps every token; top_p in
      (0, 1], 1 keeps every token. A temperature that is NaN, negative, infinite or positive
      but below `sampling.MIN_TEMPERATURE`, and a top_p outside (0, 1], are refused.
    seed: the sampler's seed, an int in [0, 2**32).
    stop: a string, a list of strings, or a list of token-id sequences; a match ends the
      request and is included in its tokens (stop reason "stop"; a sampled EOS id ends it as
      "eos" even where it completes a match, as `Completion` says).
    eos_ids: token ids that end a request, one int or a sequence (default: the tokenizer's
      `eos_ids`, else the config's `eos_token_ids`).
    tokenizer: a `Tokenizer` (`models.load_tokenizer`), or the path / preset name that
      `models.load_tokenizer` loads it from (the one given to `models.load`).
    request_ids: distinct per-prompt ids for the rng (default 0..n-1); with the same seed and
      request id a prompt gives the same output whatever the slot count or arrival order.
    skip_special_tokens: leave the tokenizer's special tokens (the EOS that ended a request,
      chat-template markers) out of `Completion.text`, as HF's and vLLM's decoding does by
      default; the token ids are never changed.
  Returns one `Completion` per prompt, in order (with `.text` when a tokenizer is given).
  """
  if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots <= 0:
    raise ValueError(f"slots must be a positive int, got {slots!r}")
  slots = int(slots)
  if not isinstance(cfg, ModelConfig):  # read below before the engine would check it
    raise TypeError(f"generate: cfg must be a jaxagent.models.ModelConfig (the config "
                    f"`models.load(path)` returns, or `models.get_config(name)`), got "
                    f"{type(cfg).__name__} {cfg!r:.60}")
  if isinstance(tokenizer, (str, os.PathLike)):  # as `JetStreamEngine` takes it
    from jaxagent.models import load_tokenizer
    tokenizer = load_tokenizer(tokenizer)
  if not isinstance(skip_special_tokens, (bool, np.bool_)):
    raise ValueError(f"skip_special_tokens must be a bool, got {skip_special_tokens!r}")
  if tokenizer is not None and not _takes_keyword(tokenizer.decode, "skip_special_tokens"):
    # Else the TypeError came after every request had run, and their tokens were lost.
    raise ValueError(f"{type(tokenizer).__name__}.decode takes no skip_special_tokens argument, "
                     "which generate passes to decode `Completion.text`: add it, or pass "
                     "tokenizer=None (token-id prompts and stops) and decode the tokens yourself")
  if isinstance(prompts, (np.ndarray, jax.Array)):  # one prompt [T] or a batch [B, T]
    prompts = np.asarray(prompts).tolist()
  if isinstance(prompts, (str, bytes, bytearray)):
    prompts = [prompts]
  try:
    prompts = list(prompts)
  except TypeError:
    raise ValueError("prompts must be a list of strs or of token-id sequences, got "
                     f"{type(prompts).__name__}") from None
  if prompts and isinstance(prompts[0], (int, np.integer)):
    prompts = [prompts]
  ids, bos = [], ...
  for i, p in enumerate(prompts):
    if isinstance(p, str):  # as `text_prompt_ids`, with the BOS to add worked out once
      if tokenizer is None:
        raise ValueError("string prompts need a tokenizer (pass tokenizer=...)")
      if bos is ...:
        bos = _bos_to_add(tokenizer)
      ids.append(_with_bos(list(tokenizer.encode(p)), bos))
    elif isinstance(p, (bytes, bytearray)):
      # list(b"hi") is [104, 105]: the bytes' values were taken as token ids.
      raise ValueError(f"prompt {i} is bytes ({bytes(p[:20])!r}): pass text as a str (with "
                       "tokenizer=...) or token ids as a sequence of ints")
    elif isinstance(p, (np.ndarray, jax.Array)):
      ids.append(np.asarray(p).tolist())  # a list of JAX scalars cannot be hashed
    else:
      try:
        ids.append(list(p))  # checked by the engine's prefill (integer ids in the vocabulary)
      except TypeError:
        raise ValueError(f"prompt {i} must be a str or a sequence of token ids, got "
                         f"{type(p).__name__}") from None
  checker = StopChecker(stop, tokenizer)
  sampling = SamplingConfig(temperature, top_p, top_k)
  if not ids:
    # Nothing to run (the last batch of a loop, say), but settings no batch could run with are
    # still refused, as they are with prompts.
    one = isinstance(max_new_tokens, (int, np.integer)) or np.ndim(max_new_tokens) == 0
    _checked_budgets(max_new_tokens, 1 if one else 0, "generate")
    return []
  if eos_ids is None:
    if tokenizer is not None and getattr(tokenizer, "eos_ids", None):
      eos_ids = sorted(tokenizer.eos_ids)
    else:
      eos_ids = list(cfg.eos_token_ids)
  longest = max(len(p) for p in ids)
  # Before the default max_len is derived from them (a negative budget made it 1, and the
  # error named max_len); `run_requests` takes the checked list.
  budgets = _checked_budgets(max_new_tokens, len(ids), "generate")
  budget = max(budgets)
  if max_len is None:
    max_len = min(cfg.max_seq_len, 1 << (longest + budget).bit_length())
  ecfg = EngineConfig(slots=slots, max_len=max_len, eos_ids=eos_ids,
                      sampling=sampling)
  engine = _engine(cfg, ecfg, mesh)
  rids = list(range(len(ids))) if request_ids is None else list(_ids_list(request_ids))
  out = run_requests(engine, params, ids, max_new_tokens=budgets, request_ids=rids,
                     seed=seed, stop=checker, decode_steps=decode_steps)
  if tokenizer is not None:
    for c in out:
      c.text = tokenizer.decode(c.tokens, skip_special_tokens=skip_special_tokens)
  return out
