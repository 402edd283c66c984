"""The per-observation token cap (`RolloutConfig.max_observation_tokens`): a tool's result cut to
a number of the model's tokens before the task wraps and tokenizes it.

Where this sits: the rollout driver calls `cap_result` on each finished call's `ToolResult`,
before `Env.format_observation` and `Env.encode_observation`. A search tool that returns many
passages, or a program that prints a lot, would otherwise fill the trajectory's KV cache (and
end the trajectory, when an observation does not fit the total budget).

What is cut is the tool's text (`ToolResult.output`, and for a failed call its `error`), never
the task's wrapper around it: the template's tags or the chat template's turn frame are added
afterwards, so the model still sees a well-formed turn. Where text was cut, a marker stands in
its place (`truncation_marker`: "...[N tokens truncated]...", N the tokens removed), so the
policy can see (and learn) that it happened. The sides (`observation_truncation`):

  "right"   keeps the head:          head + marker
  "left"    keeps the tail:          marker + tail
  "middle"  keeps the head and tail: head + marker + tail (half each, the head one more)

Tokens are counted as the task's data is encoded (`data_continuation_ids`: a continuation,
special-token spellings as text), on the tool's text alone. The cut is made on those token ids
and the kept ids are decoded back to text, which the task then wraps and tokenizes once with
`encode_observation`, so the ids in the ledger are exactly the ids in the KV cache. A long
result is tokenized once here, as an uncapped observation would have been by
`encode_observation`; after that only the short cut text is. The cut text is re-counted and
shortened until it fits. Because the text is counted on its own, the wrapped observation can
tokenize its first or last token together with the wrapper's neighbouring character (a token
more or less at each edge); a cut inside a multi-byte character drops that character's bytes
(they would decode to U+FFFD).

A failed call's error says what went wrong, so it is kept over the output printed before it:
the output gets the room the error leaves (just the marker when that is all that fits); when
not even the marker fits beside the error, the output is dropped and the error is cut, its
marker counting the output's tokens too.

A task's own `format_observation` and `encode_observation` receive the capped result (its
`truncated` flag set) and are used as they are: what they add around the result is not counted,
and their ids are never cut (cutting ids would cut the wrapper). A task whose format puts text
of its own in an observation (not from the `ToolResult`) bounds that text itself. Worked
examples (`Env.demonstration`, the SFT warm start) are the task's own text and are not cut: a
demonstration's next turn may quote what a cut would remove.

Recorded: `Turn.observation_truncated_tokens` (tokens cut from the turn's result; its `outcome`
holds the text as cut), `Trajectory.truncated_observations` (cut observations appended) and the
metrics `rollout/truncated_observations`, `rollout/truncated_observation_rate` and
`rollout/truncated_observation_tokens`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Literal

from jaxagent.agent.trajectory import data_continuation_ids
from jaxagent.tools import ToolResult

# The sides `RolloutConfig.observation_truncation` may name, and the part each keeps.
TruncationSide = Literal["left", "right", "middle"]
TRUNCATION_SIDES = {"left": "the tail", "right": "the head", "middle": "the head and the tail"}


def truncation_marker(removed: int) -> str:
  """The text that stands where `removed` tokens of a tool's output were cut."""
  return f"...[{removed} tokens truncated]..."


def _clean(text: str) -> str:
  """Text the tokenizer can encode: lone surrogates (e.g. from JSON escapes) become '?'."""
  return text.encode("utf-8", "replace").decode("utf-8")


def marker_tokens(tokenizer, removed: int = 10**9 - 1) -> int:
  """Tokens of `truncation_marker(removed)` (by default a 9-digit count: room enough for any
  count the cap can meet) with `tokenizer`, counted as tool output is."""
  return len(data_continuation_ids(tokenizer, truncation_marker(removed)))


def _strip_partial(text: str, head: bool) -> str:
  """`text` without the U+FFFD that a cut inside a multi-byte character decodes to, at its cut
  end (the end of a head, the start of a tail)."""
  if head:
    return text.rstrip("\ufffd")
  return text.lstrip("\ufffd")


def cut_text(text: str, budget: int, side: TruncationSide, tokenizer, *,
             removed_elsewhere: int = 0, ids: list[int] | None = None) -> tuple[str, int]:
  """`text` cut to at most `budget` tokens (counted as tool output is), with the marker where it
  was cut; returns (text, tokens removed). A text that fits is returned as is, with 0. A budget
  that holds the marker alone gives the marker alone. `removed_elsewhere` tokens (of text
  dropped whole) are added to the marker's count and to the count returned. `ids`: the text's
  ids where the caller has them (a long text is tokenized once)."""
  count: Callable[[str], int] = lambda s: len(data_continuation_ids(tokenizer, s))
  if ids is None:
    ids = data_continuation_ids(tokenizer, text)
  n = len(ids)
  if n <= budget:
    return text, 0
  keep = max(budget - marker_tokens(tokenizer, n + removed_elsewhere), 0)
  while True:
    head_n = {"right": keep, "left": 0, "middle": keep - keep // 2}[side]
    tail_n = keep - head_n
    head = _strip_partial(tokenizer.decode(ids[:head_n]), True) if head_n else ""
    tail = _strip_partial(tokenizer.decode(ids[n - tail_n:]), False) if tail_n else ""
    removed = n - head_n - tail_n + removed_elsewhere
    out = head + truncation_marker(removed) + tail
    over = count(out) - budget
    if over <= 0 or keep == 0:  # (the marker alone is what the caller's budget must hold)
      return out, removed
    keep = max(keep - over, 0)


def cap_result(result: ToolResult, cap: int, side: TruncationSide,
               tokenizer) -> tuple[ToolResult, int]:
  """`result` with its text (`to_observation()`) cut to at most `cap` tokens, `truncated` set;
  returns (result, tokens removed). A result that fits is returned as is, with 0. See the
  module docstring for what is kept of a failed call."""
  count = lambda s: len(data_continuation_ids(tokenizer, s))
  if result.ok:  # (cut_text counts the output once, and returns one that fits as it is)
    output, removed = cut_text(_clean(result.output), cap, side, tokenizer)
    if not removed:
      return result, 0
    return dataclasses.replace(result, output=output, truncated=True), removed
  output, error = _clean(result.output.rstrip()), _clean(result.error)
  # Each part is tokenized once; the whole text is counted only when the parts' counts leave
  # it near the cap (joining them merges a token or two at most).
  out_ids = data_continuation_ids(tokenizer, output) if output else []
  err_ids = data_continuation_ids(tokenizer, error)
  n_out, n_err, prefix = len(out_ids), len(err_ids), count("Error: ")
  if (n_out + n_err + prefix + 1 <= cap + 8
      and count(_clean(result.to_observation())) <= cap):
    return result, 0
  budget = cap
  for _ in range(8):  # a token more where the pieces merge when joined: cut that much deeper
    # The error whole, and the output in the room it leaves (a marker at least).
    room = budget - prefix - count("\n") - n_err if output else -1
    if output and room >= marker_tokens(tokenizer, n_out):
      cut_output, removed = cut_text(output, room, side, tokenizer, ids=out_ids)
      capped = dataclasses.replace(result, output=cut_output, truncated=True)
    else:  # the output dropped, the error cut (at least a token, so that a marker shows)
      cut_error, removed = cut_text(error, min(budget - prefix, n_err - 1), side, tokenizer,
                                    removed_elsewhere=n_out, ids=err_ids)
      capped = dataclasses.replace(result, output="", error=cut_error, truncated=True)
    over = count(capped.to_observation()) - cap
    if over <= 0:
      break
    budget -= over
  return capped, removed


def min_cap(tokenizer) -> int:
  """The smallest cap `cap_result` keeps with `tokenizer`: a failed call's "Error: ", a marker
  and a token of text."""
  return len(data_continuation_ids(tokenizer, "Error: ")) + marker_tokens(tokenizer) + 1
