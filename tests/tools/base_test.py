"""Tests for jaxagent/tools/base.py: ToolResult, argument checking, function tools, the registry."""

import dataclasses
import functools
import json
import pickle
from typing import Literal

import pytest

from jaxagent.tools.base import (
    ToolArgumentError,
    ToolRegistry,
    ToolResult,
    UnknownToolError,
    function_tool,
    normalize_result,
    truncate_text,
    validate_arguments,
)


@function_tool
def lookup(city: str, days: int = 1, units: Literal["C", "F"] = "C", detailed: bool | None = None) -> str:
    """Look up the weather forecast.

    Args:
      city: Name of the city.
      days: How many days to forecast,
        counted from today.
    """
    return f"{city}:{days}:{units}:{detailed}"


def test_tool_result_validates_fields():
    assert ToolResult.success("x") == ToolResult(ok=True, output="x")
    with pytest.raises(ValueError, match="needs an error message"):
        ToolResult(ok=False)
    with pytest.raises(TypeError, match="output must be a str"):
        ToolResult(ok=True, output=3)
    with pytest.raises(TypeError, match="ok must be a bool"):
        ToolResult(ok=1, output="")


def test_to_observation_shows_output_then_error():
    assert ToolResult.success("42").to_observation() == "42"
    assert ToolResult.failure("boom").to_observation() == "Error: boom"
    assert ToolResult.failure("boom", output="partial\n").to_observation() == "partial\nError: boom"


def test_normalize_result_rejects_garbage_and_truncates():
    assert normalize_result("hi", tool_name="t") == ToolResult(ok=True, output="hi")
    bad = normalize_result({"a": 1}, tool_name="t")
    assert not bad.ok and "returned dict" in bad.error
    assert not normalize_result(None, tool_name="t").ok
    long = normalize_result("x" * 1000, tool_name="t", max_output_chars=100)
    assert long.truncated and len(long.output) <= 100 and "truncated 9" in long.output
    text, cut = truncate_text("abc", 3)
    assert (text, cut) == ("abc", False)


def test_truncation_respects_the_cap_and_covers_errors():
    for cap in (1, 5, 20, 40, 100):
        text, cut = truncate_text("é" * 1000, cap)
        assert cut and len(text) <= cap, (cap, text)
    failed = normalize_result(ToolResult.failure("e" * 5000, output="o" * 5000), tool_name="t", max_output_chars=100)
    assert failed.truncated and len(failed.output) <= 100 and len(failed.error) <= 100
    assert failed.to_observation().count("truncated") == 2
    for text in (failed.output, failed.error):  # the note counts the characters it replaced
        kept, note = text.split("\n... [truncated ")
        assert len(kept) + int(note.split()[0]) == 5000, text
    short = normalize_result(ToolResult.failure("short"), tool_name="t", max_output_chars=100)
    assert short == ToolResult.failure("short")
    with pytest.raises(ValueError, match="max_output_chars"):
        normalize_result("x", tool_name="t", max_output_chars=0)


def test_function_tool_schema_from_signature_and_docstring():
    assert lookup.name == "lookup"
    assert lookup.description == "Look up the weather forecast."
    params = lookup.parameters
    assert params["required"] == ["city"]
    assert params["additionalProperties"] is False
    assert params["properties"]["city"] == {"type": "string", "description": "Name of the city."}
    assert params["properties"]["days"] == {"type": "integer",
                                            "description": "How many days to forecast, counted from today."}
    assert params["properties"]["units"] == {"enum": ["C", "F"]}
    assert params["properties"]["detailed"] == {"type": "boolean"}
    json.dumps(params)  # must be serialisable for a chat template


def test_function_tool_checks_arguments_before_calling():
    assert lookup({"city": "Oslo", "days": 3.0}) == "Oslo:3:C:None"  # integral float coerced
    for args, fragment in [({}, "missing required argument(s): city"),
                           ({"city": "Oslo", "days": "3"}, "'days' must be of type integer"),
                           ({"city": "Oslo", "days": True}, "'days' must be of type integer"),
                           ({"city": "Oslo", "units": "K"}, "must be one of ['C', 'F']"),
                           ({"city": "Oslo", "color": 1}, "unknown argument(s): color"),
                           ("Oslo", "must be a JSON object")]:
        result = lookup(args)
        assert isinstance(result, ToolResult) and not result.ok, args
        assert fragment in result.error, (args, result.error)


def test_function_tool_refuses_signatures_it_cannot_describe():
    with pytest.raises(TypeError, match="plain named parameters"):
        @function_tool
        def bad(*args: int) -> str:
            """Bad."""
            return ""
    with pytest.raises(ValueError, match="description"):
        @function_tool
        def undocumented(x: int) -> str:
            return ""
    with pytest.raises(TypeError, match="cannot describe"):
        @function_tool(description="x")
        def odd(x: complex) -> str:
            return ""


def test_function_tool_of_a_partial_or_a_callable_object_says_what_it_takes():
    """A partial (a plausible way to bind an index) failed in typing.get_type_hints with
    'functools.partial(...) is not a module, class, method, or function'."""
    def find(query: str, index: dict) -> str:
        """Find."""
        return str(index.get(query))

    class Finder:
        def __call__(self, query: str) -> str:
            return query

    for f in (functools.partial(find, index={}), Finder()):
        with pytest.raises(TypeError, match=r"function_tool takes a function \(def or async def\) "
                                            r"or a method, got (partial|Finder) .*wrap it in a def"):
            function_tool(f, name="find", description="Find.")


def test_validate_arguments_number_and_null_types():
    schema = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": ["string", "null"]}}}
    assert validate_arguments(schema, {"x": 2, "y": None}) == {"x": 2, "y": None}
    with pytest.raises(ToolArgumentError, match="'x' must be of type number"):
        validate_arguments(schema, {"x": "2"})
    assert validate_arguments(schema, {"extra": 1}) == {"extra": 1}  # additionalProperties defaults to true


@pytest.mark.parametrize("text", ['{"seconds": NaN}', '{"seconds": Infinity}', '{"seconds": -Infinity}'])
def test_nan_and_infinity_are_not_numbers(text):
    """json.loads reads NaN and Infinity in a policy's tool call; they passed as numbers, so a
    tool slept forever (time.sleep(inf)) or computed with NaN instead of being told."""

    @function_tool
    def wait(seconds: float) -> str:
        """Wait."""
        return f"waited {seconds}"

    args = json.loads(text)
    with pytest.raises(ToolArgumentError, match=r"'seconds' must be of type number, got (nan|inf|-inf) \(NaN and "
                                                r"Infinity are not JSON numbers\)"):
        validate_arguments(wait.parameters, args)
    assert not wait(args).ok and "not JSON numbers" in wait(args).error
    assert validate_arguments(wait.parameters, {"seconds": 1e308}) == {"seconds": 1e308}


def test_null_for_an_optional_argument_means_not_given():
    @function_tool(description="Scale a number.")
    def scale(x: float, factor: float | None = None, unit: str = "m") -> str:
        return f"{x * (2 if factor is None else factor)}{unit}"

    assert scale.parameters["properties"]["factor"] == {"type": "number"}  # schema unchanged
    assert scale({"x": 1.5, "factor": None}) == "3.0m"
    assert scale({"x": 1.5, "unit": None}) == "3.0m"  # the default, not None
    result = scale({"x": None})  # required: null is still wrong
    assert not result.ok and "'x' must be of type number" in result.error
    schema = {"type": "object", "properties": {"y": {"type": ["string", "null"]}, "z": {}}}
    assert validate_arguments(schema, {"y": None, "z": None}) == {"y": None, "z": None}


def test_null_reaches_a_parameter_that_takes_none_without_defaulting_to_it():
    """`x: int | None` without a default refused the null its signature takes ("must be of
    type integer"), and `w: int | None = 5` got 5 for an explicit null; with a default of None
    the schema stays the plain type (null counts as not given, which is None)."""
    @function_tool(description="Echo.")
    def echo(x: int | None, mode: Literal["a", "b"] | None, w: int | None = 5,
             n: int | None = None, xs: list[int] | None = [1]) -> str:  # noqa: B006
        return f"{x}:{mode}:{w}:{n}:{xs}"

    props = echo.parameters["properties"]
    assert props["x"] == {"type": ["integer", "null"]}
    assert props["mode"] == {"enum": ["a", "b", None]}
    assert props["w"] == {"type": ["integer", "null"]} and props["n"] == {"type": "integer"}
    assert props["xs"] == {"type": ["array", "null"], "items": {"type": "integer"}}
    assert echo({"x": None, "mode": None, "w": None, "n": None, "xs": None}) == "None:None:None:None:None"
    assert echo({"x": 2, "mode": "a"}) == "2:a:5:None:[1]"
    result = echo({"x": 1.5, "mode": "a"})
    assert not result.ok and "'x' must be of type integer or null" in result.error
    result = echo({"x": 1, "mode": "c"})
    assert not result.ok and "'mode' must be one of ['a', 'b', None]" in result.error
    assert ToolRegistry([echo]).describe() == (
        '- echo(x: integer | null, mode: "a" | "b" | null, w?: integer | null, n?: integer, '
        'xs?: array of integer | null): Echo.')


def test_null_for_an_optional_literal_argument_means_not_given():
    """A Literal parameter's schema is an enum with no type; null for it was kept (a schema with no
    type reads as allowing null) and then refused by the enum, so '"units": null' failed the call."""
    assert lookup({"city": "Oslo", "units": None}) == "Oslo:1:C:None"

    @function_tool(description="Pick a mode.")
    def pick(mode: Literal["a", "b"] | None = None, other: Literal["x", None] = "x") -> str:
        return f"{mode}:{other}"

    assert pick({"mode": None}) == "None:x"
    assert pick({"other": None}) == "None:None"  # None is one of its values: kept
    schema = {"type": "object", "properties": {"u": {"enum": ["C", "F"]}}, "required": ["u"]}
    with pytest.raises(ToolArgumentError, match=r"'u' must be one of \['C', 'F'\], got None"):
        validate_arguments(schema, {"u": None})  # required: null is still wrong


def test_registry_lookup_schemas_and_listing():
    @function_tool(name="echo", description="Repeat the text.")
    def echo(text: str) -> str:
        return text

    registry = ToolRegistry([lookup, echo])
    assert registry.names() == ["lookup", "echo"]
    assert "echo" in registry and len(registry) == 2
    assert registry.get("echo") is echo
    with pytest.raises(UnknownToolError) as info:
        registry.get("serch")
    assert str(info.value) == "unknown tool 'serch'; available tools: lookup, echo"
    with pytest.raises(ValueError, match="already registered"):
        registry.register(echo)
    schemas = registry.schemas()
    assert schemas[1] == {"type": "function", "function": {
        "name": "echo", "description": "Repeat the text.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
                       "additionalProperties": False}}}
    # A Literal parameter showed as `units?: any`, so the model was not told the values it may pass.
    assert registry.describe().splitlines() == [
        '- lookup(city: string, days?: integer, units?: "C" | "F", detailed?: boolean): Look up the weather forecast.',
        "- echo(text: string): Repeat the text."]


def test_describe_shows_literal_values_and_type_unions():
    @function_tool
    def pick(mode: Literal["fast", "exact"], level: Literal[1, 2, None] = 1) -> str:
        """Pick a mode."""
        return f"{mode}:{level}"

    class Typed:
        name, description = "typed", "A class tool."
        parameters = {"type": "object", "properties": {
            "x": {"type": ["string", "null"]}, "y": {}, "xs": {"type": "array", "items": {"type": "integer"}},
            "modes": {"type": "array", "items": {"enum": ["a", "b"]}}, "any_list": {"type": "array"}}}

        def __call__(self, args):
            return ""

    assert ToolRegistry([pick, Typed()]).describe().splitlines() == [
        '- pick(mode: "fast" | "exact", level?: 1 | 2 | null): Pick a mode.',
        '- typed(x?: string | null, y?: any, xs?: array of integer, modes?: array of ("a" | "b"), '
        'any_list?: array): A class tool.']
    # Exactly the literal values pass (an integral float is the integer member); others are named.
    assert pick({"mode": "exact", "level": 2.0}) == "exact:2"
    assert pick({"mode": "fast", "level": None}) == "fast:None"
    for args, bad in [({"mode": "slow"}, "'mode' must be one of ['fast', 'exact'], got 'slow'"),
                      ({"mode": "FAST"}, "got 'FAST'"),
                      ({"mode": "fast", "level": True}, "'level' must be one of [1, 2, None], got True"),
                      ({"mode": "fast", "level": "1"}, "got '1'"),
                      ({"mode": "fast", "level": 3}, "got 3")]:
        result = pick(args)
        assert isinstance(result, ToolResult) and not result.ok and bad in result.error, (args, result)


def test_function_tool_refuses_literal_values_json_cannot_carry():
    import enum

    class Color(enum.Enum):
        RED = "red"

    with pytest.raises(TypeError, match=r"Literal values \[<Color.RED: 'red'>\] are not JSON values"):
        @function_tool
        def paint(color: Literal[Color.RED]) -> str:
            """Paint."""
            return ""


def test_registry_rejects_malformed_tools():
    class NoSchema:
        name, description, parameters = "x", "d", {"type": "array"}

        def __call__(self, args):
            return ""

    with pytest.raises(TypeError, match="parameters must be a JSON schema"):
        ToolRegistry([NoSchema()])

    class BadName(NoSchema):
        name, parameters = "has space", {"type": "object"}

    with pytest.raises(ValueError, match="tool name 'has space'"):
        ToolRegistry([BadName()])


@pytest.mark.parametrize("parameters, message", [
    ({"type": "object", "properties": {"x": {"type": "float"}}},
     "argument 'x' has type 'float'; a type is one of string, integer, number, boolean, array, object, null"),
    ({"type": "object", "properties": {"x": {"type": ["integer", "int"]}}}, "argument 'x' has type"),
    ({"type": "object", "properties": {"x": {"type": "string"}}, "required": "x"},
     "parameters['required'] must be a list of argument names, got 'x'"),
    ({"type": "object", "properties": {"x": "string"}}, "parameters['properties'] must map each argument"),
])
def test_registry_rejects_parameter_schemas_no_call_could_satisfy(parameters, message):
    """A hand-written schema with a Python type name, or `required` as one string, was accepted;
    then every call failed as the policy's bad arguments ('must be of type float, got float',
    'missing required argument(s): x' for {"x": ...} read character by character)."""

    class Hand:
        name, description = "hand", "d"

        def __init__(self, parameters):
            self.parameters = parameters

        def __call__(self, args):
            return "ok"

    with pytest.raises((TypeError, ValueError)) as info:
        ToolRegistry([Hand(parameters)])
    assert message in str(info.value)
    ok = {"type": "object", "properties": {"x": {"type": ["number", "null"]}, "y": {}}, "required": ["x"]}
    assert ToolRegistry([Hand(ok)]).get("hand")({"x": 1}) == "ok"


def test_array_items_are_checked_against_their_schema():
    """`function_tool` writes `items` for list[int], but only the list itself was checked: the
    tool got ["a"] or [1.5] and failed as its own TypeError, not as the policy's bad arguments;
    an items type no call could satisfy was registered."""

    @function_tool(description="Add numbers.")
    def total(xs: list[int], names: list[str] | None = None) -> str:
        return str(sum(xs))

    assert total.parameters["properties"]["xs"] == {"type": "array", "items": {"type": "integer"}}

    @function_tool(description="Pairs.")
    def pairs(a: tuple[int, str], b: tuple[float, ...]) -> str:
        return repr((a, b))

    assert pairs.parameters["properties"]["a"] == {"type": "array"}  # no one type for both
    assert pairs({"a": [1, "x"], "b": [1.5, 2]}) == "([1, 'x'], [1.5, 2])"
    assert total({"xs": [1, 2.0]}) == "3"  # integral floats coerced, as for a plain integer
    for args, fragment in [({"xs": ["a"]}, "argument 'xs[0]' must be of type integer, got str"),
                           ({"xs": [1, 1.5]}, "argument 'xs[1]' must be of type integer, got float"),
                           ({"xs": [1], "names": [2]}, "argument 'names[0]' must be of type string")]:
        result = total(args)
        assert isinstance(result, ToolResult) and not result.ok, args
        assert fragment in result.error, (args, result.error)

    class Hand:
        name, description = "hand", "d"
        parameters = {"type": "object", "properties": {"x": {"type": "array", "items": {"type": "float"}}}}

        def __call__(self, args):
            return "ok"

    with pytest.raises(ValueError, match=r"argument 'x\[\]' has type 'float'; a type is one of"):
        ToolRegistry([Hand()])


def test_an_enum_argument_is_matched_as_json_compares_and_given_as_the_member():
    """A Literal[1, 2, 3] argument took true (Python's True == 1) and passed the tool True, and
    2.0 passed as the float 2.0, not as the member 2."""

    @function_tool(description="Pick a level.")
    def level(n: Literal[1, 2, 3], flag: Literal[True, "auto"] = "auto") -> str:
        return f"{n!r}:{flag!r}"

    assert level({"n": 2.0}) == "2:'auto'"
    assert level({"n": 3, "flag": True}) == "3:True"
    for args in ({"n": True}, {"n": 1, "flag": 1}, {"n": 2.5}):
        result = level(args)
        assert isinstance(result, ToolResult) and not result.ok and "must be one of" in result.error, args


def test_variants_of_a_decorated_tool_pickle_for_worker_processes():
    """A decorated tool pickles by name; a variant of it (another timeout or name) pickled its
    function by reference, found the decorated tool under that name instead, and failed, so the
    variant could not run with execution="process" ("it's not the same object as ...lookup")."""
    assert pickle.loads(pickle.dumps(lookup)) is lookup
    for variant in (dataclasses.replace(lookup, timeout_s=3.0, execution="process"),
                    function_tool(lookup.fn, name="lookup2", description="Another name.")):
        copy = pickle.loads(pickle.dumps(variant))
        assert copy == variant and copy.fn is lookup.fn
        assert copy({"city": "Oslo"}) == "Oslo:1:C:None"
