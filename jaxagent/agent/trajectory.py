"""The trajectory token ledger: every token of one multi-turn episode, with its role and logprob.

Where this sits: the rollout driver (`agent/rollout.py`) builds one `Trajectory` per (prompt,
sample) as the engine samples tokens and tools answer; rewards read it through
`to_reward_input`, the learner through `to_pack_item` (-> `rl/packing.py`), people through
`render` and JSONL dumps through `to_dict`.

Token-in, token-out (DESIGN decision 3): policy tokens are exactly the ids the engine sampled,
with exactly the log-probs it reported; they are never re-tokenized. Observations are tokenized
once, from the task's wrapped text, and appended. Per token the ledger holds:

  token id | role (PROMPT=0, POLICY=1, OBSERVATION=2) | sampler logprob (0.0 unless POLICY) | turn

Position t holds token t and the log-prob of token t given tokens < t, the convention of
`rl/packing.py`: the loss mask is 1 exactly on POLICY tokens, so observation and prompt tokens
never receive gradient. Prompt tokens have turn -1; the policy tokens of turn k and the
observation that answers them have turn k.
"""
from __future__ import annotations

import dataclasses
import enum
import inspect
import json
from typing import Any, Mapping, Sequence

import numpy as np

from jaxagent._token_ids import token_ids
from jaxagent.agent.parsers import ParseResult, ToolCall
from jaxagent.rewards import RewardInput
from jaxagent.rl.packing import PackItem


class Role(enum.IntEnum):
  """Who produced a token."""

  PROMPT = 0
  POLICY = 1
  OBSERVATION = 2


PROMPT, POLICY, OBSERVATION = Role.PROMPT, Role.POLICY, Role.OBSERVATION

# Why a trajectory ended. The first three are natural ends; every other reason truncates.
STOP_REASONS = (
    "answer",               # the parser found a final answer
    "eos",                  # the policy sampled an end-of-sequence token without an answer
    "no_tool_call",         # a turn ended at a stop string but asked for no tool and gave no answer
    "max_turns",            # the last allowed turn asked for a tool
    "max_tokens_per_turn",  # a turn used its whole token budget
    "max_total_tokens",     # the trajectory reached `RolloutConfig.max_total_tokens`
    "max_length",           # the trajectory reached the engine's cache length
    "tool_budget",          # the trajectory's tool time (`traj_tool_timeout_s`) ran out
    "prompt_too_long",      # the prompt leaves no room for a single policy token
    "env_error",            # the task's code raised for this trajectory (new_episode,
                            # format_observation, encode_observation); logged with its traceback
)
NATURAL_STOPS = frozenset({"answer", "eos", "no_tool_call"})


def tool_call_key(name: str, arguments: Any) -> str:
  """A call's identity for `Trajectory.repeated_tool_calls`: its tool name and arguments, with
  mapping keys in sorted order (so `{"a": 1, "b": 2}` and `{"b": 2, "a": 1}` are one call)."""
  try:
    return json.dumps([name, arguments], sort_keys=True, default=repr)
  except (TypeError, ValueError):  # keys that do not sort, or a cycle: the repr is still stable
    return repr((name, arguments))


@dataclasses.dataclass
class ToolOutcome:
  """What a tool call produced (a `jaxagent.tools.ToolResult`, flattened for dumps)."""

  ok: bool
  error: str | None = None
  timed_out: bool = False
  duration_s: float = 0.0
  output: str = ""
  truncated: bool = False

  @classmethod
  def from_result(cls, result) -> ToolOutcome:
    return cls(ok=bool(result.ok), error=result.error, timed_out=bool(result.timed_out),
               duration_s=float(result.duration_s), output=result.output,
               truncated=bool(getattr(result, "truncated", False)))


@dataclasses.dataclass
class Turn:
  """One policy turn and what followed it.

  Attributes:
    index: turn number (0-based).
    policy_span: [start, end) of the turn's policy tokens in the ledger.
    text: the decoded policy tokens of the turn.
    ended_by: how generation of the turn ended: "stop" (a stop string), "eos",
      "max_tokens_per_turn" or "length".
    action: the parse of the turn ("tool_call", "answer", "text", "malformed"), or None when the
      turn was cut by a budget before it could act.
    call: the parsed tool call, if any.
    answer: the final answer, if any.
    parse_error: the malformed-call message shown to the model, if any.
    outcome: the tool's result (for malformed calls and unknown tools, the error shown).
    observation_span: [start, end) of the observation tokens, or None when none was appended.
    observation_text: the wrapped observation text that was tokenized (None if none).
    observation_truncated_tokens: tokens of the tool's text cut by
      `RolloutConfig.max_observation_tokens` (0: none; the outcome holds the text as cut).
  """

  index: int
  policy_span: tuple[int, int]
  text: str = ""
  ended_by: str = ""
  action: str | None = None
  call: ToolCall | None = None
  answer: str | None = None
  parse_error: str | None = None
  outcome: ToolOutcome | None = None
  observation_span: tuple[int, int] | None = None
  observation_text: str | None = None
  observation_truncated_tokens: int = 0

  def set_parse(self, parsed: ParseResult) -> None:
    self.action, self.call, self.answer = parsed.kind, parsed.call, parsed.answer
    self.parse_error = parsed.error

  def to_dict(self) -> dict[str, Any]:
    return {
        "index": self.index, "policy_span": list(self.policy_span), "text": self.text,
        "ended_by": self.ended_by, "action": self.action,
        "call": None if self.call is None else self.call.to_dict(), "answer": self.answer,
        "parse_error": self.parse_error,
        "outcome": None if self.outcome is None else dataclasses.asdict(self.outcome),
        "observation_span": None if self.observation_span is None else list(self.observation_span),
        "observation_text": self.observation_text,
        "observation_truncated_tokens": self.observation_truncated_tokens,
    }

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> Turn:
    c = d.get("call")
    outcome = d.get("outcome")
    obs = d.get("observation_span")
    call = None if c is None else ToolCall(c["name"], dict(c["arguments"]), c.get("raw", ""))
    return cls(index=int(d["index"]), policy_span=tuple(d["policy_span"]), text=d.get("text", ""),
               ended_by=d.get("ended_by", ""), action=d.get("action"), call=call,
               answer=d.get("answer"), parse_error=d.get("parse_error"),
               outcome=None if outcome is None else ToolOutcome(**outcome),
               observation_span=None if obs is None else tuple(obs),
               observation_text=d.get("observation_text"),
               observation_truncated_tokens=int(d.get("observation_truncated_tokens", 0)))


@dataclasses.dataclass
class Trajectory:
  """One episode's token ledger, turns, stop reason, budgets and tool counts.

  Attributes:
    request_id: the id that seeded the sampler (unique per prompt and sample).
    group_id: index of the prompt in the rollout batch (the GRPO group).
    sample_index: index of this sample within its group.
    example_id: the task example's id.
    stop_reason: one of `STOP_REASONS`.
    truncated: ended by a budget rather than by the policy (every reason but answer / eos /
      no_tool_call).
    tool_seconds: wall-clock seconds spent in this trajectory's tool calls.
    tool_calls: calls per tool name (known tools only).
    num_tool_calls: calls acted on (run, or answered with an error observation).
    valid_tool_calls: calls that parsed, named a known tool and had valid arguments.
    repeated_tool_calls: valid calls with the same tool and arguments as an earlier valid call
      of this trajectory (counted in valid_tool_calls too).
    distinct_ok_tool_calls: distinct valid calls that succeeded: valid calls whose tool
      returned ok, a call with the same tool and arguments (`tool_call_key`) as an earlier
      successful one counting once. The calls `rewards.ToolUseReward` pays for. None where it
      was not counted (a trajectory built by hand, a dump written before this count).
    tool_errors: calls that ended in an error (malformed, unknown tool, bad arguments, failure,
      timeout).
    tool_timeouts, malformed_calls, unknown_tool_calls, bad_argument_calls: the error kinds.
    truncated_observations: observations appended with their tool text cut to
      `RolloutConfig.max_observation_tokens` (each turn's `observation_truncated_tokens` says
      by how much).
  """

  request_id: int
  group_id: int = -1
  sample_index: int = 0
  example_id: str | None = None
  token_ids: list[int] = dataclasses.field(default_factory=list)
  role_ids: list[int] = dataclasses.field(default_factory=list)
  logprob_list: list[float] = dataclasses.field(default_factory=list)
  turn_ids: list[int] = dataclasses.field(default_factory=list)
  turns: list[Turn] = dataclasses.field(default_factory=list)
  stop_reason: str = ""
  truncated: bool = False
  tool_seconds: float = 0.0
  tool_calls: dict[str, int] = dataclasses.field(default_factory=dict)
  num_tool_calls: int = 0
  valid_tool_calls: int = 0
  repeated_tool_calls: int = 0
  distinct_ok_tool_calls: int | None = None
  tool_errors: int = 0
  tool_timeouts: int = 0
  malformed_calls: int = 0
  unknown_tool_calls: int = 0
  bad_argument_calls: int = 0
  truncated_observations: int = 0

  # ------------------------------------------------------------------ building
  def add_prompt(self, ids: Sequence[int]) -> None:
    if self.token_ids:
      raise ValueError("add_prompt: the prompt must come first, the ledger is not empty")
    self._extend(ids, PROMPT, None, -1)

  def add_policy(self, ids: Sequence[int], logprobs: Sequence[float], turn: int) -> tuple[int, int]:
    """Appends sampled tokens with their sampler log-probs; returns their [start, end) span."""
    if len(ids) != len(logprobs):
      raise ValueError(f"add_policy: {len(ids)} tokens but {len(logprobs)} logprobs")
    return self._extend(ids, POLICY, logprobs, turn)

  def add_observation(self, ids: Sequence[int], turn: int) -> tuple[int, int]:
    return self._extend(ids, OBSERVATION, None, turn)

  def _extend(self, ids, role, logprobs, turn) -> tuple[int, int]:
    # int() would make a bool token 0 or 1 and cut a float to another token.
    ids = token_ids(ids, {PROMPT: "the prompt", POLICY: "the policy turn",
                          OBSERVATION: "the observation"}[role])
    start = len(self.token_ids)
    self.token_ids.extend(ids)
    self.role_ids.extend([int(role)] * len(ids))
    self.logprob_list.extend([0.0] * len(ids) if logprobs is None else [float(x) for x in logprobs])
    self.turn_ids.extend([int(turn)] * len(ids))
    return start, len(self.token_ids)

  def finish(self, reason: str) -> None:
    if reason not in STOP_REASONS:
      raise ValueError(f"unknown stop reason {reason!r}; expected one of {STOP_REASONS}")
    self.stop_reason = reason
    self.truncated = reason not in NATURAL_STOPS

  # ------------------------------------------------------------------ arrays
  @property
  def tokens(self) -> np.ndarray:
    return np.asarray(self.token_ids, np.int32)

  @property
  def roles(self) -> np.ndarray:
    return np.asarray(self.role_ids, np.int8)

  @property
  def logprobs(self) -> np.ndarray:
    return np.asarray(self.logprob_list, np.float32)

  @property
  def turn_index(self) -> np.ndarray:
    return np.asarray(self.turn_ids, np.int32)

  def loss_mask(self) -> np.ndarray:
    """float32 `[n]`: 1 exactly on POLICY tokens."""
    return (self.roles == POLICY).astype(np.float32)

  def __len__(self) -> int:
    return len(self.token_ids)

  @property
  def prompt_len(self) -> int:
    n = 0
    while n < len(self.role_ids) and self.role_ids[n] == PROMPT:
      n += 1
    return n

  @property
  def prompt_ids(self) -> list[int]:
    return self.token_ids[:self.prompt_len]

  @property
  def num_policy_tokens(self) -> int:
    return sum(1 for r in self.role_ids if r == POLICY)

  @property
  def num_observation_tokens(self) -> int:
    return sum(1 for r in self.role_ids if r == OBSERVATION)

  @property
  def num_turns(self) -> int:
    return len(self.turns)

  @property
  def final_answer(self) -> str | None:
    """The answer parsed from the last turn, if the trajectory ended with one."""
    return self.turns[-1].answer if self.turns and self.stop_reason == "answer" else None

  def budgets(self) -> dict[str, float]:
    """Budgets used: turns, policy tokens, total tokens, tool seconds."""
    return {"turns": self.num_turns, "policy_tokens": self.num_policy_tokens,
            "total_tokens": len(self), "tool_seconds": self.tool_seconds}

  def counts(self) -> dict[str, Any]:
    """Tool-call counts (per tool, valid, errors by kind)."""
    return {"tool_calls": dict(self.tool_calls), "num_tool_calls": self.num_tool_calls,
            "valid_tool_calls": self.valid_tool_calls,
            "repeated_tool_calls": self.repeated_tool_calls,
            "distinct_ok_tool_calls": self.distinct_ok_tool_calls, "tool_errors": self.tool_errors,
            "tool_timeouts": self.tool_timeouts, "malformed_calls": self.malformed_calls,
            "unknown_tool_calls": self.unknown_tool_calls,
            "bad_argument_calls": self.bad_argument_calls,
            "truncated_observations": self.truncated_observations}

  # ------------------------------------------------------------------ consumers
  def train_mask(self, *, observation_loss: bool = False) -> np.ndarray:
    """The mask the update trains with (`to_pack_item`'s): `loss_mask`, with the observation
    tokens too under `observation_loss`."""
    mask = self.loss_mask()
    if observation_loss:
      mask = np.maximum(mask, (self.roles == OBSERVATION).astype(np.float32))
    return mask

  def to_pack_item(self, advantage: float | np.ndarray,
                   ref_logps: np.ndarray | None = None, *,
                   observation_loss: bool = False) -> PackItem:
    """The learner's view (`rl/packing.PackItem`): position t's mask and logprob refer to token t.

    `observation_loss=True` also trains on observation tokens (the Search-R1 ablation without
    retrieved-token masking). Those tokens were never sampled, so they have no sampler
    log-prob: their `old_logps` are NaN, and the trainer replaces them with the current
    policy's (`Trainer.fill_unsampled_old_logps`) before the update. A NaN that reaches the
    loss is caught by the non-finite check, never silently trained on.
    """
    mask = self.train_mask(observation_loss=observation_loss)
    old = self.logprobs
    if observation_loss:
      old = np.where(self.roles == OBSERVATION, np.nan, old).astype(np.float32)
    return PackItem(tokens=self.tokens, loss_mask=mask, old_logps=old,
                    advantages=advantage, ref_logps=ref_logps, group_id=self.group_id,
                    traj_id=self.request_id)

  def response_text(self, tokenizer) -> str:
    """Everything after the prompt (policy turns and observations), decoded in one piece.

    Special tokens are kept (unlike `jaxagent.generate.Completion.text`): the turn ends and
    the chat framing of the observations stay visible to rewards, and
    `FormatConfig.eos_markers` strips an end-of-turn marker after the answer."""
    return tokenizer.decode(self.token_ids[self.prompt_len:])

  def policy_text(self, tokenizer) -> str:
    """Only the policy's tokens after the prompt, decoded span by span and concatenated
    (special tokens kept, as in `response_text`)."""
    return "".join(tokenizer.decode(self.token_ids[a:b]) for a, b in self._role_runs(POLICY))

  def turn_texts(self) -> list[str]:
    """The decoded text of each policy turn."""
    return [t.text for t in self.turns]

  def observation_texts(self) -> list[str]:
    """The wrapped text of each appended observation."""
    return [t.observation_text for t in self.turns if t.observation_span is not None]

  def to_reward_input(self, tokenizer, gold: str | Sequence[str] | None = None, *,
                      metadata: Mapping[str, Any] | None = None,
                      policy_only: bool = False) -> RewardInput:
    """A `rewards.RewardInput` of this trajectory.

    Args:
      metadata: task extras (e.g. unit-test counts); the stop reason, turn count and final answer
        are added under "stop_reason", "num_turns" and "final_answer", in place of any extras
        of those names (an example's "stop_reason" made `ended_without_answer` read it).
      policy_only: score only the policy's own text, so a tool output that happens to contain an
        answer tag cannot be credited to the policy.
    """
    text = self.policy_text(tokenizer) if policy_only else self.response_text(tokenizer)
    meta = {**(metadata or {}), "stop_reason": self.stop_reason, "num_turns": self.num_turns,
            "final_answer": self.final_answer}
    return RewardInput(response_text=text, gold=gold, num_response_tokens=self.num_policy_tokens,
                       num_tool_calls=self.num_tool_calls, num_valid_tool_calls=self.valid_tool_calls,
                       num_tool_errors=self.tool_errors,
                       num_repeated_tool_calls=self.repeated_tool_calls, truncated=self.truncated,
                       metadata=meta, num_distinct_ok_tool_calls=self.distinct_ok_tool_calls)

  def _role_runs(self, role: int | None = None) -> list[tuple[int, int]]:
    """[start, end) runs of equal (role, turn), optionally only those of `role`."""
    runs, start = [], 0
    for i in range(1, len(self.role_ids) + 1):
      if (i == len(self.role_ids) or self.role_ids[i] != self.role_ids[start]
          or self.turn_ids[i] != self.turn_ids[start]):
        if role is None or self.role_ids[start] == role:
          runs.append((start, i))
        start = i
    return runs

  def render(self, tokenizer, *, max_chars: int | None = 2000,
             observation_loss: bool = False) -> str:
    """A human-readable dump: a header, then each run of tokens with its role and loss mask.

    Policy runs are marked `[POLICY turn k | mask=1 | ...]`, observations
    `[OBSERVATION turn k | mask=0 | tool ...]` (`mask=1` with `observation_loss`, as
    `to_pack_item` trains them); each run's text is printed between `>>>` and `<<<` so
    whitespace is visible. `max_chars` cuts long runs in the middle.
    """
    head = (f"=== trajectory request_id={self.request_id} group={self.group_id} "
            f"sample={self.sample_index} example={self.example_id!r} stop={self.stop_reason} "
            f"truncated={self.truncated}\n"
            f"    tokens={len(self)} (prompt {self.prompt_len}, policy {self.num_policy_tokens}, "
            f"observation {self.num_observation_tokens}) turns={self.num_turns} "
            f"tool_calls={self.num_tool_calls} errors={self.tool_errors} "
            f"tool_s={self.tool_seconds:.3f}")
    lines = [head]
    turns = {t.index: t for t in self.turns}
    for a, b in self._role_runs():
      role, turn = Role(self.role_ids[a]), self.turn_ids[a]
      label = f"[{role.name} {a}:{b}"
      if role == PROMPT:
        label += " | mask=0]"
      elif role == POLICY:
        lp = float(np.mean(self.logprob_list[a:b]))
        t = turns.get(turn)
        label += f" turn {turn} | mask=1 | mean logprob {lp:.3f}"
        if t is not None:
          label += f" | ended by {t.ended_by} -> {t.action}"
          if t.call is not None:
            label += f" {t.call.name}({json.dumps(t.call.arguments, ensure_ascii=False)[:200]})"
          if t.parse_error:
            label += f" | error: {t.parse_error}"
        label += "]"
      else:
        t = turns.get(turn)
        label += f" turn {turn} | mask={int(observation_loss)}"
        if t is not None and t.outcome is not None:
          o = t.outcome
          label += f" | ok={o.ok} timed_out={o.timed_out} {o.duration_s:.3f}s"
        if t is not None and t.observation_truncated_tokens:
          label += f" | {t.observation_truncated_tokens} tool tokens truncated"
        label += "]"
      text = tokenizer.decode(self.token_ids[a:b])
      if max_chars is not None and len(text) > max_chars:
        half = max(max_chars // 2, 1)  # text[-0:] is all of it
        text = f"{text[:half]} ...[{len(text) - 2 * half} chars cut]... {text[-half:]}"
      lines.append(f"{label}\n>>>{text}<<<")
    dangling = [t for t in self.turns if t.outcome is not None and t.observation_span is None]
    for t in dangling:
      o = t.outcome
      lines.append(f"[turn {t.index}: tool result not appended (trajectory ended): ok={o.ok} "
                   f"error={o.error!r}]")
    # A model's JSON escape (`"\ud800"`) puts lone surrogates into parsed call arguments and
    # names; UTF-8 cannot encode them, so the sample dump would fail. Show them escaped.
    return "\n".join(lines).encode("utf-8", "backslashreplace").decode("utf-8")

  def to_dict(self) -> dict[str, Any]:
    """A JSON-serialisable dict (for JSONL sample dumps); `from_dict` inverts it."""
    return {
        "request_id": self.request_id, "group_id": self.group_id,
        "sample_index": self.sample_index, "example_id": self.example_id,
        "tokens": list(self.token_ids), "roles": list(self.role_ids),
        "logprobs": list(self.logprob_list), "turn_ids": list(self.turn_ids),
        "turns": [t.to_dict() for t in self.turns], "stop_reason": self.stop_reason,
        "truncated": self.truncated, "budgets": self.budgets(), "counts": self.counts(),
    }

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> Trajectory:
    counts = dict(d.get("counts", {}))
    traj = cls(request_id=int(d["request_id"]), group_id=int(d.get("group_id", -1)),
               sample_index=int(d.get("sample_index", 0)), example_id=d.get("example_id"),
               token_ids=[int(x) for x in d["tokens"]], role_ids=[int(x) for x in d["roles"]],
               logprob_list=[float(x) for x in d["logprobs"]],
               turn_ids=[int(x) for x in d["turn_ids"]],
               turns=[Turn.from_dict(t) for t in d.get("turns", [])],
               stop_reason=d.get("stop_reason", ""), truncated=bool(d.get("truncated", False)),
               tool_seconds=float(d.get("budgets", {}).get("tool_seconds", 0.0)),
               tool_calls=dict(counts.pop("tool_calls", {})))
    for k, v in counts.items():
      setattr(traj, k, None if v is None else int(v))
    return traj


def continuation_encoder(tokenizer):
  """The function that encodes text where it continues a trajectory's earlier tokens:
  `tokenizer.encode_continuation` (`Tokenizer.encode_continuation`: no start-of-input mark,
  which a Metaspace tokenizer with prepend_scheme="first" writes as a "▁"), or
  `tokenizer.encode` for a tokenizer without it. Byte-level BPE tokenizers give the same ids
  either way."""
  encode = getattr(tokenizer, "encode_continuation", None)
  return encode if callable(encode) else tokenizer.encode


def _continuation_ids(tokenizer, text: str, previous_id: int | None) -> list[int]:
  """`text` encoded by `continuation_encoder` after the id `previous_id`, passed on where the
  encoder takes it (`Tokenizer.encode_continuation`, `encode_marked`): tokenizers that mark each
  stretch of text between added tokens with a "▁" mark text after a control token ("<|im_end|>")
  but not text after text, as in the encoding of the whole rendering."""
  encode = continuation_encoder(tokenizer)
  try:
    takes_previous = "previous_id" in inspect.signature(encode).parameters
  except (TypeError, ValueError):  # a builtin or C function without a signature
    takes_previous = False
  return list(encode(text, previous_id=previous_id) if takes_previous else encode(text))


def data_continuation_ids(tokenizer, text: str) -> list[int]:
  """`text` as data that continues a trajectory (a program's output, retrieved documents):
  encoded by `continuation_encoder`, with special-token spellings ("<|im_end|>") kept as text
  where the tokenizer's `encode` takes `parse_special`, so data cannot close a turn."""
  encode = continuation_encoder(tokenizer)
  if "parse_special" in inspect.signature(tokenizer.encode).parameters:
    return list(encode(text, parse_special=False))
  return list(encode(text))


def demonstration_trajectory(prompt_ids: Sequence[int], segments: Sequence[tuple[int, str]],
                             tokenizer, *, request_id: int = -1, parser=None,
                             env=None) -> Trajectory:
  """A ledger for SFT from a task's worked example (`Env.demonstration`).

  `segments` are (role, text) pairs after the prompt, role POLICY or OBSERVATION; each text is
  tokenized on its own (there is no sampler here, so logprobs are 0). Loss masks follow roles as
  in rollouts, so SFT trains only the policy's text.

  With the task's `env`, observation texts are tokenized by `env.encode_observation`, as in
  rollouts, so a tool output that spells a special token ("<|im_end|>") stays text in both;
  `parser` defaults to `env.parser`. Without it, each text is tokenized with `tokenizer.encode`
  (special-token text parsed: right for chat-template framing such as a chat JSONL's turns).

  With the task's `parser` (`env.parser`), each policy turn is parsed as a rollout would parse
  it, so the ledger's turns carry their action, call and answer and its counts the tool calls
  (a call followed by an observation counts as a valid call of that tool, and as one that ran).
  Without it, turns have no action, the counts stay 0 and `distinct_ok_tool_calls` is None
  (not counted); the tokens and masks are the same either way.
  """
  if env is not None and parser is None:
    parser = getattr(env, "parser", None)
  # Without a parser no call is read, so none is counted: the distinct count is not known.
  traj = Trajectory(request_id=request_id, distinct_ok_tool_calls=None if parser is None else 0)
  traj.add_prompt(prompt_ids)
  call_keys: set[str] = set()
  for role, text in segments:
    if role == OBSERVATION and callable(getattr(env, "encode_observation", None)):
      ids = list(env.encode_observation(text, tokenizer))  # checked by the ledger
    else:  # the text continues the prompt and the turns before it
      ids = _continuation_ids(tokenizer, text, traj.token_ids[-1] if traj.token_ids else None)
    if role == POLICY:
      turn = len(traj.turns)
      span = traj.add_policy(ids, [0.0] * len(ids), turn)
      traj.turns.append(Turn(index=turn, policy_span=span, text=text, ended_by="demonstration"))
      if parser is not None:
        try:
          parsed = parser.parse(text)
        except Exception as e:  # noqa: BLE001 - as in rollouts: an unparsable turn is malformed
          parsed = ParseResult.malformed(f"the turn could not be parsed ({type(e).__name__})")
        traj.turns[-1].set_parse(parsed)
    elif role == OBSERVATION:
      if not traj.turns:
        raise ValueError("a demonstration must start with a POLICY segment, not an observation")
      last = traj.turns[-1]
      if last.observation_span is None and last.action is not None:
        traj.num_tool_calls += 1
        if last.action == "tool_call" and last.call is not None:
          traj.valid_tool_calls += 1
          key = tool_call_key(last.call.name, last.call.arguments)
          traj.repeated_tool_calls += key in call_keys
          traj.distinct_ok_tool_calls += key not in call_keys  # an observation: the call ran
          call_keys.add(key)
          traj.tool_calls[last.call.name] = traj.tool_calls.get(last.call.name, 0) + 1
        else:
          traj.tool_errors += 1
          traj.malformed_calls += last.action == "malformed"
      span = traj.add_observation(ids, last.index)
      if last.observation_span is not None:  # consecutive observation segments: one span
        span = (last.observation_span[0], span[1])
        text = (last.observation_text or "") + text
      last.observation_span, last.observation_text = span, text
    else:
      raise ValueError(f"demonstration segments must be POLICY or OBSERVATION, got role {role!r}")
  return traj
