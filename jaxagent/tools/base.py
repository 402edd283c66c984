"""The tool contract: `ToolResult`, the `Tool` protocol, argument checking and the registry.

Where this sits: a task (`jaxagent.envs`) owns a `ToolRegistry`; its `schemas()` go into the chat
template's `tools=` argument and `describe()` into plain-text prompts. The rollout driver
(`jaxagent.agent`) parses a tool call out of the policy's text, hands `(name, args)` to a
`jaxagent.tools.executors.ToolExecutor`, and appends `ToolResult.to_observation()` to the
trajectory as observation tokens. Every failure mode of a tool ends up as a `ToolResult` with
`ok=False`, never as an exception in the training loop (DESIGN decision 7).

A tool is any object with `name`, `description`, `parameters` (a JSON schema for an object) and
`__call__(args) -> ToolResult | str` (or `async def __call__`, whose result the executor awaits
in an event loop of the call's thread, cancelling it at the call's time limit). Optional attributes read by the executor: `timeout_s` (its
default per-call timeout), `execution` (`"thread"` for I/O-bound tools, `"process"` for
CPU-bound pure-Python tools that would otherwise hold the GIL), and `takes_timeout`: a thread
tool that sets it is called as `tool(args, timeout_s=limit)`, must stop itself within the limit
(the sandbox's `PythonTool` does), and is abandoned only `timeout_grace_s` (default 5 s) later.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import keyword
import math
import numbers
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, Protocol, runtime_checkable

Execution = Literal["thread", "process"]
_EXECUTIONS = ("thread", "process")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,63}$")


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What one tool call produced, as data.

    Attributes:
      ok: whether the call succeeded.
      output: the text the tool produced (for a failed call, whatever it produced before failing).
      error: why the call failed; required when `ok` is False, None when it is True.
      timed_out: the call was stopped at its time limit.
      truncated: `output` (or `error`) was cut to a size limit.
      duration_s: wall-clock seconds the call took.
    """

    ok: bool
    output: str = ""
    error: str | None = None
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0

    def __post_init__(self):
        if not isinstance(self.ok, bool):
            raise TypeError(f"ToolResult.ok must be a bool, got {type(self.ok).__name__}")
        if not isinstance(self.output, str):
            raise TypeError(f"ToolResult.output must be a str, got {type(self.output).__name__}")
        if self.error is not None and not isinstance(self.error, str):
            raise TypeError(f"ToolResult.error must be a str or None, got {type(self.error).__name__}")
        if not self.ok and not self.error:
            raise ValueError("ToolResult(ok=False) needs an error message saying what went wrong")

    @classmethod
    def success(cls, output: str, **extras: Any) -> ToolResult:
        return cls(ok=True, output=output, **extras)

    @classmethod
    def failure(cls, error: str, output: str = "", **extras: Any) -> ToolResult:
        return cls(ok=False, output=output, error=error, **extras)

    def to_observation(self) -> str:
        """The text a policy sees: the output, followed by the error when the call failed."""
        if self.ok:
            return self.output
        if self.output:
            return f"{self.output.rstrip()}\nError: {self.error}"
        return f"Error: {self.error}"


@runtime_checkable
class Tool(Protocol):
    """A callable tool. `parameters` is a JSON schema of `{"type": "object", ...}` form."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    def __call__(self, args: dict[str, Any]) -> ToolResult | str: ...


class UnknownToolError(KeyError):
    """Raised by `ToolRegistry.get` for a name that was never registered."""

    def __str__(self) -> str:  # KeyError would quote the whole message.
        return str(self.args[0]) if self.args else "unknown tool"


class ToolArgumentError(ValueError):
    """Tool-call arguments that do not match the tool's parameter schema."""


def truncate_text(text: str, max_chars: int) -> tuple[str, bool]:
    """Cuts `text` to at most `max_chars` characters, marking the cut; returns (text, truncated).

    The marker counts toward the limit; a limit too small to hold it cuts the text bare.
    """
    if len(text) <= max_chars:
        return text, False
    cut = len(text) - max_chars
    while True:  # the note names how many characters it replaced; its own length moves that count
        note = f"\n... [truncated {cut} characters]"
        if max_chars < len(note):
            return text[:max(0, max_chars)], True
        if len(text) - (max_chars - len(note)) == cut:
            return text[:max_chars - len(note)] + note, True
        cut = len(text) - (max_chars - len(note))


def normalize_result(value: Any, *, tool_name: str, max_output_chars: int | None = None) -> ToolResult:
    """Turns whatever a tool returned into a `ToolResult`; anything but str/ToolResult is an error.

    With `max_output_chars`, the output and the error are each cut to that many characters.
    """
    if isinstance(value, ToolResult):
        result = value
    elif isinstance(value, str):
        result = ToolResult(ok=True, output=value)
    else:
        return ToolResult.failure(
            f"tool {tool_name!r} returned {type(value).__name__}; a tool must return str or ToolResult"
        )
    if max_output_chars is not None:
        if (not isinstance(max_output_chars, numbers.Integral) or isinstance(max_output_chars, bool)
                or max_output_chars < 1):
            raise ValueError(f"max_output_chars must be an int >= 1 or None, got {max_output_chars!r}")
        output, cut_output = truncate_text(result.output, max_output_chars)
        error, cut_error = truncate_text(result.error, max_output_chars) if result.error else (result.error, False)
        if cut_output or cut_error:
            result = dataclasses.replace(result, output=output, error=error, truncated=True)
    return result


# --------------------------------------------------------------------------- argument schemas

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
    "null": (type(None),),
}


def schema_types(schema: Mapping[str, Any]) -> list[str]:
    """The JSON types an argument's schema declares, as a list (`"type": "string"` is
    `["string"]`); [] when it declares none (a `Literal[...]`'s enum, an `Any`). The schema's
    `type` must be a string or a list of strings, as the registry checks."""
    types_ = schema.get("type")
    if types_ is None:
        return []
    return [types_] if isinstance(types_, str) else list(types_)


def _check_value(name: str, value: Any, schema: Mapping[str, Any]) -> Any:
    options = schema_types(schema)
    if options:
        for option in options:
            types_ = _JSON_TYPES.get(option)
            if types_ is None:
                continue
            if isinstance(value, bool) and option in ("integer", "number"):
                continue  # JSON true is not a number.
            if isinstance(value, float) and option == "number" and not math.isfinite(value):
                continue  # NaN / Infinity: Python's json.loads reads them, but JSON has no such number.
            if isinstance(value, types_):
                break
            if option == "integer" and isinstance(value, float) and value.is_integer():
                value = int(value)  # Models often write 3.0 for an integer.
                break
        else:
            got = (f"{value!r} (NaN and Infinity are not JSON numbers)"
                   if isinstance(value, float) and not math.isfinite(value) else type(value).__name__)
            raise ToolArgumentError(f"argument {name!r} must be of type {' or '.join(options)}, got {got}")
    items = schema.get("items")
    if isinstance(value, (list, tuple)) and isinstance(items, Mapping) and items:
        # `function_tool` writes `items` for list[int]: the tool must not get ["a"] or [1.5].
        value = [_check_value(f"{name}[{i}]", item, items) for i, item in enumerate(value)]
    if "enum" in schema:
        # The member itself, matched as JSON compares: true is not 1 (Python's True == 1), and
        # 2.0 for a member 2 gives the tool 2.
        for member in schema["enum"]:
            if member == value and isinstance(member, bool) == isinstance(value, bool):
                return member
        raise ToolArgumentError(f"argument {name!r} must be one of {list(schema['enum'])}, got {value!r}")
    return value


def validate_arguments(parameters: Mapping[str, Any], args: Any) -> dict[str, Any]:
    """Checks tool-call arguments against an object schema; returns them, integral floats coerced.

    Covers the part of JSON Schema that tool specs use: required keys, unknown keys (when
    `additionalProperties` is false), primitive types, enums and the `items` schema of arrays.
    Raises `ToolArgumentError`. A null for an optional, declared argument whose schema does not
    allow null counts as not given (the tool's default applies): models write `"x": null` for an
    argument they leave unset.
    """
    if not isinstance(args, Mapping):
        raise ToolArgumentError(f"arguments must be a JSON object, got {type(args).__name__}")
    properties: Mapping[str, Any] = parameters.get("properties", {})
    required = set(parameters.get("required", ()))
    args = {key: value for key, value in args.items()
            if not (value is None and key in properties and key not in required
                    and not _allows_null(properties[key]))}
    missing = [key for key in parameters.get("required", ()) if key not in args]
    if missing:
        raise ToolArgumentError(f"missing required argument(s): {', '.join(missing)}")
    if parameters.get("additionalProperties", True) is False:
        unknown = [key for key in args if key not in properties]
        if unknown:
            allowed = ", ".join(properties) or "none"
            raise ToolArgumentError(f"unknown argument(s): {', '.join(map(str, unknown))} (allowed: {allowed})")
    return {key: _check_value(key, value, properties.get(key, {})) for key, value in args.items()}


def _allows_null(schema: Mapping[str, Any]) -> bool:
    # Both the type and the enum must admit null: `Literal["C", "F"]` is an enum with no type.
    type_ok = "type" not in schema or "null" in schema_types(schema)
    return type_ok and ("enum" not in schema or None in schema["enum"])


# --------------------------------------------------------------------------- function tools

def _schema_for_annotation(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}
    if origin is Literal:
        values = list(typing.get_args(annotation))
        bad = [v for v in values if v is not None and not isinstance(v, (str, bool, int, float))]
        if bad:
            # The schema goes to the chat template as JSON, and a call's arguments come back as
            # JSON: a value JSON has no spelling for could never be passed.
            raise TypeError(f"cannot describe parameter type {annotation!r} in a JSON schema: the "
                            f"Literal values {bad!r} are not JSON values (str, int, float, bool or "
                            "None); use their .value or name strings")
        return {"enum": values}
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _schema_for_annotation(members[0])
        return {}
    simple = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
              tuple: "array", dict: "object"}
    base = origin if origin is not None else annotation
    if base in simple:
        schema: dict[str, Any] = {"type": simple[base]}
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        # One items schema for list[X], tuple[X, ...] and tuple[X, X]; tuple[int, str] has none
        # (its first member's type would refuse the second).
        if base in (list, tuple) and args and all(a == args[0] for a in args):
            item = _schema_for_annotation(args[0])
            if item:
                schema["items"] = item
        return schema
    raise TypeError(f"cannot describe parameter type {annotation!r} in a JSON schema")


def _admits_none(annotation: Any) -> bool:
    """Whether `annotation` is a union with None (`int | None`, `Optional[...]`)."""
    return (typing.get_origin(annotation) in (typing.Union, types.UnionType)
            and type(None) in typing.get_args(annotation))


def _with_null(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` admitting null too (a schema without a type or enum admits it already)."""
    if "type" in schema:
        schema["type"] = [*schema_types(schema), "null"]
    if "enum" in schema and None not in schema["enum"]:
        schema["enum"] = [*schema["enum"], None]
    return schema


def _docstring_parts(doc: str | None) -> tuple[str, dict[str, str]]:
    """Splits a Google-style docstring into (summary paragraph, {arg name: description})."""
    doc = inspect.cleandoc(doc or "")
    summary = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    descriptions: dict[str, str] = {}
    match = re.search(r"^Args:\s*\n((?:[ \t]+.*\n?)+)", doc, flags=re.M)
    if match:
        current = None
        for line in match.group(1).splitlines():
            item = re.match(r"^\s{2,8}(\w+)(?:\s*\([^)]*\))?:\s*(.*)$", line)
            if item:
                current = item.group(1)
                descriptions[current] = item.group(2).strip()
            elif current and line.strip():
                descriptions[current] += " " + line.strip()
    return summary, descriptions


@dataclasses.dataclass(frozen=True)
class FunctionTool:
    """A `Tool` made from a plain function; arguments are checked against `parameters` first.

    Picklable (so usable with `execution="process"`) when `fn` is a module-level function.
    """

    fn: Callable[..., ToolResult | str]
    name: str
    description: str
    parameters: Mapping[str, Any]
    timeout_s: float | None = None
    execution: Execution = "thread"

    def __call__(self, args: dict[str, Any]) -> ToolResult | str:
        try:
            checked = validate_arguments(self.parameters, args)
        except ToolArgumentError as e:
            return ToolResult.failure(f"bad arguments for tool {self.name!r}: {e}")
        return self.fn(**checked)

    def __reduce__(self) -> tuple[Any, ...]:
        # `@function_tool` rebinds the function's module-level name to this tool, so pickle `fn`
        # by reference would find the tool instead of the function: pickle the tool by name.
        module = sys.modules.get(getattr(self.fn, "__module__", None) or "")
        target: Any = module
        for part in getattr(self.fn, "__qualname__", "<lambda>").split("."):
            target = getattr(target, part, None)
        if target is self:
            return _load_attribute, (self.fn.__module__, self.fn.__qualname__)
        if isinstance(target, FunctionTool) and target.fn is self.fn:
            # A variant of a decorated tool (`dataclasses.replace(tool, timeout_s=...)`,
            # `function_tool(tool.fn, name=...)`): its function is reachable only through that tool.
            fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "fn"}
            return _load_variant, (self.fn.__module__, self.fn.__qualname__, fields)
        return FunctionTool, tuple(getattr(self, f.name) for f in dataclasses.fields(self))


def _load_attribute(module: str, qualname: str) -> Any:
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _load_variant(module: str, qualname: str, fields: dict[str, Any]) -> FunctionTool:
    return FunctionTool(fn=_load_attribute(module, qualname).fn, **fields)


def function_tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = None,
    execution: Execution = "thread",
) -> Any:
    """Builds a `FunctionTool` from a typed function; usable as `@function_tool` or `@function_tool(...)`.

    The schema comes from the signature (str/int/float/bool/list/dict/Literal/Optional) and the
    description from the docstring's first paragraph, parameter descriptions from its `Args:`.
    `fn` may be an `async def` (the executor awaits it).
    """

    def build(f: Callable[..., Any]) -> FunctionTool:
        if not (inspect.isfunction(f) or inspect.ismethod(f)):
            # A partial or a callable object has no signature to read types from (get_type_hints
            # said only "... is not a module, class, method, or function").
            raise TypeError(f"function_tool takes a function (def or async def) or a method, got "
                            f"{type(f).__name__} {f!r:.200}; wrap it in a def with typed parameters, "
                            "or write a class tool (name, description, parameters, __call__)")
        summary, arg_docs = _docstring_parts(f.__doc__)
        hints = typing.get_type_hints(f)
        properties: dict[str, Any] = {}
        required: list[str] = []
        for param in inspect.signature(f).parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
                raise TypeError(f"{f.__qualname__}: tool parameters must be plain named parameters, "
                                f"not {param.kind.description} {param.name!r}")
            annotation = hints.get(param.name, inspect.Parameter.empty)
            prop = _schema_for_annotation(annotation)
            if _admits_none(annotation) and param.default is not None:
                # A null for `x: int | None = None` counts as not given, which is None: the
                # schema stays "integer". Without a default, or with another one, null must be
                # in the schema: a required `x: int | None` refused the null its signature
                # takes, and `x: int | None = 5` got 5 for an explicit null.
                prop = _with_null(prop)
            if param.name in arg_docs:
                prop["description"] = arg_docs[param.name]
            properties[param.name] = prop
            if param.default is inspect.Parameter.empty:
                required.append(param.name)
        parameters = {"type": "object", "properties": properties, "required": required,
                      "additionalProperties": False}
        tool_description = description if description is not None else summary
        if not tool_description:
            raise ValueError(f"{f.__qualname__}: give the tool a description (docstring or description=)")
        tool_ = FunctionTool(fn=f, name=name or f.__name__, description=tool_description,
                             parameters=parameters, timeout_s=timeout_s, execution=execution)
        check_tool(tool_)
        return tool_

    return build(fn) if fn is not None else build


def check_tool(tool: Any) -> None:
    """Raises TypeError/ValueError naming the problem when `tool` does not satisfy `Tool`."""
    name = getattr(tool, "name", None)
    if not isinstance(name, str) or not _NAME_RE.match(name) or keyword.iskeyword(name):
        raise ValueError(f"tool name {name!r} must match {_NAME_RE.pattern} (letters, digits, _ and -)")
    if not isinstance(getattr(tool, "description", None), str):
        raise TypeError(f"tool {name!r}: description must be a str")
    parameters = getattr(tool, "parameters", None)
    if not isinstance(parameters, Mapping) or parameters.get("type") != "object":
        raise TypeError(f"tool {name!r}: parameters must be a JSON schema dict with \"type\": \"object\"")
    _check_parameters(name, parameters)
    if not callable(tool):
        raise TypeError(f"tool {name!r} is not callable")
    execution = getattr(tool, "execution", "thread")
    if execution not in _EXECUTIONS:
        raise ValueError(f"tool {name!r}: execution must be one of {_EXECUTIONS}, got {execution!r}")
    timeout = getattr(tool, "timeout_s", None)
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"tool {name!r}: timeout_s must be a positive number or None, got {timeout!r}")


def _check_parameters(name: str, parameters: Mapping[str, Any]) -> None:
    """The parts of a parameter schema that `validate_arguments` reads, checked once at registration:
    a type it does not know (`"float"`, `"int"`) or a `required` that is a bare string would make
    every call fail with an argument error blamed on the policy."""
    properties = parameters.get("properties", {})
    if not isinstance(properties, Mapping) or not all(isinstance(p, Mapping) for p in properties.values()):
        raise TypeError(f"tool {name!r}: parameters['properties'] must map each argument name to a JSON schema "
                        f"dict, got {properties!r}")
    for key, spec in properties.items():
        while isinstance(spec, Mapping):  # the argument, then its array items (checked per call)
            types_ = spec.get("type")
            if not isinstance(types_, (str, list, tuple, type(None))) or not all(
                    isinstance(option, str) and option in _JSON_TYPES for option in schema_types(spec)):
                raise ValueError(f"tool {name!r}: argument {key!r} has type {types_!r}; a type is one of "
                                 f"{', '.join(_JSON_TYPES)}, or a list of them")
            spec, key = spec.get("items"), f"{key}[]"
    required = parameters.get("required", [])
    if not isinstance(required, (list, tuple)) or not all(isinstance(key, str) for key in required):
        raise TypeError(f"tool {name!r}: parameters['required'] must be a list of argument names, got {required!r}")


# --------------------------------------------------------------------------- registry

class ToolRegistry:
    """The tools a task offers, by name, in registration order."""

    def __init__(self, tools: Iterable[Tool] = ()):
        self._tools: dict[str, Tool] = {}
        for tool_ in tools:
            self.register(tool_)

    def register(self, tool: Tool) -> Tool:
        """Adds `tool`; raises ValueError if its name is taken. Returns the tool (decorator-friendly)."""
        check_tool(tool)
        if tool.name in self._tools:
            raise ValueError(f"a tool named {tool.name!r} is already registered")
        self._tools[tool.name] = tool
        return tool

    def get(self, name: str) -> Tool:
        try:
            return self._tools[name]
        except (KeyError, TypeError):
            available = ", ".join(self._tools) or "none"
            raise UnknownToolError(f"unknown tool {name!r}; available tools: {available}") from None

    def names(self) -> list[str]:
        return list(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """Function specs in the OpenAI/Qwen form that chat templates take as `tools=`."""
        return [{"type": "function",
                 "function": {"name": t.name, "description": t.description, "parameters": dict(t.parameters)}}
                for t in self._tools.values()]

    def describe(self) -> str:
        """A short plain-text listing, one line per tool: `- name(arg: type, opt?: type): description`.

        An argument with an `enum` (a `Literal[...]` parameter) shows its values as JSON, `"C" | "F"`;
        one with several types shows them as `string | null`; an array with an item schema shows it,
        `array of integer`; an argument with neither type nor values shows `any`.
        """
        lines = []
        for t in self._tools.values():
            props = t.parameters.get("properties", {})
            required = set(t.parameters.get("required", ()))
            args = ", ".join(f"{key}{'' if key in required else '?'}: {_describe_type(spec)}"
                             for key, spec in props.items())
            lines.append(f"- {t.name}({args}): {t.description}")
        return "\n".join(lines)


def _describe_type(spec: Mapping[str, Any]) -> str:
    """The type of one argument in `ToolRegistry.describe`."""
    if "enum" in spec:
        return " | ".join(json.dumps(value, ensure_ascii=False) for value in spec["enum"])
    options = schema_types(spec) or ["any"]
    items = spec.get("items")
    if "array" in options and isinstance(items, Mapping) and ("type" in items or "enum" in items):
        item = _describe_type(items)
        # (`list[int] | None`: "array of integer | null")
        options = [(f"array of ({item})" if " | " in item else f"array of {item}")
                   if option == "array" else option for option in options]
    return " | ".join(map(str, options))
