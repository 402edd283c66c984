"""Tests for jaxagent/rewards/composite.py: weights, progressive schedule, failure handling, metrics."""
import dataclasses
import logging
import math

import pytest

from jaxagent.rewards.composite import (
    Component,
    CompositeReward,
    ProgressiveSchedule,
    RewardInput,
    mean_metrics,
)

INP = RewardInput(response_text="<answer>4</answer>", gold="4", num_response_tokens=12)


def const(value):
  return lambda inp: value


def boom(inp):
  raise RuntimeError("verifier crashed")


def test_weighted_total_and_components():
  reward = CompositeReward([
      Component("correct", const(1.0), weight=1.0, role="outcome"),
      Component("format", const(0.5), weight=0.2, role="shaping"),
      Component("length", lambda inp: -inp.num_response_tokens / 100, weight=2.0),
  ])
  out = reward(INP)
  assert out.total == pytest.approx(1.0 + 0.2 * 0.5 + 2.0 * -0.12)
  assert out.components == {"correct": 1.0, "format": 0.5, "length": -0.12}
  assert out.weights == {"correct": 1.0, "format": 0.2, "length": 2.0}
  assert out.errors == () and out.alpha == 1.0
  assert out.metrics() == {"reward/total": out.total, "reward/alpha": 1.0, "reward/correct": 1.0,
                           "reward/format": 0.5, "reward/length": -0.12}


def test_failing_component_scores_zero_and_is_counted(caplog):
  reward = CompositeReward([
      Component("correct", boom, weight=1.0),
      Component("nan", const(math.nan), weight=1.0),
      Component("text", const("1.0"), weight=1.0),  # not a number
      Component("format", const(1.0), weight=0.5),
  ])
  with caplog.at_level(logging.WARNING, logger="jaxagent.rewards.composite"):
    outs = [reward(INP) for _ in range(3)]
  for out in outs:
    assert out.total == pytest.approx(0.5)
    assert out.components == {"correct": 0.0, "nan": 0.0, "text": 0.0, "format": 1.0}
    assert out.errors == ("correct", "nan", "text")
  assert reward.error_counts() == {"correct": 3, "nan": 3, "text": 3, "format": 0}
  assert reward.num_errors == 9
  # Logged once per component, not once per failure.
  warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 3
  assert "verifier crashed" in caplog.text


def test_a_component_that_returns_a_bool_scores_it_as_one_or_zero():
  # `answer == gold` is a natural component; it scored 0 and counted as an error every time.
  import numpy as np
  r = CompositeReward([Component("right", lambda inp: inp.metadata["final_answer"] == inp.gold),
                       Component("np", lambda inp: np.asarray(inp.metadata["final_answer"]) == "4")])
  for answer, expected in (("4", 2.0), ("5", 0.0)):
    out = r(dataclasses.replace(INP, gold="4", metadata={"final_answer": answer}))
    assert (out.total, out.errors) == (expected, ()), out
  assert r.error_counts() == {"right": 0, "np": 0}


def test_total_that_overflows_is_data_not_a_crash():
  # A finite value that overflows once weighted made the total inf (which compute_advantages
  # refuses, ending the run); two whose sum overflows made math.fsum raise out of the call.
  weighted = CompositeReward([Component("dist", const(-1e308), weight=2.0), Component("format", const(1.0))])
  out = weighted(INP)
  assert out.total == 1.0 and out.components == {"dist": 0.0, "format": 1.0} and out.errors == ("dist",)
  summed = CompositeReward([Component("a", const(1e308)), Component("b", const(1e308)),
                            Component("zero", const(5.0), weight=0.0)])
  out = summed(INP)
  assert out.total == 0.0 and out.components == {"a": 0.0, "b": 0.0, "zero": 5.0}
  assert out.errors == ("a", "b") and summed.error_counts() == {"a": 1, "b": 1, "zero": 0}
  # Large values that fit stay as they are.
  assert CompositeReward([Component("a", const(1e308)), Component("b", const(-1e308))])(INP).total == 0.0
  assert CompositeReward([Component("a", const(1e307), weight=10.0)])(INP).total == pytest.approx(1e308)


def test_keyboard_interrupt_is_not_swallowed():
  def interrupt(inp):
    raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    CompositeReward([Component("x", interrupt)])(INP)


def test_linear_schedule():
  s = ProgressiveSchedule(num_steps=100, start=0.2, end=1.0)
  assert [s.alpha(t) for t in (0, 25, 50, 100, 1000)] == pytest.approx([0.2, 0.4, 0.6, 1.0, 1.0])


def test_cosine_schedule():
  s = ProgressiveSchedule(num_steps=100, start=0.0, end=0.8, kind="cosine")
  assert s.alpha(0) == 0.0
  assert s.alpha(50) == pytest.approx(0.4)
  assert s.alpha(25) == pytest.approx(0.8 * (1 - math.cos(math.pi / 4)) / 2)
  assert s.alpha(100) == pytest.approx(0.8) and s.alpha(500) == pytest.approx(0.8)
  decreasing = ProgressiveSchedule(num_steps=10, start=1.0, end=0.5, kind="cosine")
  values = [decreasing.alpha(t) for t in range(12)]
  assert values[0] == 1.0 and values[-1] == pytest.approx(0.5)
  assert all(a >= b for a, b in zip(values, values[1:]))


def test_schedule_moves_weight_from_shaping_to_outcome():
  reward = CompositeReward([
      Component("correct", const(1.0), weight=2.0, role="outcome"),
      Component("format", const(1.0), weight=0.5, role="shaping"),
      Component("tools", const(0.4), weight=1.0, role="shaping"),
      Component("overlong", const(-0.5), weight=1.0, role="fixed"),
  ], schedule=ProgressiveSchedule(num_steps=10, start=0.2, end=1.0))
  # step 0: alpha = 0.2
  out = reward(INP, step=0)
  assert out.alpha == pytest.approx(0.2)
  assert out.weights == pytest.approx({"correct": 0.4, "format": 0.4, "tools": 0.8, "overlong": 1.0})
  assert out.total == pytest.approx(0.4 * 1.0 + 0.4 * 1.0 + 0.8 * 0.4 - 0.5)
  # step 5: alpha = 0.6
  assert reward(INP, step=5).total == pytest.approx(1.2 + 0.2 + 0.4 * 0.4 - 0.5)
  # end: shaping gone, components still reported for logging
  end = reward(INP, step=10)
  assert end.weights["format"] == 0.0 and end.weights["tools"] == 0.0
  assert end.total == pytest.approx(2.0 - 0.5)
  assert end.components["format"] == 1.0


def test_schedule_with_nothing_to_hand_over_is_refused():
  """shaping_steps > 0 with every shaping weight 0 scored every trajectory 0 at step 0 (alpha =
  start = 0) and scaled the outcome down until num_steps, without a word."""
  schedule = ProgressiveSchedule(num_steps=20)
  zero = [Component("correct", const(1.0), 1.0, role="outcome"),
          Component("format", const(1.0), 0.0, role="shaping"),
          Component("tool_calls", const(1.0), 0.0, role="shaping")]
  with pytest.raises(ValueError, match=r"no shaping component has a non-zero weight \(shaping "
                     r"weights: \{'format': 0.0, 'tool_calls': 0.0\}\).*0 at step 0.*shaping_steps=0"):
    CompositeReward(zero, schedule=schedule)
  with pytest.raises(ValueError, match=r"shaping weights: none"):
    CompositeReward([zero[0], Component("len", const(-1.0), role="fixed")], schedule=schedule)
  assert CompositeReward(zero).weights(0) == {"correct": 1.0, "format": 0.0, "tool_calls": 0.0}
  one = [zero[0], Component("format", const(1.0), 0.1, role="shaping"), zero[2]]
  assert CompositeReward(one, schedule=schedule)(INP, step=0).total == pytest.approx(0.1)


def test_a_scheduled_composite_needs_the_step():
  """Called without the step, a composite with a schedule scored every trajectory at step 0:
  the schedule never moved, and the run never learned from the outcome's full weight."""
  one = [Component("correct", const(1.0), 1.0, role="outcome"),
         Component("format", const(1.0), 0.1, role="shaping")]
  scheduled = CompositeReward(one, schedule=ProgressiveSchedule(num_steps=20))
  with pytest.raises(TypeError, match=r"has a ProgressiveSchedule, so it needs the training step: "
                                      r"call it as reward\(inp, step=step\)"):
    scheduled(INP)
  with pytest.raises(TypeError, match="needs the training step"):
    scheduled.score_batch([INP])
  assert scheduled(INP, step=20).total == pytest.approx(1.0)
  assert CompositeReward(one)(INP).total == pytest.approx(1.1)  # no schedule: no step needed


def test_score_batch_and_mean_metrics():
  flaky_calls = iter([1.0, RuntimeError("x"), 0.0, 1.0])

  def flaky(inp):
    v = next(flaky_calls)
    if isinstance(v, Exception):
      raise v
    return v

  reward = CompositeReward([Component("correct", flaky, role="outcome"), Component("format", const(0.5), 2.0)])
  outs = reward.score_batch([INP] * 4, step=3)
  metrics = mean_metrics(outs)
  assert metrics["reward/correct"] == pytest.approx(0.5)  # (1 + 0 + 0 + 1) / 4
  assert metrics["reward/format"] == pytest.approx(0.5)
  assert metrics["reward/total"] == pytest.approx(0.5 + 1.0)
  assert metrics["reward/errors/correct"] == pytest.approx(0.25)
  assert metrics["reward/errors/format"] == 0.0
  assert metrics["reward/alpha"] == 1.0
  assert mean_metrics([]) == {}


def test_component_past_its_timeout_scores_zero_and_is_counted():
  """A hanging user reward used to block the trainer forever; with `timeout_s` it is a failure
  like a raise (0.0, counted), and the other components still score."""
  import threading
  import time

  release = threading.Event()
  reward = CompositeReward([
      Component("hangs", lambda inp: release.wait(60) and 1.0, timeout_s=0.2),
      Component("fast", const(0.5), timeout_s=5.0),
      Component("raises", boom, timeout_s=5.0),
      Component("plain", const(1.0)),
  ])
  t0 = time.monotonic()
  out = reward(INP)
  assert time.monotonic() - t0 < 5
  release.set()
  assert out.components == {"hangs": 0.0, "fast": 0.5, "raises": 0.0, "plain": 1.0}
  assert out.errors == ("hangs", "raises") and out.total == pytest.approx(1.5)
  assert reward.error_counts() == {"hangs": 1, "fast": 0, "raises": 1, "plain": 0}


def test_reward_input_is_frozen():
  with pytest.raises(dataclasses.FrozenInstanceError):
    INP.gold = "5"


@pytest.mark.parametrize("make,match", [
    (lambda: Component("reward/x", const(1.0)), "name"),
    (lambda: Component("total", const(1.0)), "reserved"),
    # The trainer logs the batch's reward/mean and reward/std; a component's mean must not replace them.
    (lambda: Component("mean", const(1.0)), "reserved"),
    (lambda: Component("std", const(1.0)), "reserved"),
    (lambda: Component("x", "not callable"), "callable"),
    (lambda: Component("x", const(1.0), weight=math.inf), "weight"),
    (lambda: Component("x", const(1.0), role="bonus"), "role"),
    (lambda: Component("x", const(1.0), timeout_s=0), "timeout_s"),
    (lambda: Component("x", const(1.0), timeout_s=math.nan), "timeout_s"),
    (lambda: CompositeReward([]), "at least one"),
    (lambda: CompositeReward([Component("x", const(1.0)), Component("x", const(2.0))]), "unique"),
    (lambda: CompositeReward([Component("x", const(1.0), role="shaping")], schedule=ProgressiveSchedule(10)),
     "outcome"),
    # The schedule moved weight onto an outcome of weight 0: at its end every total was 0.
    (lambda: CompositeReward([Component("c", const(1.0), weight=0.0, role="outcome"),
                              Component("f", const(1.0), weight=0.5, role="shaping")],
                             schedule=ProgressiveSchedule(10)),
     r"every outcome component has weight 0 \(outcome weights: \{'c': 0.0\}\)"),
    (lambda: ProgressiveSchedule(num_steps=0), "num_steps"),
    (lambda: ProgressiveSchedule(num_steps=10, start=-0.1), "start"),
    (lambda: ProgressiveSchedule(num_steps=10, end=1.5), "end"),
    (lambda: ProgressiveSchedule(num_steps=10, kind="exp"), "kind"),
])
def test_validation(make, match):
  with pytest.raises(ValueError, match=match):
    make()


async def averify(inp):
  return 1.0


class AsyncVerifier:
  async def __call__(self, inp):
    return 1.0


def test_a_component_whose_fn_cannot_score_a_reward_input_is_refused():
  """Each of these failed on every call, so the term scored 0.0 for the whole run (logged once);
  the negative weight on a penalty made an overlong response score more."""
  from jaxagent.rewards import (OverlongConfig, OverlongReward, TextMatchReward, exact_match,
                                format_reward, tool_use_reward)
  for fn, match in [
      (TextMatchReward, r"fn is the class TextMatchReward, not a reward; pass an instance, TextMatchReward\(...\)"),
      (format_reward, r"shaping.format_reward, which scores text or counts, not a RewardInput; use "
                      r"jaxagent.rewards.FormatReward\(FormatConfig\(...\)\)"),
      (exact_match, r'use jaxagent.rewards.TextMatchReward\("exact_match"\)'),
      (tool_use_reward, r"use jaxagent.rewards.ToolUseReward"),
      (lambda: 1.0, r"fn must take one argument, the RewardInput, but its signature is \(\)"),
      (lambda inp, gold: 1.0, r"signature is \(inp, gold\)"),
      (averify, r"fn is an async function; the composite calls it on a host thread and does not await it"),
      (AsyncVerifier(), r"fn is an async function"),
  ]:
    with pytest.raises(ValueError, match=match):
      Component("x", fn)
  penalty = OverlongReward(OverlongConfig(max_tokens=8, cache_tokens=4))
  with pytest.raises(ValueError, match=r"'overlong': OverlongReward is a penalty already .* weight=-1.0 "
                                       r"would turn it into a bonus"):
    Component("overlong", penalty, weight=-1.0)
  reward = CompositeReward([Component("overlong", penalty, weight=1.0)])
  assert reward(INP).total == -1.0  # 12 tokens, over the 8 allowed
  # What still passes: one-argument callables, extra arguments with defaults, builtins.
  for fn in (const(1.0), lambda inp, scale=2.0: scale, print):
    Component("x", fn)


@pytest.mark.parametrize("fields,error,match", [
    ({"response_text": None}, TypeError, "response_text must be a str"),
    ({"response_text": b"<answer>4</answer>"}, TypeError, "response_text must be a str"),
    ({"num_response_tokens": -1}, ValueError, "num_response_tokens must be an int >= 0, got -1"),
    ({"num_response_tokens": 12.0}, ValueError, "num_response_tokens must be an int >= 0"),
    ({"num_tool_calls": True}, ValueError, "num_tool_calls must be an int >= 0, got True"),
    ({"num_distinct_ok_tool_calls": -1}, ValueError, "num_distinct_ok_tool_calls must be an int >= 0"),
    ({"truncated": "no"}, TypeError, "truncated must be a bool"),
    ({"metadata": None}, TypeError, "metadata must be a mapping"),
])
def test_reward_input_names_a_field_of_the_wrong_kind(fields, error, match):
  # Each of these failed every component reading it, on every trajectory: scored 0.0, logged once.
  with pytest.raises(error, match=match):
    dataclasses.replace(INP, **fields)


def test_composite_refuses_what_is_not_a_reward_input():
  reward = CompositeReward([Component("c", const(1.0))])
  with pytest.raises(TypeError, match=r"scores a RewardInput, got dict; build one with Trajectory.to_reward_input"):
    reward({"response_text": "<answer>4</answer>"})
  assert reward(dataclasses.replace(INP, num_distinct_ok_tool_calls=None, truncated=True)).total == 1.0


def test_rejects_non_component():
  with pytest.raises(TypeError, match="Component"):
    CompositeReward([const(1.0)])


def test_mean_alpha_leaves_out_outputs_whose_env_reward_raised():
  from jaxagent.rewards import ENV_REWARD_ERROR, RewardOutput, mean_metrics
  ran = [RewardOutput(1.0, {"c": 1.0}, {"c": 1.0}, alpha=0.25) for _ in range(3)]
  failed = RewardOutput(0.0, {}, {}, errors=(ENV_REWARD_ERROR,))  # the trainer's stand-in
  m = mean_metrics([*ran, failed])
  assert m["reward/alpha"] == pytest.approx(0.25)
  assert m["reward/total"] == pytest.approx(0.75) and m["reward/c"] == pytest.approx(0.75)
  assert mean_metrics([failed])["reward/alpha"] == 1.0
