"""Weighted sum of named reward components, with an optional progressive-shaping schedule.

The trainer builds one `RewardInput` per finished trajectory, calls a `CompositeReward` with the
current step, feeds `RewardOutput.total` to `rl/advantages.py`, and logs every component as
`reward/<name>` (`RewardOutput.metrics`, `mean_metrics`).

A component is any callable `RewardInput -> float` (see `components.py` for the verifiers and
shaping terms wrapped this way); a bool it returns counts as 1.0 or 0.0 (a check such as
`lambda inp: inp.metadata["final_answer"] == inp.gold`). Each has a role:

* "outcome": whether the answer is right (math equivalence, EM, unit tests);
* "shaping": step-level signals (format, valid tool calls) that help early and should fade;
* "fixed": terms the schedule leaves alone (length / overlong penalties).

With a `ProgressiveSchedule`, outcome weights are multiplied by alpha(step) and shaping weights
by 1 - alpha(step), so weight moves from shaping to outcome as alpha goes from `start` to `end`.

A component that raises or returns a non-finite value (or one that is non-finite once weighted,
or a sum of weighted values that overflows) scores 0.0 for that trajectory; the failure
is counted per component (`error_counts`) and logged once, and training goes on. A component
that might hang (a user's verifier calling out to a service, say) can be given a time limit,
`Component.timeout_s`: its call then runs on a daemon thread, and past the limit it scores 0.0
and counts as a failure. Python cannot stop that thread; it runs on until the call returns.
The verifiers shipped here bound their own time (math-verify in worker processes, unit tests in
the sandbox) and need no limit.

What could never score is refused when it is built, not counted as a failure on every
trajectory: a `Component` whose fn is a class, a text or count function (`format_reward`,
`exact_match`), async, or does not take one argument, or a penalty (`is_penalty`) with a
negative weight; a schedule with no outcome or shaping weight to move; a composite with a
schedule called without the step, or called on anything but a `RewardInput`.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import numbers
import re
import threading
from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np

logger = logging.getLogger(__name__)

Role = Literal["outcome", "shaping", "fixed"]
_ROLES = ("outcome", "shaping", "fixed")
ScheduleKind = Literal["linear", "cosine"]
_SCHEDULE_KINDS = ("linear", "cosine")
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
# `reward/<name>` of these is already taken: by `RewardOutput.metrics` / `mean_metrics` (total,
# alpha, errors/<name>) and by the trainer's batch mean and std of the totals (mean, std).
# What the trainer names in `RewardOutput.errors` when an env's `reward` itself raised (logged as
# `reward/errors/env_reward`, the fraction of the step's trajectories).
ENV_REWARD_ERROR = "env_reward"
_RESERVED_NAMES = ("total", "alpha", "errors", "mean", "std", ENV_REWARD_ERROR)


@dataclasses.dataclass(frozen=True)
class RewardInput:
  """What the reward sees of one finished trajectory.

  Attributes:
    response_text: the decoded policy (and observation) text after the prompt.
    gold: the reference answer(s), if the task has any.
    num_response_tokens: the policy's own tokens after the prompt, over all its turns; tool
      observations and the prompt are not counted. The length that `LinearLengthReward` and
      `OverlongReward` (DAPO's |y|) shape, so the policy is not penalised for what tools return.
    num_tool_calls: tool calls the rollout acted on (ran, or answered with an error).
    num_valid_tool_calls: calls that parsed, named a known tool and had valid arguments,
      whether or not the tool then succeeded: valid is not successful.
    num_tool_errors: calls that ended in an error (malformed, unknown tool, bad arguments, the
      tool raised or timed out); a valid call that failed counts here too.
    num_repeated_tool_calls: valid calls that repeat an earlier valid call of the trajectory
      (same tool, same arguments); `ToolUseReward` pays no bonus for them.
    truncated: whether the rollout ended the trajectory rather than the policy
      (`Trajectory.truncated`): a budget (tokens, turns, cache length, tool time) or the task's
      code raising ("env_error"); `metadata["stop_reason"]` says which.
    metadata: task-specific extras (e.g. unit-test counts, see `components.UnitTestReward`).
    num_distinct_ok_tool_calls: distinct valid calls (same tool and arguments count once) that
      succeeded, the calls `ToolUseReward` pays for (`Trajectory.distinct_ok_tool_calls`).
      None: not counted; `ToolUseReward` then pays an upper bound from the counts above (see
      `shaping.ToolShapingConfig`).
  """

  response_text: str
  gold: str | Sequence[str] | None = None
  num_response_tokens: int = 0
  num_tool_calls: int = 0
  num_valid_tool_calls: int = 0
  num_tool_errors: int = 0
  num_repeated_tool_calls: int = 0
  truncated: bool = False
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  num_distinct_ok_tool_calls: int | None = None

  def __post_init__(self):
    # Env code builds one per trajectory: a field of the wrong kind failed every component that
    # reads it, on every call (scored 0.0, logged once), instead of being named here.
    if not isinstance(self.response_text, str):
      raise TypeError(f"RewardInput.response_text must be a str (the decoded response), got "
                      f"{type(self.response_text).__name__}: {self.response_text!r:.100}")
    for name in ("num_response_tokens", "num_tool_calls", "num_valid_tool_calls", "num_tool_errors",
                 "num_repeated_tool_calls", "num_distinct_ok_tool_calls"):
      v = getattr(self, name)
      if v is None and name == "num_distinct_ok_tool_calls":
        continue
      if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
        raise ValueError(f"RewardInput.{name} must be an int >= 0, got {v!r}")
    if not isinstance(self.truncated, (bool, np.bool_)):
      raise TypeError(f"RewardInput.truncated must be a bool, got {self.truncated!r}")
    if not isinstance(self.metadata, Mapping):
      raise TypeError(f"RewardInput.metadata must be a mapping (task extras by name), got "
                      f"{type(self.metadata).__name__}: {self.metadata!r:.100}")

  @property
  def ended_without_answer(self) -> bool:
    """Whether the rollout ended the trajectory otherwise than with an answer (its
    "stop_reason" in `metadata`, as `Trajectory.to_reward_input` sets it). Missing or ""
    (not known, not finished) reads as False. Such a trajectory's text can still hold a
    complete answer block that the parser never read (one put together across turns)."""
    stop = self.metadata.get("stop_reason")
    return bool(stop) and stop != "answer"


@dataclasses.dataclass(frozen=True)
class Component:
  """A named, weighted reward term; `timeout_s` (None: no limit) bounds each call of `fn`."""

  name: str
  fn: Callable[[RewardInput], float]
  weight: float = 1.0
  role: Role = "fixed"
  timeout_s: float | None = None

  def __post_init__(self):
    if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
      raise ValueError(f"Component.name must be letters, digits, '_', '.', '-' (it becomes the metric "
                       f"'reward/<name>'), got {self.name!r}")
    if self.name in _RESERVED_NAMES:
      raise ValueError(f"Component.name {self.name!r} is reserved: 'reward/{self.name}' is a batch metric of "
                       f"its own (reserved: {_RESERVED_NAMES}); rename the component")
    if not callable(self.fn):
      raise ValueError(f"Component {self.name!r}: fn must be callable RewardInput -> float, got {self.fn!r}")
    _check_fn(self.name, self.fn)
    if isinstance(self.weight, bool) or not isinstance(self.weight, numbers.Real) or not math.isfinite(self.weight):
      raise ValueError(f"Component {self.name!r}: weight must be a finite number, got {self.weight!r}")
    if self.weight < 0 and getattr(self.fn, "is_penalty", False) is True:
      raise ValueError(f"Component {self.name!r}: {type(self.fn).__name__} is a penalty already (its "
                       f"values are <= 0), so weight={self.weight!r} would turn it into a bonus (for "
                       "a length penalty: the longer the response, the higher its reward); give it "
                       "a positive weight, the size of the penalty")
    if self.role not in _ROLES:
      raise ValueError(f"Component {self.name!r}: role must be one of {_ROLES}, got {self.role!r}")
    t = self.timeout_s
    if t is not None and (isinstance(t, bool) or not isinstance(t, numbers.Real)
                          or not math.isfinite(t) or t <= 0):
      raise ValueError(f"Component {self.name!r}: timeout_s must be None (no limit) or a finite "
                       f"number of seconds > 0, got {t!r}")

  def __call__(self, inp: RewardInput) -> Any:
    """`fn(inp)`, within `timeout_s` when one is set (TimeoutError past it)."""
    if self.timeout_s is None:
      return self.fn(inp)
    box: dict[str, Any] = {}
    done = threading.Event()

    def run():
      try:
        box["value"] = self.fn(inp)
      except BaseException as e:  # noqa: BLE001 - handed to the caller below
        box["error"] = e
      finally:
        done.set()

    threading.Thread(target=run, name=f"reward-{self.name}", daemon=True).start()
    if not done.wait(self.timeout_s):
      raise TimeoutError(f"took longer than its timeout_s={self.timeout_s:g}")
    if "error" in box:
      raise box["error"]
    return box["value"]


def _scoring_functions() -> list[tuple[Callable, str]]:
  """The package's functions of text or counts, each with the component that reads it off a
  `RewardInput` (imported here: `components` imports this module)."""
  from jaxagent.rewards import shaping, verifiers
  return [(shaping.format_reward, "FormatReward(FormatConfig(...))"),
          (shaping.check_format, "FormatReward(FormatConfig(...))"),
          (shaping.tool_use_reward, "ToolUseReward(ToolShapingConfig(...))"),
          (shaping.linear_length_penalty, "LinearLengthReward(LinearLengthConfig(...))"),
          (shaping.overlong_penalty, "OverlongReward(OverlongConfig(...))"),
          (verifiers.exact_match, 'TextMatchReward("exact_match")'),
          (verifiers.f1_score, 'TextMatchReward("f1")'),
          (verifiers.substring_exact_match, 'TextMatchReward("substring_exact_match")'),
          (verifiers.numeric_match, 'TextMatchReward("numeric_match")'),
          (verifiers.math_equal, "MathAnswerReward()"),
          (verifiers.unit_test_reward, "UnitTestReward()")]


def _check_fn(name: str, fn: Callable) -> None:
  """Refuses an `fn` that cannot take a `RewardInput`: each call would fail, and the term would
  score 0.0 for every trajectory of the run, logged once."""
  if isinstance(fn, type):
    raise ValueError(f"Component {name!r}: fn is the class {fn.__name__}, not a reward; pass an "
                     f"instance, {fn.__name__}(...)")
  if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
    raise ValueError(f"Component {name!r}: fn is an async function; the composite calls it on a "
                     "host thread and does not await it (each call would return a coroutine, "
                     "scored 0.0); make it a plain def, e.g. one that runs asyncio.run(...) "
                     "inside, and bound its time with timeout_s")
  use = next((component for f, component in _scoring_functions() if f is fn), None)
  if use is not None:
    raise ValueError(f"Component {name!r}: fn is {fn.__module__}.{fn.__name__}, which scores text "
                     f"or counts, not a RewardInput; use jaxagent.rewards.{use}")
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):  # a builtin without one: its calls will tell
    return
  try:
    signature.bind(None)
  except TypeError:
    raise ValueError(f"Component {name!r}: fn must take one argument, the RewardInput, but its "
                     f"signature is {signature}") from None


@dataclasses.dataclass(frozen=True)
class ProgressiveSchedule:
  """alpha(step), the share of weight given to outcome terms; shaping terms get 1 - alpha.

  alpha goes from `start` at step 0 to `end` at `num_steps` (and stays there), linearly or
  along a half cosine. A `CompositeReward` refuses a schedule when no shaping component has a
  weight: with nothing to hand over it would only scale the outcome down (to 0 at step 0 when
  start=0, so every trajectory of the first steps would score 0 and teach nothing).
  """

  num_steps: int
  start: float = 0.0
  end: float = 1.0
  kind: ScheduleKind = "linear"

  def __post_init__(self):
    if isinstance(self.num_steps, bool) or not isinstance(self.num_steps, numbers.Integral) or self.num_steps < 1:
      raise ValueError(f"ProgressiveSchedule.num_steps must be an int >= 1, got {self.num_steps!r}")
    for name in ("start", "end"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0.0 <= v <= 1.0:
        raise ValueError(f"ProgressiveSchedule.{name} must be a number in [0, 1], got {v!r}")
    if self.kind not in _SCHEDULE_KINDS:
      raise ValueError(f"ProgressiveSchedule.kind must be one of {_SCHEDULE_KINDS}, got {self.kind!r}")

  def alpha(self, step: int) -> float:
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}")
    t = min(step / self.num_steps, 1.0)
    if self.kind == "cosine":
      t = 0.5 * (1.0 - math.cos(math.pi * t))
    return float(self.start + (self.end - self.start) * t)


@dataclasses.dataclass(frozen=True)
class RewardOutput:
  """One trajectory's reward.

  Attributes:
    total: sum over components of effective weight * value.
    components: each component's unweighted value (0.0 where it failed).
    weights: each component's effective weight at this step.
    errors: names of the components that failed on this input.
    alpha: the schedule's alpha at this step (1.0 without a schedule).
  """

  total: float
  components: Mapping[str, float]
  weights: Mapping[str, float]
  errors: tuple[str, ...] = ()
  alpha: float = 1.0

  def metrics(self) -> dict[str, float]:
    """`reward/total`, `reward/alpha` and `reward/<name>` for each component."""
    out = {"reward/total": self.total, "reward/alpha": self.alpha}
    out.update({f"reward/{k}": v for k, v in self.components.items()})
    return out


class CompositeReward:
  """sum_i w_i(step) * component_i(input), never raising for a component's failure."""

  def __init__(self, components: Sequence[Component], schedule: ProgressiveSchedule | None = None):
    components = tuple(components)
    if not components:
      raise ValueError("CompositeReward needs at least one Component")
    for c in components:
      if not isinstance(c, Component):
        raise TypeError(f"CompositeReward takes Component objects, got {type(c).__name__}: {c!r}")
    names = [c.name for c in components]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
      raise ValueError(f"CompositeReward component names must be unique; repeated: {duplicates}")
    if schedule is not None and not any(c.role == "outcome" for c in components):
      raise ValueError("a ProgressiveSchedule moves weight to outcome components, but none has role='outcome'")
    if schedule is not None and not any(c.role == "outcome" and c.weight != 0 for c in components):
      outcome = {c.name: c.weight for c in components if c.role == "outcome"}
      raise ValueError(
          f"a ProgressiveSchedule hands weight from shaping components to outcome ones, but every "
          f"outcome component has weight 0 (outcome weights: {outcome}): once alpha reaches "
          f"{schedule.end:g} the outcome, whether the answer is right, would count for nothing. "
          "Give the outcome component a weight (1.0 is usual)")
    if schedule is not None and not any(c.role == "shaping" and c.weight != 0 for c in components):
      shaping = {c.name: c.weight for c in components if c.role == "shaping"}
      raise ValueError(
          f"a ProgressiveSchedule hands weight from shaping components to outcome ones, but no "
          f"shaping component has a non-zero weight (shaping weights: {shaping or 'none'}): it would "
          f"only scale the outcome reward by alpha, which is {schedule.start:g} at step 0 "
          f"(start=0: every trajectory of the first steps scores 0). Give a shaping term a weight "
          f"(an env's format_weight, tool_weight, ...), or drop the schedule (an env's "
          f"shaping_steps=0)")
    self.components = components
    self.schedule = schedule
    self._lock = threading.Lock()
    self._errors = {c.name: 0 for c in components}

  def alpha(self, step: int) -> float:
    return 1.0 if self.schedule is None else self.schedule.alpha(step)

  def weights(self, step: int = 0) -> dict[str, float]:
    """Effective weight of each component at `step`."""
    alpha = self.alpha(step)
    scale = {"outcome": alpha, "shaping": 1.0 - alpha, "fixed": 1.0} if self.schedule is not None else {}
    return {c.name: float(c.weight) * scale.get(c.role, 1.0) for c in self.components}

  def __call__(self, inp: RewardInput, *, step: int | None = None) -> RewardOutput:
    """Scores `inp` at training step `step`, which a composite with a schedule requires (one
    without ignores it)."""
    step = self._step(step)
    if not isinstance(inp, RewardInput):
      # Every component would fail on it and score 0.0, as if the responses were all wrong.
      raise TypeError(f"CompositeReward scores a RewardInput, got {type(inp).__name__}; build one "
                      "with Trajectory.to_reward_input(tokenizer, gold, metadata=...)")
    weights = self.weights(step)
    values: dict[str, float] = {}
    failed: list[str] = []
    for c in self.components:
      try:
        value = c(inp)
        if isinstance(value, (bool, np.bool_)):
          # A check's outcome (Python's or NumPy's): it scored 0 as an error on every trajectory.
          value = 1.0 if value else 0.0
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
          raise ValueError(f"returned {value!r}; a reward component must return a finite float")
        if not math.isfinite(weights[c.name] * float(value)):
          raise ValueError(f"returned {value!r}, which times its weight {weights[c.name]!r} is not a "
                           "finite float")
        values[c.name] = float(value)
      except Exception as e:  # noqa: BLE001  (failures are data: see module docstring)
        values[c.name] = 0.0
        failed.append(c.name)
        self._record_error(c.name, e)
    try:
      total = math.fsum(weights[n] * v for n, v in values.items())
    except OverflowError:
      total = math.inf
    if not math.isfinite(total):
      # Finite terms whose sum overflows: an infinite total would stop the advantage computation,
      # and no one term is to blame, so every non-zero term fails and the total is 0.0.
      for n, v in values.items():
        if weights[n] * v != 0.0:
          values[n] = 0.0
          failed.append(n)
          self._record_error(n, OverflowError(f"the weighted sum of the components overflows a float "
                                              f"(this one's value {v!r}, weight {weights[n]!r})"))
      total = 0.0
    return RewardOutput(total=total, components=values, weights=weights, errors=tuple(failed),
                        alpha=self.alpha(step))

  def score_batch(self, inputs: Sequence[RewardInput], *, step: int | None = None) -> list[RewardOutput]:
    return [self(inp, step=step) for inp in inputs]

  def _step(self, step: int | None) -> int:
    if step is not None:
      return step
    if self.schedule is not None:
      # Without the step the schedule would stay at alpha=start for the whole run, unnoticed.
      raise TypeError("this CompositeReward has a ProgressiveSchedule, so it needs the training "
                      "step: call it as reward(inp, step=step), passing on the step that "
                      "Env.reward receives")
    return 0

  def _record_error(self, name: str, error: Exception) -> None:
    with self._lock:
      self._errors[name] += 1
      first = self._errors[name] == 1
    if first:
      logger.warning("reward component %r failed (scored 0.0; later failures are only counted): %r",
                     name, error, exc_info=error)
    else:
      logger.debug("reward component %r failed: %r", name, error)

  def error_counts(self) -> dict[str, int]:
    """Failures per component since construction."""
    with self._lock:
      return dict(self._errors)

  @property
  def num_errors(self) -> int:
    with self._lock:
      return sum(self._errors.values())


def mean_metrics(outputs: Sequence[RewardOutput]) -> dict[str, float]:
  """Batch means of `RewardOutput.metrics`, plus `reward/errors/<name>` (fraction that failed).

  `reward/alpha` is the mean over the outputs whose env reward ran: one that raised
  (`ENV_REWARD_ERROR`, scored 0.0 by the trainer) has no schedule value of its own.
  """
  if not outputs:
    return {}
  sums: dict[str, float] = {}
  for out in outputs:
    for k, v in out.metrics().items():
      sums[k] = sums.get(k, 0.0) + v
    for name in out.components:
      key = f"reward/errors/{name}"
      sums[key] = sums.get(key, 0.0) + (name in out.errors)
  means = {k: v / len(outputs) for k, v in sums.items()}
  ran = [out.alpha for out in outputs if ENV_REWARD_ERROR not in out.errors]
  if ran:
    means["reward/alpha"] = math.fsum(ran) / len(ran)
  return means
