"""A safe arithmetic calculator: `evaluate`, `calculate` and the `Calculator` tool.

Where this sits: the quickstart and basic-arithmetic tasks (`jaxagent.envs`) give the policy a
calculator (`<calc>EXPR</calc>` -> `<result>...</result>`, or a JSON tool call); the rollout
driver runs it through `jaxagent.tools.executors.ToolExecutor` and appends the formatted number,
or the error, as an observation.

Expressions are parsed with `ast` and walked node by node; nothing is `eval`-ed. Allowed: int and
float literals, `+ - * / // % **`, unary `+`/`-`, parentheses, the constants `pi`, `e`, `tau`, and
the functions in `FUNCTIONS`. `^` is read as power (models write `2^10`). Denial of service is
bounded by a limit on expression length, on the size of integer results (in bits, checked before
a power or factorial is computed) and on nesting depth.

Results: exact integer arithmetic stays integer (`10**20 / 10**10` is `10000000000`); a float
that is an integer below 1e15 prints without a decimal point; other floats print with up to 12
significant digits (`0.1 + 0.2` -> `0.3`, `1/3` -> `0.333333333333`), as plain decimals from
1e-7 to 1e21 (`format_number`).
"""

from __future__ import annotations

import ast
import decimal
import math
import operator
import sys
from collections.abc import Callable
from typing import Any

from jaxagent.tools.base import ToolArgumentError, ToolResult, validate_arguments

Number = int | float

MAX_EXPRESSION_CHARS = 512
MAX_INT_BITS = 4096   # ~1233 decimal digits; also keeps str(int) under Python's 4300-digit limit
MAX_DEPTH = 400      # a 512-character sum of ones nests 256 deep

CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e, "tau": math.tau}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is shown to the model."""


def _check_int(value: Number, max_bits: int) -> Number:
    if isinstance(value, int) and value.bit_length() > max_bits:
        raise CalculatorError(f"result too large (more than {max_bits} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        # Float + - * / overflow to inf without raising; carried on, 1 / inf became 0 and
        # min(5, inf - inf) became 5: a wrong number instead of an error.
        raise CalculatorError("result is not a finite number (beyond the floating-point range, about 1.8e308)")
    return value


def _div(a: Number, b: Number) -> Number:
    if b == 0:
        raise CalculatorError("division by zero")
    if isinstance(a, int) and isinstance(b, int) and a % b == 0:
        return a // b  # exact, so big integers do not lose precision through float
    try:
        return a / b
    except OverflowError:
        raise CalculatorError("result too large for a floating-point number") from None


def _floordiv(a: Number, b: Number) -> Number:
    if b == 0:
        raise CalculatorError("division by zero")
    return a // b


def _mod(a: Number, b: Number) -> Number:
    if b == 0:
        raise CalculatorError("modulo by zero")
    return a % b


def _pow(a: Number, b: Number, max_bits: int) -> Number:
    if isinstance(a, int) and isinstance(b, int) and b >= 0:
        # |a|**b has about b*log2|a| >= b bits: refuse before computing it (b first: a b
        # beyond the float range made the product overflow, named as a float result).
        if abs(a) > 1 and (b > max_bits or b * math.log2(abs(a)) > max_bits):
            raise CalculatorError(f"result too large (more than {max_bits} bits)")
        return a ** b
    if a == 0 and b < 0:
        raise CalculatorError("division by zero (zero to a negative power)")
    sign = 1.0
    if isinstance(b, int) and a < 0:  # an integer power of a negative number: sign by parity
        sign, a = (-1.0 if b % 2 else 1.0), -a
    if isinstance(b, int) and a == 1:  # exact for any integer exponent, however large
        return sign
    try:
        exponent = float(b)
    except OverflowError:  # an integer exponent beyond the float range: as an infinite one
        exponent = math.inf if b > 0 else -math.inf
    if a < 0 and not exponent.is_integer():
        raise CalculatorError("a negative number to a fractional power is not a real number")
    try:
        # 0.5 ** (10**400) is 0.0, as 0.5 ** 10000 is; 2.0 ** (10**400) is refused by the
        # finiteness check of the result.
        return sign * math.pow(a, exponent)
    except OverflowError:
        raise CalculatorError("result too large for a floating-point number") from None


def _factorial(n: Number, max_bits: int) -> int:
    if isinstance(n, float) and n.is_integer():
        n = int(n)
    if not isinstance(n, int) or n < 0:
        raise CalculatorError("factorial needs a non-negative integer")
    if n > 2 and math.lgamma(n + 1) / math.log(2) > max_bits:
        raise CalculatorError(f"result too large (more than {max_bits} bits)")
    return math.factorial(n)


def _round(x: Number, ndigits: Number | None = None) -> Number:
    if ndigits is None:
        return round(x)
    if not isinstance(ndigits, int):
        raise CalculatorError("round's second argument must be an integer")
    if isinstance(x, int) and -ndigits > len(str(abs(x))):
        # |x| < 10**digits <= 10**-ndigits / 10: it rounds to 0. Python would first compute
        # 10**-ndigits, which for round(5, -10**9) holds the GIL for hours.
        return 0
    return round(x, ndigits)


def _log(x: Number, base: Number | None = None) -> float:
    return math.log(x) if base is None else math.log(x, base)


FUNCTIONS: dict[str, tuple[Callable[..., Number], int, int]] = {
    # name: (function, min args, max args; -1 means any number >= min)
    "sqrt": (math.sqrt, 1, 1), "abs": (abs, 1, 1), "round": (_round, 1, 2), "min": (min, 2, -1),
    "max": (max, 2, -1), "floor": (math.floor, 1, 1), "ceil": (math.ceil, 1, 1), "exp": (math.exp, 1, 1),
    "log": (_log, 1, 2), "ln": (math.log, 1, 1), "log2": (math.log2, 1, 1), "log10": (math.log10, 1, 1),
    "sin": (math.sin, 1, 1), "cos": (math.cos, 1, 1), "tan": (math.tan, 1, 1), "asin": (math.asin, 1, 1),
    "acos": (math.acos, 1, 1), "atan": (math.atan, 1, 1), "factorial": (math.factorial, 1, 1),
    "gcd": (math.gcd, 1, -1), "lcm": (math.lcm, 1, -1),
}

_BINARY: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: _div,
    ast.FloorDiv: _floordiv, ast.Mod: _mod,
}


class _Evaluator:
    def __init__(self, max_int_bits: int):
        self.max_bits = max_int_bits

    def eval(self, node: ast.AST, depth: int = 0) -> Number:
        if depth > MAX_DEPTH:
            raise CalculatorError(f"expression nested too deeply (more than {MAX_DEPTH} levels)")
        if isinstance(node, ast.Expression):
            return self.eval(node.body, depth + 1)
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise CalculatorError(f"unsupported syntax: Constant {node.value!r}")
            return _check_int(node.value, self.max_bits)
        if isinstance(node, ast.Name):
            if node.id in CONSTANTS:
                return CONSTANTS[node.id]
            raise CalculatorError(f"unsupported syntax: Name {node.id!r}")
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = self.eval(node.operand, depth + 1)
            return -value if isinstance(node.op, ast.USub) else +value
        if isinstance(node, ast.BinOp):
            left = self.eval(node.left, depth + 1)
            right = self.eval(node.right, depth + 1)
            if isinstance(node.op, ast.Pow):
                return _check_int(_pow(left, right, self.max_bits), self.max_bits)
            op = _BINARY.get(type(node.op))
            if op is None:
                raise CalculatorError(f"unsupported syntax: operator {type(node.op).__name__}")
            return _check_int(op(left, right), self.max_bits)
        if isinstance(node, ast.Call):
            return self._call(node, depth)
        raise CalculatorError(f"unsupported syntax: {type(node).__name__}")

    def _call(self, node: ast.Call, depth: int) -> Number:
        func = node.func
        if (isinstance(func, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.Call))
                or (isinstance(func, ast.Name) and func.id in CONSTANTS)):
            # 2(3 + 4), (1 + 2)(3), pi(2): implicit multiplication, which the policy is told how to write.
            raise CalculatorError("unsupported syntax: implicit multiplication (a number, constant or parenthesis "
                                  "followed by '('); write * between them, as in 2 * (3 + 4)")
        if not isinstance(func, ast.Name):
            raise CalculatorError(f"unsupported syntax: {type(func).__name__}")
        name = node.func.id
        if name not in FUNCTIONS:
            raise CalculatorError(f"unsupported syntax: function {name!r} (available: {', '.join(FUNCTIONS)})")
        if node.keywords:
            raise CalculatorError(f"{name}() takes positional arguments only")
        fn, lo, hi = FUNCTIONS[name]
        if len(node.args) < lo or (hi >= 0 and len(node.args) > hi):
            expected = f"{lo}" if lo == hi else (f"at least {lo}" if hi < 0 else f"{lo} to {hi}")
            raise CalculatorError(f"{name}() takes {expected} argument(s), got {len(node.args)}")
        args = [self.eval(arg, depth + 1) for arg in node.args]
        if name == "factorial":
            return _factorial(args[0], self.max_bits)
        if name in ("gcd", "lcm") and not all(isinstance(a, int) for a in args):
            raise CalculatorError(f"{name}() needs integers")
        try:
            return _check_int(fn(*args), self.max_bits)
        except CalculatorError:
            raise  # e.g. a result too large: not a domain error
        except ValueError:
            shown = ", ".join(format_number(a) for a in args)
            raise CalculatorError(f"math domain error: {name}({shown}) is undefined") from None
        except OverflowError:
            # math's functions take ints as floats: sqrt(10**400) overflows in its argument.
            raise CalculatorError(f"{name}() is beyond the floating-point range (about 1.8e308) in an "
                                  "argument or its result") from None


def evaluate(expression: str, *, max_chars: int = MAX_EXPRESSION_CHARS, max_int_bits: int = MAX_INT_BITS,
             caret_is_power: bool = True) -> Number:
    """Evaluates an arithmetic expression to an int or a finite float; raises `CalculatorError`."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > max_chars:
        raise CalculatorError(f"expression too long ({len(text)} characters; the limit is {max_chars})")
    if caret_is_power:
        text = text.replace("^", "**")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"invalid syntax: {e.msg}") from None
    except (RecursionError, MemoryError, ValueError):
        raise CalculatorError("expression could not be parsed (too deeply nested or malformed)") from None
    try:
        value = _Evaluator(max_int_bits).eval(tree)
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None
    except OverflowError:
        raise CalculatorError("result too large for a floating-point number") from None
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except TypeError as e:
        raise CalculatorError(f"invalid operation: {e}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    return value


def format_number(value: Number, *, significant_digits: int = 12) -> str:
    """A plain decimal for ints and for floats from 1e-7 to 1e21, scientific notation beyond.

    Integers print exactly; integral floats below 1e15 without `.0`. Other floats in the plain
    range print to 12 significant digits, but never round away integer digits: a float of 1e12
    or more prints rounded to an integer (`1234567890123.5` -> `1234567890124`, `1e20` ->
    `100000000000000000000`). Plain decimals are what `rewards.verifiers.numeric_match` reads,
    so a policy that copies a result into its answer is scored on the number.
    """
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if 1e-7 <= abs(value) < 1e21:
        if abs(value) >= 10 ** significant_digits:
            # repr is the shortest decimal that reads back as this float: no binary noise digits.
            return format(decimal.Decimal(repr(value)).to_integral_value(decimal.ROUND_HALF_EVEN), "f")
        return format(decimal.Decimal(f"{value:.{significant_digits}g}"), "f")
    text = f"{value:.{significant_digits}g}"
    if "e" in text:
        mantissa, exponent = text.split("e")
        sign = "-" if exponent.startswith("-") else ""
        text = f"{mantissa}e{sign}{exponent.lstrip('+-').lstrip('0') or '0'}"
    return "0" if text in ("-0", "0") else text


def calculate(expression: str, **limits: Any) -> str:
    """`evaluate` then `format_number`: the text a calculator tool returns."""
    return format_number(evaluate(expression, **limits))


class Calculator:
    """The calculator as a `Tool` taking `{"expression": ...}`."""

    parameters = {"type": "object", "additionalProperties": False, "required": ["expression"],
                  "properties": {"expression": {"type": "string",
                                                "description": "Arithmetic expression, e.g. (3 + 4) * 2 ** 3"}}}
    execution = "thread"
    timeout_s = 5.0

    def __init__(self, name: str = "calculator", description: str | None = None, **limits: Any):
        self.name = name
        self.description = description or (
            "Evaluate an arithmetic expression with + - * / // % ** (or ^), parentheses, pi, e and "
            f"the functions {', '.join(FUNCTIONS)}.")
        unknown = sorted(set(limits) - {"max_chars", "max_int_bits", "caret_is_power"})
        if unknown:
            # Caught here, not at each call: there every call would fail as a tool error.
            raise TypeError(f"Calculator got unknown limit(s) {unknown}; the limits are max_chars, "
                            "max_int_bits and caret_is_power")
        for key in ("max_chars", "max_int_bits"):
            value = limits.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Calculator {key} must be a positive int, got {value!r}")
        if not isinstance(limits.get("caret_is_power", True), bool):  # "false" would read as true
            raise ValueError(f"Calculator caret_is_power must be True or False, got {limits['caret_is_power']!r}")
        max_digits = getattr(sys, "get_int_max_str_digits", lambda: 0)()  # 0: no limit
        printable_bits = int(max_digits / math.log10(2)) if max_digits else None
        if printable_bits is not None and limits.get("max_int_bits", MAX_INT_BITS) > printable_bits:
            raise ValueError(f"Calculator max_int_bits must be at most {printable_bits}: larger integers exceed "
                             "Python's limit on printing integers (sys.set_int_max_str_digits)")
        self._limits = limits

    def __call__(self, args: dict[str, Any]) -> ToolResult:
        try:
            expression = validate_arguments(self.parameters, args)["expression"]
            return ToolResult.success(calculate(expression, **self._limits))
        except (CalculatorError, ToolArgumentError) as e:
            return ToolResult.failure(str(e))
