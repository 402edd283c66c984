"""The text rewrites done to a math answer before it is parsed: pure string functions, linear time.

`_math_compare._equal_inline` and `_parse_answer` rewrite each side here before math-verify or
sympy sees it: markdown marks dropped (`_drop_markdown`), white space collapsed
(`_collapse_spaces`), boxes braced and read (`_brace_boxes`, `_box_spans`), Unicode math, numbers,
plus-minus fractions, towers of powers and double factorials written as LaTeX reads them; an
answer in English number words is read by `_spelled_number`. `_too_costly` refuses input too
costly to read at all. `verifiers.extract_boxed` reads boxes by the same rules.

This file imports only the standard library: worker processes load it by path beside
`_math_compare.py`, without importing the `jaxagent` package (and so without JAX).
"""
from __future__ import annotations

import ast
import decimal
import functools
import math
import re

# "1\,000", "1 000": thousands groups split by a LaTeX or plain space. LaTeX would read "1 000" as
# 1*000 and "1 234" as the mixed number 1 + 234.
_SPACED_THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:(?:\\[,;:! ]| )\d{3})+(?!\d)")
_THOUSANDS_SPACE = re.compile(r"\\[,;:! ]| ")
# "1e3", "2.5e-3": scientific notation, which LaTeX would read as 1*e*3 (Euler's number).
_SCIENTIFIC = re.compile(r"(?<![\w.])\d+(?:\.\d+)?[eE][+-]?\d{1,3}(?![\w.])")
# A mixed number in plain text ("3 1/2"), read as two numbers side by side; groups: the whole
# part, the numerator, the denominator (greater than the numerator, or it is no mixed number).
_MIXED_NUMBER = re.compile(r"(?<![\d.,/])(\d{1,9})[ \t]+(\d{1,9})/(\d{1,9})(?![\d/.]|,\d)")
# A full stop ending an answer ("\frac{1}{2}.", "2/3."), which LaTeX would read as part of it.
_FULL_STOP = re.compile(r"(?<![.\s])\s*\.$")
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A box whose one-token argument goes without braces ("\boxed5", "\boxed B", "\boxed\pi"), as
# LaTeX allows ("\frac12"); group 1 the argument. A run of digits is one argument ("\boxed12" is
# 12, as its writer meant), and "\boxed5 6" boxes 5 only. An argument followed by an operator
# ("\boxed x = 5") or a command that takes arguments ("\boxed\frac12", "\boxed\frac{1}{2}",
# "\boxed\sqrt[3]{8}") is left to `_COMMAND_BOX` and the prose reading: its writer meant the
# whole expression. A command's name is read whole ("\frac", never "\fra" before a "c"), and a
# box is no argument ("\boxed\boxed5" boxes 5), so no such box holds another. "\fbox5" is such
# a box too.
_UNBRACED_BOX = re.compile(
    r"\\(?:boxed|fbox)(?![A-Za-z])\s*(\d+(?:\.\d+)?(?!\.?\d)|[A-Za-z](?![A-Za-z])"
    r"|\\(?!(?:boxed|fbox)(?![A-Za-z]))[A-Za-z]+(?![A-Za-z])(?!\s*[{\d\[]))"
    r"(?!\s*[=<>+\-*/^_!])")
# A box whose argument is a command with its own arguments, unbraced ("\boxed\sqrt{2}",
# "\boxed\frac12", "\boxed\frac{\sqrt5}{2}"): its writer boxed the whole command. Read after
# `_UNBRACED_BOX` (`_brace_boxes`), in the answer as in `verifiers.extract_boxed`. Only commands
# that take arguments: "\boxed\pi 2" stays a box of \pi.
_COMMAND_BOX = re.compile(
    r"\\(?:boxed|fbox)\s*(\\(?:[dt]?frac|sqrt|[dt]?binom|text|textbf|mathrm|mathbf|mbox)"
    r"(?![A-Za-z])(?:\s*\[[^\[\]{}]*\])?(?:\s*(?:\{(?:[^{}]|\{[^{}]*\})*\}|\d)){1,2})"
    r"(?!\s*[{\d=<>+\-*/^_!])")
# Unicode math that math-verify does not read: a root of one number, letter or bracket ("√2",
# "2√(3)"), superscript digits ("x²", "10⁻³"), infinity and common vulgar fractions ("1½" is the
# mixed number 1 1/2).
_UNICODE_ROOT = re.compile(r"√\s*(?:(\d+(?:\.\d+)?|[A-Za-z])|\(([^()]*)\)|\{([^{}]*)\})")
_SUPERSCRIPT = re.compile("⁻?[⁰¹²³⁴⁵⁶⁷⁸⁹]+")
_SUPERSCRIPT_DIGITS = str.maketrans("⁻⁰¹²³⁴⁵⁶⁷⁸⁹", "-0123456789")
_UNICODE_SYMBOLS = str.maketrans({"∞": "\\infty ", "½": " 1/2", "⅓": " 1/3", "⅔": " 2/3", "¼": " 1/4",
                                  "¾": " 3/4"})
# Unicode forms of numbers (`_read_unicode`): full-width digits and signs ("１２", "－５"), and
# no-break, figure, thin and narrow no-break spaces, which split thousands groups ("1 000 000")
# as a space does. An en dash right before a number that follows no number is a minus ("–5",
# "x = –5"); "3–5" and "3 –5" are left alone.
_UNICODE_NUMBERS = str.maketrans({"\uff0d": "-", "\uff0b": "+", "\uff0c": ",", "\uff0e": ".",
                                  "\u00a0": " ", "\u2007": " ", "\u2009": " ", "\u202f": " ",
                                  **{chr(0xff10 + i): str(i) for i in range(10)}})
_EN_DASH_MINUS = re.compile(r"(?<![\w.)\]}])(?<!\d )\u2013(?=\d)")
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)
# Inline code in markdown ("The answer is `5`.", "``5``"), which quotes its content; group 2 the
# content. Code blocks ("```python") are left as written.
_INLINE_CODE = re.compile(r"(?<!`)(`{1,2})([^`\n]+)\1(?!`)")
# Bold or italic text in markdown ("**7**", "*7*", "__7__"), which a bare answer would read as
# Python's power operator or a product; group 2 or 3 the content. "2**3**2", "2*3*4" and
# "(2)*3*(4)" are arithmetic: emphasis starts and ends outside a word or a bracket. Its content
# holds no mark of its kind, so each try ends at the next mark (linear time).
_EMPHASIS = re.compile(
    r"(?<![\w*)\]}])"
    r"(?:(\*\*?)(?=[^\s*])([^*\n]+?)(?<=[^\s*])\1|__(?=[^\s_])([^_\n]+?)(?<=[^\s_])__)"
    r"(?![\w*(\[{])")
# A plus-minus, and what may stand before and after a fraction on its own (`_spread_plus_minus`).
_PLUS_MINUS = re.compile(r"\\pm(?![A-Za-z])")
_FRAC_HEAD = re.compile(r"\\[dt]?frac\s*\{$")
_BRACE_OPEN = re.compile(r"\s*\{")
_ALONE_BEFORE = re.compile(r"(?:^|[=,{$]|\\[(\[]|\\boxed\s*\{)\s*$")
_ALONE_AFTER = re.compile(r"\s*(?:$|[,}$.]|\\[)\]])")
# A tower of powers ("2^3^2", and "2**3**2" once written "2^{3}^{2}"), which math-verify reads
# as (2^3)^2 = 64: a power is right-associative, 2^{3^{2}} = 512. Each exponent one token.
_POWER_TOWER = re.compile(r"\^\s*(?:\{[^{}]*\}|\w)(?:\s*\^\s*(?:\{[^{}]*\}|\w))+")
_EXPONENT = re.compile(r"\^\s*(?:\{([^{}]*)\}|(\w))")


# Inputs that cost math-verify seconds to minutes and are no realistic answer (`_too_costly`):
# brackets nested deeper than this (its LaTeX parser's time doubles with each level past about
# 8; "(" * 2000 took 14 s), a power of literal numbers with more digits than this ("2^3^4^5" is
# 2^{3^{4^{5}}}; 10^{10^{7}} took 6 s), or a factorial of more ("\boxed{1000000!}" took 5 s).
_MAX_NESTING = 12
_MAX_DIGITS = 10**5
_MAX_FACTORIAL = 10**5
# A factorial of a value that is no whole number (the gamma function: "e^{7}!", "\frac{10001}{3}!",
# "(100\pi)!") costs more: math-verify rounds it to compare it with a decimal ("0.25"), evaluating
# it to as many digits as it has (e^{7}! = 1096.6! took 11 s, (100\pi)! 1.6 s, e^{5}! 0.15 s).
_MAX_GAMMA = 100
# A box's braces do not count: boxes in boxes are read one by one ("\boxed{\boxed{5}}").
_NESTING_TOKEN = re.compile(r"\\(?:boxed|fbox)\s*\{|[(\[{]|[)\]}]")
# A power of literal numbers, a tower read right to left ("9^{9^{9}}", "2**3**4"); group 1 the
# base, a number or the constant e or pi ("e^{10^{7}}", which math-verify evaluates to round it
# against a decimal: past the time limit), group 2 the exponents.
_NUMBER_POWER = re.compile(
    r"((?<![\d.])\d+(?:\.\d+)?|(?<![A-Za-z\\])e(?![A-Za-z])|\\pi(?![A-Za-z]))"
    r"((?:\s*(?:\^|\*\*)\s*(?:[{(]\s*)?\d+(?:\.\d+)?)+)")
_CONSTANTS = {"e": math.e, "\\pi": math.pi}
# A power of e, \pi or a number whose exponent is a group of arithmetic ("e^{e^{e^{e}}}",
# "e^{-10^{7}}", "2^{3 \cdot 10^6}"), and so an exponential ("\exp(10^{7})", "\exp\left(10^{7}\right)",
# "\exp(\exp(\exp(e)))", read as powers of e: `_EXPONENTIAL`): bounded by its digits as
# `_NUMBER_POWER` is (each ran to the time limit against "0.25"); group 1 the base. The group
# starts where this ends (`_group_closings`).
_GROUP_POWER = re.compile(
    r"((?<![\d.])\d+(?:\.\d+)?|(?<![A-Za-z\\])e(?![A-Za-z])|\\pi(?![A-Za-z]))\s*(?:\^|\*\*)"
    r"\s*(?:\\left(?![A-Za-z])\s*)?(?=[({\[]|\\\{)")
_EXPONENTIAL = re.compile(r"\\exp(?![A-Za-z])")  # "\exp 10^7" is e^{10^7} too
_GROUP_TOKEN = re.compile(r"\\?[{}]|\\.|[(\[]|[)\]]", re.DOTALL)
# A sum or product with its index's bounds ("\prod_{k=1}^{10^6} k", "\sum_{k=1}^{20000} \frac{1}{k}"),
# which math-verify evaluates term by term: bounded by its number of terms (each of these ran to
# the time limit; 5,000 terms of 1/k took 0.4 s, 10,000 2.3 s). Irrational terms cost more per
# term (1,000 terms of \sqrt{k^3+1} took 5.5 s, 200 3.7 s, 100 0.8 s; 300 of \sin{k} 2.6 s):
# a summand with a root, a function, a power of e or \pi or a fractional power (3,000 terms of
# k^{\frac{1}{2}} ran to the limit) (`_IRRATIONAL_TERM`, in the `_SUMMAND_CHARS` after the upper
# bound, up to a "+", "-", "=" or "," outside its brackets) has at most `_MAX_IRRATIONAL_TERMS`.
# A sum inside another's summand has the product of both counts ("\sum_{i=1}^{300}\sum_{j=1}^{300}
# \frac{1}{i+j}" ran to the time limit). The lower bound's group starts where `_SUM` ends;
# `_SUM_INDEX` reads it, `_SUM_UPPER` the upper bound after it.
_MAX_TERMS = 5000
_MAX_IRRATIONAL_TERMS = 100
_SUMMAND_CHARS = 200
_IRRATIONAL_TERM = re.compile(
    r"\\(?:sqrt|exp|pi|ln|log|lg|(?:arc)?(?:sin|cos|tan|cot|sec|csc)h?)(?![A-Za-z])"
    r"|(?<![A-Za-z\\])e\s*\^|\^\s*\{[^{}]*[./][^{}]*\}|\^\s*(?:\{[^{}]*)?\\[dt]?frac(?![A-Za-z])")
_SUMMAND_END = re.compile(r"[-+=,;$()\[\]{}]")
_SUM = re.compile(r"\\(?:sum|prod)(?![A-Za-z])\s*(?:\\limits(?![A-Za-z])\s*)?_\s*(?=\{)")
_SUM_INDEX = re.compile(r"\s*[A-Za-z]\s*=(.*)", re.DOTALL)
_SUM_UPPER = re.compile(r"\s*\^\s*(?:(\{)|(\d))")
_POWER_EXPONENT = re.compile(r"\d+(?:\.\d+)?")
# A factorial of a number ("\boxed{1000000!}", "1000000!", "(1000000)!": 8 to 12 s each). An
# exclamation ending a sentence of prose ("So she has 1000000!") is a full stop by the time the
# guard runs (`_math_compare._exclaimed`).
_NUMBER_FACTORIAL = re.compile(r"(?<![\d.])(\d+)\s*(?:[)}]\s*)?!")
# A double factorial of a number ("5!!" = 5 * 3 * 1 = 15, "6!!" = 48, "(5)!!"), which
# math-verify reads as a factorial of a factorial ((5!)! = 120!): written as its value
# (`_double_factorials`) before math-verify reads it, up to `_MAX_DOUBLE_FACTORIAL` (1000!! has
# 1,285 digits; past it the guard refuses it). Group 1 or 2 the number. "18!!!" and "(5!)!" are
# no such double factorial.
_DOUBLE_FACTORIAL = re.compile(r"(?<![\d.])(?:\((\d+)\)|(\d+))!!(?!!)")
_MAX_DOUBLE_FACTORIAL = 1000
# A factorial of a factorial ("(18!)!", "18!!!", "18! !"), which math-verify reads as such: past
# 8 it is beyond `_MAX_FACTORIAL` (9! = 362880), and "(18!)!" ran until the time limit killed its
# worker. The guard reads it once double factorials are written as their values.
_NESTED_FACTORIAL = re.compile(r"(?<![\d.])(\d+)\s*!\s*(?:\)\s*)?!")
# The operand of a factorial written as arithmetic of literal numbers ("(10^{6})!", "{10^6}!",
# "(2^{20})!", "\left(10^{6}\right)!", "(1000 \cdot 1000)!", "\frac{10^7}{2}!", "\frac{10^7}{2}\,!",
# "\sqrt{10^{12}}!", "\binom{100}{50}!", "{100 \choose 50}!", "|10^7|!", "\lfloor 10^7/2 \rfloor!",
# "e^{100}!", and "10^6!", which math-verify reads as (10^6)!), read by `_factorial_operands`;
# past `_MAX_FACTORIAL` each ran to the time limit. An operand longer than `_MAX_OPERAND` that is
# such arithmetic is refused unread.
_MAX_OPERAND = 200
# The delimiters that group a factorial's operand (`_factorial_operands`): group 1 an opener, group
# 2 a closer (brackets, escaped braces, "\left|", "\right|", floors, ceilings, "\lvert", "\rvert"),
# group 3 a bar ("|", "\vert"), which opens or closes by what stands before it. Other commands and
# escaped characters ("\(", "\|") group nothing.
_DELIMITER = re.compile(
    r"(\\left\s*(?:\||\\vert(?![A-Za-z]))|\\l(?:floor|ceil|vert)(?![A-Za-z])|\\\{|[(\[{])"
    r"|(\\right\s*(?:\||\\vert(?![A-Za-z]))|\\r(?:floor|ceil|vert)(?![A-Za-z])|\\\}|[)\]}])"
    r"|(\||\\vert(?![A-Za-z]))|\\(?:[A-Za-z]+|.)", re.DOTALL)
_LEFT_END = re.compile(r"\\left\s*$")
_FACTORIAL_MARK = re.compile(r"(?<!\\)!")  # "\\!" is a negative space
# Factorials of factorials read of one operand ("((4!)!)!" is 24!): past 3, a value of 3 or more
# has passed any limit (3 -> 6 -> 720 -> 720!), and 1 and 2 stay as they are.
_MAX_INNER = 4
# The gamma function ("\Gamma(10^7)", "\Gamma\left(10^7\right)"), a factorial: its argument's group
# starts where this ends.
_GAMMA = re.compile(r"\\Gamma(?![A-Za-z])\s*(?:\\left(?![A-Za-z])\s*)?")
# Thin, medium, thick and negative spaces, and a control space, which may stand between an operand
# and its factorial ("\frac{10^7}{2}\,!").
_SPACING_COMMANDS = frozenset(",;:! ")
_SPACING = re.compile(r"(?:\s|\\[,;:! ])*")
_SPACING_OR_RIGHT = re.compile(r"(?:\s|\\[,;:! ]|\\right(?![A-Za-z]))*")
# LaTeX an operand may hold (`_operand_python`): a command's name (group 1), or a spacing command.
_OPERAND_COMMAND = re.compile(r"\\(?:([A-Za-z]+)|[,;:! ])")
# Such a command right before the group that ends a factorial's operand (`_command_start`).
_COMMAND_END = re.compile(r"\\(?:([dtc]?frac|[dt]?binom)|(sqrt))$")
# What a command of an operand writes in Python (`_operand_python`): an operator, a constant (a
# value starts), a group's opening (a value starts, and the group is open), or a group's closing.
_OPERAND_OPERATORS = {"cdot": "*", "times": "*"}
_OPERAND_CONSTANTS = {"pi": "PI"}
_OPERAND_OPENERS = {"lfloor": "floor(", "lceil": "ceil(", "lvert": "abs("}
_OPERAND_CLOSERS = frozenset({"rfloor", "rceil", "rvert"})
_BAR = re.compile(r"\s*(?:\||\\vert(?![A-Za-z]))")
_ARITHMETIC = re.compile(r"(?:[\d.+\-*/() ,]|binom|abs|floor|ceil|gamma|E|PI)+")
_GAMMA_ARGUMENT = re.compile(r"\s*(?:\\left(?![A-Za-z])\s*)?\(")  # "\Gamma(" or "\Gamma\left("
_LEADING_ZEROS = re.compile(r"(?<![\d.])0+(?=\d)")


def _too_costly(text: str) -> bool:
  """Whether `text` holds math too costly to read (`_MAX_NESTING`, `_MAX_DIGITS`,
  `_MAX_FACTORIAL`); the cost of the check is linear in the text."""
  depth, opened = 0, []
  for m in _NESTING_TOKEN.finditer(text):
    if m.group() in ")]}":
      if opened:
        depth -= opened.pop()
    else:
      counts = len(m.group()) == 1
      opened.append(counts)
      depth += counts
      if depth > _MAX_NESTING:
        return True
  if (text.isascii() and "!" not in text and "^" not in text and "**" not in text and "\\Gamma" not in text
          and "\\exp" not in text):
    return False
  # Numbers and powers as `_math_compare._parse_answer` writes them before math-verify reads them
  # ("1\,000\,000!", "1~000~000!" and "(1e6)!" are 1000000!; "10⁶!" is 10^{6}!).
  text = _normalize_numbers((text if text.isascii() else _read_unicode(text)).replace("~", " "))
  if "\\exp" in text:  # before the factorials: "\exp(10)!" is (e^{10})!, no whole number
    text = _EXPONENTIAL.sub(" e^", text)
  if "!!" in text:
    if any(len(a + b) > 4 or int(a + b) > _MAX_DOUBLE_FACTORIAL
           for a, b in _DOUBLE_FACTORIAL.findall(text)):
      return True
    text = _double_factorials(text)  # "(18!!)!" is 185794560!
  if "!" in text and any(len(n) > 6 or int(n) > _MAX_FACTORIAL
                         for n in _NUMBER_FACTORIAL.findall(text)):
    return True
  if "!" in text and any(len(n) > 2 or math.factorial(int(n)) > _MAX_FACTORIAL
                         for n in _NESTED_FACTORIAL.findall(text)):
    return True
  if ("!" in text or "\\Gamma" in text) and any(_costly_operand(*operand)
                                                for operand in set(_factorial_operands(text))):
    return True  # each operand read once: a long answer may repeat one many times
  if ("^" in text or "**" in text) and (_costly_group_powers(text) or _costly_sums(text)):
    return True
  if "^" not in text and "**" not in text:
    return False
  for m in _NUMBER_POWER.finditer(text):
    numbers = [m[1]] + _POWER_EXPONENT.findall(m[2])
    if any(len(n) > 300 for n in numbers):
      return True
    exponent = float(numbers[-1])
    for n in reversed(numbers[1:-1]):
      base = float(n)
      exponent = math.inf if exponent * math.log10(max(base, 1.0)) > 300 else base**exponent
    base = _CONSTANTS[numbers[0]] if numbers[0] in _CONSTANTS else float(numbers[0])
    scale = abs(math.log10(base)) if base > 0 else 0.0
    if scale and exponent * scale > _MAX_DIGITS:
      return True
  return False


def _costly_group_powers(text: str) -> bool:
  """Whether a power whose exponent is a group of arithmetic (`_GROUP_POWER`) has more than
  `_MAX_DIGITS` digits, or fewer than -`_MAX_DIGITS` (or overflows a float on the way); each
  group is read once per power it is the exponent of, and groups nest no deeper than
  `_MAX_NESTING`: linear time."""
  closings = None
  for m in _GROUP_POWER.finditer(text):
    closings = _group_closings(text) if closings is None else closings
    if m.end() not in closings:
      continue
    exponent = _operand_value(text[m.end() + 1 + (text[m.end()] == "\\"):closings[m.end()]])
    base = _CONSTANTS[m[1]] if m[1] in _CONSTANTS else float(m[1])
    scale = abs(math.log10(base)) if base > 0 else 0.0
    if exponent is not None and scale and not abs(exponent) * scale <= _MAX_DIGITS:  # NaN too
      return True
  return False


def _costly_sums(text: str) -> bool:
  """Whether a sum or product with bounds of arithmetic (`_SUM`) has more than `_MAX_TERMS` terms,
  or `_MAX_IRRATIONAL_TERMS` of an irrational summand, counting the terms of the sums it stands
  in; linear time."""
  closings = None
  sums = []  # (where it starts, its terms or None, where its summand starts)
  for m in _SUM.finditer(text):
    closings = _group_closings(text) if closings is None else closings
    if m.end() not in closings:
      continue
    index = _SUM_INDEX.fullmatch(text, m.end() + 1, closings[m.end()])
    upper = _SUM_UPPER.match(text, closings[m.end()] + 1)
    if index is None or upper is None or (upper[1] and upper.end() - 1 not in closings):
      continue
    start = upper.end() if upper[2] else closings[upper.end() - 1] + 1
    upper = upper[2] or text[upper.end():closings[upper.end() - 1]]
    lower, upper = _operand_value(index[1]), _operand_value(upper)
    sums.append((m.start(), None if lower is None or upper is None else upper - lower + 1, start))
  bound = 1.0  # the product of the sums' terms: the most any summand can have
  for _, terms, _ in sums:
    if terms is not None and not terms <= 1:  # NaN too
      bound *= terms
  if bound <= _MAX_IRRATIONAL_TERMS:
    return False
  ends = _summand_ends(text, [start for _, _, start in sums])
  enclosing = []  # (where a summand ends, its terms with those of the sums it stands in)
  for (where, terms, start), end in zip(sums, ends):
    while enclosing and enclosing[-1][0] <= where:
      enclosing.pop()
    terms = (1.0 if terms is None else terms) * (enclosing[-1][1] if enclosing else 1.0)
    if not terms <= _MAX_IRRATIONAL_TERMS and (not terms <= _MAX_TERMS  # NaN too
                                               or _IRRATIONAL_TERM.search(text, start, end)):
      return True
    enclosing.append((end, max(terms, 1.0)))
  return False


def _summand_ends(text: str, starts: list[int]) -> list[int]:
  """Where each summand that starts at one of `starts` (in order) ends: at a "+", "-", "=", ","
  or ";" outside its brackets once it has begun, or where a bracket it did not open closes; at
  most `_SUMMAND_CHARS` on. One pass over the text for all of them."""
  ends = {start: min(len(text), start + _SUMMAND_CHARS) for start in starts}
  pending, depth, i = [], 0, 0  # pending: (depth, start) of the open summands, depths ascending
  for m in _SUMMAND_END.finditer(text):
    pos, c = m.start(), m.group()
    while i < len(starts) and starts[i] <= pos:
      pending.append((depth, starts[i]))
      i += 1
    if c in "()[]" and pos and text[pos - 1] == "\\":
      continue  # "\(" groups nothing
    if c in "([{":
      depth += 1
    elif c in ")]}":
      while pending and pending[-1][0] == depth:
        ends[pending[-1][1]] = min(ends[pending[-1][1]], pos)
        pending.pop()
      depth = max(depth - 1, 0)
    else:
      while pending and pending[-1][0] == depth and text[pending[-1][1]:pos].strip():
        ends[pending[-1][1]] = min(ends[pending[-1][1]], pos)
        pending.pop()
    while pending and pending[0][1] + _SUMMAND_CHARS <= pos:
      pending.pop(0)  # past its last character
  return [ends[start] for start in starts]


def _group_closings(text: str) -> dict[int, int]:
  """Where each bracket of `text` that opens a group is closed, by where it opens; an escaped
  brace ("\\{") is a bracket, other escaped brackets ("\\(") group nothing."""
  closings, opened = {}, []
  for m in _GROUP_TOKEN.finditer(text):
    if m[0][-1] in "([{":
      opened.append(m.start())
    elif m[0][-1] in ")]}" and opened:
      closings[opened.pop()] = m.start()
  return closings


def _double_factorials(text: str) -> str:
  """`text` with each double factorial of a number (`_DOUBLE_FACTORIAL`: "5!!") written as its value
  in brackets ("(15)"); one past `_MAX_DOUBLE_FACTORIAL` is left as it is."""
  def value(m: re.Match) -> str:
    digits = m[1] or m[2]
    return m[0] if len(digits) > 4 or int(digits) > _MAX_DOUBLE_FACTORIAL else _double_factorial(int(digits))
  return _DOUBLE_FACTORIAL.sub(value, text) if "!!" in text else text


@functools.lru_cache(maxsize=256)
def _double_factorial(n: int) -> str:
  return f"({math.prod(range(n, 0, -2))})"


def _factorial_operands(text: str):
  """The text of each factorial's operand in `text` that is a group (a bracket, a bar, a floor or
  a ceiling, with a command it is the last argument of: "\\frac{10^7}{2}"), a number, a constant
  ("e", "\\pi") or a power of these ("10^{6}" in "10^{6}!", "e^{100}" in "e^{100}!"); spaces and
  spacing commands may stand before the "!". Each comes with how many factorials are taken
  of it before the last (up to `_MAX_INNER`): the operand of a factorial of a factorial
  ("((18)!)!", "(|18|!)!", "(10^1)!!", "((4!)!)!"), which math-verify reads so. Any other
  operand that holds a factorial is left out: it is no arithmetic of numbers, and so the
  operands read are disjoint and the cost is linear in the text."""
  opener, opened, bars, command_end = {}, [], set(), -1  # opened: where each open group starts
  wide = {}  # a delimiter longer than a character ("\\lfloor"): where it ends, from its start, or
  # where it starts, from its end
  for m in _DELIMITER.finditer(text):
    kind = m.lastindex
    if kind == 1:
      start, end = m.span()
      opened.append(start)
      if end - start > 1:
        wide[start] = end
        if m[1][-1] in "|t":  # "\\left|", "\\lvert"
          bars.add(start)
    elif kind == 2 or (kind == 3 and opened and opened[-1] in bars
                       and _ends_value(text, m.start(), opener, command_end)):
      if opened:
        start, end = m.span()
        opener[end - 1] = opened.pop()
        if end - start > 1:
          wide[end - 1] = start
    elif kind == 3:
      start, end = m.span()
      opened.append(start)
      bars.add(start)
      if end - start > 1:
        wide[start] = end
    else:
      command_end = m.end() - 1
  if "\\Gamma" in text:  # \Gamma(x) is (x - 1)!: read as x!, a bound
    closing = {start: end for end, start in opener.items()}
    for m in _GAMMA.finditer(text):
      if m.end() in closing and text[m.end()] in "({[":
        yield text[m.end():closing[m.end()] + 1], False
  last, last_start, last_operand, inner = -1, -1, None, 0  # the factorial before: where, its operand
  for m in _FACTORIAL_MARK.finditer(text):
    bang = m.start()
    i = end = bang - 1
    if i >= 0 and (text[i] == " " or (i and text[i - 1] == "\\")):
      i = end = _skip_spacing(text, i)
    if last_operand is not None and (end == last or (
        end in opener and _holds_just(text, end, opener, wide, last_start, last))):
      inner = min(inner + 1, _MAX_INNER)
      yield last_operand, inner  # "(18!)!", "18! !", "((4!)!)!"
      if end in opener:  # the group read is the operand of the factorial after it
        left = _LEFT_END.search(text, max(opener[end] - 13, 0), opener[end])
        last_start = left.start() if left else opener[end]
      last = bang
      continue
    while True:  # one base or exponent per turn, right to left
      if i in opener:
        i = opener[i] - 1
        spaced = i >= 0 and (text[i] == " " or text.endswith("ft", 0, i + 1))  # "\\left(", "\\left ("
        left = _LEFT_END.search(text, max(i - 12, 0), i + 1) if spaced else None
        i = left.start() - 1 if left else _command_start(text, i, opener)
      elif i >= 0 and text[i].isdigit():
        while i >= 0 and (text[i].isdigit() or text[i] == "."):
          i -= 1
      elif i >= 0 and text[i] == "e" and not (i and (text[i - 1].isalpha() or text[i - 1] == "\\")):
        i -= 1
      elif text.endswith("\\pi", 0, i + 1):
        i -= 3
      else:
        i = bang  # a power of something else ("x^{10^6}!")
        break
      power = i
      while power >= 0 and text[power] == " ":
        power -= 1
      if text.endswith("^", 0, power + 1):
        power -= 1
      elif text.endswith("**", 0, power + 1):
        power -= 2
      else:
        break
      while power >= 0 and text[power] == " ":
        power -= 1
      i = power
    operand = text[i + 1:end + 1].strip() or None if i >= last else None  # else it holds the one before
    if operand:
      yield operand, False
    last, last_start, last_operand, inner = bang, i + 1, operand, 0


def _holds_just(text: str, end: int, opener: dict[int, int], wide: dict[int, int], start: int, stop: int) -> bool:
  """Whether the group that ends at `end` holds just `text[start:stop + 1]` (spaces, spacing
  commands and "\\right" aside) and is a factorial's whole operand (`_alone`)."""
  content = wide.get(opener[end], opener[end] + 1)
  return (content <= start and _SPACING.fullmatch(text, content, start) is not None
          and _SPACING_OR_RIGHT.fullmatch(text, stop + 1, wide.get(end, end)) is not None
          and _alone(text, end, opener))


def _alone(text: str, end: int, opener: dict[int, int]) -> bool:
  """Whether the group that ends at `end` is a factorial's whole operand: no command's argument
  ("\\frac{1}{(5!)}!") and no exponent ("10^{(5!)}!")."""
  i = opener[end] - 1
  left = _LEFT_END.search(text, max(i - 12, 0), i + 1)
  i = left.start() - 1 if left else i
  if _command_start(text, i, opener) != i:
    return False
  while i >= 0 and text[i] == " ":
    i -= 1
  return not text.endswith("^", 0, i + 1)


def _ends_value(text: str, i: int, opener: dict[int, int], command_end: int) -> bool:
  """Whether what stands before `i` (spaces aside) ends a value: a letter or digit that ends no
  command, or a closed group; a bar at `i` then closes an open bar ("|a|"), else it opens one
  ("|{-5}|", "||a|-|b||")."""
  i -= 1
  while i >= 0 and text[i] == " ":
    i -= 1
  return i >= 0 and i != command_end and (text[i].isalnum() or text[i] in ".!" or i in opener)


def _skip_spacing(text: str, i: int) -> int:
  """Where `text` up to `i` ends once spaces and spacing commands (`_SPACING_COMMANDS`) are dropped."""
  while i >= 0:
    if i and text[i - 1] == "\\" and text[i] in _SPACING_COMMANDS:
      i -= 2
    elif text[i] == " ":
      i -= 1
    else:
      break
  return i


def _command_start(text: str, i: int, opener: dict[int, int]) -> int:
  """Where the operand of a factorial starts when the group that ends at `i` + 1 is the last
  argument of `\\frac`, `\\binom` or `\\sqrt` (`_COMMAND_END`): just before the command; else
  `i`."""
  j = i
  while j >= 0 and text[j] == " ":
    j -= 1
  if j in opener:  # a group before it: the first argument of a fraction, or a root's index
    k = opener[j] - 1
    while k >= 0 and text[k] == " ":
      k -= 1
    m = _COMMAND_END.search(text, max(k - 6, 0), k + 1)
    if m and (m[1] or text[j] == "]"):
      return m.start() - 1
  m = _COMMAND_END.search(text, max(j - 6, 0), j + 1)
  return m.start() - 1 if m and m[2] else i


def _operand_python(operand: str) -> str | None:
  """A factorial's operand as Python arithmetic ("\\frac{10^7}{2}" is "((10**7)/(2))", "2\\pi" is
  "2*PI", "|x|" is "abs(x)"), or None where it holds LaTeX other than brackets, bars, floors,
  ceilings, powers, `\\cdot`, `\\times`, spacing, fractions, binomials (`\\binom`, `\\choose`),
  roots and the constants e and pi, or a letter other than e; linear time, as brackets nest no
  deeper than `_MAX_NESTING`."""
  out, groups, i = [], [], 0  # groups: [where its opening is in `out`, its \choose, whether a bar]
  choose = None  # a \choose outside any group: the operand is a binomial
  value_end = digit_end = False  # whether what `out` ends with (spaces aside) is a value, a number
  while i < len(operand):
    c = operand[i]
    piece, opens, closes, bar = None, False, False, False
    if c.isdigit() or c == ".":
      if value_end and not digit_end:
        out.append("*")
      out.append(c)
      value_end = digit_end = True
      i += 1
      continue
    if c == " ":
      out.append(c)
      i += 1
      continue
    if c in "+-*/,^":
      out.append("**" if c == "^" else c)
      value_end = digit_end = False
      i += 1
      continue
    if c in "([{":
      piece, opens = "(", True
      i += 1
    elif c in ")]}":
      closes = True
      i += 1
    elif c == "|":
      bar, i = True, i + 1
    elif c == "e":
      piece, i = "E", i + 1
    elif operand.startswith("\\{", i):  # "\{10^6\}", "\left\{10^6\right\}": a group
      piece, opens, i = "(", True, i + 2
    elif operand.startswith("\\}", i):
      closes, i = True, i + 2
    elif c != "\\":
      return None  # a letter or a symbol: no arithmetic of numbers
    else:
      m = _OPERAND_COMMAND.match(operand, i)
      if m is None:
        return None
      name, i = m[1], m.end()
      if name is None:  # a spacing command
        continue
      if name in ("left", "right"):
        delimiter = _BAR.match(operand, i)
        if delimiter is None:
          continue  # "\left(", "\left\lfloor", "\left\{": the delimiter is read next
        i = delimiter.end()
        if name == "left":
          piece, opens, bar = "abs(", True, True
        else:
          closes, bar = True, True
      elif name == "vert":
        bar = True
      elif name == "choose":
        if groups and groups[-1][1] is None:
          groups[-1][1] = len(out)
        elif not groups and choose is None:
          choose = len(out)
        else:
          return None
        out.append(",")
        value_end = digit_end = False
        continue
      elif name in _OPERAND_OPERATORS:
        out.append(_OPERAND_OPERATORS[name])
        value_end = digit_end = False
        continue
      elif name in _OPERAND_CONSTANTS:
        piece = _OPERAND_CONSTANTS[name]
      elif name in _OPERAND_OPENERS:
        piece, opens, bar = _OPERAND_OPENERS[name], True, name == "lvert"
      elif name in _OPERAND_CLOSERS:
        closes, bar = True, name == "rvert"
      elif name == "Gamma":  # "\Gamma(\Gamma(10))" is Gamma(362880): a call with its bracket
        call = _GAMMA_ARGUMENT.match(operand, i)
        if call is None:
          return None
        piece, opens, i = "gamma(", True, call.end()
      else:
        piece, i = _operand_command(operand, i, name)
        if piece is None:
          return None
    if bar and piece is None and not closes:  # "|" or "\vert": it closes an open bar after a value
      if value_end and groups and groups[-1][2]:
        closes = True
      else:
        piece, opens = "abs(", True
    if closes:
      if not groups or groups[-1][2] != bar:
        return None
      start, inner, _ = groups.pop()
      if inner is not None:
        out[start] += "binom(("
        out[inner] = "),("
        out.append("))")
      out.append(")")
      value_end, digit_end = True, False
      continue
    if value_end:
      out.append("*")  # a product: "2\\pi", "(2)(3)", "2|x|"
    if opens:
      groups.append([len(out), None, bar])
      value_end = False
    else:
      value_end = True
    out.append(piece)
    digit_end = False
  if groups:
    return None
  if choose is not None:
    return f"binom(({''.join(out[:choose])}),({''.join(out[choose + 1:])}))"
  return "".join(out)


def _operand_command(operand: str, i: int, name: str) -> tuple[str | None, int]:
  """A fraction, binomial or root named `name` whose arguments start at `i`, as Python
  arithmetic (`_operand_python`), and where it ends; None for any other command."""
  root = name == "sqrt"
  if not (root or re.fullmatch(r"[dtc]?frac|[dt]?binom", name)):
    return None, i
  index = None
  if root:
    while operand.startswith(" ", i):
      i += 1
    if operand.startswith("[", i):
      index, i = _operand_argument(operand, i, "[", "]")
      if index is None:
        return None, i
  args = []
  for _ in range(1 if root else 2):
    arg, i = _operand_argument(operand, i, "{", "}")
    if arg is None:
      return None, i
    args.append(arg)
  if root:
    return (f"(({args[0]})**(1/({index})))" if index is not None else f"(({args[0]})**0.5)"), i
  if name.endswith("frac"):
    return f"(({args[0]})/({args[1]}))", i
  return f"binom(({args[0]}),({args[1]}))", i


def _operand_argument(operand: str, i: int, open_: str, close: str) -> tuple[str | None, int]:
  """The argument of a command that starts at `i` (a group between `open_` and `close`, or one
  digit) as Python arithmetic (`_operand_python`), and where it ends."""
  while operand.startswith(" ", i):
    i += 1
  if i < len(operand) and operand[i].isdigit() and open_ == "{":
    return operand[i], i + 1
  if not operand.startswith(open_, i):
    return None, i
  depth = 0
  for j in range(i, len(operand)):
    if operand[j] == open_:
      depth += 1
    elif operand[j] == close:
      depth -= 1
      if depth == 0:
        return _operand_python(operand[i + 1:j]), j + 1
  return None, i


def _costly_operand(operand: str, inner: int = 0) -> bool:
  """Whether a factorial's operand (`_factorial_operands`) is arithmetic of literal numbers whose
  value (once `inner` factorials are taken of it) passes `_MAX_FACTORIAL` (or overflows a float
  on the way); an operand with anything else in it ("(2n)", "x^{2}") is left to math-verify."""
  if operand.isdigit() and not inner:
    return len(operand) > 6 or int(operand) > _MAX_FACTORIAL
  value = _operand_value(operand)
  for _ in range(inner):
    if value is None or not value >= 0:
      break
    value = math.inf if not value <= 170 else math.gamma(value + 1)
  if value is not None and _MAX_GAMMA < value < math.inf and abs(value - round(value)) > 1e-9 * value:
    return True  # no whole number (up to a float's rounding: "(0.1 \cdot 3000)!" is 300!)
  return value is not None and not value <= _MAX_FACTORIAL  # NaN: a term overflowed


def _operand_value(operand: str) -> float | None:
  """The value of an operand (`_operand_python`) that is arithmetic of literal numbers, in floats;
  inf where it is longer than `_MAX_OPERAND`, None where it is no such arithmetic or has no value."""
  expr = _operand_python(operand)
  if expr is None or not _ARITHMETIC.fullmatch(expr):
    return None
  if len(expr) > _MAX_OPERAND:
    return math.inf
  try:
    return _float_value(ast.parse(_LEADING_ZEROS.sub("", expr).strip(), mode="eval").body)
  except (SyntaxError, ValueError):
    return None


def _float_value(node: ast.AST) -> float | None:
  """The value of arithmetic on numbers (`_costly_operand`) in floats, inf past their range; None
  where it has none (division by zero, a complex power)."""
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    try:
      return float(node.value)
    except OverflowError:
      return math.inf
  if isinstance(node, ast.Name) and node.id in ("E", "PI"):
    return math.e if node.id == "E" else math.pi
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
    value = _float_value(node.operand)
    return None if value is None else value if isinstance(node.op, ast.UAdd) else -value
  if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("abs", "floor", "ceil")
          and len(node.args) == 1 and not node.keywords):
    value = _float_value(node.args[0])
    if value is None or not math.isfinite(value):
      return None if value is None else abs(value)
    return float({"abs": abs, "floor": math.floor, "ceil": math.ceil}[node.func.id](value))
  if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "gamma"
          and len(node.args) == 1 and not node.keywords):
    value = _float_value(node.args[0])
    if value is None or math.isnan(value) or value <= 0 and value == math.floor(value):
      return None  # a pole, or no arithmetic: left to math-verify
    return math.inf if value > 171 else math.gamma(value)
  if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "binom"
          and len(node.args) == 2 and not node.keywords):
    n, k = (_float_value(arg) for arg in node.args)
    if n == math.inf and k is not None and 1 <= k < math.inf:
      return math.inf  # a term overflowed
    if n is None or k is None or not 0 <= k <= n < math.inf or n != int(n) or k != int(k):
      return None  # left to math-verify
    log_value = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
    return math.inf if log_value > 700 else math.exp(log_value)
  if not isinstance(node, ast.BinOp) or not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div,
                                                                  ast.Pow)):
    return None
  a, b = _float_value(node.left), _float_value(node.right)
  if a is None or b is None:
    return None
  try:
    value = {ast.Add: a.__add__, ast.Sub: a.__sub__, ast.Mult: a.__mul__, ast.Div: a.__truediv__,
             ast.Pow: a.__pow__}[type(node.op)](b)
  except OverflowError:
    return math.inf
  except ZeroDivisionError:
    return None
  return value if isinstance(value, float) else None


# A run of white space (a degenerate response pads with thousands of spaces): math-verify's parse
# of a bare answer took quadratic time in its length ("x" + 3000 spaces + "=5": 2 s).
_SPACE_RUN = re.compile(r"[ \t\r\f\v]*\n[\s]*|[ \t\r\f\v]{2,}")


def _collapse_spaces(text: str) -> str:
  """`text` with each run of white space one space, or one or two line breaks where it breaks
  lines ("Answer:\n\n5" keeps its blank line)."""
  return _SPACE_RUN.sub(lambda m: "\n" * min(m.group().count("\n"), 2) or " ", text)


def _brace_boxes(text: str) -> str:
  """`text` with each box whose argument goes without braces braced: a one-token argument
  (`_UNBRACED_BOX`: "\\boxed5" -> "\\boxed{5}"), then a command with its arguments
  (`_COMMAND_BOX`: "\\boxed\\sqrt{2}" -> "\\boxed{\\sqrt{2}}")."""
  return _COMMAND_BOX.sub(r"\\boxed{\1}", _UNBRACED_BOX.sub(r"\\boxed{\1}", text))


def _box_spans(text: str) -> list[tuple[int, int, int]]:
  """(start, content start, content end) of each `\\boxed{...}` / `\\fbox{...}` whose braces balance.

  One pass pairs every brace, so the cost is linear however many boxes are left open. Escaped
  braces (`\\{`, `\\}`, as in sets) do not count.
  """
  closing, open_braces = {}, []
  for m in _BRACE_TOKEN.finditer(text):
    if m.group() == "{":
      open_braces.append(m.start())
    elif m.group() == "}" and open_braces:
      closing[open_braces.pop()] = m.start()
  return [(m.start(), m.end(), closing[m.end() - 1]) for m in _BOX.finditer(text) if m.end() - 1 in closing]


def _drop_boxed_full_stops(text: str) -> str:
  """Drops a full stop that ends a box's content ("\\boxed{5.}"), which math-verify cannot parse."""
  if "\\boxed" not in text:
    return text
  pieces, last = [], 0
  for _, start, end in _box_spans(text):
    stop = _FULL_STOP.search(text, start, end) if start >= last else None
    if stop is not None:
      pieces.append(text[last:stop.start()])
      last = end
  return "".join(pieces) + text[last:]


def _drop_markdown(text: str) -> str:
  """Drops the marks of inline code ("`5`") and bold or italic text ("**7**") around what they
  mark."""
  text = _INLINE_CODE.sub(r"\2", text)
  return _EMPHASIS.sub(lambda m: m.group(2) if m.group(3) is None else m.group(3), text)


def _spread_plus_minus(text: str) -> str:
  """Writes a fraction with a plus-minus in its numerator ("\\frac{-1 \\pm \\sqrt{5}}{2}") as
  "\\frac{-1}{2} \\pm \\frac{\\sqrt{5}}{2}", which math-verify reads as the set of both values;
  it cannot parse the first. Only where the text holds one plus-minus and the fraction stands on
  its own (a side of an equation, a box's content, a list's element): next to other terms, the
  spread sum would bind differently."""
  signs = list(_PLUS_MINUS.finditer(text))
  if len(signs) != 1:
    return text
  sign = signs[0]
  opens, closing, numerator = [], {}, None
  for m in _BRACE_TOKEN.finditer(text):
    if m.start() == sign.start():
      numerator = opens[-1] if opens else None
    elif m.group() == "{":
      opens.append(m.start())
    elif m.group() == "}" and opens:
      closing[opens.pop()] = m.start()
  frac = numerator is not None and _FRAC_HEAD.search(text, 0, numerator + 1)
  if not frac or numerator not in closing:
    return text
  denominator = _BRACE_OPEN.match(text, closing[numerator] + 1)
  if denominator is None or denominator.end() - 1 not in closing:
    return text
  end = closing[denominator.end() - 1] + 1
  if not (_ALONE_BEFORE.search(text, 0, frac.start()) and _ALONE_AFTER.match(text, end)):
    return text
  a, b = text[numerator + 1:sign.start()].strip(), text[sign.end():closing[numerator]].strip()
  d = text[denominator.end():end - 1]
  spread = f"\\frac{{{a}}}{{{d}}} \\pm \\frac{{{b}}}{{{d}}}" if a else f"\\pm \\frac{{{b}}}{{{d}}}"
  return text[:frac.start()] + spread + text[end:]


def _right_powers(text: str) -> str:
  """Writes a tower of powers right-associatively: "2^3^2" -> "2^{3^{2}}"."""
  def nest(m):
    exponents = [braced or token for braced, token in _EXPONENT.findall(m.group())]
    tower = exponents[-1]
    for e in reversed(exponents[:-1]):
      tower = f"{e}^{{{tower}}}"
    return "^{" + tower + "}"
  return _POWER_TOWER.sub(nest, text) if "^" in text else text


# English cardinal number words (`_spelled_number`): an exact table, not a guess.
_UNIT_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen".split())}
_TENS_WORDS = {w: 10 * i for i, w in enumerate(
    "twenty thirty forty fifty sixty seventy eighty ninety".split(), start=2)}
_SCALE_WORDS = {"thousand": 10**3, "million": 10**6, "billion": 10**9, "trillion": 10**12}
_NUMBER_WORDS = frozenset(_UNIT_WORDS) | frozenset(_TENS_WORDS) | frozenset(_SCALE_WORDS) | {"hundred"}
_WORD_TOKEN = re.compile(r"[a-z]+")


def _spelled_number(words: str) -> int | None:
  """The value of a whole English cardinal number in words ("seven", "forty-two", "one hundred
  and five", "two thousand twenty-four"), lowercase, or None for anything else ("seven or eight",
  "seven seven", "the seventh", "hundred")."""
  tokens = [t for t in re.split(r"[\s\-]+", words.strip()) if t]
  if not tokens or tokens[-1] == "and" or any(not _WORD_TOKEN.fullmatch(t) for t in tokens):
    return None
  if tokens == ["zero"]:
    return 0
  total, group, last, scale = 0, 0, None, None
  for token in tokens:
    if token == "and":  # "one hundred and five", "two thousand and five"
      if last not in ("hundred", "scale"):
        return None
      last = "and"
    elif token in _UNIT_WORDS and token != "zero":
      value = _UNIT_WORDS[token]
      if last == "tens" and value < 10:
        group += value
      elif last in (None, "hundred", "scale", "and") and group % 100 == 0:
        group += value
      else:
        return None
      last = "unit" if value < 10 else "teen"
    elif token in _TENS_WORDS:
      if last not in (None, "hundred", "scale", "and") or group % 100:
        return None
      group += _TENS_WORDS[token]
      last = "tens"
    elif token == "hundred":
      if last != "unit" or group >= 10:
        return None
      group *= 100
      last = "hundred"
    elif token in _SCALE_WORDS:
      value = _SCALE_WORDS[token]
      if not group or last == "and" or (scale is not None and value >= scale):
        return None
      total, group, last, scale = total + group * value, 0, "scale", value
    else:
      return None
  return total + group


def _number_word_count(text: str) -> int:
  """How many number words (`_NUMBER_WORDS`) `text` holds."""
  return sum(t in _NUMBER_WORDS for t in _WORD_TOKEN.findall(text.lower()))


def _improper_fraction(m: re.Match) -> str:
  whole, numerator, denominator = int(m[1]), int(m[2]), int(m[3])
  return f"{whole * denominator + numerator}/{denominator}" if numerator < denominator else m[0]


def _read_unicode(text: str) -> str:
  """Writes the Unicode math of `_UNICODE_ROOT`, `_SUPERSCRIPT`, `_UNICODE_NUMBERS`,
  `_EN_DASH_MINUS` and `_UNICODE_SYMBOLS` as LaTeX."""
  text = _UNICODE_ROOT.sub(lambda m: "\\sqrt{" + (m[1] or m[2] or m[3] or "") + "}", text)
  text = _SUPERSCRIPT.sub(lambda m: "^{" + m.group().translate(_SUPERSCRIPT_DIGITS) + "}", text)
  text = _EN_DASH_MINUS.sub("-", text.translate(_UNICODE_NUMBERS))
  return text.translate(_UNICODE_SYMBOLS)


def _normalize_numbers(text: str) -> str:
  """Writes spaced thousands ("1\\,000", "1 000"), scientific notation ("1e3") and mixed numbers
  ("3 1/2" as "7/2") as plain numbers."""
  text = _SPACED_THOUSANDS.sub(lambda m: _THOUSANDS_SPACE.sub("", m.group()), text)
  text = _MIXED_NUMBER.sub(_improper_fraction, text)
  return _SCIENTIFIC.sub(lambda m: format(decimal.Decimal(m.group()), "f"), text)
