"""Tests for jaxagent/rewards/components.py: each component read off a RewardInput, and a full composite."""
import dataclasses

import pytest

from jaxagent.rewards.components import (
    TESTS_PASSED_KEY,
    TESTS_TOTAL_KEY,
    FormatReward,
    LinearLengthReward,
    MathAnswerReward,
    OverlongReward,
    TextMatchReward,
    ToolUseReward,
    UnitTestReward,
)
from jaxagent.rewards.composite import Component, CompositeReward, ProgressiveSchedule, RewardInput
from jaxagent.rewards.math_verifier import MathVerifier, MathVerifyConfig
from jaxagent.rewards.shaping import FormatConfig, LinearLengthConfig, OverlongConfig, ToolShapingConfig


@pytest.fixture(scope="module")
def verifier():
  with MathVerifier(MathVerifyConfig(backend="thread")) as v:
    yield v


def test_math_answer_reward(verifier):
  math = MathAnswerReward(verifier=verifier)
  assert math(RewardInput("<think>1/2</think><answer>\\frac{1}{2}</answer>", gold="0.5")) == 1.0
  assert math(RewardInput("<answer>0.4</answer>", gold="0.5")) == 0.0
  assert math(RewardInput("so the answer is \\boxed{1,000}", gold="1000")) == 1.0
  assert math(RewardInput("I think it is 0.5", gold="0.5")) == 0.0  # no extractable answer
  assert math(RewardInput("<answer>3</answer>", gold=["2", "3"])) == 1.0
  # A box whose argument goes without braces is read as math_equal reads it (it scored 0).
  untagged = MathAnswerReward(tag=None, verifier=verifier)
  assert untagged(RewardInput("So the answer is \\boxed5.", gold="5")) == 1.0
  assert untagged(RewardInput("\\boxed B", gold="B")) == 1.0
  assert untagged(RewardInput("\\boxed5 6", gold="6")) == 0.0
  assert math(RewardInput("<answer>`5`</answer>", gold="5")) == 1.0  # markdown (scored 0)
  assert math(RewardInput("<answer>**7**</answer>", gold="7")) == 1.0
  with pytest.raises(ValueError, match="gold"):
    math(RewardInput("<answer>3</answer>"))


def test_math_answer_reward_validation():
  with pytest.raises(ValueError, match="timeout_s"):
    MathAnswerReward(timeout_s=0)
  with pytest.raises(ValueError, match="tag"):
    MathAnswerReward(tag="<answer>")
  # A config in place of the verifier scored every answer 0.0 (AttributeError on each call).
  with pytest.raises(ValueError, match=r"verifier must be a MathVerifier or None .* got MathVerifyConfig.*"
                                       r"MathVerifier\(MathVerifyConfig\(...\)\)"):
    MathAnswerReward(verifier=MathVerifyConfig(backend="thread"))


def test_text_match_reward():
  inp = RewardInput("<search>q</search><answer>The Eiffel Tower, Paris</answer>", gold=["eiffel tower", "x"])
  assert TextMatchReward("exact_match")(inp) == 0.0
  assert TextMatchReward("f1")(inp) == pytest.approx(0.8)  # [eiffel, tower, paris] vs [eiffel, tower]
  assert TextMatchReward("substring_exact_match")(inp) == 1.0
  assert TextMatchReward("exact_match")(RewardInput("no answer", gold="x")) == 0.0
  with pytest.raises(ValueError, match="metric"):
    TextMatchReward("bleu")


def test_answer_rewards_without_fallback_read_only_the_tag():
  # A box or a '####' guess outside the answer tag (in a thought, in a tool call), with no answer
  # given, is no answer to the rollout's parser; with fallback=False it scores 0 too.
  for text in ("<think>It is \\boxed{42}.</think>", "<calc>\\boxed{42}</calc>", "#### 42"):
    inp = RewardInput(text, gold="42")
    assert TextMatchReward("numeric_match")(inp) == MathAnswerReward()(inp) == 1.0, text
    assert TextMatchReward("numeric_match", fallback=False)(inp) == 0.0, text
    assert MathAnswerReward(fallback=False)(inp) == 0.0, text
  inp = RewardInput("\\boxed{7} <answer>42</answer>", gold="42")
  assert TextMatchReward("numeric_match", fallback=False)(inp) == MathAnswerReward(fallback=False)(inp) == 1.0
  for cls in (TextMatchReward, MathAnswerReward):
    with pytest.raises(ValueError, match="fallback=False reads only the answer tag's block"):
      cls(tag=None, fallback=False)
    with pytest.raises(ValueError, match="fallback must be a bool"):
      cls(fallback="no")


@pytest.mark.parametrize("gold", [42, 4.2, [42], b"42", {"answer": "42"}])
def test_golds_that_are_not_text_are_a_clear_error(gold):
  # A mapping's keys were read as the golds ("answer" scored 1 against {"answer": "42"}); an int
  # failed with "'int' object is not iterable".
  inp = RewardInput("<answer>answer</answer>", gold=gold)
  for component in (TextMatchReward("exact_match"), MathAnswerReward()):
    with pytest.raises(TypeError, match=r"RewardInput\.gold must be a str or a sequence of str"):
      component(inp)


def test_golds_may_be_any_sequence_of_str():
  np = pytest.importorskip("numpy")
  for gold in ("42", ["41", "42"], ("42",), np.array(["41", "42"])):
    assert TextMatchReward("numeric_match")(RewardInput("<answer>42</answer>", gold=gold)) == 1.0


def test_unit_test_reward_reads_metadata():
  inp = RewardInput("def f(): ...", metadata={TESTS_PASSED_KEY: 3, TESTS_TOTAL_KEY: 4})
  assert UnitTestReward()(inp) == 0.75
  assert UnitTestReward(all_or_nothing=True)(inp) == 0.0
  with pytest.raises(KeyError, match=TESTS_TOTAL_KEY):
    UnitTestReward()(RewardInput("x", metadata={TESTS_PASSED_KEY: 1}))


def test_shaping_components_read_their_fields():
  inp = RewardInput("<answer>4</answer>", num_response_tokens=90, num_tool_calls=4, num_valid_tool_calls=3,
                    num_tool_errors=1)
  assert FormatReward()(inp) == 1.0
  assert FormatReward(FormatConfig(required_tags=("think",)))(inp) == 0.0
  assert ToolUseReward(ToolShapingConfig(0.1, 0.25, penalty_per_error=0.1))(inp) == pytest.approx(0.25 - 0.1)
  # A call, its repeat and a valid call that failed: the exact count (one ran) is paid, not the
  # bound from the counts (two).
  calls = RewardInput("x", num_tool_calls=3, num_valid_tool_calls=3, num_tool_errors=1,
                      num_repeated_tool_calls=1)
  assert ToolUseReward()(calls) == pytest.approx(0.2)
  assert ToolUseReward()(dataclasses.replace(calls, num_distinct_ok_tool_calls=1)) == pytest.approx(0.1)
  assert LinearLengthReward(LinearLengthConfig(max_tokens=100, free_tokens=50))(inp) == pytest.approx(-0.8)
  assert OverlongReward(OverlongConfig(max_tokens=100, cache_tokens=20))(inp) == pytest.approx(-0.5)


def test_math_task_composite_end_to_end(verifier):
  reward = CompositeReward([
      Component("correct", MathAnswerReward(verifier=verifier), 1.0, role="outcome"),
      Component("format", FormatReward(FormatConfig(required_tags=("think",))), 0.5, role="shaping"),
      Component("tool_calls", ToolUseReward(ToolShapingConfig(0.1, 0.2)), 1.0, role="shaping"),
      Component("overlong", OverlongReward(OverlongConfig(max_tokens=100, cache_tokens=20)), 1.0, role="fixed"),
  ], schedule=ProgressiveSchedule(num_steps=100, start=0.5, end=1.0))
  right = RewardInput("<think>use calc</think><answer>\\frac{3}{4}</answer>", gold="0.75",
                      num_response_tokens=85, num_tool_calls=3, num_valid_tool_calls=3)
  wrong_no_gold = RewardInput("<think>x</think><answer>1</answer>", gold=None, num_response_tokens=10)

  out = reward(right, step=50)  # alpha = 0.75
  assert out.components == pytest.approx({"correct": 1.0, "format": 1.0, "tool_calls": 0.2, "overlong": -0.25})
  assert out.total == pytest.approx(0.75 * 1.0 + 0.25 * 0.5 * 1.0 + 0.25 * 0.2 - 0.25)

  out = reward(wrong_no_gold, step=0)  # outcome cannot be scored: counted, not raised
  assert out.errors == ("correct",)
  assert out.total == pytest.approx(0.5 * 0.5 * 1.0)
  assert reward.error_counts()["correct"] == 1


@pytest.mark.parametrize("make,message", [
    (lambda: FormatReward({"answer_tag": "answer"}), r"FormatReward\.config must be a shaping\.FormatConfig, got dict"),
    (lambda: ToolUseReward({"max_reward": 0.5}), r"ToolUseReward\.config must be a shaping\.ToolShapingConfig"),
    (lambda: LinearLengthReward(512), r"LinearLengthReward\.config must be a shaping\.LinearLengthConfig, got int"),
    (lambda: OverlongReward(OverlongConfig), r"OverlongReward\.config must be a shaping\.OverlongConfig, got type"),
    (lambda: UnitTestReward(all_or_nothing="no"), r"UnitTestReward\.all_or_nothing must be a bool, got 'no'"),
    (lambda: UnitTestReward(passed_key=None), r"UnitTestReward\.passed_key must be a str"),
])
def test_components_refuse_malformed_settings_when_built(make, message):
  """A config that was not its shaping dataclass failed each call instead (scored 0.0 for every
  trajectory, logged once), and all_or_nothing="no" scored all-or-nothing."""
  with pytest.raises(ValueError, match=message):
    make()
