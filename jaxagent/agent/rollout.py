"""The multi-turn rollout driver: G samples of many prompts through the engine, with tools.

Where this sits: the trainer calls `rollout(engine, params, env, examples, ...)` (or keeps a
`RolloutDriver`) each step and gets one `Trajectory` ledger per (prompt, sample), in order.
This is `generate.scheduler.run_requests` generalised to many turns:

* Continuous batching: trajectories wait in a queue; free KV slots are refilled by one batched
  `prefill` + `insert`; every decoding slot advances `decode_steps` tokens per `generate` call.
* A turn ends at a stop string (the parser's closing tags, checked on the host after every
  token; a parser with a `stop_allowed(text)` method may refuse one, e.g. inside a think
  block), at EOS, at the per-turn token budget (the engine's `remaining`) or at the slot's total
  length (the engine's `limit`). A sampled EOS id ends the turn by "eos" even where it completes
  a stop string (one spelling the EOS token's text, say), as `generate.Completion` reports it.
  A slot stopped by the host mid-call is rewound with `update_slots` to the stop token, which
  stays pending (not yet in the cache).
* At a tool call the trajectory leaves the decode batch (its slot is frozen, other slots keep
  decoding) and its call goes to a `ToolExecutor`, which returns a future. Futures are polled
  between device calls without blocking; when no slot is decoding, the driver waits on them (with
  a timeout) instead of spinning. Finished calls are wrapped by the task and tokenized once; all
  observations ready at that moment go into their slots in one `append` call (pending token +
  observation, no re-prefill), which also samples each next turn's first token (DESIGN 5).
* Budgets end or truncate a trajectory and are recorded as its `stop_reason`, never silently:
  max turns, tokens per turn, total tokens (an observation that would not fit truncates the
  trajectory; a call that ends at the last position is not run), per-call tool timeout and
  per-trajectory tool time. A tool's text longer than `max_observation_tokens` is cut to it
  (marked where it was cut) before the task wraps it, so the wrapper stays whole and the
  trajectory goes on (`agent/observation_cap.py`). Malformed calls, unknown tools, bad
  arguments, tool errors and timeouts become error observations and counts (DESIGN 7). Task
  code that raises for one trajectory (`new_episode`, `format_observation`,
  `encode_observation`), returns the wrong type (an `Episode`, a list of int ids) or gives
  observation ids outside the model's vocabulary ends that trajectory
  with stop reason "env_error" (logged); the others go on. An `observation_template` that the
  default `format_observation` cannot fill with any output is refused when the driver is built,
  and so is an `XMLTagParser` tag whose text cannot be its tool's argument (one the tool
  declares as a number, or does not take).

Reproducibility: each trajectory's sampler rng is `(seed, request_id, position)` with
`request_id = request_id_offset + prompt_index * G + sample_index`, so tokens do not depend on
slot assignment, batch composition or tool timing. Give each training step its own
`request_id_offset` (e.g. `step * len(examples) * G`) or seed.

The ledger records exactly the token ids and log-probs the engine returned; only observation
tokens come from the tokenizer.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxagent._token_ids import is_int, scalar_int, token_ids
from jaxagent.agent.env import Env, Episode, Example
from jaxagent.agent.observation_cap import (TRUNCATION_SIDES, TruncationSide, cap_result,
                                            marker_tokens, min_cap, truncation_marker)
from jaxagent.agent.parsers import ParseResult, XMLTagParser
from jaxagent.agent.trajectory import STOP_REASONS, ToolOutcome, Trajectory, Turn, tool_call_key
from jaxagent.generate.engine import (RUNNING, STOP_BUDGET, STOP_EOS, STOP_KV_LEN, STOP_LENGTH,
                                      STOP_NONFINITE)
from jaxagent.generate.scheduler import StopChecker
from jaxagent.tools import (ToolArgumentError, ToolExecutor, ToolRegistry, ToolResult,
                            UnknownToolError, validate_arguments)
from jaxagent.tools.base import schema_types

log = logging.getLogger(__name__)

_INT32_MAX = 2**31 - 1
# The engine's stop codes that end a turn, and how the turn is recorded (`Turn.ended_by`).
_TURN_ENDS = {STOP_EOS: "eos", STOP_BUDGET: "max_tokens_per_turn", STOP_LENGTH: "length"}


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Budgets and scheduling of multi-turn rollouts.

  Attributes:
    max_turns: policy turns per trajectory; a tool call in the last turn ends it ("max_turns").
    max_tokens_per_turn: sampled tokens per turn (the engine's per-turn budget).
    max_total_tokens: cap on a trajectory's whole length, prompt included (None: the engine's
      cache length `max_len`; it may not exceed it).
    max_prompt_tokens: the longest rendered prompt that is decoded; a longer one ends its
      trajectories before any decoding with stop reason "prompt_too_long" (logged; counted in
      the stop-reason metrics). None: whatever fits the cache. The launcher's fit check plans
      prefill at this length, so a bound well under `max_len` frees prefill memory.
    tool_timeout_s: time limit of one tool call.
    traj_tool_timeout_s: total tool time of one trajectory; reaching it ends the trajectory
      ("tool_budget"). Each call's limit is the smaller of the two, and of the tool's own
      `timeout_s` where it sets one.
    decode_steps: tokens per slot per `generate` call (more: fewer host round trips; fewer:
      quicker reaction to stop strings and finished tools).
    stop_strings: extra strings that end a turn, besides the parser's.
    tool_poll_s: longest single wait on tool futures when no slot is decoding.
    tool_workers: threads of the executor the driver creates when none is given (0: one per
      engine slot, so every frozen slot can have its call running).
    max_observation_tokens: the most tokens of one tool result's text (its output, and a failed
      call's error) that an observation carries; a longer one is cut, with the marker
      "...[N tokens truncated]..." where it was cut, before the task wraps it
      (`format_observation`) and tokenizes it (`encode_observation`), so the wrapper (tags, the
      chat template's turn frame) is whole. Counted per trajectory (`truncated_observations`)
      and logged (`rollout/truncated_observations`, `rollout/truncated_observation_tokens`).
      None: no cap (a long result fills the cache, or ends the trajectory when it does not
      fit). See `agent/observation_cap.py`.
    observation_truncation: which part of a result over the cap is kept: "left" cuts the left
      and keeps the tail, "right" keeps the head, "middle" keeps the head and the tail.
  """

  max_turns: int = 4
  max_tokens_per_turn: int = 256
  max_total_tokens: int | None = None
  max_prompt_tokens: int | None = None
  tool_timeout_s: float = 30.0
  traj_tool_timeout_s: float = 120.0
  decode_steps: int = 8
  stop_strings: tuple[str, ...] = ()
  tool_poll_s: float = 0.5
  tool_workers: int = 0
  max_observation_tokens: int | None = None
  observation_truncation: TruncationSide = "middle"

  def __post_init__(self):
    for name in ("max_turns", "max_tokens_per_turn", "decode_steps"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"RolloutConfig.{name} must be an int >= 1, got {v!r}")
    m = self.max_total_tokens
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 2):
      raise ValueError(f"RolloutConfig.max_total_tokens must be None or an int >= 2, got {m!r}")
    m = self.max_prompt_tokens
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
      raise ValueError(f"RolloutConfig.max_prompt_tokens must be None or an int >= 1, got {m!r}")
    for name in ("tool_timeout_s", "traj_tool_timeout_s", "tool_poll_s"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or math.isnan(v):
        raise ValueError(f"RolloutConfig.{name} must be a number of seconds > 0 (inf allowed for "
                         f"traj_tool_timeout_s), got {v!r}")
    if math.isinf(self.tool_timeout_s) or math.isinf(self.tool_poll_s):
      raise ValueError("RolloutConfig.tool_timeout_s and tool_poll_s must be finite")
    # Taken into a tuple before the check: a generator was used up by it (no stop string was
    # left), and None failed with a bare "not iterable". A set is taken in sorted order, so
    # that the order does not vary between runs.
    stops = self.stop_strings
    try:
      stops = (None if isinstance(stops, str) else
               tuple(sorted(stops)) if isinstance(stops, (set, frozenset)) else tuple(stops))
    except TypeError:  # not iterable, or a set of things that do not sort
      stops = None
    if stops is None or not all(isinstance(s, str) and s for s in stops):
      raise ValueError("RolloutConfig.stop_strings must be a tuple of non-empty strings, got "
                       f"{self.stop_strings!r}")
    object.__setattr__(self, "stop_strings", stops)
    if isinstance(self.tool_workers, bool) or not isinstance(self.tool_workers, int) or self.tool_workers < 0:
      raise ValueError(f"RolloutConfig.tool_workers must be an int >= 0, got {self.tool_workers!r}")
    m = self.max_observation_tokens
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
      raise ValueError(f"RolloutConfig.max_observation_tokens must be None (no cap) or an int >= 1 "
                       f"(tokens of one tool result's text), got {m!r}")
    if not isinstance(self.observation_truncation, str) or (
        self.observation_truncation not in TRUNCATION_SIDES):
      sides = ", ".join(f"{k!r} keeps {v}" for k, v in TRUNCATION_SIDES.items())
      raise ValueError(f"RolloutConfig.observation_truncation must be one of {sides}; got "
                       f"{self.observation_truncation!r}")


@dataclasses.dataclass
class RolloutStats:
  """Where the time of the last `RolloutDriver.run` went (host wall-clock seconds)."""

  wall_s: float = 0.0
  prefill_s: float = 0.0
  generate_s: float = 0.0
  append_s: float = 0.0
  tool_wait_s: float = 0.0       # blocked on tool futures with no slot decoding
  prefill_calls: int = 0
  generate_calls: int = 0
  append_calls: int = 0
  update_calls: int = 0
  decoded_tokens: int = 0        # valid sampled tokens (including those discarded after a stop)
  max_concurrent_tools: int = 0

  def to_dict(self) -> dict[str, float]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, eq=False)
class _EnvView:
  """What the driver reads of the env that runs a trajectory (a mixture's task env, or the env
  itself): its parser, the stop strings that end its turns, and the parser's stop hook."""

  env: Env
  parser: Any
  stop: StopChecker
  stop_allowed: Callable[[str], bool] | None


@dataclasses.dataclass(eq=False)
class _Live:
  """A trajectory bound to a KV slot."""

  traj: Trajectory
  episode: Episode
  slot: int
  limit: int
  view: _EnvView
  cached: int                     # host mirror of the slot's cache length (pending token excluded)
  turn: int = 0
  phase: str = "decode"           # "decode" | "tool" | "ready"
  toks: list[int] = dataclasses.field(default_factory=list)
  lps: list[float] = dataclasses.field(default_factory=list)
  future: concurrent.futures.Future | None = None
  obs_ids: list[int] | None = None
  call_keys: set[str] = dataclasses.field(default_factory=set)  # the valid calls made so far
  ok_keys: set[str] = dataclasses.field(default_factory=set)  # the valid calls that succeeded
  call_key: str | None = None     # the key of the call in flight


@dataclasses.dataclass
class _Job:
  traj: Trajectory
  example: Example
  prompt: list[int]
  view: _EnvView


def _clean_text(text: str) -> str:
  """Text the tokenizer can encode: lone surrogates (e.g. from JSON escapes) become '?'."""
  return text.encode("utf-8", "replace").decode("utf-8")


def _check_observation_template(env) -> None:
  """Refuses an `observation_template` that the default `Env.format_observation` cannot fill:
  such a template (a JSON-shaped one with unescaped braces, a field other than `{output}`) fails
  every observation of every trajectory, which would end each one at its first tool call with
  stop reason "env_error" while training went on. An env with its own format is not checked."""
  if getattr(getattr(env, "format_observation", None), "__func__", None) is not Env.format_observation:
    return
  template = getattr(env, "observation_template", None)
  try:
    if not isinstance(template, str):
      raise TypeError(f"it is a {type(template).__name__}, not a str")
    template.format(output="tool output")
  except (KeyError, IndexError, ValueError, TypeError, AttributeError) as e:
    raise ValueError(
        f"env {getattr(env, 'name', env)!r}: observation_template {template!r} cannot wrap a tool "
        f"output ({type(e).__name__}: {e}); it is a str.format template whose only field is "
        "{output}, with literal braces doubled ('{{' and '}}')") from None


def _check_tag_arguments(env) -> None:
  """Refuses an `XMLTagParser` tag whose body cannot be an argument of its tool in `env.tools`:
  a tag's body is always text, so a tool that declares that argument as a number (say) or does
  not take it at all (a misspelt name, with `additionalProperties: false` as `function_tool`
  writes) fails every call as the policy's bad arguments while training goes on. Tools that
  only an episode has (`Env.new_episode`), and parsers with a `parse` of their own, are not
  checked."""
  parser, tools = getattr(env, "parser", None), getattr(env, "tools", None)
  # A subclass with its own `parse` may turn the text into other types: not checked.
  if (not isinstance(parser, XMLTagParser) or not isinstance(tools, ToolRegistry)
      or getattr(type(parser), "parse", None) is not XMLTagParser.parse):
    return
  for tag, (name, arg) in parser.tools.items():
    if name not in tools:
      continue
    params = tools.get(name).parameters
    props = params.get("properties", {})
    where = (f"env {getattr(env, 'name', env)!r}: XMLTagParser tag <{tag}> fills argument "
             f"{arg!r} of tool {name!r} with the text between its tags")
    if arg not in props:
      if params.get("additionalProperties", True) is False:
        raise ValueError(f"{where}, but the tool takes no argument {arg!r} (its arguments: "
                         f"{', '.join(props) or 'none'}); map the tag to one of them")
      continue
    options = schema_types(props[arg])
    enum = props[arg].get("enum")
    if (options and "string" not in options) or (
        enum is not None and not any(isinstance(m, str) for m in enum)):
      declared = (f"type {props[arg]['type']!r}" if options and "string" not in options
                  else f"enum {enum!r}")
      raise ValueError(f"{where}, but the tool declares it as {declared}, which no text is: every "
                       "call would fail as bad arguments; declare it a str and convert it in "
                       "the tool")


def _token_ids(ids, what: str = "encode_observation", vocab_size: int | None = None) -> list[int]:
  """`what`'s return as a list of ints; anything else raises `TokenIdError` (a TypeError),
  naming what it was (a float id would be cut to another token, a bool become 0 or 1, a string
  read character by character), and an id outside [0, vocab_size) a ValueError."""
  return token_ids(ids, f"{what}'s return", vocab_size)


class RolloutCancelled(RuntimeError):
  """`RolloutDriver.run(cancel=...)` saw its event set and ended the rollout early."""


class RolloutDriver:
  """Runs multi-turn trajectories of one env through one engine; reusable across steps.

  Args:
    engine: a `jaxagent.generate.Engine` (or an object with the same contract).
    env: the task.
    tokenizer: encodes observations and decodes turns (stop strings, parsing).
    cfg: budgets and scheduling.
    executor: a `ToolExecutor`; by default the driver creates one (`close()` shuts it down).
  """

  def __init__(self, engine, env: Env, *, tokenizer, cfg: RolloutConfig = RolloutConfig(),
               executor: ToolExecutor | None = None):
    ecfg = engine.ecfg
    if cfg.max_total_tokens is not None and cfg.max_total_tokens > ecfg.max_len:
      raise ValueError(f"RolloutConfig.max_total_tokens={cfg.max_total_tokens} exceeds the engine's "
                       f"cache length max_len={ecfg.max_len}; lower it or build the engine with a "
                       "larger max_len")
    self.engine, self.env, self.tokenizer, self.cfg = engine, env, tokenizer, cfg
    cap = cfg.max_observation_tokens
    if cap is not None and cap < (least := min_cap(tokenizer)):
      raise ValueError(
          f"RolloutConfig.max_observation_tokens={cap} leaves no room for a tool's text beside "
          f"the truncation marker {truncation_marker(10**9 - 1)!r} ({marker_tokens(tokenizer)} "
          f"tokens with this tokenizer) and a failed call's 'Error: ': set it to at least "
          f"{least}, or None for no cap")
    self.limit = min(cfg.max_total_tokens or ecfg.max_len, ecfg.max_len)
    self.limit_reason = "max_total_tokens" if self.limit < ecfg.max_len else "max_length"
    self.eos_ids = frozenset(int(e) for e in ecfg.eos_ids)
    # Observation ids are checked against the model's vocabulary (where the engine says it), so
    # that one task's bad ids end its trajectory instead of failing the batched append.
    self.vocab_size = getattr(getattr(engine, "cfg", None), "vocab_size", None)
    # One view per env that runs trajectories: the env itself, or each task of a mixture
    # (`Env.member_envs`; `Env.env_for` names an example's).
    self.views = {id(e): self._view(e) for e in (getattr(env, "member_envs", None) or (env,))}
    self._own_executor = executor is None
    self.executor = executor if executor is not None else ToolExecutor(
        max_workers=cfg.tool_workers or ecfg.slots, default_timeout_s=cfg.tool_timeout_s)
    self.stats = RolloutStats()
    self._closed = False

  def _view(self, env) -> _EnvView:
    """Checks `env`'s parser, observation template and tag arguments; its `_EnvView`."""
    parser = getattr(env, "parser", None)
    if not (callable(getattr(parser, "parse", None)) and callable(getattr(parser, "stop_strings", None))):
      raise ValueError(f"env {getattr(env, 'name', env)!r} needs a `parser` with parse(text) and "
                       "stop_strings() methods (see jaxagent.agent.parsers.Parser)")
    _check_observation_template(env)
    _check_tag_arguments(env)
    parser_stops = parser.stop_strings()
    # A single string would be taken apart into one stop string per character, ending every
    # turn at its first "<"; None failed with a bare "not iterable".
    if (not isinstance(parser_stops, (list, tuple, set, frozenset))
        or not all(isinstance(s, str) and s for s in parser_stops)):
      raise ValueError(f"env {getattr(env, 'name', env)!r}: parser.stop_strings() must return a "
                       f"list of non-empty strings, got {parser_stops!r}")
    if isinstance(parser_stops, (set, frozenset)):  # an order that does not vary between runs
      parser_stops = sorted(parser_stops)
    stops = list(dict.fromkeys([*parser_stops, *self.cfg.stop_strings]))
    # An optional parser hook: may a stop string end the turn here (not while the policy is
    # still thinking, `XMLTagParser(think_tag=...)`)? Without it every match ends the turn. A
    # parser that says it never refuses (`may_refuse_stops` False) is not asked: each call
    # decodes the whole turn so far.
    allowed = getattr(parser, "stop_allowed", None)
    refuses = bool(getattr(parser, "may_refuse_stops", True))
    return _EnvView(env, parser, StopChecker(stops, self.tokenizer),
                    allowed if callable(allowed) and refuses else None)

  def view_for(self, example: Example) -> _EnvView:
    """The view of the env that runs `example`'s trajectories (`Env.env_for`)."""
    env_for = getattr(self.env, "env_for", None)  # (an env that is not an `Env` subclass)
    env = env_for(example) if callable(env_for) else self.env
    view = self.views.get(id(env))
    if view is None:
      raise ValueError(f"env {getattr(self.env, 'name', self.env)!r}: env_for(example "
                       f"{example.id!r}) returned {env!r}, which is not one of its member_envs")
    return view

  def prompt_too_long(self, n: int) -> str | None:
    """Why a prompt of `n` tokens cannot be decoded (its trajectories end "prompt_too_long"
    before any decoding), or None when it fits."""
    if n + 1 > self.limit:
      return f"prompt of {n} tokens leaves no room in {self.limit} total tokens"
    cap = self.cfg.max_prompt_tokens
    if cap is not None and n > cap:
      return f"prompt of {n} tokens exceeds rollout.max_prompt_tokens={cap}"
    return None

  def close(self) -> None:
    """Shuts down the executor if the driver created it; `run` is refused after it."""
    self._closed = True
    if self._own_executor:
      self.executor.shutdown(wait=False)

  def __enter__(self) -> RolloutDriver:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def run(self, params, examples: Sequence[Example], *, num_samples: int = 1, seed: int = 0,
          request_id_offset: int = 0,
          on_finish: Callable[[Trajectory], None] | None = None,
          cancel: threading.Event | None = None) -> list[Trajectory]:
    """`num_samples` trajectories per example; returned grouped by example, then sample.

    on_finish: called with each trajectory once it is final (stop reason set, episode closed,
    nothing of it changes after), on this thread, while the others go on decoding: e.g. to
    hand it to a reward that runs beside the rollout. Every trajectory is reported exactly once
    when `run` returns normally (in the order they finish, not the returned order); an error
    the callback raises ends the run.
    cancel: an event (anything with `is_set()`) looked at before each step of the loop (a
    decode call, or a wait of at most `tool_poll_s` on tools); once it is set, `run` closes
    every episode and raises `RolloutCancelled`: a rollout whose result nobody will use (the
    trainer's, collected ahead of the learner, when the trainer closes) ends within a step
    instead of running to its end.
    """
    if self._closed:
      # Its executor is shut down: the first tool call failed the run, naming the executor.
      raise RuntimeError("RolloutDriver.run called after close(); build a new RolloutDriver")
    examples = list(examples)
    for i, ex in enumerate(examples):
      if not isinstance(ex, Example):
        raise TypeError(f"examples[{i}] is a {type(ex).__name__}, not a jaxagent.agent.Example")
    # A NumPy integer (the trainer's config check takes one) is the int it holds.
    if not is_int(num_samples) or num_samples < 1:
      raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    num_samples = int(num_samples)
    # int() cut a float seed (1.5 and 1.7 drew the same samples); a float offset failed later,
    # in the engine's request-id check, without naming request_id_offset.
    checked = []
    for name, v in (("seed", seed), ("request_id_offset", request_id_offset)):
      if (n := scalar_int(v)) is None:  # a 0-d integer array (a JAX scalar) counts
        raise ValueError(f"{name} must be an int, got {v!r}")
      checked.append(n)
    seed, request_id_offset = checked
    if not 0 <= seed < 2**32:
      raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    last = request_id_offset + len(examples) * num_samples - 1
    if request_id_offset < 0 or last > _INT32_MAX:
      raise ValueError(f"request ids {request_id_offset}..{last} must lie in [0, 2**31); lower "
                       "request_id_offset (or vary the seed per step instead)")
    if on_finish is not None and not callable(on_finish):
      raise TypeError(f"on_finish must be a callable taking a Trajectory, got {on_finish!r}")
    if cancel is not None and not callable(getattr(cancel, "is_set", None)):
      raise TypeError(f"cancel must be a threading.Event (anything with is_set()), got {cancel!r}")
    run = _Run(self, params, seed, on_finish, cancel)
    return run.run(examples, num_samples, request_id_offset)


def rollout(engine, params, env: Env, examples: Sequence[Example], *, tokenizer, num_samples: int = 1,
            cfg: RolloutConfig = RolloutConfig(), seed: int = 0, executor: ToolExecutor | None = None,
            request_id_offset: int = 0) -> list[Trajectory]:
  """Runs `num_samples` (G) multi-turn trajectories for each example; see the module docstring.

  Returns `len(examples) * num_samples` trajectories, example-major (group_id = example index).
  """
  driver = RolloutDriver(engine, env, tokenizer=tokenizer, cfg=cfg, executor=executor)
  try:
    return driver.run(params, examples, num_samples=num_samples, seed=seed,
                      request_id_offset=request_id_offset)
  finally:
    driver.close()


class _Run:
  """The state of one `RolloutDriver.run` call."""

  def __init__(self, driver: RolloutDriver, params, seed: int,
               on_finish: Callable[[Trajectory], None] | None = None,
               cancel: threading.Event | None = None):
    self.d = driver
    self.on_finish, self.cancel = on_finish, cancel
    self.engine, self.env, self.tok, self.cfg = driver.engine, driver.env, driver.tokenizer, driver.cfg
    # Merged decode weights made once for the run's decode calls (`Engine.prepare`).
    self.params, self.seed = driver.engine.prepare(params), seed
    self.stats = driver.stats = RolloutStats()
    self.queue: collections.deque[_Job] = collections.deque()
    self.free = list(range(self.engine.ecfg.slots))[::-1]
    self.live: dict[int, _Live] = {}
    self.ready: list[_Live] = []
    self.rewinds: list[tuple[int, int, int]] = []   # (slot, cache length, pending token)
    self.state = None

  # ------------------------------------------------------------------ main loop
  def run(self, examples, num_samples, offset) -> list[Trajectory]:
    t0 = time.perf_counter()
    out: list[Trajectory] = []
    for i, ex in enumerate(examples):
      try:
        # Ids outside the vocabulary (a tokenizer that does not match the model) are refused
        # here, before anything runs: prefill refused them later, after the trajectories
        # admitted before them were generated, naming the prompt's index in its batch.
        prompt = _token_ids(self.env.render_prompt(ex, self.tok), "render_prompt",
                            self.d.vocab_size)
      except Exception as e:  # the task's data is at fault: name the example among thousands
        raise ValueError(f"example {ex.id!r} (examples[{i}]): env {getattr(self.env, 'name', self.env)!r} "
                         f"could not render its prompt: {type(e).__name__}: {e}; fix or drop this "
                         "example") from e
      if not prompt:
        raise ValueError(f"example {ex.id!r}: the rendered prompt is empty")
      view = self.d.view_for(ex)
      for g in range(num_samples):
        traj = Trajectory(request_id=offset + i * num_samples + g, group_id=i, sample_index=g,
                          example_id=ex.id, distinct_ok_tool_calls=0)
        traj.add_prompt(prompt)
        out.append(traj)
        too_long = self.d.prompt_too_long(len(prompt))
        if too_long is not None:
          log.warning("example %r: %s", ex.id, too_long)
          traj.finish("prompt_too_long")
          self._report(traj)
        else:
          self.queue.append(_Job(traj, ex, prompt, view))
    if self.queue:
      self.state = self.engine.init_decode_state()
    try:
      self._loop()
    finally:
      for lv in list(self.live.values()):  # only on an exception: release what is left
        if lv.future is not None:
          lv.future.cancel()
        self._close(lv.episode, lv.traj)
      self.stats.wall_s = time.perf_counter() - t0
    return out

  def _loop(self) -> None:
    while self.queue or self.live:
      if self.cancel is not None and self.cancel.is_set():  # (`run` closes the live episodes)
        raise RolloutCancelled(f"the rollout was cancelled with {len(self.live)} trajectories "
                               f"under way and {len(self.queue)} not started")
      self._poll_tools(block=False)
      if self.ready:
        self._append()
      if self.queue and self.free:
        self._admit()
      decoding = [lv for lv in self.live.values() if lv.phase == "decode"]
      if decoding:
        self._generate(decoding)
      elif not self.ready and not (self.queue and self.free):
        if any(lv.phase == "tool" for lv in self.live.values()):
          self._poll_tools(block=True)
        elif self.live:
          raise RuntimeError("rollout driver stalled: live trajectories are neither decoding, "
                             "waiting on a tool nor ready to append (a driver bug)")

  # ------------------------------------------------------------------ device calls
  def _flush_rewinds(self) -> None:
    """Freeze host-stopped slots at their stop token (the engine pads the batch to a bucket)."""
    if not self.rewinds:
      return
    rw, self.rewinds = self.rewinds, []
    slots, lengths, tokens = (np.asarray(x, np.int32) for x in zip(*rw))
    self.state = self.engine.update_slots(self.state, slots, lengths=lengths, tokens=tokens,
                                          active=False, remaining=0)
    self.stats.update_calls += 1

  def _admit(self) -> None:
    self._flush_rewinds()
    n = min(len(self.free), len(self.queue))
    jobs, episodes = [], []
    for job in (self.queue.popleft() for _ in range(n)):
      try:
        episode = self.env.new_episode(job.example)
        if not isinstance(episode, Episode):
          raise TypeError(f"new_episode returned {type(episode).__name__}, not a "
                          "jaxagent.agent.Episode; wrap the trajectory's tools: Episode(tools)")
        episodes.append(episode)
      except Exception:  # noqa: BLE001 - one trajectory's task failure is data, not a crashed run
        log.warning("env %r: new_episode raised for example %r (request %d); the trajectory ends "
                    "with stop reason 'env_error'", getattr(self.env, "name", self.env),
                    job.example.id, job.traj.request_id, exc_info=True)
        job.traj.finish("env_error")
        self._report(job.traj)
        continue
      jobs.append(job)
    if not jobs:
      return
    n = len(jobs)
    slots = [self.free.pop() for _ in jobs]
    t = time.perf_counter()
    try:
      self.state, (toks, lps, done) = self.engine.prefill_insert(
          self.params, self.state, [j.prompt for j in jobs], slots,
          [j.traj.request_id for j in jobs], self.seed, [self.cfg.max_tokens_per_turn] * n,
          [self.d.limit] * n)
    except BaseException:
      for job, episode in zip(jobs, episodes):  # not live yet, so `run` would not close them
        self._close(episode, job.traj)
      raise
    self.stats.prefill_s += time.perf_counter() - t
    self.stats.prefill_calls += 1
    self.stats.decoded_tokens += n
    # All live before any first token is taken: a token that raises (non-finite logits) leaves
    # the batch's other episodes to `run`, which closes the live ones.
    admitted = [_Live(job.traj, episode, slot, self.d.limit, job.view, cached=len(job.prompt))
                for job, episode, slot in zip(jobs, episodes, slots)]
    for lv in admitted:
      self.live[lv.slot] = lv
    for j, lv in enumerate(admitted):
      self._take(lv, toks[j], lps[j], int(done[j]))
    self._flush_rewinds()

  def _generate(self, decoding: list[_Live]) -> None:
    self._flush_rewinds()
    steps = self.cfg.decode_steps
    kv = max(lv.cached for lv in decoding) + steps
    t = time.perf_counter()
    self.state, out = self.engine.generate(self.params, self.state, steps=steps, kv_len=kv)
    toks, lps, valid, done = jax.device_get((out.tokens, out.logprobs, out.valid, out.done))
    self.stats.generate_s += time.perf_counter() - t
    self.stats.generate_calls += 1
    # Every slot's code before any token is taken: a token that completes a stop string ends
    # its turn there (and may start a tool call), and the code after the call went unseen.
    for lv in decoding:
      s = lv.slot
      if int(done[s]) == STOP_KV_LEN:
        raise RuntimeError(
            f"the engine stopped slot {s} (STOP_KV_LEN): it held more cached tokens than the "
            f"kv_len bound {kv} the driver gave, from its host copy of the slot's length "
            f"({lv.cached}): engine and driver disagree about the slot's state")
      self._check_code(lv, int(done[s]))
    for lv in decoding:
      s = lv.slot
      n = int(np.asarray(valid[:, s]).sum())
      if n == 0:
        raise RuntimeError(f"the engine sampled nothing for slot {s} (stop code {int(done[s])}), "
                           "which the driver believes is decoding: engine and driver disagree "
                           "about the slot's state")
      self.stats.decoded_tokens += n
      for j in range(n):
        lv.cached += 1
        if self._take(lv, toks[j, s], lps[j, s], int(done[s]) if j == n - 1 else RUNNING):
          break
    self._flush_rewinds()

  def _append(self) -> None:
    self._flush_rewinds()
    batch, self.ready = self.ready, []
    t = time.perf_counter()
    self.state, (tok, lp, code) = self.engine.append(
        self.params, self.state, [lv.slot for lv in batch], [lv.obs_ids for lv in batch],
        max_new_tokens=[self.cfg.max_tokens_per_turn] * len(batch),
        cached_lens=[lv.cached for lv in batch])
    tok, lp, code = jax.device_get((tok, lp, code))
    self.stats.append_s += time.perf_counter() - t
    self.stats.append_calls += 1
    self.stats.decoded_tokens += len(batch)
    for j, lv in enumerate(batch):
      span = lv.traj.add_observation(lv.obs_ids, lv.turn)
      lv.traj.turns[-1].observation_span = span
      lv.cached += 1 + len(lv.obs_ids)   # the pending stop token, then the observation
      lv.obs_ids, lv.phase = None, "decode"
      lv.turn += 1
      self._take(lv, tok[j], lp[j], int(code[j]))
    self._flush_rewinds()

  # ------------------------------------------------------------------ per-token logic
  def _take(self, lv: _Live, tok, lp, code: int) -> bool:
    """Records one sampled token (pending at `lv.cached`); True when the turn ended."""
    # Checked first: a token that also completed a stop string ended its turn at that stop,
    # and the code went unseen.
    self._check_code(lv, code)
    lv.toks.append(int(tok))
    lv.lps.append(float(lp))
    if code == STOP_NONFINITE:
      traj = lv.traj
      raise FloatingPointError(
          f"rollout: the policy's logits held a NaN or inf while sampling turn {lv.turn} of "
          f"request {traj.request_id} (group {traj.group_id}, sample {traj.sample_index}), at "
          f"token {len(lv.toks)} of the turn: the params have diverged or a kernel failed "
          "numerically. No trajectory of this rollout is returned.")
    # A stop string that spells the EOS token's text matches when EOS is sampled: the turn
    # still ended by EOS (the engine stopped the slot), not at a stop string.
    stop = lv.view.stop
    match = stop.check(lv.toks) if stop and code != STOP_EOS else None
    if isinstance(match, str) and lv.view.stop_allowed is not None:
      match = self._allowed_stop(lv, match)
    if match is not None:
      if code == RUNNING:  # the device would go on (or already did): freeze it at this token
        self.rewinds.append((lv.slot, lv.cached, int(tok)))
      self._end_turn(lv, "stop", match)
      return True
    if code != RUNNING:
      self._end_turn(lv, _TURN_ENDS[code])
      return True
    return False

  @staticmethod
  def _check_code(lv: _Live, code: int) -> None:
    """A RuntimeError for a stop code of `lv`'s slot that the driver does not know."""
    if code not in _TURN_ENDS and code not in (RUNNING, STOP_NONFINITE):
      traj = lv.traj
      raise RuntimeError(
          f"rollout: the engine reported stop code {code} for slot {lv.slot} (request "
          f"{traj.request_id}, turn {lv.turn}), neither RUNNING ({RUNNING}), STOP_NONFINITE "
          f"({STOP_NONFINITE}) nor a code a turn ends with {_TURN_ENDS}: the engine and the "
          "driver disagree about the engine's stop codes. No trajectory of this rollout is "
          "returned.")

  def _allowed_stop(self, lv: _Live, match: str) -> str | None:
    """`match` if the parser lets the turn end at its newest stop string, else None.

    The checker's window can still hold a stop string that the parser refused a few tokens
    earlier, so the newest occurrence in the turn's text is the one judged: a refused one stays
    refused, and a new one is judged at the token that completed it.
    """
    text = self.tok.decode(lv.toks)
    ends = [(text.rfind(s) + len(s), s) for s in lv.view.stop.strings if s in text]
    if not ends:  # the window's decoding saw it, the whole turn's did not: keep the match
      return match
    end, newest = max(ends)
    try:
      allowed = lv.view.stop_allowed(text[:end])
    except Exception:  # noqa: BLE001 - a parser failure on model text must not end the run
      log.warning("parser %r: stop_allowed raised on model output; the stop ends the turn",
                  lv.view.parser, exc_info=True)
      allowed = True
    return newest if allowed else None

  @staticmethod
  def _parse(lv: _Live, text: str) -> ParseResult:
    try:
      parsed = lv.view.parser.parse(text)
    except Exception as e:  # noqa: BLE001 - a parser failure on model text is a malformed call
      log.warning("parser %r raised on model output", lv.view.parser, exc_info=True)
      return ParseResult.malformed(f"the tool call could not be parsed ({type(e).__name__})")
    if not isinstance(parsed, ParseResult):
      return ParseResult.malformed(f"the parser returned {type(parsed).__name__}, not a ParseResult")
    return parsed

  def _end_turn(self, lv: _Live, ended_by: str, match: str | None = None) -> None:
    traj = lv.traj
    toks, lps, lv.toks, lv.lps = lv.toks, lv.lps, [], []
    span = traj.add_policy(toks, lps, lv.turn)
    text = self.tok.decode(toks)
    turn = Turn(index=lv.turn, policy_span=span, text=text, ended_by=ended_by)
    traj.turns.append(turn)
    if ended_by == "stop":
      cut = text.rfind(match)
      parse_text = text[:cut + len(match)] if cut >= 0 else text
    elif ended_by == "eos" and toks[-1] in self.d.eos_ids:
      parse_text = self.tok.decode(toks[:-1])
    else:
      parse_text = text
    parsed = self._parse(lv, parse_text)
    turn.set_parse(parsed)
    if ended_by == "max_tokens_per_turn":
      return self._finish(lv, "max_tokens_per_turn")
    if ended_by == "length":
      return self._finish(lv, self.d.limit_reason)
    if parsed.kind == "answer":
      return self._finish(lv, "answer")
    if ended_by == "eos":
      return self._finish(lv, "eos")
    if parsed.kind == "text":
      return self._finish(lv, "no_tool_call")
    if lv.turn + 1 >= self.cfg.max_turns:
      return self._finish(lv, "max_turns")
    if lv.cached + 2 > lv.limit:
      # The call's last token is the trajectory's last position: not even an empty observation and
      # one more policy token fit, so the call is not acted on (no tool runs, nothing is counted).
      return self._finish(lv, self.d.limit_reason)
    traj.num_tool_calls += 1
    if parsed.kind == "malformed":
      traj.malformed_calls += 1
      traj.tool_errors += 1
      return self._observe(lv, ToolResult.failure(parsed.error))
    call = parsed.call
    try:
      tool = lv.episode.tools.get(call.name)
    except UnknownToolError as e:
      traj.unknown_tool_calls += 1
      traj.tool_errors += 1
      return self._observe(lv, ToolResult.failure(str(e)))
    try:
      args = validate_arguments(tool.parameters, call.arguments)
    except ToolArgumentError as e:
      traj.bad_argument_calls += 1
      traj.tool_errors += 1
      return self._observe(lv, ToolResult.failure(f"bad arguments for tool {call.name!r}: {e}"))
    traj.valid_tool_calls += 1
    traj.tool_calls[call.name] = traj.tool_calls.get(call.name, 0) + 1
    key = tool_call_key(call.name, args)
    traj.repeated_tool_calls += key in lv.call_keys
    lv.call_keys.add(key)
    lv.call_key = key
    timeout = min(self.cfg.tool_timeout_s, self.cfg.traj_tool_timeout_s - traj.tool_seconds)
    own = getattr(tool, "timeout_s", None)  # a tool's own limit (`function_tool(timeout_s=...)`)
    if isinstance(own, (int, float)) and not isinstance(own, bool) and own > 0:
      timeout = min(timeout, own)
    lv.future = self.d.executor.submit(tool, args, timeout_s=max(timeout, 1e-3))
    lv.phase = "tool"
    waiting = sum(1 for x in self.live.values() if x.phase == "tool")
    self.stats.max_concurrent_tools = max(self.stats.max_concurrent_tools, waiting)

  # ------------------------------------------------------------------ tools
  def _poll_tools(self, block: bool) -> None:
    waiting = [lv for lv in self.live.values() if lv.phase == "tool"]
    if not waiting:
      return
    if block:
      t = time.perf_counter()
      concurrent.futures.wait([lv.future for lv in waiting], timeout=self.cfg.tool_poll_s,
                              return_when=concurrent.futures.FIRST_COMPLETED)
      self.stats.tool_wait_s += time.perf_counter() - t
    for lv in waiting:
      if not lv.future.done():
        continue
      try:
        result = lv.future.result()
      except BaseException as e:  # noqa: BLE001 - a cancelled or broken future is a failed call
        result = ToolResult.failure(f"the tool call failed: {type(e).__name__}: {e}")
      if not isinstance(result, ToolResult):
        result = ToolResult.failure(f"the tool executor returned {type(result).__name__}, not a ToolResult")
      lv.future = None
      if not result.ok:
        lv.traj.tool_errors += 1
        lv.traj.tool_timeouts += int(result.timed_out)
      elif lv.call_key not in lv.ok_keys:
        lv.ok_keys.add(lv.call_key)
        lv.traj.distinct_ok_tool_calls += 1
      self._observe(lv, result)

  def _observe(self, lv: _Live, result: ToolResult) -> None:
    """Turns a call's result into observation tokens, or ends the trajectory if they cannot follow."""
    traj, turn = lv.traj, lv.traj.turns[-1]
    turn.outcome = ToolOutcome.from_result(result)
    traj.tool_seconds += float(result.duration_s)
    if traj.tool_seconds >= self.cfg.traj_tool_timeout_s - 1e-9:
      return self._finish(lv, "tool_budget")
    try:
      cut = 0
      if self.cfg.max_observation_tokens is not None:
        # The tool's text cut to the cap before the task wraps it (agent/observation_cap.py);
        # the outcome holds what the policy sees.
        result, cut = cap_result(result, self.cfg.max_observation_tokens,
                                 self.cfg.observation_truncation, self.tok)
        turn.outcome = ToolOutcome.from_result(result)
        turn.observation_truncated_tokens = cut
      env = lv.view.env
      text = env.format_observation(result)
      ids = _token_ids(env.encode_observation(_clean_text(text), self.tok))
      vocab = self.d.vocab_size
      bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab)), None)
      if bad is not None:
        raise ValueError(f"encode_observation returned token id {bad}, outside the model's "
                         f"vocabulary [0, {vocab}): the tokenizer does not match the model")
    except Exception:  # noqa: BLE001 - one trajectory's task failure is data, not a crashed run
      log.warning("env %r: turning the result of turn %d into observation tokens raised (request "
                  "%d); the trajectory ends with stop reason 'env_error'",
                  getattr(self.env, "name", self.env), turn.index, traj.request_id, exc_info=True)
      return self._finish(lv, "env_error")
    turn.observation_text = text
    # The pending token, the observation and at least one new token must fit.
    if lv.cached + 1 + len(ids) + 1 > lv.limit:
      return self._finish(lv, self.d.limit_reason)
    traj.truncated_observations += cut > 0
    lv.obs_ids, lv.phase = ids, "ready"
    self.ready.append(lv)

  def _finish(self, lv: _Live, reason: str) -> None:
    assert reason in STOP_REASONS, reason
    lv.traj.finish(reason)
    del self.live[lv.slot]
    self.free.append(lv.slot)
    self._close(lv.episode, lv.traj)
    self._report(lv.traj)

  def _report(self, traj: Trajectory) -> None:
    if self.on_finish is not None:
      self.on_finish(traj)

  def _close(self, episode: Episode, traj: Trajectory) -> None:
    """Closes an episode; a close that raises (an overridden `Episode.close`) is logged, as a
    failing cleanup must not end the rollout, nor stop the other episodes from closing."""
    try:
      episode.close()
    except Exception:  # noqa: BLE001 - one trajectory's cleanup failure is not a crashed run
      log.warning("env %r: closing the episode of request %d raised; the trajectory is kept",
                  getattr(self.env, "name", self.env), traj.request_id, exc_info=True)


def rollout_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
  """Batch means for logging: `rollout/<budget>`, `rollout/stop/<reason>`, tool counts and rates."""
  n = len(trajectories)
  if n == 0:
    return {}
  out: dict[str, float] = {"rollout/num_trajectories": float(n)}
  for key in ("turns", "policy_tokens", "total_tokens", "tool_seconds"):
    vals = np.array([t.budgets()[key] for t in trajectories], np.float64)
    out[f"rollout/{key}"] = float(vals.mean())
    if key != "tool_seconds":  # length and turn distributions
      out[f"rollout/{key}_p50"] = float(np.percentile(vals, 50))
      out[f"rollout/{key}_p90"] = float(np.percentile(vals, 90))
      out[f"rollout/{key}_max"] = float(vals.max())
  turns = np.array([t.budgets()["turns"] for t in trajectories])
  for k in np.unique(turns):
    out[f"rollout/turns_frac/{int(k)}"] = float(np.mean(turns == k))
  out["rollout/truncated"] = float(np.mean([t.truncated for t in trajectories]))
  for reason in STOP_REASONS:
    out[f"rollout/stop/{reason}"] = sum(t.stop_reason == reason for t in trajectories) / n
  for key in ("num_tool_calls", "valid_tool_calls", "repeated_tool_calls", "tool_errors",
              "tool_timeouts", "malformed_calls", "unknown_tool_calls", "bad_argument_calls",
              "truncated_observations"):
    out[f"rollout/{key}"] = float(np.mean([getattr(t, key) for t in trajectories]))
  # The calls the tool bonus pays; a trajectory built by hand has no count (None).
  distinct = [t.distinct_ok_tool_calls for t in trajectories if t.distinct_ok_tool_calls is not None]
  if distinct:
    out["rollout/distinct_ok_tool_calls"] = float(np.mean(distinct))
  calls = sum(t.num_tool_calls for t in trajectories)
  out["rollout/tool_error_rate"] = sum(t.tool_errors for t in trajectories) / calls if calls else 0.0
  out["rollout/tool_timeout_rate"] = (sum(t.tool_timeouts for t in trajectories) / calls
                                      if calls else 0.0)
  # Of the calls acted on, the share whose observation was cut to `max_observation_tokens`,
  # and the tokens cut from the observations appended (mean per trajectory).
  out["rollout/truncated_observation_rate"] = (
      sum(t.truncated_observations for t in trajectories) / calls if calls else 0.0)
  out["rollout/truncated_observation_tokens"] = float(np.mean([
      sum(x.observation_truncated_tokens for x in t.turns if x.observation_span is not None)
      for t in trajectories]))
  names = sorted({k for t in trajectories for k in t.tool_calls})
  for name in names:
    out[f"rollout/tool/{name}"] = sum(t.tool_calls.get(name, 0) for t in trajectories) / n
  return out
