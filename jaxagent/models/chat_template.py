"""Chat-template rendering with jinja2, as Hugging Face renders it.

`tokenizer.Tokenizer.apply_chat_template` compiles a model's template here: a sandboxed
environment with `trim_blocks` / `lstrip_blocks`, the `raise_exception`, `tojson` and
`strftime_now` helpers and the `{% generation %}` tag, over messages normalised to plain data.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment


def plain(value: Any, where: str) -> Any:
  """A copy of `value` made of JSON-like Python types only, so the sandbox sees no foreign objects."""
  if value is None or type(value) in (str, int, float, bool):
    return value
  # Subclasses (str enums, ...) may carry methods the sandbox does not know; keep the plain value.
  if isinstance(value, str):
    return str.__str__(value)
  if isinstance(value, int):
    return int.__int__(value)
  if isinstance(value, float):
    return float.__float__(value)
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, Mapping):
    return {plain(k, where): plain(v, where) for k, v in value.items()}
  if isinstance(value, list):
    return [plain(v, where) for v in value]
  if isinstance(value, tuple):
    return tuple(plain(v, where) for v in value)
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: plain(getattr(value, f.name), where) for f in dataclasses.fields(value)}
  raise TypeError(f"{where} may only contain JSON-like values (dict, list, str, numbers, bool, None); "
                  f"got {type(value).__name__}")


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
    raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts, "
                    f"got {type(messages).__name__}")
  if not messages:
    raise ValueError("cannot render an empty conversation; pass at least one message")
  out = []
  for i, message in enumerate(messages):
    if not isinstance(message, Mapping):
      raise TypeError(f"messages[{i}] must be a dict with a 'role', got {type(message).__name__}")
    if not isinstance(message.get("role"), str):
      raise ValueError(f"messages[{i}] has no string 'role': {dict(message)!r}")
    # As transformers: drop None-valued keys (APIs send content=None with tool calls), and offer a
    # message's reasoning under the names templates read.
    message = plain({k: v for k, v in message.items() if v is not None}, f"messages[{i}]")
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
      message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    out.append(message)
  return out


# Marks where the final message's text ends, for `continue_final_message`. The trailing space
# shows whether the template kept the text as written or trimmed its end.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def tag_final_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """`messages` with a marker after the final message's text (its last text block for a list)."""
  last = dict(messages[-1])
  content = last.get("content")
  if isinstance(content, str):
    last["content"] = content + _CONTINUE_TAG
  elif isinstance(content, list):
    blocks = [dict(b) if isinstance(b, dict) else b for b in content]
    text_blocks = [b for b in blocks if isinstance(b, dict) and isinstance(b.get("text"), str)]
    if not text_blocks:
      raise ValueError("continue_final_message: the final message has no text block to continue")
    text_blocks[-1]["text"] += _CONTINUE_TAG
    last["content"] = blocks
  else:
    raise ValueError("continue_final_message: the final message has no 'content' to continue "
                     f"(got {type(content).__name__})")
  return messages[:-1] + [last]


def cut_at_final_message(text: str) -> str:
  """The rendering of `tag_final_message(...)` cut where the final message's text ends."""
  at = text.rfind(_CONTINUE_TAG.strip())
  if at < 0:
    raise ValueError("continue_final_message: the chat template does not write the final "
                     "message's content, so there is nothing to continue")
  # A template that trims the text also dropped its trailing whitespace: drop it here too.
  return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()


class _GenerationBlock(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` (marks assistant text in some templates): renders its body."""

  tags = {"generation"}

  def parse(self, parser: Any) -> jinja2.nodes.Node:
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

  def _render(self, caller: Any) -> str:
    return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
  """`namespace()` that refuses underscore-prefixed attributes (no route to Python internals)."""

  def __init__(*args: Any, **kwargs: Any):  # same signature trick as jinja2's Namespace
    self, args = args[0], args[1:]
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _TemplateNamespace._check(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name: str, value: Any) -> None:
    _TemplateNamespace._check(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


def _raise_exception(message: str) -> None:
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
  # Unlike jinja2's own filter: no HTML escaping, and json.dumps' formatting options.
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  return datetime.now().strftime(fmt)


class _TemplateDict:
  """`dict` for templates: `dict(...)` and `dict.fromkeys(...)`, nothing else of the type."""

  def __call__(self, *args: Any, **kwargs: Any) -> dict:
    return dict(*args, **kwargs)

  def fromkeys(self, *args: Any) -> dict:
    return dict.fromkeys(*args)


@functools.lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  env.globals["dict"] = _TemplateDict()
  env.globals["namespace"] = _TemplateNamespace
  try:
    return env.from_string(template)
  except jinja2.TemplateSyntaxError as e:
    raise ValueError(f"invalid chat template (line {e.lineno}): {e.message}") from e
