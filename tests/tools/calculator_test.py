"""Tests for jaxagent/tools/calculator.py: hand-worked results, formatting, refusals and limits."""

import decimal
import math
import random
import re
import time

import pytest

from jaxagent.rewards.verifiers import numeric_match
from jaxagent.tools.calculator import Calculator, CalculatorError, calculate, evaluate, format_number


@pytest.mark.parametrize("expression, expected", [
    ("1 + 2 * 3", "7"),
    ("(1 + 2) * 3", "9"),
    ("2 ** 10", "1024"),
    ("2^10", "1024"),                 # caret read as power
    ("2 ** 3 ** 2", "512"),           # right-associative: 2 ** 9
    ("-3 ** 2", "-9"),                # unary minus binds looser than **
    ("7 / 2", "3.5"),
    ("6 / 3", "2"),                   # exact division stays an integer
    ("10**20 / 10**10", "10000000000"),
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),
    ("-7 % 3", "2"),
    ("0.1 + 0.2", "0.3"),             # 12 significant digits hide the binary rounding
    ("1 / 3", "0.333333333333"),
    ("2 / 3", "0.666666666667"),
    ("1e20", "100000000000000000000"),  # plain decimals from 1e-7 to 1e21
    ("1.5e-7", "0.00000015"),
    ("3e-5", "0.00003"),
    ("2.5 * 10**15", "2500000000000000"),
    ("1234567890123.5", "1234567890124"),  # integer digits are never rounded away
    ("1e21", "1e21"),
    ("9.5e-8", "9.5e-8"),
    ("sqrt(16)", "4"),
    ("sqrt(2)", "1.41421356237"),
    ("abs(-2.5)", "2.5"),
    ("round(3.14159, 2)", "3.14"),
    ("round(2.5)", "2"),              # Python rounds halves to even
    ("min(4, 2, 8)", "2"),
    ("max(4, 2.5)", "4"),
    ("floor(-1.5) + ceil(1.2)", "0"),
    ("log(e)", "1"),
    ("log(8, 2)", "3"),
    ("log10(1000)", "3"),
    ("factorial(20)", "2432902008176640000"),
    ("gcd(12, 18) * lcm(4, 6)", "72"),
    ("2 * pi", "6.28318530718"),
    ("sin(0)", "0"),
    ("-0.0", "0"),
    ("12345678901234567890 * 10", "123456789012345678900"),
    ("2 ** 0.5", "1.41421356237"),
    ("(-8) ** 2", "64"),
    ("1 + 2 * (3 - 4) ** 2 / 4", "1.5"),
])
def test_hand_worked_results(expression, expected):
    assert calculate(expression) == expected


@pytest.mark.parametrize("expression, message", [
    ("1 / 0", "division by zero"),
    ("1 // 0", "division by zero"),
    ("5 % 0", "modulo by zero"),
    ("0 ** -1", "division by zero"),
    ("x + 1", "unsupported syntax: Name 'x'"),
    ("__import__('os')", "unsupported syntax: function '__import__'"),
    ("__import__('os').system('ls')", "unsupported syntax: Attribute"),
    ("(1).real", "unsupported syntax: Attribute"),
    ("[1, 2]", "unsupported syntax: List"),
    ("1 if 2 else 3", "unsupported syntax: IfExp"),
    ("1 < 2", "unsupported syntax: Compare"),
    ("3 & 1", "unsupported syntax: operator BitAnd"),
    ("'a' * 3", "unsupported syntax: Constant 'a'"),
    ("True + 1", "unsupported syntax: Constant True"),
    ("lambda: 1", "unsupported syntax: Lambda"),
    # implicit multiplication was 'unsupported syntax: Constant' / 'BinOp' / "function 'pi'"
    ("2(3 + 4)", "implicit multiplication (a number, constant or parenthesis followed by '('); write *"),
    ("(1 + 2)(3)", "write * between them, as in 2 * (3 + 4)"),
    ("pi(2)", "implicit multiplication"),
    ("sqrt(4)(2)", "implicit multiplication"),
    ("sqrt(x=4)", "positional arguments only"),
    ("sqrt(1, 2)", "sqrt() takes 1 argument(s), got 2"),
    ("min(1)", "min() takes at least 2 argument(s)"),
    ("sqrt(-1)", "math domain error: sqrt(-1) is undefined"),
    ("(-8) ** 0.5", "not a real number"),
    ("1e308 * 10", "not a finite number"),
    ("gcd(1.5, 2)", "gcd() needs integers"),
    ("factorial(-1)", "non-negative integer"),
    ("1 +", "invalid syntax"),
    ("", "empty expression"),
    ("   ", "empty expression"),
])
def test_bad_input_gives_clear_errors(expression, message):
    with pytest.raises(CalculatorError) as info:
        evaluate(expression)
    assert message in str(info.value)


@pytest.mark.parametrize("expression", [
    "9 ** 9 ** 9",           # would have ~10^8 digits
    "2 ** 100000",
    "10 ** 5000",
    "factorial(100000)",
    "(10 ** 1000) ** 5",
    "99999999999 ** 99999",
    "lcm(2 ** 4000, 2 ** 4000 - 1)",  # was reported as "math domain error: lcm(...) is undefined"
])
def test_huge_results_are_refused_fast(expression):
    start = time.monotonic()
    with pytest.raises(CalculatorError, match="too large"):
        evaluate(expression)
    assert time.monotonic() - start < 2.0  # room for a loaded host


def test_limits_on_length_and_nesting():
    with pytest.raises(CalculatorError, match="too long"):
        evaluate("1+" * 300 + "1")
    assert calculate("+".join(["1"] * 200)) == "200"  # long flat sums still work
    with pytest.raises(CalculatorError, match="nested too deeply"):
        evaluate("-" * 450 + "1")
    assert calculate("(" * 100 + "1" + ")" * 100) == "1"  # parentheses add no nesting
    assert calculate("1+" * 300 + "1", max_chars=1000) == "301"
    with pytest.raises(CalculatorError, match="more than 64 bits"):
        evaluate("2 ** 100", max_int_bits=64)


@pytest.mark.parametrize("expression", [
    "1e300 / (1e200 * 1e200) * 1e150",  # 1e50, but the product overflowed to inf and 1e300 / inf is 0
    "min(5, 1e308 * 10 - 1e308 * 10)",  # inf - inf is NaN, and min(5, NaN) is 5
    "1 / 1e400",
    "atan(1e308 * 10)",
])
def test_float_overflow_inside_an_expression_is_an_error_not_a_wrong_number(expression):
    with pytest.raises(CalculatorError, match="not a finite number"):
        evaluate(expression)
    assert calculate("1e300 / (1e200 * 1e100) * 1e150") == "1e150"  # in range: unchanged


@pytest.mark.parametrize("expression, expected", [
    # An integer exponent beyond the float range: the power's limit, as for 0.5 ** 10000.
    ("0.5 ** (10 ** 400)", 0.0), ("2 ** -(10 ** 400)", 0.0), ("(-0.5) ** (10 ** 400)", 0.0),
    # A negative base to an integer power has the sign of its parity, however large the power.
    ("(-1.0) ** (10 ** 400 + 1)", -1.0), ("(-1.0) ** (10 ** 400)", 1.0), ("(-2) ** -3", -0.125),
])
def test_powers_with_exponents_beyond_the_float_range(expression, expected):
    # Each was refused as "result too large for a floating-point number" (the first two and
    # the last but one) or "a negative number to a fractional power".
    assert evaluate(expression) == expected


@pytest.mark.parametrize("expression, message", [
    ("2 ** 3 ** 4 ** 5", "result too large (more than 4096 bits)"),  # an integer power
    ("2.0 ** (10 ** 400)", "not a finite number"),
    ("sqrt(10 ** 400)", "sqrt() is beyond the floating-point range (about 1.8e308) in an argument"),
])
def test_overflows_are_named_for_what_overflowed(expression, message):
    with pytest.raises(CalculatorError, match=re.escape(message)):
        evaluate(expression)


def test_caret_can_mean_xor_syntax_error_instead():
    with pytest.raises(CalculatorError, match="operator BitXor"):
        evaluate("2 ^ 3", caret_is_power=False)


def test_format_number():
    assert format_number(3) == "3"
    assert format_number(3.0) == "3"
    assert format_number(1e15) == "1000000000000000"
    assert format_number(1.5e300) == "1.5e300"
    assert format_number(123456.789) == "123456.789"
    assert format_number(-2.5e-10) == "-2.5e-10"
    assert format_number(2 ** 70) == "1180591620717411303424"


def test_calculator_tool():
    tool = Calculator()
    assert tool.name == "calculator" and tool.parameters["required"] == ["expression"]
    assert tool({"expression": "2 + 2"}) .output == "4"
    failure = tool({"expression": "1/0"})
    assert not failure.ok and failure.error == "division by zero"
    assert "missing required argument" in tool({}).error
    assert "must be of type string" in tool({"expression": 5}).error


def test_round_to_huge_negative_digits_is_fast_and_exact():
    # round(5, -10**7) made Python build 10**(10**7) first (14 s holding the GIL; -10**9: hours).
    start = time.monotonic()
    assert calculate("round(5, -10**7)") == "0"
    assert time.monotonic() - start < 2.0  # room for a loaded host
    assert calculate("round(-12345, -10**100)") == "0"
    for x in (5, 15, 50, 55, 149, 150, 250, -55, 99999, 10 ** 30 + 1):
        for nd in range(-8, 2):
            assert calculate(f"round({x}, {nd})") == str(round(x, nd)), (x, nd)


def test_formatted_floats_are_read_back_by_numeric_match():
    """A policy that copies a result into its answer is scored on the number it copied."""
    rng = random.Random(0)
    for _ in range(2000):
        x = rng.choice([-1, 1]) * 10 ** rng.uniform(-7, 21) * rng.uniform(1, 10) / 10
        if not 1e-7 <= abs(x) < 1e21:
            continue
        text = format_number(x)
        assert "e" not in text, (x, text)
        assert math.isclose(float(text), x, rel_tol=1e-11), (x, text)
        gold = format(decimal.Decimal(repr(x)), "f")  # the shortest decimal that reads back as x
        assert numeric_match(text, gold) == 1.0, (x, text, gold)


def test_calculator_rejects_bad_limits_when_built():
    # A misspelt limit used to fail every call with a TypeError observation.
    with pytest.raises(TypeError, match=r"unknown limit\(s\) \['max_int_bit'\]"):
        Calculator(max_int_bit=64)
    with pytest.raises(ValueError, match="max_chars must be a positive int"):
        Calculator(max_chars="100")
    with pytest.raises(ValueError, match="max_int_bits must be at most"):
        Calculator(max_int_bits=100_000)  # its results could not be printed
    assert Calculator(max_int_bits=64)({"expression": "2 ** 100"}).error == "result too large (more than 64 bits)"
    # caret_is_power was used as a truth value: "false" made ^ a power, None made it XOR.
    for bad in ("false", None, 0):
        with pytest.raises(ValueError, match=f"caret_is_power must be True or False, got {bad!r}"):
            Calculator(caret_is_power=bad)
    assert "operator BitXor" in Calculator(caret_is_power=False)({"expression": "2 ^ 3"}).error
