"""How a math answer is read and compared: the code that runs inside a `MathVerifier` worker.

`math_verifier.py` holds the public API (`MathVerifier`, `math_equal`) and the time limit: its
thread backend calls `_equal_inline` on a daemon thread, and its process backend starts worker
processes that run `_serve`, which answers one JSON request per line with `_equal_inline`.
`_parse_answer` decides how each side is read (a bare answer, prose, a box, a marked answer, a
hedge). The text rewrites done before parsing (markdown, spaces, boxes, Unicode math, numbers,
towers of powers) and the cost guard `_too_costly` live in `_math_text.py`;
`verifiers.extract_boxed` reads boxes by the same rules (`_math_text._brace_boxes`, `_box_spans`).

This file imports only the standard library and `_math_text` at module level: worker processes
load both by path, without importing the `jaxagent` package (and so without JAX).
"""
from __future__ import annotations

import bisect
import json
import logging
import os
import re
import sys
from typing import Any

from jaxagent.rewards._math_text import (
    _BOX,
    _FULL_STOP,
    _UNBRACED_BOX,
    _box_spans,
    _brace_boxes,
    _collapse_spaces,
    _double_factorials,
    _drop_boxed_full_stops,
    _drop_markdown,
    _normalize_numbers,
    _number_word_count,
    _read_unicode,
    _right_powers,
    _spelled_number,
    _spread_plus_minus,
    _too_costly,
)

# Explicit math delimiters: let math-verify's own extraction find the answer.
_DELIMITED = re.compile(r"\\boxed|\\fbox|\\\(|\\\[|\$[^$]*\$")
# LaTeX commands (with one braced argument, so \text{ dollars} goes too) are not prose.
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+\s*(?:\{[^{}]*\})?")
_WORD = re.compile(r"[A-Za-z]{2,}")
_MATH_WORDS = frozenset({
    "sin", "cos", "tan", "cot", "sec", "csc", "sinh", "cosh", "tanh", "arcsin", "arccos", "arctan",
    "log", "ln", "exp", "sqrt", "pi", "oo", "inf", "infty", "max", "min", "gcd", "lcm", "mod", "det",
})
# Two numbers side by side ("5 6", "5\quad 6"), which LaTeX adds up as a mixed number; group 1 is a
# command whose arguments may go unbraced ("\frac 1 2", and after a subscript "\log_2 8").
_JUXTAPOSED = re.compile(
    r"(\\[A-Za-z]+\s*(?:_\s*)?)?(?<![\d.])\d+(?:\.\d+)?(?:\s|\\[,;:! ]|\\q?quad(?![A-Za-z]))+\d")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
# math-verify reads \boxed only; \fbox is the same box to a reader.
_FBOX = re.compile(r"\\fbox(?![A-Za-z])")
# An empty box names nothing; left in, it hid an earlier box ("\boxed{5} so \boxed{}").
_EMPTY_BOX = re.compile(r"\\boxed\s*\{\s*\}")
# A number with its unit inside text ("\text{7 apples}") is the number with a unit after it.
_TEXT_NUMBER = re.compile(
    r"\\(?:text|mbox|mathrm)\s*\{\s*([-+]?\d+(?:[.,]\d+)*)\s+([A-Za-z][A-Za-z ]*)\}")
# Letters listed inside text ("\text{A, C}", choices of a multiple-answer question) are a list,
# which math-verify would read as one symbol "a,c".
_TEXT_LETTERS = re.compile(r"\\text\s*\{\s*(\(?[A-Z]\)?(?:\s*,\s*\(?[A-Z]\)?)+)\s*\}")
# A word of prose that holds LaTeX ("2\sqrt{2}", "3\pi", "2^{10}", "\frac{1}{2}"), with the
# punctuation after it; math-verify finds LaTeX in prose only between delimiters, and read "We get
# 2\sqrt{2}" as 2. A word that starts with a letter is left ("5 cm^2" is 5 with a unit). A
# factorial before a space, a comma or a semicolon ("3! ways, so 6", "3!, so 6") is such a word
# too: math-verify read it as 3, a second value beside 6.
_UNDELIMITED_MATH = re.compile(
    r"(?<!\S)(?=[-+(\\\d])([^\s$]*(?:\\[A-Za-z]|\^|(?<=[\d)])!(?=[,;]?\s))[^\s$]*?)([.,;:!?]*)(?!\S)")
# A logical or between answers ("x = 2 \lor x = 3"), which math-verify reads as the chain
# x = (2 \lor x) = 3, that is 3; "\text{ or }" it reads as the set of both.
_LOGICAL_OR = re.compile(r"\\(?:lor|vee)(?![A-Za-z])")
# Space or a line break between equations ("x = 2 \quad x = 3", "x = 2 \\ x = 3"), which
# math-verify reads as one chain x = 2x = 3 (or as its last side, 3): such equations are a list.
_EQUATION_BREAK = re.compile(r"(?<!\s)\s*(?:\\\\|\\q?quad(?![A-Za-z])|\\[ ;]|\\text\{\s*\})\s*")
# "and" / "or" between math, which then lists its sides.
_LISTING_WORD = re.compile(r"(?<!\s)\s+(?:and|or)\s+")
# The end of a sentence: a full stop before a space or the end, or a line break. "0.5" goes on.
_SENTENCE_END = re.compile(r"\.(?=\s|$)|\n")
# A reason given after a marked answer in its sentence ("The answer is 5, since 2 + 3 = 5."), or a
# remark on it after a comma ("The answer is 5, which is not divisible by 2."): its working names
# no other answer. "5 as well as 6" names two, and "as" after a word is no reason ("the same as
# 5", "such as"). (This pattern, `_EQUATION_BREAK` and `_LISTING_WORD` start only
# where a run of spaces starts: tried at every space of a long run, each would scan the rest of
# it, in quadratic time.)
_REASON = re.compile(
    r"(?:[,;]|(?<!\s))\s*\(?\b(?:since|because|(?<![A-Za-z]{2} )as(?!\s+well\b))\b|,\s*which\b",
    re.IGNORECASE)
# The end of an answer phrase that has named nothing yet ("The answer is", "### Final Answer").
_ENDS_MARKED = re.compile(r"\b(?:answer|is)$", re.IGNORECASE)
# What names an answer after an answer phrase: a letter or digit (group 1) outside a command or
# an environment's name ("$$", "\[" and "\begin{equation}" name nothing yet).
_NAMING = re.compile(r"\\(?:begin|end)\s*\{[^{}]*\}|\\[A-Za-z]+|([A-Za-z0-9])")
# Exclamation marks that end a sentence of prose after a number ("The answer is 18!", "18!!",
# "18!\nSo ..."), which LaTeX would read as a factorial: a full stop to a reader. A bare answer
# ("5!"), math between delimiters ("$5!$", "\boxed{5!}") and "5! = 120" keep their factorial.
_EXCLAMATION = re.compile(r"(?<=\d)!+(?=[ \t]*(?:$|\n)|\s+[A-Z])")
# A double factorial of an expression ("(2n-1)!!", "n!!"), which math-verify reads as a factorial
# of a factorial, ((2n-1)!)!; one of a number is written as its value first (`_double_factorials`).
# Read so on both sides, two compare by their operands; against a side with a factorial and no
# such double factorial it is not credited (`_equal_inline`). "Wow!!" is no such thing.
_SYMBOLIC_DOUBLE_FACTORIAL = re.compile(r"(?:[)}\]]|(?<![A-Za-z\\])[A-Za-z])\s*!!(?!!)")
# A value ruled out right after an answer, to the end of its sentence ("The answer is 5, not 6.",
# "x = 5, and not 6"): the answer is the value before it, as a reader takes it, not a hedge between
# the two. "5, not 6 or 7" and "5, not 6, 7" are left to the hedge rule.
_EXCLUDED = re.compile(
    r"(?<=[\d$})])[ \t]*,[ \t]*(?:(?:and|but)[ \t]+)?not[ \t]+(?:\$[ \t]*)?[-+]?\d+(?:[.,]\d+)*"
    r"(?:[ \t]*\$)?(?=[ \t]*(?:[.!;]|$|\n))", re.IGNORECASE)
# An approximation sign, and the plain decimal number that may follow it (`_rounded_value`).
_APPROX = re.compile(r"\\approx(?![A-Za-z])|≈")
_DECIMAL = re.compile(r"[-+]?\d+(?:\.\d+)?")
# Python's power operator ("2**3", "2**(1/2)"), which LaTeX does not read; group 1 the exponent.
_PY_POWER = re.compile(r"\*\*\s*(\([^()]*\)|[-+]?[\w.]+)")


def _is_bare_answer(text: str) -> bool:
  """True for an answer on its own ("1,000", "[1,2)", "\\frac{1}{2}"), False for prose or delimited math."""
  if _DELIMITED.search(text):
    return False
  words = _WORD.findall(_LATEX_COMMAND.sub(" ", text))
  return all(w.lower() in _MATH_WORDS for w in words)


def _latex_only() -> list:
  """math-verify extraction that reads only boxed LaTeX, without picking numbers out of it."""
  from math_verify.parser import LatexExtractionConfig

  return [LatexExtractionConfig(try_extract_without_anchor=False)]


def _same_value(a, b, options: dict[str, Any]) -> bool:
  """Whether two parsed values are equal, read either way round."""
  from math_verify import verify

  return bool(verify(a, b, timeout_seconds=None, **options) or verify(b, a, timeout_seconds=None, **options))


def _equates_two_values(parsed: list, options: dict[str, Any]) -> bool:
  """True when an equation in `parsed` sets two different constants equal ("5 = 6", "x = 5 = 6")."""
  import sympy

  for expr in parsed:
    if not isinstance(expr, sympy.Basic):
      continue
    for eq in sympy.preorder_traversal(expr):
      if (isinstance(eq, sympy.Eq) and not eq.lhs.free_symbols and not eq.rhs.free_symbols
          and not _same_value(eq.lhs, eq.rhs, options)):
        return True
  return False


def _rounded_value(text: str) -> list | None:
  """The rounded value of a bare answer "A \\approx r" (A without variables, r a decimal number):
  [r] when r is A to r's precision, within one unit of its last digit ("\\frac{2}{3} \\approx
  0.67", "\\pi \\approx 3.14", "2/3 \\approx 0.66"), [] when it is not ("42 \\approx 41": two
  values, as "5 = 6" is), None for any other answer. math-verify reads the exact side A; r is the
  same answer written to a precision, so a gold of either is named."""
  import sympy
  from math_verify import parse

  sides = _APPROX.split(text)
  if len(sides) != 2 or not _DECIMAL.fullmatch(sides[1].strip()):
    return None
  exact = sides[0].rsplit("=", 1)[-1].strip()  # "x = \\frac{1}{3} \\approx 0.33"
  parsed = parse("\\boxed{" + exact + "}", extraction_config=_latex_only(), parsing_timeout=None)
  value = parsed[0] if parsed and isinstance(parsed[0], sympy.Expr) else None
  if value is None or value.free_symbols:
    return None
  rounded = sympy.Rational(sides[1].strip())
  digits = sides[1].strip().lstrip("+-")
  places = len(digits.partition(".")[2])
  zeros = 0 if places else len(digits) - len(digits.rstrip("0"))
  unit = sympy.Rational(10) ** (zeros - places) if digits.strip("0.") else sympy.Integer(1)
  error = sympy.N(value - rounded, 30)
  if not error.is_real:
    return None
  return [rounded] if abs(error) < unit else []


def _names_two_values(text: str, options: dict[str, Any]) -> bool:
  """True when math-verify reads two different values in prose ("5 or 6", "5. 6.").

  Where the text boxes its answer, only the boxes count, as math-verify reads only the box: two
  boxes with different values hedge ("\\boxed{5}. No: \\boxed{6}"), and so does a box whose
  content hedges on its own ("\\boxed{5 \\lor 6}"), but prose around a box does not
  ("\\boxed{5}. Check: 5 \\cdot 2 = 10"). Otherwise every match of math-verify's extraction
  patterns counts, except one nested in a longer match that parses ("1/2" holds "1"). Where the
  text marks its answer ("answer: ...", "final answer is ..."), only matches from the first mark
  on count, so working before it is no hedge.
  """
  seen: dict = {}
  spans = _box_spans(text)
  # A box holding a hedge hedges as the same answer unboxed does ("\\boxed{5 \\lor 6}"). Only
  # outermost boxes are read here; reading one reads the boxes in it (each read once: reading
  # every nested box at every level took exponential time in the depth).
  for content in dict.fromkeys(_outermost_boxes(text, spans)):
    if not _parse_answer(content, single=True, **options) and _parse_answer(content):
      return True
  # (start, end, marked, match, target); a box has no match: math-verify's own box pattern runs
  # from the first box to the last closing brace, so boxes are read one by one here.
  boxes = [(start, end + 1, True, None, None) for start, _, end in spans]
  if boxes:
    hedged, read = _differ(text, boxes, seen, options)
    if read:  # a box that parses; boxes none of which parse leave the prose to decide
      return hedged
  found = _without_dollar_openers(text, boxes + _extraction_matches(text))
  first_mark = min((start for start, _, marked, _, _ in found if marked), default=0)
  return _differ(text, [f for f in found if f[0] >= first_mark], seen, options)[0]


def _outermost_boxes(text: str, spans: list) -> list[str]:
  """The contents of the boxes of `spans` (`_box_spans(text)`) that are in no other box."""
  contents, reach = [], -1
  for _, start, end in spans:
    if start > reach:
      contents.append(text[start:end])
      reach = end
  return contents


def _without_dollar_openers(text: str, found: list) -> list:
  """`found` without a number math-verify reads as dollars ("$2" in "We get $2\\sqrt{2}$") whose
  "$" opens inline math: that is the math, not a value of its own."""
  spans = [(text.find("$", start, end), text[start:end].strip()) for start, end, _, _, _ in found]
  opens = {dollar for dollar, match in spans if len(match) > 1 and match[0] == match[-1] == "$"}
  return [f for f, (dollar, match) in zip(found, spans) if dollar not in opens or match[-1] == "$"]


def _extraction_matches(text: str) -> list:
  """(start, end, marked, match, target) of every match of math-verify's extraction patterns;
  `marked` for the patterns that mark an answer ("answer: ...", "final answer is ...")."""
  from math_verify.parser import (ExprExtractionConfig, LatexExtractionConfig,
                                  get_extraction_regexes)

  targets = (LatexExtractionConfig(boxed_match_priority=-1), ExprExtractionConfig())
  found = []
  for patterns, target in get_extraction_regexes(targets):
    for pattern, priority in patterns:
      found += [(m.start(), m.end(), priority < 300, m, target) for m in pattern.finditer(text)]
  return found


def _marked_answer(text: str) -> tuple[str | None, str] | None:
  """(the text up to the end of the sentence that first marks an answer, the rest), or None
  when nothing is marked or the text boxes its answer. The head is None where the marking
  sentence names an answer math-verify does not read ("The answer is B. It has 2 sides.").

  "The answer is 5. Check: 5 \\cdot 2 = 10" reads as "The answer is 5.": a marked answer ends
  with its sentence, and what follows (a check, an explanation) is no answer. math-verify's own
  "answer is" pattern runs on across sentences and would read 10 here. So does a reason given in
  the same sentence: "The answer is 5, since 2 + 3 = 5." reads as "The answer is 5", and "The
  answer is B, because 2 is even." names B, not 2.
  """
  if _box_spans(text):
    return None
  marks = [start for start, _, marked, _, _ in _extraction_matches(text) if marked]
  if not marks:
    return None
  first = min(marks)
  ends = [m.span() for m in _SENTENCE_END.finditer(text, first)] + [(len(text),) * 2]
  for i, (stop, end) in enumerate(ends):
    head = text[:end]
    # "Answer:\n5": the sentence must hold the marked value itself.
    if any(marked and start >= first and _match_value(match, target) is not None
           for start, _, marked, match, target in _extraction_matches(head)):
      end = _reason_start(text, first, end)
      return text[:end], text[end:]
    # "The answer is B.\nOption B has 12 apples.": the marking sentence names an answer
    # math-verify does not read, and a later number is none. ("Answer:\n$$\n(1, 2)\n$$" names
    # nothing in its first line, and its later lines are one display.)
    if i == 0 and not _names_nothing(text, first, stop):
      return None, text[end:]
  return None


def _reasoned_answer(text: str) -> str | None:
  """The answer in "7, since 3 + 4 = 7": a bare answer followed by its reason, which runs to the
  end of the text; else None. The reason's working names no other answer, as after a marked
  answer ("The answer is 7, since ..."); a later sentence ("... Actually 8.") leaves the text to
  the prose reading, and so does a reason that marks or boxes an answer ("5 because the answer
  is 6", "5, since \\boxed{6}")."""
  reason = _REASON.search(text)
  if reason is None or _ANSWER_MARK.search(text) or _box_spans(text):
    return None
  head = text[:reason.start()].strip()
  stop = _SENTENCE_END.search(text, reason.end())
  if not head or not _is_bare_answer(head) or (stop is not None and text[stop.end():].strip()):
    return None
  return head


def _reason_start(text: str, pos: int, end: int) -> int:
  """Where the first reason given in `text[pos:end]` once an answer is named starts, else `end`.

  "The answer is as follows: 5" names no answer before its "as".
  """
  return next((r.start() for r in _REASON.finditer(text, pos, end)
               if text[pos:r.start()].strip() and not _names_nothing(text, pos, r.start())), end)


def _names_nothing(text: str, pos: int, end: int) -> bool:
  """Whether `text[pos:end]` names nothing after its last answer phrase ("answer is", "Answer:**",
  "The answer is\\n$$", "### Final Answer") or ends with a colon ("The answer is as follows:"):
  the answer it names is still to come."""
  named = end
  while named > pos and (text[named - 1] in "*:" or text[named - 1].isspace()):
    named -= 1
  if ":" in text[named:end] or _ENDS_MARKED.search(text[max(pos, named - 7):named]):
    return True
  for m in _ANSWER_MARK.finditer(text, pos, end):
    pos = m.end()
  return not any(m.group(1) for m in _NAMING.finditer(text, pos, end))


def _match_value(match, target):
  from math_verify.parser import extract_match

  return extract_match(match, target)[0]


def _differ(text: str, found: list, seen: dict, options: dict[str, Any]) -> tuple[bool, bool]:
  """(whether the matches in `found` read two different values, whether any read a value)."""
  from math_verify import parse

  found = sorted(found, key=lambda f: (f[0], -f[1]))
  covered, first = -1, None
  for start, end, _, match, target in found:
    if end <= covered:
      continue
    key = (text[start:end], target, match and match.re)  # an answer may repeat one number many times
    if key not in seen:
      if match is None:
        values = parse(key[0], extraction_config=_latex_only(), fallback_mode="no_fallback",
                       parsing_timeout=None)
        seen[key] = values[0] if values else None
      else:
        seen[key] = _match_value(match, target)
    value = seen[key]
    if value is None:
      continue
    covered = end
    if first is None:
      first = value
    elif value != first and not _same_value(first, value, options):
      return True, True
  return False, first is not None


def _with_percent_values(parsed: list) -> list:
  """Adds the number of each percentage: "12.5%" then also equals 12.5, as "50%" equals 50."""
  import sympy

  hundredth = sympy.Rational(1, 100)
  extra = [x.args[0] for x in parsed
           if isinstance(x, sympy.Mul) and len(x.args) == 2
           and x.args[1] in (hundredth, sympy.UnevaluatedExpr(hundredth))]
  return parsed + extra


def _parse_answer(text: str, *, single: bool = False, **options) -> list:
  """math-verify parse results for one side, choosing how to read the string.

  A bare answer is parsed as if boxed, so the whole string is read as one LaTeX expression
  ("[1,2)" is an interval, "1,2" a set, "0.5" the rational 1/2); unboxed, math-verify would pick a
  single number out of it. Prose and delimited math go through math-verify's extraction, which
  finds "5" in "5 dollars" and the boxed part of a full solution. A bare string that yields no
  expression when boxed ("3.") falls back to extraction. Prose that marks its answer without a
  box ("The answer is 5. Check: ...") is read up to the end of the marking sentence or a reason
  given in it ("..., since 2 + 3 = 5"), and a later sentence marking another value hedges; a
  bare answer with a reason that ends the text ("7, since 3 + 4 = 7") is that answer; an
  answer phrase naming what math-verify does not read ("The answer is B.") parses to nothing, for
  `_equal_inline` to read. A self-correction after a marked answer ("The answer is 5. Wait, no,
  it is 6.") replaces it: the text after the last one followed by a number is read instead.
  Unmarked prose whose last sentence concludes ("... Therefore, she makes $18.") is read by that
  sentence when it names one value. Python's power operator is read ("2**3" is 8), a box's
  argument may go without braces ("\\boxed5"), and math joined by "and", "or" or "\\lor", and
  equations side by side ("x = 2 \\quad x = 3"), are a list.

  With `single` (the prediction's side), an answer naming two or more different values parses to
  nothing, since extraction would pick one of them: "5 or 6", "The answer is 5. The answer is 6.",
  "5 = 6", "5 6" (which LaTeX adds up), "5|6"; so does one that rules a value out ("not 5").
  A value ruled out right after the answer is dropped first ("5, not 6" is 5: `_EXCLUDED`).
  `options` are `verify`'s, to tell values apart.
  """
  from math_verify import parse

  # A tie ("5~or~6", "1~000") is a space to LaTeX.
  text = text if text.isascii() else _read_unicode(text)
  text = _brace_boxes(_FBOX.sub(r"\\boxed", text.replace("~", " ").strip()))
  text = _EMPTY_BOX.sub("", text).strip()
  text = _TEXT_LETTERS.sub(r"\1", _TEXT_NUMBER.sub(r"\1\\text{ \2}", text))
  text = _normalize_numbers(_LOGICAL_OR.sub(r"\\text{ or }", _drop_boxed_full_stops(text)))
  text = _double_factorials(text)  # "5!!" is 15, which math-verify would read as (5!)!
  text = _right_powers(_spread_plus_minus(text))
  if single and "not" in text:
    text = _EXCLUDED.sub("", text)
  equations = _EQUATION_BREAK.split(text)
  if len(equations) > 1 and all("=" in e for e in equations):
    # "x = 2 \\quad x = 3" lists two equations
    text = ", ".join(e.strip().strip(",;").strip() for e in equations)
  if not text or (single and (_NEGATED.search(text) or _negates_only_number(text))):
    return []
  if _LISTING_WORD.search(text) and not _is_bare_answer(text):
    listed = _LISTING_WORD.sub(", ", text)  # "2 and 3", "x = 2 or x = 3": a list, as "2, 3"
    text = listed if _is_bare_answer(listed) else text
  if _is_bare_answer(text):
    text = _FULL_STOP.sub("", text) or text
    text = _right_powers(_PY_POWER.sub(lambda m: "^{" + m.group(1) + "}", text))  # 2**3: 2^{3}
    if single and any(m.group(1) is None for m in _JUXTAPOSED.finditer(text)):
      return []
    boxed = parse("\\boxed{" + text + "}", extraction_config=_latex_only(), parsing_timeout=None)
    if any(not isinstance(x, str) for x in boxed):
      if single and _equates_two_values(boxed, options):
        return []
      rounded = _rounded_value(text) if single else None
      if rounded is not None:
        return _with_percent_values(boxed + rounded) if rounded else []
      return _with_percent_values(boxed)
    if single and len(_NUMBER.findall(text)) > 1:
      return []
    raw = parse(text, parsing_timeout=None)
    return _with_percent_values(raw or boxed)
  spans = _box_spans(text) if single else []
  if spans:
    # A box taken back after it ("\\boxed{5}. Wait, no.") names nothing, as a phrase's answer.
    rest = text[max(end for _, _, end in spans):]
    cue = _last_correction(rest)
    if cue is not None and _retracts(rest, cue):
      return []
  called_wrong = _called_wrong(text, spans) if single else None
  if called_wrong is not None:
    # "The answer is 42, which is wrong.": the text takes its answer back. What follows may name
    # another, read as after a correction that does not overrule ("Wait, it is 6."); one that
    # calls an answer wrong again names none (and is not read one remark at a time: linear time).
    rest = text[called_wrong:]
    named = _DIGIT.search(rest) and not _CALLED_WRONG.search(rest)
    revised = _parse_answer(rest, single=True, **options) if named else []
    return revised if revised and ("=" not in rest or _ANSWER_MARK.search(rest)) else []
  reasoned = _reasoned_answer(text)
  parsed = [] if reasoned is None else _parse_answer(reasoned, single=single, **options)
  if any(not isinstance(x, str) for x in parsed):  # else the prose reading decides
    return parsed
  if not _DELIMITED.search(text):
    text = _UNDELIMITED_MATH.sub(r"$\1$\2", text)  # "We get 2\\sqrt{2}." as "We get $2\\sqrt{2}$."
  marked = _marked_answer(text)
  if marked is not None:
    head, rest = marked
    if head is None:
      return []  # `_equal_inline` reads what the answer phrase names
    tails = _answer_tails(head)
    tail = tails.pop() if len(tails) == 1 else ""
    if _DIGIT.search(tail) and _is_bare_answer(tail):
      # "The answer is 2\\sqrt{2}.": what the phrase names, read whole; math-verify's own
      # pattern stops at the first command and read 2.
      parsed = _parse_answer(tail, single=single, **options)
    else:
      parsed = _parse_prose(head, single, options)
    revised = _revised_answer(rest, options) if single and parsed else None
    if revised is not None:
      return revised
    # A later sentence that marks another value hedges ("The answer is 5. The answer is 6."), and
    # so does one that offers another ("The answer is 5. Alternatively, 6.").
    if single and parsed and (_marks_other_value(rest, parsed[0], options)
                              or _offers_other_value(rest, parsed[0], options)):
      return []
    return parsed
  if not _box_spans(text) and any(_ALNUM.search(tail) and not _DIGIT.search(tail)
                                  for tail in _answer_tails(text)):
    # "The answer is B.\nOption B has 12 apples.": the phrase names an answer without a number,
    # which math-verify does not read (`_equal_inline` reads it), and a number elsewhere is none.
    return []
  conclusion = _concluding_sentence(text) if single and not _box_spans(text) else None
  parsed = [] if conclusion is None else _parse_prose(conclusion, single, options)
  return parsed or _parse_prose(text, single, options)


def _called_wrong(text: str, spans: list) -> int | None:
  """Where the sentence of the answer ends when the text calls its answer wrong right after
  naming it (`_CALLED_WRONG`: "The answer is 42, which is wrong.", "\\boxed{42}, but that is
  incorrect."), else None. The answer is what the last box (`spans`) or the first answer phrase
  names, and a remark after another clause of its sentence ("The answer is 5, since 2 + 2 = 5,
  which is wrong") is left alone. In text with neither, the remark must be in the last sentence,
  with no number after it ("42, which is wrong", "So it is 42, which is wrong.")."""
  mark = None if spans else _ANSWER_MARK.search(text)
  if not spans and mark is None:
    remark = None
    for remark in _CALLED_WRONG.finditer(text):
      pass
    if (remark is None or _DIGIT.search(text, remark.end())
        or any(m.end() < len(text.rstrip()) for m in _SENTENCE_END.finditer(text, remark.end()))):
      return None
    return len(text)
  start = spans[-1][2] + 1 if spans else mark.end()
  stop = _SENTENCE_END.search(text, start)
  end = len(text) if stop is None else stop.start()
  remark = _CALLED_WRONG.search(text, start, end)
  if remark is None or _CLAUSE_BREAK.search(text, start, remark.start()):
    return None
  return end


def _negates_only_number(text: str) -> bool:
  """Whether `text` names one number only and rules it out (`_NEGATION`). With another number
  ("The answer is 5, not 6.") the hedge rule decides."""
  return len(set(_SIGNED_NUMBER.findall(text))) == 1 and _NEGATION.search(text) is not None


def _concluding_sentence(text: str) -> str | None:
  """The last sentence of prose when it concludes ("... 9*2=18. Therefore, she makes $18."), else
  None. Naming one value, it is the answer, as a marked answer is: working before it is no hedge."""
  body = text.rstrip()
  start = max((m.end() for m in _SENTENCE_END.finditer(body) if m.end() < len(body)), default=0)
  last = body[start:].strip()
  return last if start and _CONCLUSION.match(last) and not last.endswith("?") else None


def _last_correction(text: str, pos: int = 0, endpos: int | None = None) -> re.Match | None:
  """The last self-correction (`_REVISION`) that starts in `text[pos:endpos]`."""
  cue = None
  for cue in _REVISION.finditer(text, pos, len(text) if endpos is None else endpos):
    pass
  return cue


def _overrules(text: str, cue: re.Match) -> bool:
  """Whether a correction says the answer before it was wrong ("Wait, no, ...", "Correction:",
  "..., I made a mistake")."""
  return bool(_NEGATING_CUE.match(text, cue.start()) or _ADMITS_ERROR.search(text, cue.end()))


def _retracts(text: str, cue: re.Match) -> bool:
  """Whether a correction takes the answer before it back without naming another ("Wait, no.",
  "Hmm, no, that is wrong.", "Actually, I made a mistake.")."""
  if _NAMES_CHOICE.search(text, cue.end()):
    return False
  negating = _NEGATING_CUE.match(text, cue.start())
  if negating is not None:
    return _RETRACTION.match(text, negating.end()) is not None
  return _ADMISSION.match(text, cue.end()) is not None


def _revised_answer(text: str, options: dict[str, Any]) -> list | None:
  """What a self-correction in `text`, the rest after a marked answer, gives instead of that
  answer, or None where it leaves it. The last correction followed by a number is read on its
  own. One that overrules the answer ("Wait, no, it is 6.") gives what it settles on, or no answer
  (no credit) where it settles on no single value. One that does not ("Wait, it is 6.") gives its
  value when it restates one or marks it ("... So the answer is 6."), and is a check that leaves
  the answer when it works something out ("Wait, let me verify: 2 * 5 = 10.") or names several
  values. One that takes the answer back and names nothing ("Wait, no.") leaves no answer."""
  last = _last_correction(text)
  if last is not None and _retracts(text, last):
    return []
  last_digit = _LAST_DIGIT.search(text)
  cue = None if last_digit is None else _last_correction(text, 0, last_digit.start())
  if cue is None:
    return None
  correction = text[cue.end():]
  revised = _parse_answer(correction, single=True, **options)
  if _overrules(text, cue):
    return revised
  return revised if revised and ("=" not in correction or _ANSWER_MARK.search(correction)) else None


def _parse_prose(text: str, single: bool, options: dict[str, Any]) -> list:
  from math_verify import parse

  if single and _names_two_values(text, options):
    return []
  return _with_percent_values(parse(text, parsing_timeout=None))


def _offered(text: str, pos: int = 0):
  """What each sentence of `text[pos:]` that offers an alternative answer (`_ALTERNATIVE`:
  "Alternatively, 6.", "Or maybe it is 6.") offers: its text after the cue, to the sentence's
  end."""
  for cue in _ALTERNATIVE.finditer(text, pos):
    stop = _SENTENCE_END.search(text, cue.end())
    yield text[cue.end():len(text) if stop is None else stop.start()]


def _offers_other_value(text: str, value, options: dict[str, Any]) -> bool:
  """Whether a sentence of `text` offers an alternative answer (`_offered`) that names one value
  other than `value`. Working after the cue ("Alternatively, 2 + 3 = 5.") is a check, not an
  answer."""
  seen = set()  # a response stuck in a loop offers the same sentence many times
  for offered in _offered(text):
    if not _DIGIT.search(offered) or "=" in offered or offered in seen:
      continue
    seen.add(offered)
    other = _parse_answer(offered, single=True, **options)
    if other and not _same_value(value, other[0], options):
      return True
  return False


def _offers_other(text: str, pos: int, tail: str) -> bool:
  """Whether a sentence of `text[pos:]` offers an alternative answer (`_offered`) that names
  something other than `tail`, an answer phrase's answer ("The answer is B. Alternatively, C.")."""
  for offered in _offered(text, pos):
    offered = " ".join(offered.split())
    if _NAMES_CHOICE.search(offered) and "=" not in offered and offered != tail:
      return True
  return False


def _marks_other_value(text: str, value, options: dict[str, Any]) -> bool:
  for _, _, marked, match, target in _extraction_matches(text):
    other = _match_value(match, target) if marked else None
    if other is not None and other != value and not _same_value(value, other, options):
      return True
  return False


# A self-correction starting a sentence ("Wait, no, it is 6.", "Actually, ...", "Correction: ...");
# what follows it may replace the answer (`_revised_answer`). Only spaces and tabs are skipped
# before the cue (one scan per line, linear).
_REVISION = re.compile(
    r"(?:^|(?<=[.!?\n]))[ \t]*(?:wait|actually|correction|oops|hmm+|no(?=\s*[,:;!.]))\b[\s,:;!.]*",
    re.IGNORECASE)
# A sentence that offers an alternative answer (`_offers_other_value`).
_ALTERNATIVE = re.compile(
    r"(?:^|(?<=[.!?\n]))[ \t]*(?:alternatively|or|maybe|perhaps|possibly)\b[\s,:;]*", re.IGNORECASE)
_LAST_DIGIT = re.compile(r"\d\D*$")
# A correction that overrules the answer before it (`_overrules`).
_NEGATING_CUE = re.compile(r"[ \t]*(?:(?:wait|hmm+|actually)[\s,:;!.]*)?(?:no|correction|oops)\b",
                           re.IGNORECASE)
# A remark right after an answer, in its sentence, that calls it wrong ("..., which is wrong",
# "..., but that's incorrect", `_called_wrong`). Doubt ("..., which is probably wrong", "Maybe I
# am wrong.") keeps the answer, and so does a remark on a case ("which is wrong for n = 1").
_CALLED_WRONG = re.compile(
    r",[ \t]*(?:which[ \t]+(?:is|was)|but[ \t]+(?:that|this|it)(?:[ \t]+(?:is|was)|['’]s))[ \t]+"
    r"(?:(?:definitely|clearly|certainly)[ \t]+)?"
    r"(?:wrong|incorrect|not[ \t]+(?:right|correct)|a[ \t]+mistake|an[ \t]+error)\b"
    r"(?![ \t]*(?:to|for|if|when|unless|only|in)\b)", re.IGNORECASE)
_CLAUSE_BREAK = re.compile(r"[,;]")
_ADMITS_ERROR = re.compile(r"\b(?:wrong|incorrect|mistaken|mistake)\b", re.IGNORECASE)
# What a correction that takes the answer back says, naming nothing (`_retracts`): after "no",
# "oops" or "correction", nothing or an admission; after "wait" or "actually", an admission.
_ADMISSION = re.compile(
    r"[\s,:;!.]*(?:that|this|it|i)\b[^.\n]{0,30}?"
    r"\b(?:wrong|incorrect|mistaken|mistake|error|not right|not correct)\b", re.IGNORECASE)
_RETRACTION = re.compile(_ADMISSION.pattern + r"|[\s,:;!.]*$", re.IGNORECASE)
# The opening of a sentence that concludes (`_concluding_sentence`).
_CONCLUSION = re.compile(r"(?:therefore|thus|so|hence|in total|in conclusion|altogether)\b",
                         re.IGNORECASE)
# What names an answer in a correction of a phrase's answer: a digit or a capital letter on its
# own ("Wait, no, it is C."), not the word "I"; group 1 the letter.
_NAMES_CHOICE = re.compile(r"\d|\b(?!I\b)([A-Z])\b")
# An answer phrase ("The answer is B.", "**Answer:** (C)"), which names what follows it to the end
# of its sentence (`_TAIL_STOP`).
_ANSWER_MARK = re.compile(r"\banswer\b(?:\*\*)?\s*(?:is\b\s*:?|:)\s*(?:\*\*)?\s*", re.IGNORECASE)
_TAIL_STOP = re.compile(r"\.(?=\s|$)|\n|$")
_ALNUM = re.compile(r"[A-Za-z0-9]")
_DIGIT = re.compile(r"\d")
# An answer that rules a value out ("not 5", "The answer is not $5$.") names no answer.
_NEGATED = re.compile(
    r"(?:^|\banswer\b(?:\*\*)?\s*(?:is\b|:))\s*(?:\*\*\s*)?not\s+(?=[-+\d$\\(\[{])", re.IGNORECASE)
# A statement that rules out the only number a text names ("It is not 5.", "The answer isn't 5.",
# "It cannot be 5.", "The answer ≠ 5", "5 is not the answer") names no answer either
# (`_negates_only_number`). "x ≠ 5" is an inequation, no negation: "≠" counts after a word only.
_NEGATION = re.compile(
    r"(?:\b(?:not|never|cannot|isn[’']t|can[’']t|won[’']t)|(?:^|\b(?:answer|it|result|value|is))\s*"
    r"(?:≠|\\neq?(?![A-Za-z])))(?:\s+(?:be|equal|equals|to)\b)*"
    r"(?:\s*(?:\*\*|[$`(\[{]|\\[(\[{]|\\boxed\s*\{))*\s*[-+]?\d"
    r"|\d[$*})\]`]*\s+(?:is\s+not|isn[’']t|is\s+never|cannot\s+be)\s+(?:the\s+)?"
    r"(?:answer|solution|result|correct|right)\b", re.IGNORECASE)
_SIGNED_NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*")  # "5, not -5" names two numbers
# A multiple-choice answer spelled out ("option A", "Choice (B)") is its letter.
_OPTION = re.compile(r"\b(?i:option|choice)\s+(\(?[A-Z]\)?)(?![\w(])")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf)\s*\{([^{}]*)\}")
_WORDS_ONLY = re.compile(r"[A-Za-z]{2,}(?:[ '\-][A-Za-z]+)*")


def _answer_tails(text: str) -> set[str]:
  """What each answer phrase in `text` names, without a reason given after it ("The answer is B,
  because ..." names B); a phrase inside that reason names an answer too."""
  # The sentence ends are found once: a phrase's tail can run to the end of a long sentence that
  # holds many phrases.
  stops = [m.start() for m in _TAIL_STOP.finditer(text)]
  tails, covered = set(), 0
  for m in _ANSWER_MARK.finditer(text):
    if m.start() < covered or m.end() == len(text):
      continue
    stop = stops[bisect.bisect_left(stops, m.end() + 1)]
    end = _trimmed_end(text, m.end(), stop)
    cut = _reason_start(text, m.end(), end)
    tails.add(" ".join(text[m.end():cut].split()))
    covered = cut if cut < end else stop  # a reason is read on for phrases
  return tails


def _trimmed_end(text: str, start: int, stop: int) -> int:
  """`stop` moved back over trailing spaces and one "**" ("B** " ends after "B"), keeping at
  least one character after `start`."""
  end = stop
  while end > start + 1 and text[end - 1].isspace():
    end -= 1
  if end > start + 2 and text.startswith("**", end - 2):
    end -= 2
    while end > start + 1 and text[end - 1].isspace():
      end -= 1
  return end


def _word_answer(text: str) -> str | None:
  """A gold or prediction that is only words ("Yes", "\\text{No}.", "$\\text{even}$"), lowercased;
  None for anything with math in it. A text with boxes is read by its boxes ("So \\boxed{Yes}."),
  which must agree; a box in a box is read inside ("\\boxed{\\boxed{Yes}}")."""
  spans = _box_spans(text)
  if spans:
    words = {_word_answer(text[start:end]) for i, (_, start, end) in enumerate(spans)
             if i + 1 == len(spans) or spans[i + 1][0] > end}
    return words.pop() if len(words) == 1 else None
  text = _TEXT_WRAPPER.sub(r"\1", text).strip(" \t\n$.")
  return text.lower() if _WORDS_ONLY.fullmatch(text) else None


def _equal_inline(prediction: str, gold: str, float_rounding: int = 6, numeric_precision: int = 15,
                  strict: bool = True) -> bool:
  """Compares on the calling thread with no time limit; raises on unexpected errors."""
  from math_verify import verify

  # A model writing markdown quotes its answer as code ("**Answer:** `5`") or stresses it ("**7**"):
  # the text is read as written without the marks, so "`5` or `6`" still hedges.
  prediction, gold = _drop_markdown(prediction), _drop_markdown(gold)
  prediction, gold = _OPTION.sub(r"\1", prediction), _OPTION.sub(r"\1", gold)
  prediction, gold = _collapse_spaces(prediction), _collapse_spaces(gold)
  if " ".join(prediction.split()) == " ".join(gold.split()) and prediction.strip():
    return True
  response = prediction
  # Before the cost guard, which refuses "(18!)!": "The answer is 18!!" is no such factorial.
  prediction, gold = _exclaimed(prediction), _exclaimed(gold)
  if _too_costly(prediction) or _too_costly(gold):
    return False  # no realistic answer; math-verify would take seconds or minutes to say so
  if _reads_double_factorial_as_nested(prediction, gold):
    return False
  options = {"float_rounding": float_rounding, "numeric_precision": numeric_precision, "strict": strict}
  gold_parsed = _parse_answer(gold)
  pred_parsed = _parse_answer(prediction, single=True, **options)
  if not pred_parsed and not (_BOX.search(prediction) or _UNBRACED_BOX.search(prediction)):
    # Prose naming an answer math-verify finds nothing in ("The answer is B.", "Final answer:
    # yes"): what the phrase names is read as the answer on its own. Phrases naming different
    # answers name none. A prediction that boxes its answer is read by its boxes only ("The
    # answer is \\boxed{5}. No: \\boxed{6}" hedges). A correction after the phrase that overrules
    # it and names a letter or number ("The answer is B. Wait, no, it is C."), or names another
    # letter ("... Wait, it is C."), leaves the phrase's answer unread.
    tails = _answer_tails(prediction)
    if len(tails) == 1:
      tail = tails.pop()
      after_mark = _ANSWER_MARK.search(prediction).end()
      cue = _last_correction(prediction, after_mark)
      named = [] if cue is None else _NAMES_CHOICE.findall(prediction, cue.end())
      overruled = named and (_overrules(prediction, cue) or set(named) - {"", tail.strip("()")})
      overruled = overruled or (cue is not None and _retracts(prediction, cue))
      overruled = overruled or _called_wrong(prediction, []) is not None
      if not overruled and not _offers_other(prediction, after_mark, tail):
        prediction = tail
        pred_parsed = _parse_answer(prediction, single=True, **options)
  if not pred_parsed and _several_values(gold_parsed):
    # A gold of several values ("2, 3") is named by prose that lists exactly them ("The roots are
    # 2 and 3."), which the hedge rule refuses for a gold of one value.
    pred_parsed = _listed_values(prediction, options)
  # A number in words ("seven", "The answer is forty-two.") is that number, where the response
  # names no other number, in digits or in words ("The answer is seven. Wait, no, it is eight.").
  # (math-verify reads a boxed "seven" as the product of five symbols.)
  pred_parsed = _spelled_value(prediction, response) or pred_parsed
  gold_parsed = _spelled_value(gold, gold) or gold_parsed
  if not gold_parsed or not pred_parsed:
    # Words hold no math to parse ("Yes" against "\\text{yes}."): they are compared as text.
    word = _word_answer(gold)
    return word is not None and word == _word_answer(prediction)
  if verify(gold_parsed, pred_parsed, timeout_seconds=None, **options):
    return True
  # An inequality in one variable against an interval ("x < 3" and "(-\\infty, 3)"): the
  # inequality is compared as its solution set. Only then, so "x < 3" stays unequal to "y < 3".
  for a, b in ((gold_parsed, pred_parsed), (pred_parsed, gold_parsed)):
    if _has_set(b) and not _has_set(a):
      sets = _solution_sets(a)
      if sets and verify(sets, b, timeout_seconds=None, **options):
        return True
  return False


def _reads_double_factorial_as_nested(prediction: str, gold: str) -> bool:
  """Whether one side has a double factorial of an expression (`_SYMBOLIC_DOUBLE_FACTORIAL`) and
  the other a factorial but none: math-verify would credit "((2n-1)!)!" for "(2n-1)!!", as it
  reads both as the former (while "(5!)!" is not credited for "5!!", which is 15)."""
  marked = [bool(_SYMBOLIC_DOUBLE_FACTORIAL.search(_double_factorials(t))) if "!!" in t else False
            for t in (prediction, gold)]
  return marked[0] != marked[1] and "!" in (gold if marked[0] else prediction)


def _spelled_value(answer: str, text: str) -> list:
  """`answer`, a whole number in words (`_word_answer`, `_spelled_number`), parsed as its digits;
  [] for any other answer, or where `text`, the whole response, names another number in digits
  or words."""
  word = _word_answer(answer)
  value = None if word is None else _spelled_number(word)
  if value is None or _DIGIT.search(text) or _number_word_count(text) != _number_word_count(word):
    return []
  return _parse_answer(str(value))


def _exclaimed(text: str) -> str:
  """Prose with each exclamation after a number (`_EXCLAMATION`) a full stop; a bare answer as it is."""
  return _EXCLAMATION.sub(".", text) if "!" in text and not _is_bare_answer(text) else text


def _several_values(parsed: list) -> bool:
  """Whether a parsed gold is a set of two or more values ("2, 3", "\\{2, 3\\}", "x=2, x=3")."""
  import sympy

  return bool(parsed) and isinstance(parsed[0], sympy.FiniteSet) and len(parsed[0].args) > 1


# A conclusion drawn in a list's sentence ("x = 2 and x = 3, so their sum is 5"), `_listed_values`.
_DRAWN = re.compile(r"[,;]\s*(?:so|hence|thus|therefore|then|giving|and so)\b", re.IGNORECASE)


def _listed_values(text: str, options: dict[str, Any]) -> list:
  """The values prose names, as one set ("The roots are 2 and 3." -> {2, 3}), for a gold that
  is such a set; [] where it names fewer than two. They are read where the answer is: from the
  first answer phrase to the end of its sentence, else in a concluding sentence, else in a text
  of one sentence (working over several sentences, "Try 2: no. Try 3: yes.", lists nothing), up
  to a reason or a conclusion drawn from them ("..., so their sum is 5"). A prediction with a box
  is read by its boxes only (`_boxed_values`), and one with a self-correction by `_parse_answer`
  only ("The answer is 2 and 3. Wait, no." names nothing)."""
  import sympy

  spans = _box_spans(text)
  if spans:
    return _boxed_values(text, spans, options)
  digit = _DIGIT.search(text)
  if digit is None or _last_correction(text, digit.start()) is not None:
    return []
  marked = _marked_answer(text)
  head = marked[0] if marked is not None else None
  if head is None:
    body = text.strip()
    one_sentence = all(m.end() >= len(body) for m in _SENTENCE_END.finditer(body))
    head = _concluding_sentence(text) or (body if one_sentence else None)
  if head is None or _NEGATED.search(head) or _NEGATION.search(head) or _CALLED_WRONG.search(head):
    return []  # "The roots are not 2 and 3.", "The roots are 2 and 3, which is wrong."
  head = head if head.isascii() else _read_unicode(head)
  if not _DELIMITED.search(head):
    head = _UNDELIMITED_MATH.sub(r"$\1$\2", head)  # "2\sqrt{2} and 3" names 2\sqrt{2}, not 2
  found = _without_dollar_openers(head, _extraction_matches(head))
  first_mark = min((start for start, _, is_mark, _, _ in found if is_mark), default=0)
  stop = min((m.start() for m in (_REASON.search(head, first_mark), _DRAWN.search(head, first_mark))
              if m is not None), default=len(head))
  values, covered, seen = [], -1, {}
  for start, end, _, match, target in sorted(found, key=lambda f: (f[0], -f[1])):
    if start < first_mark or end > stop or end <= covered:
      continue
    key = (head[start:end], target, match.re)  # a list may repeat its values many times
    if key not in seen:
      seen[key] = _match_value(match, target)
    value = seen[key]
    if value is None:
      continue
    covered = end
    if not any(v == value or _same_value(v, value, options) for v in values):
      values.append(value)
  if len(values) < 2:
    return []
  listed = sympy.FiniteSet(*values)
  # A later sentence that marks or offers other values hedges, as for one value.
  rest = "" if marked is None else marked[1]
  if _marks_other_value(rest, listed, options) or _offers_other_value(rest, listed, options):
    return []
  return [listed]


def _boxed_values(text: str, spans: list, options: dict[str, Any]) -> list:
  """The values of several boxes as one set ("\\boxed{2} and \\boxed{3}", "x = \\boxed{2} or
  x = \\boxed{3}" -> {2, 3}), for a gold that is such a set, as `_listed_values` reads prose;
  [] where fewer than two values are boxed, a box does not parse as one value or a set of values,
  or a self-correction follows the first box ("\\boxed{2}. Wait, no: \\boxed{3}")."""
  import sympy

  if _last_correction(text, spans[0][0]) is not None:
    return []
  values = []
  for content in _outermost_boxes(text, spans):  # a box inside a box is read with it
    parsed = _parse_answer(content, single=True, **options)
    if not parsed:
      return []
    members = parsed[0].args if isinstance(parsed[0], sympy.FiniteSet) else (parsed[0],)
    for value in members:
      if not any(v == value or _same_value(v, value, options) for v in values):
        values.append(value)
  return [sympy.FiniteSet(*values)] if len(values) > 1 else []


def _has_set(parsed: list) -> bool:
  import sympy

  return any(isinstance(x, sympy.Set) for x in parsed)


def _solution_sets(parsed: list) -> list:
  """The solution set on the reals of each inequality in one variable ("1 < x < 3" -> (1, 3))."""
  import sympy

  out = []
  for x in parsed:
    if (isinstance(x, (sympy.core.relational.Relational, sympy.And, sympy.Or))
        and not isinstance(x, (sympy.Eq, sympy.Ne)) and len(x.free_symbols) == 1):
      try:
        out.append(x.as_set())
      except Exception:  # sympy raises several types for what it cannot solve; no set then
        continue
  return out


class _DropDisabledTimeoutWarning(logging.Filter):
  """math-verify warns once that its timeouts are off; here that is by design."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "Timeout is disabled" not in record.getMessage()


def _silence_math_verify() -> None:
  for name in ("math_verify.parser", "math_verify.grader"):
    lg = logging.getLogger(name)
    if not any(isinstance(f, _DropDisabledTimeoutWarning) for f in lg.filters):
      lg.addFilter(_DropDisabledTimeoutWarning())


# ----------------------------------------------------------------------------------------------
# The worker process's main loop (see `math_verifier._ProcessWorker`).

def _serve(options_json: str) -> None:
  """Worker process main loop: one JSON request per stdin line, one JSON reply per line."""
  import signal

  options = json.loads(options_json)
  # Protocol replies go to the original stdout; anything else printed lands on stderr.
  reply_fd = os.dup(1)
  os.dup2(2, 1)
  send = lambda obj: os.write(reply_fd, (json.dumps(obj) + "\n").encode())  # noqa: E731
  memory_mb = options.pop("memory_mb")
  if memory_mb:
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = memory_mb * 2**20
    if hard != resource.RLIM_INFINITY:
      cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
  try:
    import math_verify  # noqa: F401  (pay the import before reporting ready)
    _silence_math_verify()
  except BaseException as e:  # noqa: BLE001
    send({"ready": False, "error": f"{type(e).__name__}: {e}"})
    return
  send({"ready": True})
  for line in sys.stdin.buffer:
    request = json.loads(line)
    signal.alarm(int(request["watchdog_s"]))
    try:
      reply = {"equal": _equal_inline(request["prediction"], request["gold"], **options)}
    except BaseException as e:  # noqa: BLE001  (MemoryError, RecursionError: a wrong answer)
      reply = {"equal": False, "error": f"{type(e).__name__}: {e}"}
    finally:
      signal.alarm(0)
    send(reply)
