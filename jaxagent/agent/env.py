"""The contract a task implements for the rollout driver: `Example`, `Episode`, `Env`.

Where this sits: tasks in `jaxagent/envs/` subclass `Env`; the trainer hands examples and the env
to `agent.rollout.rollout`, which for each (example, sample)

1. tokenizes the prompt once with `env.render_prompt(example, tokenizer)` (chat template applied);
2. opens `episode = env.new_episode(example)` for per-trajectory tools and state (a persistent
   Python session, a scratch directory) and closes it when the trajectory ends;
3. stops each turn at `env.parser.stop_strings()`, parses the turn with `env.parser.parse`, runs the
   call on `episode.tools`, wraps the `ToolResult` with `env.format_observation` and tokenizes it
   once with `env.encode_observation`;

and afterwards the trainer scores each trajectory with `env.reward(trajectory, example, tokenizer,
step)` (`env.reward_threads` at a time). `env.demonstration(example)` optionally gives a worked example for an SFT warm start.

`CalculatorEnv` at the end is the contract's reference (arithmetic with a `<calc>` tool: parser,
tool, observations, reward and demonstrations) and what the tests run; it has no dataset
(`examples` is not defined), so it trains on the examples of a subclass or of the caller. The
trainable arithmetic task is "quickstart" (`envs.quickstart.ArithmeticToolEnv`).
"""
from __future__ import annotations

import abc
import dataclasses
import functools
import inspect
import logging
import math
import numbers
import re
import string
from typing import Any, Iterable, Mapping, Sequence

from jaxagent.agent.parsers import Parser, XMLTagParser
from jaxagent.agent.trajectory import OBSERVATION, POLICY, Trajectory, continuation_encoder
from jaxagent.generate.scheduler import text_prompt_ids
from jaxagent.rewards import (Component, CompositeReward, RewardOutput, TextMatchReward,
                              ToolUseReward)
from jaxagent.tools import Calculator, Tool, ToolRegistry, ToolResult

log = logging.getLogger(__name__)

# Observation wrappers of common conventions; `{output}` receives `ToolResult.to_observation()`.
OBSERVATION_TEMPLATES = {
    # Search-R1: retrieved passages between <information> tags.
    "information": "\n<information>{output}</information>\n",
    # ReTool: interpreter output between <interpreter> tags.
    "interpreter": "<interpreter>{output}</interpreter>",
    # The calculator quickstart (`<calc>EXPR</calc>` -> `<result>...</result>`).
    "result": "<result>{output}</result>",
    # ChatML tool turn (Qwen2.5 / SmolLM2 templates): close the assistant turn, answer as the tool
    # in a user turn, and reopen the assistant turn.
    "chatml_tool": ("<|im_end|>\n<|im_start|>user\n<tool_response>\n{output}\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n"),
}


class NoSplitError(ValueError):
  """Raised by `Env.examples(split)` for a split the task does not have (an "sft" split of a
  task without demonstrations, a split name it does not know), as opposed to a split that it
  has but fails to load (a missing or malformed data file: any other error).

  A mixture (`envs.mixture`) leaves such a task out of its "sft" split, with a warning, where
  it raises for a load failure; the trainer's warm start says the task has no "sft" split
  (give `sft.data` or set `sft.steps=0`). A `ValueError`, so code that catches `ValueError`
  catches it as before.

  Args:
    message: what is missing and what the task has, e.g. "unknown split 'test'; expected one of
      ['eval', 'train']".
    split: the split asked for; when set, the error means that split only (an error about
      another split, raised from inside `examples(split)`, is a load failure of `split`).
  """

  def __init__(self, message: str, *, split: str | None = None):
    super().__init__(message)
    self.split = split

  def __reduce__(self):  # keeps `split` through pickling (a worker process's error)
    return _no_split_error, (str(self), self.split)


def _no_split_error(message: str, split: str | None) -> NoSplitError:
  return NoSplitError(message, split=split)


def lacks_split(error: BaseException, split: str) -> bool:
  """Whether `error`, raised by an env's `examples(split)`, says that the env has no such split
  (rather than that the split failed to load): a `NoSplitError` (of `split`, or of no named
  split), a `NotImplementedError` (the base `Env`'s: no examples at all), or a `KeyError` of the
  split's name (a lookup of the split by name)."""
  if isinstance(error, NoSplitError):
    return error.split is None or error.split == split
  if isinstance(error, NotImplementedError):
    return True
  if isinstance(error, KeyError):
    return error.args == (split,)
  # Envs written before `NoSplitError` said so in words only: a plain ValueError saying
  # "unknown split 'sft'" (the built-in envs' words then), "no sft split", or for "sft" "no
  # demonstrations" (MCPToolEnv's then). Kept for those envs; new code raises NoSplitError.
  said = rf"unknown split|\bno ['\"]?{re.escape(split)}['\"]? split" + (
      r"|\bno demonstrations" if split == "sft" else "")
  return type(error) is ValueError and re.search(said, str(error), re.I) is not None


@dataclasses.dataclass(frozen=True)
class Example:
  """One task instance.

  Attributes:
    id: a stable identifier (for dumps and evaluation joins).
    prompt: the prompt text, or chat messages (dicts with "role" and "content").
    gold: the reference answer(s), if the task has any.
    metadata: task extras (unit tests, difficulty, source).
  """

  id: str
  prompt: str | Sequence[Mapping[str, Any]]
  gold: str | Sequence[str] | None = None
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not isinstance(self.prompt, str):
      msgs = tuple(self.prompt) if isinstance(self.prompt, Iterable) else ()
      if not msgs or not all(isinstance(m, Mapping) and "role" in m for m in msgs):
        raise ValueError(f"Example {self.id!r}: prompt must be text or a non-empty list of chat "
                         f"messages with a 'role' key, got {type(self.prompt).__name__}")
      object.__setattr__(self, "prompt", msgs)
    gold = self.gold
    if not (gold is None or isinstance(gold, str) or (
        isinstance(gold, Sequence) and all(isinstance(g, str) for g in gold))):
      raise TypeError(f"Example {self.id!r}: gold must be a str, a list of str or None (the "
                      f"reference answers as text), got {type(gold).__name__} {gold!r}; convert "
                      "it, e.g. gold=str(answer) (a number would fail every text-matching reward)")


class Episode:
  """Per-trajectory tools and state; the driver calls `close()` when the trajectory ends.

  Args:
    tools: the tools this trajectory may call (shared stateless tools and/or its own).
    owned: tools created for this trajectory alone; `close()` calls their `close()` method.
    state: anything else the task keeps per trajectory (read back in `Env.reward`).
  """

  def __init__(self, tools: ToolRegistry | Iterable[Tool] = (), *, owned: Iterable[Any] = (),
               state: Any = None):
    self.tools = tools if isinstance(tools, ToolRegistry) else ToolRegistry(tools)
    self.owned = list(owned)
    self.state = state
    self.closed = False

  def close(self) -> None:
    """Releases per-trajectory resources (idempotent)."""
    if self.closed:
      return
    self.closed = True
    for obj in self.owned:
      close = getattr(obj, "close", None)
      if callable(close):
        try:
          close()
        except Exception:  # noqa: BLE001 - a failing cleanup must not end the rollout
          log.warning("closing %r failed", obj, exc_info=True)


class Env(abc.ABC):
  """A task: prompts, tools, a parser for the policy's actions, observation format and reward.

  Subclasses set `name`, `parser` and usually `tools` and `observation_template`, and implement
  `reward`; the other methods have working defaults.
  """

  name: str = "env"
  parser: Parser
  tools: ToolRegistry | None = None
  observation_template: str = "{output}"
  # True trains on observation tokens too (the Search-R1 ablation without retrieved-token
  # masking); the default gives loss only to the policy's own tokens.
  train_on_observations: bool = False
  # How many trajectories the trainer scores at once with `reward` (a thread pool; outputs and
  # their order are those of scoring one after another). Raise it only when `reward` is
  # thread-safe; it pays where a reward waits on something else (unit tests in a sandbox, a
  # verifier process), so that slow or hanging answers overlap instead of adding up.
  reward_threads: int = 1

  def examples(self, split: str) -> Sequence[Example]:
    """The task's examples of `split`: "train", "eval" (held out) and optionally "sft".

    For a split the task does not have, raise `NoSplitError(message, split=split)`; any other
    error reads as a split that failed to load (`lacks_split`).
    """
    raise NotImplementedError(f"env {self.name!r} does not provide examples; implement "
                              "`examples(split)` for 'train' and 'eval'")

  def is_success(self, out: RewardOutput) -> bool:
    """Whether a reward counts as solved for pass@k (default: total reward >= 1)."""
    return out.total >= 1.0

  def env_for(self, example: Example) -> Env:
    """The env that runs `example`'s trajectories (its parser, stop strings, observations) and
    judges their success: this env, or the example's task in a mixture (`envs.mixture`)."""
    return self

  @property
  def member_envs(self) -> Sequence[Env]:
    """Every env that `env_for` may return (checked when a rollout driver is built)."""
    return (self,)

  def render_prompt(self, example: Example, tokenizer) -> list[int]:
    """Prompt token ids: chat messages through the tokenizer's chat template, text as is.

    Messages go through `encode_chat`, where only the template's control tokens are control
    tokens: a message that spells one ("<|im_end|>") keeps it as text, so a dataset prompt
    cannot forge an end of turn or another role's turn. A text prompt is the model's whole
    input (a chat rendered by hand, say), encoded with its special tokens parsed and, as
    `generate` feeds a text prompt, with the tokenizer's BOS first where its own encoding adds
    one (a Llama 3 base model), unless the text starts with it.
    """
    if isinstance(example.prompt, str):
      return text_prompt_ids(tokenizer, example.prompt)
    return list(tokenizer.encode_chat(list(example.prompt), add_generation_prompt=True))

  def new_episode(self, example: Example) -> Episode:
    """Tools and state of one trajectory (default: the env's shared tools, no state)."""
    return Episode(self.tools if self.tools is not None else ())

  def format_observation(self, result: ToolResult) -> str:
    """The text appended after a tool call: `observation_template` around the result.

    With `RolloutConfig.max_observation_tokens` set, `result` arrives with its text already cut
    to the cap (`truncated` set, "...[N tokens truncated]..." where it was cut); what this
    method and `encode_observation` add around it is not counted and never cut
    (`agent/observation_cap.py`).
    """
    return self.observation_template.format(output=result.to_observation())

  def encode_observation(self, text: str, tokenizer) -> list[int]:
    """Observation token ids: the wrapper's text with its control tokens, the tool output as text.

    An observation continues the trajectory, so its text (and each piece of it below) is
    encoded with `tokenizer.encode_continuation` where the tokenizer has it (`encode` where
    not): as the text after the policy's tokens is in the encoding of the whole conversation,
    not as the start of an input (a Metaspace tokenizer with prepend_scheme="first", Mistral or
    Llama 2 style, puts a "▁" there that the model never sees mid-conversation). Byte-level BPE
    tokenizers give the ids of `encode` either way.

    A tool's output is data: a program that prints "<|im_end|>" must not close the turn. When
    `text` is a wrapper around an output that spells a special token, and the tokenizer takes
    `parse_special`, the output is tokenized literally and the wrapper's parts are tokenized on
    their own. The wrapper is `observation_template` (escaped braces `{{ }}` read as the braces
    they print; `{output}` may appear more than once) with the default `format_observation`;
    with an overridden one, it is what that method puts around a placeholder output, or else
    around a placeholder error (so a format that adds the same text around every output, and
    another around every error, is taken apart too); an override is called with these
    placeholders once per env, the first time a text that spells a special token is encoded.
    A text that cannot be taken apart (a template field with a conversion or format spec such
    as `{output!r}`; a format that frames it otherwise) is tokenized whole with
    `parse_special=False` when the wrapper's own text spells no special token. Otherwise (the
    usual case: an output without special-token text) `text` is tokenized whole, as before.
    Override for other formats.
    """
    encode = continuation_encoder(tokenizer)
    # `text` is encoded whole only when that is the result (not also on the split path).
    if "parse_special" not in inspect.signature(tokenizer.encode).parameters:
      return list(encode(text))
    # A format of the env's own: a subclass's method, or a function set on the instance.
    if getattr(self.format_observation, "__func__", None) is not Env.format_observation:
      # The override runs only to find its frames, once per env (it may keep state: a counter
      # of its calls or of errors counted two extra calls per observation), and not at all for
      # a text that spells no special token (tokenized whole either way).
      whole = list(encode(text))
      if whole == list(encode(text, parse_special=False)):
        return whole
      frames = self._observation_frames()
      split = next((s for f in frames if (s := _split_segments(f, text)) is not None), None)
      literals = [seg for f in frames for seg in f] or None
    else:
      split = _split_template(self.observation_template, text)
      literals = _template_literals(self.observation_template)
    if split is None:
      if literals is not None and not any(
          list(tokenizer.encode(x)) != list(tokenizer.encode(x, parse_special=False))
          for x in literals if x):
        return list(encode(text, parse_special=False))
      return list(encode(text))
    segments, output = split
    literal = list(encode(output, parse_special=False))
    if literal == list(encode(output)):
      return list(encode(text))  # no special-token text in the output
    ids = list(encode(segments[0])) if segments[0] else []
    for seg in segments[1:]:
      ids += literal + (list(encode(seg)) if seg else [])
    return ids

  def _observation_frames(self) -> list[list[str]]:
    """`_formatted_frames` of this env's `format_observation`, found once and kept on the env."""
    fn = getattr(self.format_observation, "__func__", self.format_observation)
    cache = getattr(self, "__dict__", None)  # an env with __slots__ finds them each time
    kept = cache.get("_jaxagent_observation_frames") if cache is not None else None
    if kept is not None and kept[0] is fn:
      return kept[1]
    frames = _formatted_frames(self.format_observation)
    if cache is not None:
      cache["_jaxagent_observation_frames"] = (fn, frames)
    return frames

  @abc.abstractmethod
  def reward(self, trajectory: Trajectory, example: Example, tokenizer, step: int) -> RewardOutput:
    """The reward of a finished trajectory at training step `step`."""

  def demonstration(self, example: Example) -> list[tuple[int, str]] | None:
    """A worked example as (role, text) segments after the prompt (POLICY / OBSERVATION), or None.

    Turn it into a ledger with `trajectory.demonstration_trajectory`.
    """
    return None


def check_shaping_settings(owner: str, *, shaping_steps: int = 0, shaping_start: float = 0.0,
                           **weights: float) -> None:
  """Raises a ValueError naming the env's own setting (`SearchQAEnv.format_weight`) for a reward
  weight that is not a finite number, a `shaping_steps` that is not an int >= 0 (0: fixed
  weights) or a `shaping_start` outside [0, 1]. The reward's checks name its parts instead
  ("Component 'format': weight ...", "ProgressiveSchedule.num_steps must be an int >= 1"),
  which are not the names a config sets."""
  for name, w in weights.items():
    if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w):
      raise ValueError(f"{owner}.{name} must be a finite number (0 = off), got {w!r}")
  if (isinstance(shaping_steps, bool) or not isinstance(shaping_steps, numbers.Integral)
      or shaping_steps < 0):
    raise ValueError(f"{owner}.shaping_steps must be an int >= 0 (0 = fixed weights), got "
                     f"{shaping_steps!r}")
  if (isinstance(shaping_start, bool) or not isinstance(shaping_start, numbers.Real)
      or not 0.0 <= shaping_start <= 1.0):
    raise ValueError(f"{owner}.shaping_start must be a number in [0, 1], got {shaping_start!r}")


@functools.lru_cache(maxsize=64)
def _template_parts(template: str) -> tuple[tuple, ...] | None:
  """`string.Formatter().parse(template)` as a tuple (parsed once per template: the env's
  template is fixed and every observation reads it), or None if the template is invalid."""
  try:
    return tuple(string.Formatter().parse(template))
  except ValueError:
    return None


def _template_literals(template: str) -> list[str] | None:
  """The literal text around each field of a `str.format` template, or None if it is invalid."""
  parts = _template_parts(template)
  return None if parts is None else [literal for literal, _, _, _ in parts]


def _split_template(template: str, text: str) -> tuple[list[str], str] | None:
  """(literal segments, output) with `text == output.join(segments)` when every field of
  `template` is a plain `{output}`; None when the template or `text` cannot be taken apart."""
  parts = _template_parts(template)
  if parts is None:
    return None
  segments = [""]  # the literal text before, between and after the fields
  for literal, name, spec, conversion in parts:  # escaped braces split a literal in parts
    segments[-1] += literal
    if name is not None:
      if (name, spec, conversion) != ("output", "", None):
        return None
      segments.append("")
  return _split_segments(segments, text)


# A placeholder tool output no format is expected to spell or alter (private-use characters).
_PLACEHOLDER = "\ue000jaxagent-tool-output\ue001"


def _formatted_frames(format_observation) -> list[list[str]]:
  """The literal segments an overridden `format_observation` puts around a placeholder output,
  then around a placeholder error (a format often frames errors its own way: `<error>...`).
  A format that leaves the placeholder out gives its whole text as one segment: it cannot
  split a text, but its control tokens count as the format's own."""
  frames = []
  for result in (ToolResult.success(_PLACEHOLDER), ToolResult.failure(_PLACEHOLDER)):
    try:
      framed = format_observation(result)
    except Exception:  # noqa: BLE001 - a format that cannot take the placeholder is not split
      continue
    if isinstance(framed, str):
      frames.append(framed.split(_PLACEHOLDER))
  return frames


def _split_segments(segments: list[str], text: str) -> tuple[list[str], str] | None:
  """(segments, output) with `text == output.join(segments)`, or None."""
  k = len(segments) - 1
  if k == 0:
    return None
  n = len(text) - sum(map(len, segments))
  if n < 0 or n % k:
    return None
  start = len(segments[0])
  output = text[start:start + n // k]
  if output.join(segments) != text:
    return None
  return segments, output


class CalculatorEnv(Env):
  """Arithmetic with a calculator: `<calc>EXPR</calc>` -> `<result>VALUE</result>`, then
  `<answer>VALUE</answer>`. Reward: the answer equals the gold number (`numeric_match`), plus
  `tool_bonus` times `shaping.tool_use_reward` (0.1 per distinct call that ran without an error,
  capped at 0.5: a bonus of at most 0.05 at the default weight). No dataset: give a subclass an
  `examples(split)`, or roll out examples of your own.
  """

  name = "calculator"
  observation_template = OBSERVATION_TEMPLATES["result"]

  def __init__(self, *, tool_bonus: float = 0.1):
    check_shaping_settings("CalculatorEnv", tool_bonus=tool_bonus)
    self.parser = XMLTagParser({"calc": ("calculator", "expression")}, answer_tag="answer")
    self.tools = ToolRegistry([Calculator()])
    self._reward = CompositeReward([
        # The <answer> block only, as the parser reads the answer (a box in a call is none).
        Component("correct", TextMatchReward("numeric_match", fallback=False), 1.0, role="outcome"),
        Component("tool_calls", ToolUseReward(), tool_bonus, role="shaping"),
    ])

  def reward(self, trajectory: Trajectory, example: Example, tokenizer, step: int) -> RewardOutput:
    inp = trajectory.to_reward_input(tokenizer, example.gold, metadata=example.metadata,
                                     policy_only=True)
    return self._reward(inp, step=step)

  def demonstration(self, example: Example) -> list[tuple[int, str]] | None:
    expr = example.metadata.get("expression")
    if expr is None or example.gold is None:
      return None
    gold = example.gold if isinstance(example.gold, str) else example.gold[0]
    return [(POLICY, f"<calc>{expr}</calc>"), (OBSERVATION, self.observation_template.format(output=gold)),
            (POLICY, f"<answer>{gold}</answer>")]
