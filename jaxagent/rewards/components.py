"""Reward components: the verifiers and shaping terms as callables `RewardInput -> float`.

Each is a small frozen dataclass holding its settings, ready to be wrapped in a
`composite.Component` with a name, weight and role. For example, a math task with a code tool:

    CompositeReward([
        Component("correct", MathAnswerReward(), 1.0, role="outcome"),
        Component("format", FormatReward(), 0.2, role="shaping"),
        Component("tool_calls", ToolUseReward(), 0.2, role="shaping"),
        Component("overlong", OverlongReward(OverlongConfig(4096, 512)), 1.0, role="fixed"),
    ], schedule=ProgressiveSchedule(num_steps=200, start=0.5))

Inputs a component cannot score (a task without gold answers, missing unit-test counts) raise,
which the composite counts as that component's error and scores 0.0.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import re
from typing import ClassVar, Iterable, Literal, Mapping

from jaxagent.rewards import shaping
from jaxagent.rewards import verifiers
from jaxagent.rewards.composite import RewardInput
from jaxagent.rewards.math_verifier import MathVerifier, math_equal

TextMetric = Literal["exact_match", "f1", "substring_exact_match", "numeric_match"]
_TEXT_METRICS = {
    "exact_match": verifiers.exact_match,
    "f1": verifiers.f1_score,
    "substring_exact_match": verifiers.substring_exact_match,
    "numeric_match": verifiers.numeric_match,
}

# Keys in `RewardInput.metadata` that the code environments fill from the sandbox's test run.
TESTS_PASSED_KEY = "tests_passed"
TESTS_TOTAL_KEY = "tests_total"


def _golds(inp: RewardInput) -> list[str]:
  if inp.gold is None:
    raise ValueError("this reward component needs RewardInput.gold, which is None")
  gold = inp.gold
  if isinstance(gold, str):
    return [gold]
  golds = list(gold) if isinstance(gold, Iterable) and not isinstance(gold, (bytes, bytearray, Mapping)) else None
  if golds is None or not all(isinstance(g, str) for g in golds):
    raise TypeError(f"RewardInput.gold must be a str or a sequence of str (the task's reference "
                    f"answers as text), got {type(gold).__name__}: {gold!r:.200}")
  if not golds:
    raise ValueError("RewardInput.gold is an empty sequence")
  return golds


def _answer(text: str, tag: str | None, fallback: bool) -> str | None:
  """The answer a reward reads: `extract_answer`'s (the tag's block, else a box, else `####`),
  or with `fallback=False` the tag's block only."""
  return verifiers.extract_answer(text, tag=tag) if fallback else verifiers.extract_tagged(text, tag)


def _check_fallback(owner: str, tag: str | None, fallback) -> None:
  if not isinstance(fallback, bool):
    raise ValueError(f"{owner}.fallback must be a bool, got {fallback!r}")
  if tag is None and not fallback:
    raise ValueError(f"{owner}: fallback=False reads only the answer tag's block, so it needs a "
                     "tag (tag=None reads only boxes and '####')")


def _check_config(owner: str, config, kind: type) -> None:
  # A dict or ConfigDict here failed each call, and the composite scored the term 0.0 for every
  # trajectory of the run (logged once) instead of refusing it here.
  if not isinstance(config, kind):
    raise ValueError(f"{owner}.config must be a shaping.{kind.__name__}, got {type(config).__name__}: "
                     f"{config!r:.200}; build one with shaping.{kind.__name__}(**values)")


def _check_tag(owner: str, tag: str | None) -> None:
  if tag is not None and not (isinstance(tag, str) and re.fullmatch(r"[A-Za-z_][\w\-]*", tag)):
    raise ValueError(f"{owner}.tag must be a bare tag name like 'answer' or None, got {tag!r}")


@dataclasses.dataclass(frozen=True)
class MathAnswerReward:
  """1.0 if the extracted answer equals any gold answer as math (math-verify), else 0.0.

  Attributes:
    tag: answer tag for `extract_answer` (None: only `\\boxed{}` and `####`).
    timeout_s: limit per comparison; a timeout scores 0.0.
    verifier: a `MathVerifier` to use instead of the shared default one.
    fallback: without the tag's block, read the last `\\boxed{}`, then `####` (the default);
      False reads only the tag's block, the answer a rollout's parser reads as one (a box in
      a thought or a tool call is no answer).
  """

  tag: str | None = "answer"
  timeout_s: float = 5.0
  verifier: MathVerifier | None = dataclasses.field(default=None, compare=False, repr=False)
  fallback: bool = True

  def __post_init__(self):
    _check_tag("MathAnswerReward", self.tag)
    _check_fallback("MathAnswerReward", self.tag, self.fallback)
    t = self.timeout_s
    if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t <= 0:
      raise ValueError(f"MathAnswerReward.timeout_s must be a finite number of seconds > 0, got {t!r}")
    if self.verifier is not None and not callable(getattr(self.verifier, "equal", None)):
      # A MathVerifyConfig here failed each call, so every answer scored 0.0 (logged once).
      raise ValueError(f"MathAnswerReward.verifier must be a MathVerifier or None (the shared one), "
                       f"got {type(self.verifier).__name__}: {self.verifier!r:.200}; build one with "
                       "MathVerifier(MathVerifyConfig(...))")

  def __call__(self, inp: RewardInput) -> float:
    golds = _golds(inp)
    answer = _answer(inp.response_text, self.tag, self.fallback)
    if answer is None:
      return 0.0
    equal = math_equal if self.verifier is None else self.verifier.equal
    return float(any(equal(answer, g, timeout_s=self.timeout_s) for g in golds))


@dataclasses.dataclass(frozen=True)
class TextMatchReward:
  """Exact match, token F1, substring or numeric match of the extracted answer against the golds.

  The text metrics normalise as SQuAD does, which drops signs and decimal points; use
  "numeric_match" (`verifiers.numeric_match`) for numbers. `tag` and `fallback` choose what is
  read as the answer, as for `MathAnswerReward`.
  """

  metric: TextMetric = "exact_match"
  tag: str | None = "answer"
  fallback: bool = True

  def __post_init__(self):
    if self.metric not in _TEXT_METRICS:
      raise ValueError(f"TextMatchReward.metric must be one of {tuple(_TEXT_METRICS)}, got {self.metric!r}")
    _check_tag("TextMatchReward", self.tag)
    _check_fallback("TextMatchReward", self.tag, self.fallback)

  def __call__(self, inp: RewardInput) -> float:
    golds = _golds(inp)
    return _TEXT_METRICS[self.metric](_answer(inp.response_text, self.tag, self.fallback), golds)


@dataclasses.dataclass(frozen=True)
class UnitTestReward:
  """Pass fraction (or all-or-nothing) from the test counts in `RewardInput.metadata`."""

  all_or_nothing: bool = False
  passed_key: str = TESTS_PASSED_KEY
  total_key: str = TESTS_TOTAL_KEY

  def __post_init__(self):
    if not isinstance(self.all_or_nothing, bool):  # "no" would turn it on
      raise ValueError(f"UnitTestReward.all_or_nothing must be a bool, got {self.all_or_nothing!r}")
    for name in ("passed_key", "total_key"):
      if not isinstance(getattr(self, name), str):
        raise ValueError(f"UnitTestReward.{name} must be a str (a key of RewardInput.metadata), "
                         f"got {getattr(self, name)!r}")

  def __call__(self, inp: RewardInput) -> float:
    for key in (self.passed_key, self.total_key):
      if key not in inp.metadata:
        raise KeyError(f"UnitTestReward needs RewardInput.metadata[{key!r}] from the test runner")
    return verifiers.unit_test_reward(inp.metadata[self.passed_key], inp.metadata[self.total_key],
                                      all_or_nothing=self.all_or_nothing)


@dataclasses.dataclass(frozen=True)
class FormatReward:
  """`shaping.format_reward` of the response text."""

  config: shaping.FormatConfig = shaping.FormatConfig()

  def __post_init__(self):
    _check_config("FormatReward", self.config, shaping.FormatConfig)

  def __call__(self, inp: RewardInput) -> float:
    return shaping.format_reward(inp.response_text, self.config)


@dataclasses.dataclass(frozen=True)
class ToolUseReward:
  """`shaping.tool_use_reward` of the trajectory's tool-call counts: pays the distinct valid
  calls that succeeded (`RewardInput.num_distinct_ok_tool_calls`)."""

  config: shaping.ToolShapingConfig = shaping.ToolShapingConfig()

  def __post_init__(self):
    _check_config("ToolUseReward", self.config, shaping.ToolShapingConfig)

  def __call__(self, inp: RewardInput) -> float:
    return shaping.tool_use_reward(inp.num_tool_calls, inp.num_valid_tool_calls, inp.num_tool_errors,
                                   self.config, num_repeated=inp.num_repeated_tool_calls,
                                   num_distinct_ok=inp.num_distinct_ok_tool_calls)


@dataclasses.dataclass(frozen=True)
class LinearLengthReward:
  """`shaping.linear_length_penalty` of `RewardInput.num_response_tokens` (policy tokens only).

  A penalty (values <= 0): its `Component` takes a positive weight, and refuses a negative one.
  """

  config: shaping.LinearLengthConfig
  is_penalty: ClassVar[bool] = True

  def __post_init__(self):
    _check_config("LinearLengthReward", self.config, shaping.LinearLengthConfig)

  def __call__(self, inp: RewardInput) -> float:
    return shaping.linear_length_penalty(inp.num_response_tokens, self.config)


@dataclasses.dataclass(frozen=True)
class OverlongReward:
  """DAPO overlong shaping (`shaping.overlong_penalty`) of `RewardInput.num_response_tokens`
  (the policy's tokens over all turns; observations and prompt excluded).

  A penalty (values in [-1, 0]): its `Component` takes a positive weight, and refuses a
  negative one.
  """

  config: shaping.OverlongConfig
  is_penalty: ClassVar[bool] = True

  def __post_init__(self):
    _check_config("OverlongReward", self.config, shaping.OverlongConfig)

  def __call__(self, inp: RewardInput) -> float:
    return shaping.overlong_penalty(inp.num_response_tokens, self.config)
