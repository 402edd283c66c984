"""Tool-call parsers: what the policy asked for at the end of a turn.

Where this sits: the rollout driver (`agent/rollout.py`) stops a turn when the policy writes one
of the parser's `stop_strings()` (closing tags such as `</search>` or `</tool_call>`), decodes the
turn's tokens and calls `parse(text)`. The result says what to do next:

* `ParseResult.kind == "tool_call"`: run `call` (a `ToolCall`) and append its observation;
* `"answer"`: the trajectory is finished with a final answer;
* `"text"`: no call and no answer (the trajectory ends; the driver records why);
* `"malformed"`: the policy tried to call a tool but the call cannot be read. `error` is written
  for the model: the driver shows it as an error observation and counts it, so a malformed call is
  data, never an exception (DESIGN decision 7).

Two conventions are provided:

* `XMLTagParser`: Search-R1 / ReTool style tags, `<search>query</search>`, `<code>...</code>`,
  `<answer>...</answer>`, each tag mapped to a tool and the argument its body fills;
* `JSONToolCallParser`: the Qwen / Hermes convention,
  `<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>`.

Both act only on the LAST complete block that ends the turn text (only whitespace may follow it),
because the driver stops the turn right after a closing tag; earlier blocks are history. A block
runs from its opening tag to the first closing tag of the same name, and the first block to open
hides what it holds: an opening tag written inside a body is body text (`<code>s = "<code>"</code>`
runs `s = "<code>"`; `<tool_call>` inside a JSON string argument stays in the string; a call
body that is no JSON, though, is read from its last `<tool_call>`, so that the tag named in the
reasoning before a call or written twice does not spoil the call). An answer block is read as
the rewards read it (`rewards.verifiers.extract_tagged`): from the last answer tag inside the
block (`<answer>so <answer>42</answer>` answers "42"). A tag never closed hides nothing from a
block after it; a turn that ends inside one is "malformed". `parse` never raises on any input
string (see the hypothesis fuzz tests) and is linear in the text.

Reasoning models (Qwen3 style) think in a `<think>...</think>` block before they act. With
`XMLTagParser(..., think_tag="think")` or `JSONToolCallParser(think_tag="think")` what is
written while thinking is not an action, as the
rewards judge it (`FormatConfig.think_tag`, math_tool's answer): `parse` reads the text without
its think blocks, and `stop_allowed(text)` (an optional parser method that the driver calls when
a stop string matches) keeps a turn going while a think block is still open, so a closing tag
written in thought does not end it. A parser whose `may_refuse_stops` is False (an optional
attribute; either parser without a think_tag) is never asked.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal, Mapping, Protocol, Sequence, runtime_checkable

ActionKind = Literal["tool_call", "answer", "text", "malformed"]
_KINDS = ("tool_call", "answer", "text", "malformed")
_TAG_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
_ECHO_CHARS = 120  # how much of a bad call an error message quotes back to the model


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """A parsed call: tool name, JSON-like arguments, and the raw block it came from."""

  name: str
  arguments: dict[str, Any]
  raw: str = ""

  def to_dict(self) -> dict[str, Any]:
    return {"name": self.name, "arguments": self.arguments, "raw": self.raw}


@dataclasses.dataclass(frozen=True)
class ParseResult:
  """What a turn's text asks for (see the module docstring for the four kinds).

  Attributes:
    kind: "tool_call", "answer", "text" or "malformed".
    call: the call, when kind is "tool_call".
    answer: the final answer's text, when kind is "answer".
    error: for "malformed", a message addressed to the model saying what was wrong.
    raw: the block the result was read from ("" for "text").
  """

  kind: ActionKind
  call: ToolCall | None = None
  answer: str | None = None
  error: str | None = None
  raw: str = ""

  def __post_init__(self):
    if self.kind not in _KINDS:
      raise ValueError(f"ParseResult.kind must be one of {_KINDS}, got {self.kind!r}")
    if (self.kind == "tool_call") != (self.call is not None):
      raise ValueError("ParseResult: `call` is set exactly when kind == 'tool_call'")
    if self.kind == "malformed" and not self.error:
      raise ValueError("ParseResult(kind='malformed') needs an error message for the model")

  @classmethod
  def text(cls) -> ParseResult:
    return cls("text")

  @classmethod
  def malformed(cls, error: str, raw: str = "") -> ParseResult:
    return cls("malformed", error=error, raw=raw)

  def to_dict(self) -> dict[str, Any]:
    return {"kind": self.kind, "call": None if self.call is None else self.call.to_dict(),
            "answer": self.answer, "error": self.error}


@runtime_checkable
class Parser(Protocol):
  """What the rollout driver needs from a parser."""

  def parse(self, text: str) -> ParseResult:
    """The action at the end of `text` (one turn of policy output). Never raises."""
    ...

  def stop_strings(self) -> list[str]:
    """Strings that end a turn (the engine's host-side stop strings)."""
    ...


def _quote(text: str) -> str:
  """A short, single-line rendering of model text for an error message."""
  text = text.strip()
  if len(text) > _ECHO_CHARS:
    text = text[:_ECHO_CHARS] + "..."
  return json.dumps(text, ensure_ascii=False)


def _check_tag(owner: str, tag: str) -> None:
  if not isinstance(tag, str) or not _TAG_RE.fullmatch(tag):
    raise ValueError(f"{owner}: tag {tag!r} must be a bare tag name like 'search' (letters, digits, "
                     "'_' and '-', not starting with a digit)")


def _last_closing(text: str, tags: Sequence[str]) -> tuple[str, int] | None:
  """(tag, start index of `</tag>`) for a closing tag followed only by whitespace, or None."""
  end = len(text.rstrip())
  for tag in tags:
    close = f"</{tag}>"
    if text.endswith(close, 0, end):
      return tag, end - len(close)
  return None


def _block_spans(text: str, tags: Sequence[str], *, until: str | None = None,
                 skip_unclosed: Sequence[str] = ()) -> list[tuple[str, int, int, bool]]:
  """(tag, start, end, closed) of each `<tag>...</tag>` block of `text`, in order.

  A block runs from its opening tag to the first closing tag of the same name; the first block to
  open hides what it holds. One never closed runs to where `<until>` next opens, or to the end of
  the text; a tag in `skip_unclosed` left open is no block, and the scan goes on after it. Linear
  in the text, however many tags are left open (a regex that looked for each one's close was
  quadratic: seconds on a degenerate 100k-character output).
  """
  opening = re.compile("<(" + "|".join(re.escape(t) for t in tags) + ")>")
  last_close = {t: text.rfind(f"</{t}>") for t in tags}
  spans, pos = [], 0
  while (m := opening.search(text, pos)) is not None:
    tag = m.group(1)
    close = text.find(f"</{tag}>", m.end()) if last_close[tag] >= m.end() else -1
    if close >= 0:
      end = close + len(tag) + 3
    elif tag in skip_unclosed:
      pos = m.end()
      continue
    else:
      nxt = text.find(f"<{until}>", m.end()) if until is not None else -1
      end = nxt if nxt >= 0 else len(text)
    spans.append((tag, m.start(), end, close >= 0))
    pos = end
  return spans


def _without(text: str, spans: Sequence[tuple[str, int, int, bool]], tag: str) -> str:
  """`text` without the spans of `tag`."""
  parts, pos = [], 0
  for t, start, end, _ in spans:
    if t == tag:
      parts.append(text[pos:start])
      pos = end
  parts.append(text[pos:])
  return "".join(parts)


def _final_block(text: str, tags: Sequence[str],
                 answer_tag: str | None) -> ParseResult | tuple[str, int, int]:
  """(tag, opening start, closing start) of the block that ends `text`, or the ParseResult when
  there is none ("text", or "malformed" for a tag left open or a stray closing tag).

  The blocks are those of `_block_spans`: an opening tag inside a body is body text, so the
  closing tag at the end belongs to the first opening tag after the previous block (the last
  opening tag before it cut `<code>s = "<code>"</code>` to `"`). An answer starts at its last
  opening tag inside its block, as `extract_tagged` reads it for the reward.
  """
  found = _last_closing(text, tags)
  if found is None:
    spans = _block_spans(text, tags)  # one never closed runs to the end of the text
    if spans and not spans[-1][3]:
      tag, start = spans[-1][:2]
      return ParseResult.malformed(f"<{tag}> was opened but never closed; write <{tag}>...</{tag}>.",
                                   raw=text[start:])
    return ParseResult.text()
  tag, close_at = found
  end = close_at + len(tag) + 3
  spans = _block_spans(text, tags, skip_unclosed=tags)
  if not spans or spans[-1][2] != end:  # the closing tag at the end closes no block
    opened = text.rfind(f"<{tag}>", 0, close_at)
    if opened < 0:
      # An opening tag with attributes or in other case ('<search query="x">', '<Search>') is
      # no opening tag; the error names the last one written, or the model hears it wrote none.
      near = None
      for near in re.finditer(rf"<{re.escape(tag)}(?:\s[^<>]*)?>", text[:close_at], re.IGNORECASE):
        pass
      seen = f" ({_quote(near.group())} is not one)" if near is not None else ""
      return ParseResult.malformed(f"</{tag}> has no matching <{tag}>{seen}; write "
                                   f"<{tag}>...</{tag}>.", raw=text[max(0, close_at - _ECHO_CHARS):end])
    return ParseResult.malformed(f"unbalanced <{tag}> tags: {_quote(text[opened:end])}",
                                 raw=text[opened:end])
  opened = spans[-1][1]
  if tag == answer_tag:
    opened = text.rfind(f"<{tag}>", opened, close_at)
  return tag, opened, close_at


class _Thinking:
  """The think-block handling that `XMLTagParser` and `JSONToolCallParser` share (see their
  `think_tag`): blocks of `think_tag` are free text, hidden from `parse`, and a stop string
  matched while one is open does not end the turn."""

  think_tag: str | None = None
  answer_tag: str | None = None
  _hiding: tuple[str, ...] = ()

  def _set_think_tag(self, who: str, think_tag: str | None, call_tags: Sequence[str]) -> None:
    if think_tag is not None:
      _check_tag(f"{who}.think_tag", think_tag)
      if think_tag in call_tags or think_tag == self.answer_tag:
        raise ValueError(f"{who}: think_tag {think_tag!r} is also a tool tag or the answer "
                         "tag; give the reasoning block a tag of its own")
    self.think_tag = think_tag
    # Think and call blocks (`_block_spans`): the first to open hides what it holds.
    self._hiding = (think_tag, *call_tags) if think_tag is not None else ()

  @property
  def may_refuse_stops(self) -> bool:
    """Whether `stop_allowed` can ever return False (only with a think_tag): the driver skips
    the hook, and the decode of the turn it needs, when it cannot."""
    return self.think_tag is not None

  def stop_allowed(self, text: str) -> bool:
    """Whether a stop string that ends `text` (the turn so far) may end the turn: not while a
    think block is open. Always True without a think_tag."""
    if self.think_tag is None or not isinstance(text, str):
      return True
    spans = _block_spans(text, self._hiding)  # one never closed runs to the end
    return not (spans and spans[-1][0] == self.think_tag and not spans[-1][3])

  def _without_thinking(self, text: str) -> str:
    """`text` without its think blocks: what was written while thinking is not an action."""
    if self.think_tag is None:
      return text
    return _without(text, _block_spans(text, self._hiding, until=self.answer_tag), self.think_tag)


class XMLTagParser(_Thinking):
  """Tags mapped to tools, e.g. `<search>query</search>` -> `search(query=...)`.

  Args:
    tools: tag -> (tool name, argument name), e.g. `{"search": ("search", "query"),
      "code": ("python", "code"), "calc": ("calculator", "expression")}`.
    answer_tag: the tag of a final answer (None: the task has no answer tag).
    strip: strip surrounding whitespace from a block's body (code keeps its inner layout).
    think_tag: the tag of a reasoning block, e.g. "think" (None: no such block, every tag is
      read wherever it is). Its blocks are free text: a tool or answer tag inside one is not a
      call or an answer, and a stop string matched while one is open does not end the turn
      (`stop_allowed`). The first block to open hides what it holds: a `<think>` inside a call's
      body is part of the call. A think block never closed (the turn ended by EOS or a budget)
      runs to where an answer tag opens, or to the end of the text: an answer written after it is
      read, as math_tool's reward reads it, and a call inside it is not.
  """

  def __init__(self, tools: Mapping[str, tuple[str, str]], answer_tag: str | None = "answer", *,
               strip: bool = True, think_tag: str | None = None):
    if not isinstance(tools, Mapping):
      raise TypeError(f"XMLTagParser.tools must map tag -> (tool name, argument name), got {tools!r}")
    self.tools: dict[str, tuple[str, str]] = {}
    for tag, target in tools.items():
      _check_tag("XMLTagParser.tools", tag)
      if (not isinstance(target, (tuple, list)) or len(target) != 2
          or not all(isinstance(x, str) and x for x in target)):
        raise ValueError(f"XMLTagParser.tools[{tag!r}] must be (tool name, argument name), got {target!r}")
      self.tools[tag] = (target[0], target[1])
    if answer_tag is not None:
      _check_tag("XMLTagParser.answer_tag", answer_tag)
      if answer_tag in self.tools:
        raise ValueError(f"XMLTagParser: {answer_tag!r} is both a tool tag and the answer tag")
    if not self.tools and answer_tag is None:
      raise ValueError("XMLTagParser needs at least one tool tag or an answer tag")
    self.answer_tag = answer_tag
    self.strip = strip
    self._set_think_tag("XMLTagParser", think_tag, list(self.tools))
    # Longest first so that a tag that is a suffix of another (`q` vs `subq`) never shadows it.
    self._tags = sorted([*self.tools, *([answer_tag] if answer_tag else [])], key=len, reverse=True)

  def __repr__(self) -> str:
    think = f", think_tag={self.think_tag!r}" if self.think_tag is not None else ""
    return f"XMLTagParser(tools={self.tools}, answer_tag={self.answer_tag!r}{think})"

  def stop_strings(self) -> list[str]:
    return [f"</{t}>" for t in [*self.tools, *([self.answer_tag] if self.answer_tag else [])]]

  def parse(self, text: str) -> ParseResult:
    if not isinstance(text, str):
      return ParseResult.malformed(f"expected text, got {type(text).__name__}")
    text = self._without_thinking(text)
    found = _final_block(text, self._tags, self.answer_tag)
    if isinstance(found, ParseResult):
      return found
    tag, opened, close_at = found
    raw = text[opened:close_at + len(tag) + 3]
    body = text[opened + len(tag) + 2:close_at]
    if self.strip:
      body = body.strip()
    if tag == self.answer_tag:
      return ParseResult("answer", answer=body, raw=raw)
    tool, arg = self.tools[tag]
    if not body.strip():
      return ParseResult.malformed(f"empty <{tag}></{tag}> block: put the {arg} for {tool} inside the tags.",
                                   raw=raw)
    return ParseResult("tool_call", call=ToolCall(tool, {arg: body}, raw), raw=raw)


class JSONToolCallParser(_Thinking):
  """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen / Hermes).

  `arguments` may be omitted (no arguments) or be a JSON-encoded object string (OpenAI style).
  Any other key (say Llama-style "parameters") makes the call malformed rather than dropped.
  Unknown tool names are not checked here: the driver reports them from the task's registry.

  Args:
    tag: the wrapping tag.
    answer_tag: an optional final-answer tag (None: a turn without a call is plain text).
    think_tag: the tag of a reasoning block, e.g. "think" for Qwen3 (None: no such block). As
      for `XMLTagParser`: a call or answer written inside one is not read, and a stop string
      matched while one is open does not end the turn.
  """

  def __init__(self, tag: str = "tool_call", answer_tag: str | None = None, *,
               think_tag: str | None = None):
    _check_tag("JSONToolCallParser.tag", tag)
    if answer_tag is not None:
      _check_tag("JSONToolCallParser.answer_tag", answer_tag)
      if answer_tag == tag:
        raise ValueError(f"JSONToolCallParser: {tag!r} is both the call tag and the answer tag")
    self.tag = tag
    self.answer_tag = answer_tag
    self._tags = [t for t in (tag, answer_tag) if t]
    self._set_think_tag("JSONToolCallParser", think_tag, [tag])

  def __repr__(self) -> str:
    think = f", think_tag={self.think_tag!r}" if self.think_tag is not None else ""
    return f"JSONToolCallParser(tag={self.tag!r}, answer_tag={self.answer_tag!r}{think})"

  def stop_strings(self) -> list[str]:
    return [f"</{t}>" for t in self._tags]

  def parse(self, text: str) -> ParseResult:
    if not isinstance(text, str):
      return ParseResult.malformed(f"expected text, got {type(text).__name__}")
    text = self._without_thinking(text)
    found = _final_block(text, sorted(self._tags, key=len, reverse=True), self.answer_tag)
    if isinstance(found, ParseResult):
      return found
    tag, opened, close_at = found
    raw = text[opened:close_at + len(tag) + 3]
    body = text[opened + len(tag) + 2:close_at]
    if tag == self.answer_tag:
      return ParseResult("answer", answer=body.strip(), raw=raw)
    # The block opens at the first `<tool_call>`; one the model wrote before its call (named in
    # its reasoning, or the tag written twice) makes the body no JSON. Then the call is read
    # from the last opening tag inside, if that part is JSON (a tag inside a JSON string of a
    # body that parses stays in the string).
    opening = f"<{self.tag}>"
    inner_at = body.rfind(opening)
    if inner_at >= 0 and not _is_json(body) and _is_json(body[inner_at + len(opening):]):
      return self._parse_call(body[inner_at + len(opening):], raw[len(opening) + inner_at:])
    return self._parse_call(body, raw)

  def _parse_call(self, body: str, raw: str) -> ParseResult:
    form = f'<{self.tag}>{{"name": "<tool>", "arguments": {{...}}}}</{self.tag}>'
    if not body.strip():
      return ParseResult.malformed(f"empty <{self.tag}> block; write {form}", raw=raw)
    try:
      obj = json.loads(body)
    except json.JSONDecodeError as e:
      # A Markdown fence around the object is the usual cause of "Expecting value at line 1".
      fence = " without a ``` fence" if body.lstrip().startswith("`") else ""
      return ParseResult.malformed(
          f"invalid JSON in <{self.tag}>: {e.msg} at line {e.lineno} column {e.colno}; write "
          f"{form}{fence}", raw=raw)
    except (ValueError, RecursionError, TypeError) as e:  # e.g. over-long integers, deep nesting
      return ParseResult.malformed(f"invalid JSON in <{self.tag}>: {type(e).__name__}: {str(e)[:200]}",
                                   raw=raw)
    if not isinstance(obj, dict):
      return ParseResult.malformed(
          f"the <{self.tag}> body must be a JSON object with \"name\" and \"arguments\", "
          f"got a JSON {_json_type(obj)}", raw=raw)
    name = obj.get("name")
    if "name" not in obj:
      return ParseResult.malformed(f"the call has no \"name\"; write {form}", raw=raw)
    if not isinstance(name, str) or not name.strip():
      return ParseResult.malformed(f"\"name\" must be a non-empty string, got {_quote(json.dumps(name))}",
                                   raw=raw)
    # A key the call has no use for would be dropped without a word: Llama-style "parameters"
    # ran the tool without the arguments the model gave (or failed on a "missing" one).
    extra = [k for k in obj if k not in ("name", "arguments")]
    if extra:
      keys = ", ".join(_quote(k) for k in extra[:3]) + (", ..." if len(extra) > 3 else "")
      return ParseResult.malformed(
          f"unexpected key(s) {keys} in the call: it has only \"name\" and \"arguments\" (the "
          f"tool's arguments go inside \"arguments\"); write {form}", raw=raw)
    args = obj.get("arguments", {})
    if isinstance(args, str):  # OpenAI style: the arguments object encoded as a string
      try:
        args = json.loads(args) if args.strip() else {}
      except (ValueError, RecursionError, TypeError) as e:
        msg = e.msg if isinstance(e, json.JSONDecodeError) else type(e).__name__
        return ParseResult.malformed(f"\"arguments\" is a string but not a JSON object: {msg}", raw=raw)
    if args is None:
      args = {}
    if not isinstance(args, dict):
      return ParseResult.malformed(f"\"arguments\" must be a JSON object, got a JSON {_json_type(args)}",
                                   raw=raw)
    return ParseResult("tool_call", call=ToolCall(name.strip(), args, raw), raw=raw)


def _is_json(text: str) -> bool:
  try:
    json.loads(text)
  except (ValueError, RecursionError, TypeError):
    return False
  return True


def _json_type(value: Any) -> str:
  if isinstance(value, bool):
    return "boolean"
  if isinstance(value, (int, float)):
    return "number"
  names = {str: "string", list: "array", dict: "object", type(None): "null"}
  return names.get(type(value), type(value).__name__)
