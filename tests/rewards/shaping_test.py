"""Tests for jaxagent/rewards/shaping.py: format protocol, capped tool shaping, length / DAPO overlong."""
import math
import time

import numpy as np
import pytest

from jaxagent.rewards.shaping import (
    FormatCheck,
    FormatConfig,
    LinearLengthConfig,
    OverlongConfig,
    ToolShapingConfig,
    check_format,
    format_reward,
    linear_length_penalty,
    overlong_penalty,
    tool_use_reward,
)

# --- format ---------------------------------------------------------------------------------------

GOOD = "<think>2 + 2 = 4</think>\n<answer>4</answer>"


@pytest.mark.parametrize("text", [
    GOOD,
    GOOD + "\n\n",
    GOOD + "<|im_end|>",
    GOOD + " <|endoftext|>\n</s>",
    "<answer>4</answer>",  # think is allowed, not required
    "<think>compare x < y and y > z</think><answer>4</answer>",  # bare angle brackets are text
])
def test_format_accepts(text):
  assert format_reward(text) == 1.0


@pytest.mark.parametrize("text,failed", [
    ("<think>2 + 2 = 4</think>", "one_answer"),  # no answer
    ("The answer is 4.", "one_answer"),
    (GOOD + "<answer>5</answer>", "one_answer"),  # two answers
    ("<think>x</think><answer>  </answer>", "one_answer"),  # empty answer
    (GOOD + " Hope this helps!", "answer_last"),  # text after the answer
    ("<answer>4</answer><think>more</think>", "answer_last"),
    ("<think>unclosed <answer>4</answer>", "tags_ok"),
    ("<think>x<answer>4</think></answer>", "tags_ok"),  # crossing blocks
    ("<think>x</think></think><answer>4</answer>", "tags_ok"),  # stray close
    ("<reasoning>x</reasoning><answer>4</answer>", "tags_ok"),  # unknown tag
])
def test_format_rejects(text, failed):
  check = check_format(text)
  assert not getattr(check, failed), check
  assert format_reward(text) == 0.0


def test_format_nesting():
  nested = "<think>plan <search>q</search></think><answer>4</answer>"
  strict = FormatConfig(allowed_tags=("think", "search", "answer"))
  assert format_reward(nested, strict) == 0.0
  assert not check_format(nested, strict).tags_ok
  loose = FormatConfig(allowed_tags=("think", "search", "answer"), allow_nesting=True)
  assert format_reward(nested, loose) == 1.0
  # Even with nesting allowed, an answer inside think is not final.
  assert format_reward("<think><answer>4</answer></think>", loose) == 0.0


def test_format_unknown_tags_can_be_tolerated():
  text = "<reasoning>x</reasoning><answer>4</answer>"
  assert format_reward(text, FormatConfig(allow_unknown_tags=True)) == 1.0


def test_format_required_tags():
  config = FormatConfig(required_tags=("think",))
  assert format_reward(GOOD, config) == 1.0
  assert format_reward("<answer>4</answer>", config) == 0.0
  assert check_format("<answer>4</answer>", config) == FormatCheck(True, True, True, False)


def test_format_opaque_tags_hide_observation_markup():
  text = ("<search>capital of France</search><information><b>Paris</b> is <answer>not this</answer>"
          "</information><answer>Paris</answer>")
  config = FormatConfig(allowed_tags=("think", "search", "information", "answer"), opaque_tags=("information",))
  assert format_reward(text, config) == 1.0
  not_opaque = FormatConfig(allowed_tags=("think", "search", "information", "answer"))
  assert format_reward(text, not_opaque) == 0.0
  assert format_reward("<information>never closed <answer>x</answer>", config) == 0.0


def test_format_partial_credit():
  partial = FormatConfig(partial_credit=True)
  assert format_reward(GOOD, partial) == 1.0
  # Only answer_last fails: 2 of 3 checks.
  assert format_reward(GOOD + " trailing", partial) == pytest.approx(2 / 3)
  # No answer: one_answer and answer_last fail; tags fine: 1 of 3.
  assert format_reward("<think>x</think>", partial) == pytest.approx(1 / 3)
  # With a required tag there are 4 checks; missing think only: 3 of 4.
  required = FormatConfig(partial_credit=True, required_tags=("think",))
  assert format_reward("<answer>4</answer>", required) == pytest.approx(3 / 4)


@pytest.mark.parametrize("kwargs,match", [
    ({"answer_tag": "final"}, "answer_tag"),
    ({"required_tags": ("plan",)}, "required_tags"),
    ({"opaque_tags": ("obs",)}, "opaque_tags"),
    ({"allowed_tags": "answer"}, "allowed_tags"),
    ({"allowed_tags": ("answer", "<think>")}, "allowed_tags"),
    ({"opaque_tags": ("answer",)}, "opaque"),
    ({"eos_markers": ("",)}, "eos_markers"),
])
def test_format_config_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    FormatConfig(**kwargs)


def test_format_check_is_linear_in_stray_closing_tags():
  # A degenerate policy repeating one tag: each stray close used to rescan every open block
  # (quadratic: about 12 s at 20000 of each here); the result is unchanged.
  n = 20000
  for text in ("<think>" * n + "</answer>" * n, "<think>" * n + "</search>" * n + "<answer>4</answer>"):
    for config in (FormatConfig(), FormatConfig(allowed_tags=("think", "search", "answer"), allow_nesting=True)):
      start = time.perf_counter()
      check = check_format(text, config)
      assert time.perf_counter() - start < 1.5
      assert not check.tags_ok and format_reward(text, config) == 0.0
  crossing = FormatConfig(allowed_tags=("think", "search", "answer"), allow_nesting=True)
  # A close of an outer block closes the blocks opened inside it; a close of nothing open is ignored.
  assert check_format("<think><search>q</think></search><answer>4</answer>", crossing) == FormatCheck(
      False, True, True, True)


THINKING = FormatConfig(allowed_tags=("code", "answer"), opaque_tags=("code",), think_tag="think")


@pytest.mark.parametrize("text", [
    "<think>\nSo 3 + 4 = 7.\n\nChecking: 7.\n</think>\n\n<answer>7</answer>",
    "<think></think><answer>7</answer>",  # a reasoning model with thinking switched off
    "  \n<think>\n\n</think>\n\n<answer>7</answer><|im_end|>",
    "<think>a</think><code>print(3 + 4)</code>\n<think>b</think>\n<answer>7</answer>",  # per turn
    "<think>I could write <code> or <answer>6</answer>, or compare x < y</think><answer>7</answer>",
    "<answer>7</answer>",  # the block is allowed, not required
])
def test_format_think_tag_accepts_a_block_that_opens_a_turn(text):
  """A Qwen3-style reasoning model opens its turn with <think>...</think>: with "think" not an
  allowed tag the format scored 0 however well the rest was formed."""
  assert check_format(text, THINKING) == FormatCheck(True, True, True, True)
  assert format_reward(text, THINKING) == 1.0


@pytest.mark.parametrize("text,failed", [
    ("<think>7 is the sum<answer>7</answer>", "tags_ok"),  # never closed
    ("<think>7 is the sum", "tags_ok"),
    ("Let me think. <think>x</think><answer>7</answer>", "tags_ok"),  # text before it
    ("<code>print(7)</code> so <think>x</think><answer>7</answer>", "tags_ok"),
    ("<think>x</think></think><answer>7</answer>", "tags_ok"),  # a stray close
    ("<answer>7</answer><think>x</think>", "answer_last"),
    ("<think><answer>7</answer></think>", "one_answer"),  # an answer while thinking is no answer
])
def test_format_think_tag_rejects(text, failed):
  check = check_format(text, THINKING)
  assert not getattr(check, failed), check
  assert format_reward(text, THINKING) == 0.0


def test_format_think_tag_validation_and_default():
  assert FormatConfig().think_tag is None
  with pytest.raises(ValueError, match="think_tag 'think' is also in allowed_tags"):
    FormatConfig(think_tag="think")
  with pytest.raises(ValueError, match="think_tag must be a bare tag name"):
    FormatConfig(allowed_tags=("answer",), think_tag="<think>")


def test_format_config_is_hashable_with_list_inputs():
  config = FormatConfig(allowed_tags=["think", "answer"])
  assert config.allowed_tags == ("think", "answer")
  hash(config)


# --- tool use -------------------------------------------------------------------------------------


def test_tool_use_reward_is_capped():
  config = ToolShapingConfig(reward_per_valid_call=0.1, max_reward=0.3)
  assert tool_use_reward(0, 0, 0, config) == 0.0
  assert tool_use_reward(3, 2, 1, config) == pytest.approx(0.2)  # no error penalty configured
  assert tool_use_reward(3, 3, 0, config) == pytest.approx(0.3)
  assert tool_use_reward(10, 10, 0, config) == pytest.approx(0.3)


def test_tool_use_error_penalty_and_its_cap():
  config = ToolShapingConfig(reward_per_valid_call=0.1, max_reward=0.3, penalty_per_error=0.05, max_penalty=0.1)
  assert tool_use_reward(2, 2, 0, config) == pytest.approx(0.2)
  assert tool_use_reward(2, 1, 1, config) == pytest.approx(0.1 - 0.05)
  assert tool_use_reward(6, 1, 5, config) == pytest.approx(0.1 - 0.1)
  uncapped = ToolShapingConfig(reward_per_valid_call=0.0, max_reward=0.0, penalty_per_error=0.25)
  assert tool_use_reward(8, 0, 8, uncapped) == pytest.approx(-2.0)


def test_a_repeated_call_earns_no_bonus_unless_asked():
  """The same call five times earned the whole cap, as five different calls did."""
  config = ToolShapingConfig(reward_per_valid_call=0.1, max_reward=0.5)
  assert tool_use_reward(5, 5, 0, config, num_repeated=4) == pytest.approx(0.1)
  assert tool_use_reward(5, 5, 0, config) == pytest.approx(0.5)
  # A failed first try and its repeat that ran: one distinct call ran.
  assert tool_use_reward(2, 2, 1, config, num_repeated=1) == pytest.approx(0.1)
  # A call that ran and its repeat that failed: still one.
  assert tool_use_reward(3, 3, 1, config, num_repeated=1) == pytest.approx(0.2)
  paid = ToolShapingConfig(reward_per_valid_call=0.1, max_reward=0.5, reward_repeated_calls=True)
  assert tool_use_reward(5, 5, 0, paid, num_repeated=4) == pytest.approx(0.5)
  with pytest.raises(ValueError, match="num_repeated=3 must be <= num_valid=2"):
    tool_use_reward(4, 2, 0, config, num_repeated=3)
  with pytest.raises(ValueError, match="num_repeated must be an int >= 0"):
    tool_use_reward(4, 2, 0, config, num_repeated=-1)
  with pytest.raises(ValueError, match="reward_repeated_calls must be a bool"):
    ToolShapingConfig(reward_repeated_calls=1)


def test_a_valid_call_that_failed_earns_no_bonus():
  """The rollout counts a well-formed call whose tool then failed (NameError, 1/0, a timeout) as
  valid and as an error; five such calls earned the full bonus, as five that ran."""
  config = ToolShapingConfig(reward_per_valid_call=0.1, max_reward=0.5)
  assert tool_use_reward(5, 5, 5, config) == 0.0
  assert tool_use_reward(5, 5, 0, config) == pytest.approx(0.5)
  assert tool_use_reward(5, 5, 3, config) == pytest.approx(0.2)  # two ran
  assert tool_use_reward(6, 4, 3, config) == pytest.approx(0.3)  # two invalid, one valid failed
  penalised = ToolShapingConfig(reward_per_valid_call=0.1, max_reward=0.5, penalty_per_error=0.05)
  assert tool_use_reward(2, 2, 1, penalised) == pytest.approx(0.1 - 0.05)


def test_the_exact_count_of_distinct_successful_calls_is_paid():
  """Calls A (ran), A again (ran, a repeat), B (valid, the tool raised): one distinct call ran,
  but the counts alone paid two (min(valid - repeated, calls - errors) = min(2, 2))."""
  config = ToolShapingConfig(reward_per_valid_call=0.1, max_reward=0.5)
  assert tool_use_reward(3, 3, 1, config, num_repeated=1, num_distinct_ok=1) == pytest.approx(0.1)
  assert tool_use_reward(3, 3, 1, config, num_repeated=1) == pytest.approx(0.2)  # the bound
  # A (failed), A again (ran), B (ran): two distinct calls ran; the bound says two as well.
  assert tool_use_reward(3, 3, 1, config, num_repeated=1, num_distinct_ok=2) == pytest.approx(0.2)
  assert tool_use_reward(0, 0, 0, config, num_distinct_ok=0) == 0.0
  # Paying repeats too counts every valid call that ran, whatever the distinct count.
  paid = ToolShapingConfig(reward_per_valid_call=0.1, max_reward=0.5, reward_repeated_calls=True)
  assert tool_use_reward(3, 3, 1, paid, num_repeated=1, num_distinct_ok=1) == pytest.approx(0.2)
  # Out of range for the other counts: more than the distinct valid calls, more than the calls
  # that ran, fewer than the calls that ran less the repeats.
  for counts, distinct, low, high in (((3, 3, 0, 1), 3, 2, 2), ((3, 3, 2, 0), 2, 1, 1),
                                      ((4, 4, 0, 1), 2, 3, 3)):
    with pytest.raises(ValueError, match=rf"num_distinct_ok={distinct} must be between {low} and {high}"):
      tool_use_reward(*counts[:3], config, num_repeated=counts[3], num_distinct_ok=distinct)
  with pytest.raises(ValueError, match="num_distinct_ok must be an int >= 0"):
    tool_use_reward(1, 1, 0, config, num_distinct_ok=1.0)


@pytest.mark.parametrize("counts,match", [((1, 2, 0), "disagree"), ((1, 0, 2), "disagree"), ((-1, 0, 0), "num_calls"),
                                          ((1, 1.0, 0), "num_valid")])
def test_tool_use_rejects_bad_counts(counts, match):
  with pytest.raises(ValueError, match=match):
    tool_use_reward(*counts)


@pytest.mark.parametrize("kwargs,match", [({"reward_per_valid_call": -0.1}, "reward_per_valid_call"),
                                          ({"max_reward": float("nan")}, "max_reward"),
                                          ({"max_penalty": -1.0}, "max_penalty")])
def test_tool_config_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ToolShapingConfig(**kwargs)


# --- length -------------------------------------------------------------------------------------


def test_linear_length_penalty():
  config = LinearLengthConfig(max_tokens=100, free_tokens=20, coef=0.5)
  assert linear_length_penalty(0, config) == 0.0
  assert linear_length_penalty(20, config) == 0.0
  assert linear_length_penalty(60, config) == pytest.approx(-0.25)
  assert linear_length_penalty(100, config) == pytest.approx(-0.5)
  assert linear_length_penalty(150, config) == pytest.approx(-0.5)


def dapo_eq13_reference(lengths, l_max, l_cache):
  """DAPO eq. (13), vectorised with NumPy."""
  y = np.asarray(lengths, dtype=np.float64)
  return np.where(y <= l_max - l_cache, 0.0, np.where(y <= l_max, ((l_max - l_cache) - y) / l_cache, -1.0))


def test_overlong_boundaries():
  config = OverlongConfig(max_tokens=100, cache_tokens=20)
  assert overlong_penalty(0, config) == 0.0
  assert overlong_penalty(80, config) == 0.0  # exactly L_max - L_cache
  assert overlong_penalty(81, config) == pytest.approx(-1 / 20)
  assert overlong_penalty(90, config) == pytest.approx(-0.5)
  assert overlong_penalty(100, config) == -1.0  # exactly L_max
  assert overlong_penalty(101, config) == -1.0  # L_max + 1
  assert overlong_penalty(10**6, config) == -1.0


@pytest.mark.parametrize("l_max,l_cache", [(100, 20), (4096, 512), (7, 7), (5, 1)])
def test_overlong_matches_numpy_reference(l_max, l_cache):
  config = OverlongConfig(max_tokens=l_max, cache_tokens=l_cache)
  lengths = np.arange(0, l_max + 50)
  ours = np.array([overlong_penalty(int(n), config) for n in lengths])
  np.testing.assert_allclose(ours, dapo_eq13_reference(lengths, l_max, l_cache), rtol=0, atol=1e-12)
  assert np.all(np.diff(ours) <= 0)  # never rewards growing longer


@pytest.mark.parametrize("make,match", [
    (lambda: OverlongConfig(max_tokens=100, cache_tokens=0), "cache_tokens"),
    (lambda: OverlongConfig(max_tokens=100, cache_tokens=101), "cache_tokens"),
    (lambda: OverlongConfig(max_tokens=100.0, cache_tokens=10), "max_tokens"),
    (lambda: LinearLengthConfig(max_tokens=10, free_tokens=10), "free_tokens"),
    (lambda: LinearLengthConfig(max_tokens=10, coef=math.inf), "coef"),
])
def test_length_config_validation(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_length_rejects_negative_token_counts():
  with pytest.raises(ValueError, match="num_tokens"):
    overlong_penalty(-1, OverlongConfig(max_tokens=10, cache_tokens=2))
