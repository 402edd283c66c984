"""Shaping rewards: tag-protocol format, capped tool use, and length in tokens (linear, DAPO overlong).

These score how a response was produced rather than whether it is right; `composite.py` adds
them to the outcome verifiers with weights (and, optionally, a progressive schedule that hands
weight from shaping to outcome as training goes on). Each function takes its small frozen config;
configs validate themselves so a bad value fails at construction, not mid-run.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import re

# ----------------------------------------------------------------------------------------------
# Format: a response follows a tag protocol such as <think>...</think><answer>...</answer>.

_TAG = re.compile(r"<(/?)([A-Za-z_][\w\-]*)>")
_TAG_NAME = re.compile(r"[A-Za-z_][\w\-]*")


def _as_tag_tuple(owner: str, name: str, value) -> tuple[str, ...]:
  if isinstance(value, str):
    raise ValueError(f"{owner}.{name} must be a tuple of tag names, got the string {value!r}")
  value = tuple(value)
  for tag in value:
    if not isinstance(tag, str) or not _TAG_NAME.fullmatch(tag):
      raise ValueError(f"{owner}.{name} holds {tag!r}, which is not a bare tag name like 'answer'")
  return value


@dataclasses.dataclass(frozen=True)
class FormatConfig:
  """The tag protocol a response must follow.

  Attributes:
    allowed_tags: tags that may appear (as `<t>...</t>` blocks).
    answer_tag: the tag of the final answer; exactly one non-empty block, last in the response.
    required_tags: tags that must appear at least once (e.g. ("think",)).
    opaque_tags: tags whose content is not scanned for tags, e.g. tool observations that may
      quote arbitrary markup (`<information>`, `<result>`).
    allow_nesting: whether allowed blocks may contain other blocks.
    allow_unknown_tags: whether `<x>`-style markup outside `allowed_tags` is tolerated as text.
    eos_markers: end-of-sequence strings that may follow the answer (besides whitespace).
    partial_credit: score the fraction of checks passed instead of 1.0/0.0.
    think_tag: a reasoning block that may open the response, as Qwen3-style reasoning models
      open every turn with `<think>...</think>` (possibly empty, any number of lines); None: no
      such block. It is accepted only where nothing but whitespace comes before it since the start
      of the text or since the close of the previous block (a later turn opening right after a
      tool block), must be closed, and is free text: tags inside it are not read, so an answer
      written while thinking is not the answer. Anywhere else it fails `tags_ok`. Not one of
      `allowed_tags` (the tags a response may use anywhere).
  """

  allowed_tags: tuple[str, ...] = ("think", "answer")
  answer_tag: str = "answer"
  required_tags: tuple[str, ...] = ()
  opaque_tags: tuple[str, ...] = ()
  allow_nesting: bool = False
  allow_unknown_tags: bool = False
  eos_markers: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>")
  partial_credit: bool = False
  think_tag: str | None = None

  def __post_init__(self):
    for name in ("allowed_tags", "required_tags", "opaque_tags"):
      object.__setattr__(self, name, _as_tag_tuple("FormatConfig", name, getattr(self, name)))
    if isinstance(self.eos_markers, str) or not all(isinstance(m, str) and m for m in self.eos_markers):
      raise ValueError(f"FormatConfig.eos_markers must be a tuple of non-empty strings, got {self.eos_markers!r}")
    object.__setattr__(self, "eos_markers", tuple(self.eos_markers))
    if self.answer_tag not in self.allowed_tags:
      raise ValueError(
          f"FormatConfig.answer_tag {self.answer_tag!r} must be one of allowed_tags {self.allowed_tags}")
    for name in ("required_tags", "opaque_tags"):
      extra = set(getattr(self, name)) - set(self.allowed_tags)
      if extra:
        raise ValueError(f"FormatConfig.{name} {sorted(extra)} are not in allowed_tags {self.allowed_tags}")
    if self.answer_tag in self.opaque_tags:
      raise ValueError("FormatConfig.answer_tag cannot be opaque")
    if self.think_tag is not None:
      if not isinstance(self.think_tag, str) or not _TAG_NAME.fullmatch(self.think_tag):
        raise ValueError(f"FormatConfig.think_tag must be a bare tag name like 'think' or None, "
                         f"got {self.think_tag!r}")
      if self.think_tag in self.allowed_tags:
        raise ValueError(f"FormatConfig.think_tag {self.think_tag!r} is also in allowed_tags "
                         f"{self.allowed_tags}: keep it in allowed_tags to allow the block anywhere, "
                         "or drop it from there to allow it only where a turn opens")


@dataclasses.dataclass(frozen=True)
class FormatCheck:
  """The individual checks behind `format_reward`, for debugging and logging."""

  tags_ok: bool  # only allowed tags, every block closed, nested only where allowed
  one_answer: bool  # exactly one non-empty answer block
  answer_last: bool  # nothing but whitespace / EOS markers after the answer's closing tag
  required_present: bool  # every required tag appears as a block

  def score(self, config: FormatConfig) -> float:
    checks = [self.tags_ok, self.one_answer, self.answer_last]
    if config.required_tags:
      checks.append(self.required_present)
    if config.partial_credit:
      return sum(checks) / len(checks)
    return float(all(checks))


def _strip_end(text: str, eos_markers: tuple[str, ...]) -> str:
  """Drops trailing whitespace and EOS markers, in any order and number."""
  while True:
    stripped = text.rstrip()
    for marker in eos_markers:
      if stripped.endswith(marker):
        stripped = stripped[: -len(marker)]
    if stripped == text:
      return text
    text = stripped


def check_format(text: str, config: FormatConfig = FormatConfig()) -> FormatCheck:
  """Runs each check of the tag protocol on `text`."""
  text = _strip_end(text, config.eos_markers)
  allowed = set(config.allowed_tags)
  tags_ok = True
  stack: list[tuple[str, int]] = []  # (tag, end of its opening tag)
  open_count: dict[str, int] = {}  # tag -> its entries in `stack`, so a stray close is O(1) to check
  blocks: dict[str, list[tuple[int, int, int]]] = {}  # tag -> [(content start, content end, block end)]
  answer_opens = 0
  pos = 0
  boundary = 0  # end of the last top-level block: a think block may follow it after whitespace
  while (m := _TAG.search(text, pos)) is not None:
    pos = m.end()
    closing, name = m.group(1) == "/", m.group(2)
    if name == config.think_tag:
      if closing or stack or text[boundary:m.start()].strip():
        tags_ok = False  # a stray close, or a think block that does not open a turn
      if closing:
        continue
      end = text.find(f"</{name}>", m.end())
      if end < 0:
        tags_ok = False
        break
      pos = boundary = end + len(name) + 3
      continue
    if name not in allowed:
      tags_ok = tags_ok and config.allow_unknown_tags
      continue
    if not closing:
      if stack and not config.allow_nesting:
        tags_ok = False
      answer_opens += name == config.answer_tag
      if name in config.opaque_tags:
        end = text.find(f"</{name}>", m.end())
        if end < 0:
          tags_ok = False
          break
        blocks.setdefault(name, []).append((m.end(), end, end + len(name) + 3))
        pos = end + len(name) + 3
        if not stack:
          boundary = pos
        continue
      stack.append((name, m.end()))
      open_count[name] = open_count.get(name, 0) + 1
    elif stack and stack[-1][0] == name:
      _, start = stack.pop()
      open_count[name] -= 1
      blocks.setdefault(name, []).append((start, m.start(), m.end()))
      if not stack:
        boundary = m.end()
    else:
      tags_ok = False  # a close with no matching open, or crossing blocks
      if open_count.get(name, 0):  # close the blocks opened since `name`, and `name` itself
        while True:
          top, _ = stack.pop()
          open_count[top] -= 1
          if top == name:
            break
  tags_ok = tags_ok and not stack

  answers = blocks.get(config.answer_tag, [])
  one_answer = (len(answers) == 1 and answer_opens == 1 and bool(text[answers[0][0]:answers[0][1]].strip()))
  answer_last = bool(answers) and answers[-1][2] == len(text)
  required_present = all(t in blocks for t in config.required_tags)
  return FormatCheck(tags_ok, one_answer, answer_last, required_present)


def format_reward(text: str, config: FormatConfig = FormatConfig()) -> float:
  """1.0 if `text` follows the tag protocol, else 0.0 (or the fraction of checks passed)."""
  return check_format(text, config).score(config)


# ----------------------------------------------------------------------------------------------
# Tool use.


def _check_real(owner: str, name: str, value, *, minimum: float = 0.0) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < minimum:
    raise ValueError(f"{owner}.{name} must be a finite number >= {minimum}, got {value!r}")


def _check_count(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
    raise ValueError(f"{name} must be an int >= 0, got {value!r}")
  return int(value)


@dataclasses.dataclass(frozen=True)
class ToolShapingConfig:
  """Capped bonus for valid tool calls that ran, and an optional (capped) penalty for tool errors.

  reward = min(reward_per_valid_call * num_ok, max_reward)
           - min(penalty_per_error * num_errors, max_penalty)

  num_ok is the number of distinct calls that ran: valid calls (parsed, a known tool, valid
  arguments) that succeeded, counting a call that repeats an earlier one of the trajectory word
  for word (same tool, same validated arguments) once. A valid call that the tool then refused,
  or that raised or timed out (garbage code, `1/0` for a calculator), earns nothing, or the bonus
  would pay for calls that do nothing; a repeat earns nothing, or one trivial call made five
  times would collect the whole cap. The rollout counts this number exactly
  (`Trajectory.distinct_ok_tool_calls`, `RewardInput.num_distinct_ok_tool_calls`). Where it is
  not known (None: a `RewardInput` built by hand without it, a trajectory dump older than the
  count), num_ok = min(num_valid - num_repeated, num_calls - num_errors), an upper bound: with
  both a repeat and a failed valid call the counts do not say whether the failure was one of the
  repeats (calls `1+1`, `1+1`, `1/0`: the bound is 2, the exact count 1).

  `reward_repeated_calls=True` pays for every valid call that succeeded, repeats included:
  num_ok = min(num_valid, num_calls - num_errors), exact from the counts since every invalid
  call is an error.
  """

  reward_per_valid_call: float = 0.1
  max_reward: float = 0.5
  penalty_per_error: float = 0.0
  max_penalty: float = math.inf
  reward_repeated_calls: bool = False

  def __post_init__(self):
    _check_real("ToolShapingConfig", "reward_per_valid_call", self.reward_per_valid_call)
    _check_real("ToolShapingConfig", "max_reward", self.max_reward)
    _check_real("ToolShapingConfig", "penalty_per_error", self.penalty_per_error)
    if isinstance(self.max_penalty, bool) or not isinstance(self.max_penalty, numbers.Real) or not (
        self.max_penalty >= 0):
      raise ValueError(f"ToolShapingConfig.max_penalty must be a number >= 0 (inf = no cap), got {self.max_penalty!r}")
    if not isinstance(self.reward_repeated_calls, bool):
      raise ValueError(f"ToolShapingConfig.reward_repeated_calls must be a bool, "
                       f"got {self.reward_repeated_calls!r}")


def tool_use_reward(num_calls: int, num_valid: int, num_errors: int,
                    config: ToolShapingConfig = ToolShapingConfig(), *,
                    num_repeated: int = 0, num_distinct_ok: int | None = None) -> float:
  """Shaping for tool use from a trajectory's counts; see `ToolShapingConfig` for what is paid.

  Args:
    num_calls: tool calls attempted.
    num_valid: calls that parsed and named a known tool (with valid arguments), whether or not
      the tool then succeeded.
    num_errors: calls that failed (malformed, tool raised, timed out); a valid call that failed
      counts in both, as the rollout counts it.
    num_repeated: valid calls with the same tool and arguments as an earlier valid call of the
      trajectory (`Trajectory.repeated_tool_calls`); they count in num_valid too.
    num_distinct_ok: distinct valid calls (by tool and arguments) that succeeded
      (`Trajectory.distinct_ok_tool_calls`): the number of calls paid. None: not counted; the
      upper bound from the other counts is paid instead.
  """
  num_calls = _check_count("num_calls", num_calls)
  num_valid = _check_count("num_valid", num_valid)
  num_errors = _check_count("num_errors", num_errors)
  num_repeated = _check_count("num_repeated", num_repeated)
  if num_valid > num_calls or num_errors > num_calls:
    raise ValueError(f"tool counts disagree: num_valid={num_valid} and num_errors={num_errors} "
                     f"must each be <= num_calls={num_calls}")
  if num_repeated > num_valid:
    raise ValueError(f"tool counts disagree: num_repeated={num_repeated} must be <= "
                     f"num_valid={num_valid} (a repeated call is a valid call)")
  # Valid calls that succeeded: at most the valid calls, and at most the calls without an error.
  succeeded = min(num_valid, num_calls - num_errors)
  bound = min(num_valid - num_repeated, succeeded)
  if num_distinct_ok is not None:
    num_distinct_ok = _check_count("num_distinct_ok", num_distinct_ok)
    # Each success past the first of its call is a repeat, so at most num_repeated are dropped.
    low = max(0, succeeded - num_repeated)
    if not low <= num_distinct_ok <= bound:
      raise ValueError(
          f"tool counts disagree: num_distinct_ok={num_distinct_ok} must be between "
          f"{low} and {bound} (from num_calls={num_calls}, num_valid={num_valid}, "
          f"num_errors={num_errors}, num_repeated={num_repeated}): distinct successful calls "
          "are at most the distinct valid calls and the successful ones, and at least the "
          "successful ones less the repeats")
  if config.reward_repeated_calls:
    num_ok = succeeded
  else:
    num_ok = bound if num_distinct_ok is None else num_distinct_ok
  bonus = min(config.reward_per_valid_call * num_ok, config.max_reward)
  penalty = min(config.penalty_per_error * num_errors, config.max_penalty) if num_errors else 0.0
  return bonus - penalty


# ----------------------------------------------------------------------------------------------
# Length, counted in the policy's own tokens: in a multi-turn trajectory the sum over its turns,
# without the prompt and without tool observations (`RewardInput.num_response_tokens`).


@dataclasses.dataclass(frozen=True)
class LinearLengthConfig:
  """penalty = -coef * clip((n - free_tokens) / (max_tokens - free_tokens), 0, 1)."""

  max_tokens: int
  free_tokens: int = 0
  coef: float = 1.0

  def __post_init__(self):
    _check_count("LinearLengthConfig.max_tokens", self.max_tokens)
    _check_count("LinearLengthConfig.free_tokens", self.free_tokens)
    if self.free_tokens >= self.max_tokens:
      raise ValueError(f"LinearLengthConfig needs free_tokens < max_tokens, got free_tokens={self.free_tokens}, "
                       f"max_tokens={self.max_tokens}")
    _check_real("LinearLengthConfig", "coef", self.coef)


def linear_length_penalty(num_tokens: int, config: LinearLengthConfig) -> float:
  """A penalty growing linearly from 0 at `free_tokens` to -coef at `max_tokens` (and beyond)."""
  n = _check_count("num_tokens", num_tokens)
  frac = (n - config.free_tokens) / (config.max_tokens - config.free_tokens)
  return -config.coef * min(max(frac, 0.0), 1.0)


@dataclasses.dataclass(frozen=True)
class OverlongConfig:
  """DAPO soft overlong punishment: L_max = max_tokens, L_cache = cache_tokens.

  The length is the policy's token count (observations excluded; see the section comment), so
  set `max_tokens` to the policy-token budget (at most `RolloutConfig.max_turns *
  max_tokens_per_turn`), not to `RolloutConfig.max_total_tokens`, which also holds the prompt
  and the observations: against that cap the penalty would start late or never.
  """

  max_tokens: int
  cache_tokens: int

  def __post_init__(self):
    _check_count("OverlongConfig.max_tokens", self.max_tokens)
    _check_count("OverlongConfig.cache_tokens", self.cache_tokens)
    if not 0 < self.cache_tokens <= self.max_tokens:
      raise ValueError(f"OverlongConfig needs 0 < cache_tokens <= max_tokens, got cache_tokens={self.cache_tokens}, "
                       f"max_tokens={self.max_tokens}")


def overlong_penalty(num_tokens: int, config: OverlongConfig) -> float:
  """DAPO eq. (13): 0 up to L_max - L_cache, then linear down to -1 at L_max, -1 beyond."""
  n = _check_count("num_tokens", num_tokens)
  expected = config.max_tokens - config.cache_tokens
  if n <= expected:
    return 0.0
  if n <= config.max_tokens:
    return (expected - n) / config.cache_tokens
  return -1.0
