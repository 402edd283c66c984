"""Math answer equivalence through math-verify, with a time limit the caller can rely on.

Sits in `rewards/` between a rollout's extracted answer and the outcome reward: the math
environments call `math_equal(extract_answer(response), gold)`.

math-verify bounds its own work with `signal.alarm`, which only works on the main thread, so
here its timeouts are off (`parsing_timeout=None`, `timeout_seconds=None`) and the limit is
enforced from outside by one of two backends (`MathVerifyConfig.backend`):

* ``"process"`` (default on POSIX): a small pool of long-lived worker processes. A request that
  runs past its limit gets its worker killed (SIGKILL) and replaced, so a pathological input
  such as ``10^{10^{10}}`` costs the caller the timeout and leaves nothing running. Each worker
  also caps its address space and arms a kernel alarm per request that ends it if the parent is
  gone. Costs, measured on a 2-core CPU host: under a second to start a worker (not counted
  against a call's limit; bounded by `startup_timeout_s`), about 60 MB resident per started
  worker, and a 0.1 ms pipe round trip per call.
* ``"thread"``: each call runs on a daemon thread and the caller waits at most the timeout. No
  subprocesses, but an abandoned call keeps running (and holding a core) until it finishes, and
  a computation that never releases the GIL, such as sympy evaluating a huge integer power in C,
  blocks the caller too. Use it for trusted inputs, tests and notebooks.

Callers beyond `max_workers` wait for a free worker (up to `wait_timeout_s`) before their own
limit starts. Any failure (timeout, parse error, worker crash, busy pool) returns False and is
counted in `MathVerifier.stats()` so the trainer can log it. A worker that cannot start at all
is a setup error and raises.

This file imports only the standard library at module level: worker processes load it by path,
without importing the `jaxagent` package (and so without JAX).
"""
from __future__ import annotations

import atexit
import bisect
import dataclasses
import decimal
import json
import logging
import math
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time
from typing import Any, Literal

logger = logging.getLogger(__name__)

Backend = Literal["process", "thread"]
_BACKENDS = ("process", "thread")


@dataclasses.dataclass(frozen=True)
class MathVerifyConfig:
  """How answers are compared and how the time limit is enforced.

  Attributes:
    timeout_s: default limit per comparison (parse both sides + verify), in seconds.
    backend: "process" (hard limit, killed on timeout) or "thread" (soft limit); see module doc.
    max_workers: concurrent comparisons (processes or threads); started lazily.
    startup_timeout_s: how long a fresh worker process may take to import math-verify.
    wait_timeout_s: how long a call may wait for a free worker when more callers than
      `max_workers` compare at once (a trainer scoring on several threads); the call's own
      `timeout_s` starts once it has one, so a correct answer is not scored 0 because others
      were slow. Past it the call returns False, counted as "busy". A process worker frees up
      within a call's limit, so "busy" means that callers queued longer than this (raise
      `max_workers`) or, with the thread backend, that abandoned calls which never finish hold
      every slot.
    worker_memory_mb: address-space cap per worker process (0 disables it).
    float_rounding, numeric_precision, strict: passed to `math_verify.verify`.
  """

  timeout_s: float = 5.0
  backend: Backend = "process" if os.name == "posix" else "thread"
  max_workers: int = 4
  startup_timeout_s: float = 60.0
  wait_timeout_s: float = 300.0
  worker_memory_mb: int = 4096
  float_rounding: int = 6
  numeric_precision: int = 15
  strict: bool = True

  def __post_init__(self):
    if self.backend not in _BACKENDS:
      raise ValueError(f"MathVerifyConfig.backend must be one of {_BACKENDS}, got {self.backend!r}")
    if self.backend == "process" and os.name != "posix":
      raise ValueError("MathVerifyConfig.backend='process' needs a POSIX system; use backend='thread'")
    _check_timeout("MathVerifyConfig.timeout_s", self.timeout_s)
    _check_timeout("MathVerifyConfig.startup_timeout_s", self.startup_timeout_s)
    _check_timeout("MathVerifyConfig.wait_timeout_s", self.wait_timeout_s)
    if not isinstance(self.max_workers, int) or self.max_workers < 1:
      raise ValueError(f"MathVerifyConfig.max_workers must be an int >= 1, got {self.max_workers!r}")
    if not isinstance(self.worker_memory_mb, int) or self.worker_memory_mb < 0:
      raise ValueError(
          f"MathVerifyConfig.worker_memory_mb must be an int >= 0 (0 = no cap), got {self.worker_memory_mb!r}")
    if not isinstance(self.float_rounding, int) or self.float_rounding < 0:
      raise ValueError(f"MathVerifyConfig.float_rounding must be an int >= 0, got {self.float_rounding!r}")
    if not isinstance(self.numeric_precision, int) or self.numeric_precision < 1:
      raise ValueError(f"MathVerifyConfig.numeric_precision must be an int >= 1, got {self.numeric_precision!r}")

  def verify_options(self) -> dict[str, Any]:
    return {"float_rounding": self.float_rounding, "numeric_precision": self.numeric_precision,
            "strict": self.strict}


def _check_timeout(name: str, value: float) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
    raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")


# ----------------------------------------------------------------------------------------------
# The comparison itself (runs inside a worker thread or process).

# Explicit math delimiters: let math-verify's own extraction find the answer.
_DELIMITED = re.compile(r"\\boxed|\\fbox|\\\(|\\\[|\$[^$]*\$")
# LaTeX commands (with one braced argument, so \text{ dollars} goes too) are not prose.
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+\s*(?:\{[^{}]*\})?")
_WORD = re.compile(r"[A-Za-z]{2,}")
_MATH_WORDS = frozenset({
    "sin", "cos", "tan", "cot", "sec", "csc", "sinh", "cosh", "tanh", "arcsin", "arccos", "arctan",
    "log", "ln", "exp", "sqrt", "pi", "oo", "inf", "infty", "max", "min", "gcd", "lcm", "mod", "det",
})
# "1\,000", "1 000": thousands groups split by a LaTeX or plain space. LaTeX would read "1 000" as
# 1*000 and "1 234" as the mixed number 1 + 234.
_SPACED_THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:(?:\\[,;:! ]| )\d{3})+(?!\d)")
_THOUSANDS_SPACE = re.compile(r"\\[,;:! ]| ")
# "1e3", "2.5e-3": scientific notation, which LaTeX would read as 1*e*3 (Euler's number).
_SCIENTIFIC = re.compile(r"(?<![\w.])\d+(?:\.\d+)?[eE][+-]?\d{1,3}(?![\w.])")
# Two numbers side by side ("5 6", "5\quad 6"), which LaTeX adds up as a mixed number; group 1 is a
# command whose arguments may go unbraced ("\frac 1 2", and after a subscript "\log_2 8").
_JUXTAPOSED = re.compile(
    r"(\\[A-Za-z]+\s*(?:_\s*)?)?(?<![\d.])\d+(?:\.\d+)?(?:\s|\\[,;:! ]|\\q?quad(?![A-Za-z]))+\d")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
# A full stop ending an answer ("\frac{1}{2}.", "2/3."), which LaTeX would read as part of it.
_FULL_STOP = re.compile(r"(?<![.\s])\s*\.$")
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
# math-verify reads \boxed only; \fbox is the same box to a reader.
_FBOX = re.compile(r"\\fbox(?![A-Za-z])")
# A box whose one-token argument goes without braces ("\boxed5", "\boxed B", "\boxed\pi"), as
# LaTeX allows ("\frac12"); group 1 the argument. A run of digits is one argument ("\boxed12" is
# 12, as its writer meant), and "\boxed5 6" boxes 5 only. An argument followed by an operator
# ("\boxed x = 5") or a command that takes arguments ("\boxed\frac12", "\boxed\frac{1}{2}") is
# left as written: its writer meant the whole expression, which the prose reading finds. A
# command's name is read whole ("\frac", never "\fra" before a "c"), and a box is no argument
# ("\boxed\boxed5" boxes 5), so no such box holds another. "\fbox5" is such a box too.
_UNBRACED_BOX = re.compile(
    r"\\(?:boxed|fbox)(?![A-Za-z])\s*(\d+(?:\.\d+)?(?!\.?\d)|[A-Za-z](?![A-Za-z])"
    r"|\\(?!(?:boxed|fbox)(?![A-Za-z]))[A-Za-z]+(?![A-Za-z])(?!\s*[{\d]))"
    r"(?!\s*[=<>+\-*/^_!])")
# A logical or between answers ("x = 2 \lor x = 3"), which math-verify reads as the chain
# x = (2 \lor x) = 3, that is 3; "\text{ or }" it reads as the set of both.
_LOGICAL_OR = re.compile(r"\\(?:lor|vee)(?![A-Za-z])")
# Space or a line break between equations ("x = 2 \quad x = 3", "x = 2 \\ x = 3"), which
# math-verify reads as one chain x = 2x = 3 (or as its last side, 3): such equations are a list.
_EQUATION_BREAK = re.compile(r"(?<!\s)\s*(?:\\\\|\\q?quad(?![A-Za-z])|\\[ ;]|\\text\{\s*\})\s*")
# "and" / "or" between math, which then lists its sides.
_LISTING_WORD = re.compile(r"(?<!\s)\s+(?:and|or)\s+")
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)
# The end of a sentence: a full stop before a space or the end, or a line break. "0.5" goes on.
_SENTENCE_END = re.compile(r"\.(?=\s|$)|\n")
# A reason given after a marked answer in its sentence ("The answer is 5, since 2 + 3 = 5."): its
# working names no other answer. "5 as well as 6" names two, and "as" after a word is no reason
# ("the same as 5", "such as"). (This pattern, `_EQUATION_BREAK` and `_LISTING_WORD` start only
# where a run of spaces starts: tried at every space of a long run, each would scan the rest of
# it, in quadratic time.)
_REASON = re.compile(
    r"(?:[,;]|(?<!\s))\s*\(?\b(?:since|because|(?<![A-Za-z]{2} )as(?!\s+well\b))\b", re.IGNORECASE)
# The end of an answer phrase that has named nothing yet ("The answer is", "### Final Answer").
_ENDS_MARKED = re.compile(r"\b(?:answer|is)$", re.IGNORECASE)
# What names an answer after an answer phrase: a letter or digit (group 1) outside a command or
# an environment's name ("$$", "\[" and "\begin{equation}" name nothing yet).
_NAMING = re.compile(r"\\(?:begin|end)\s*\{[^{}]*\}|\\[A-Za-z]+|([A-Za-z0-9])")
# Inline code in markdown ("The answer is `5`.", "``5``"), which quotes its content; group 2 the
# content. Code blocks ("```python") are left as written.
_INLINE_CODE = re.compile(r"(?<!`)(`{1,2})([^`\n]+)\1(?!`)")
# Bold text in markdown ("**7**", "**-3**"), which a bare answer would read as Python's power
# operator; group 1 the content. "2**3**2" is powers: bold starts and ends outside a word.
_BOLD = re.compile(r"(?<![\w*])\*\*(?=\S)([^*\n]+?)(?<=\S)\*\*(?![\w*])")
# Python's power operator ("2**3", "2**(1/2)"), which LaTeX does not read; group 1 the exponent.
_PY_POWER = re.compile(r"\*\*\s*(\([^()]*\)|[-+]?[\w.]+)")


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
  """Drops the marks of inline code ("`5`") and bold text ("**7**") around what they mark."""
  return _BOLD.sub(r"\1", _INLINE_CODE.sub(r"\2", text))


def _normalize_numbers(text: str) -> str:
  """Writes spaced thousands ("1\\,000", "1 000") and scientific notation ("1e3") as plain numbers."""
  text = _SPACED_THOUSANDS.sub(lambda m: _THOUSANDS_SPACE.sub("", m.group()), text)
  return _SCIENTIFIC.sub(lambda m: format(decimal.Decimal(m.group()), "f"), text)


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


def _names_two_values(text: str, options: dict[str, Any]) -> bool:
  """True when math-verify reads two different values in prose ("5 or 6", "6, not 5").

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
  # A box holding a hedge hedges as the same answer unboxed does ("\\boxed{5 \\lor 6}").
  for content in dict.fromkeys(text[start:end] for _, start, end in spans):
    if not _parse_answer(content, single=True, **options) and _parse_answer(content):
      return True
  # (start, end, marked, match, target); a box has no match: math-verify's own box pattern runs
  # from the first box to the last closing brace, so boxes are read one by one here.
  boxes = [(start, end + 1, True, None, None) for start, _, end in spans]
  if boxes:
    hedged, read = _differ(text, boxes, seen, options)
    if read:  # a box that parses; boxes none of which parse leave the prose to decide
      return hedged
  found = boxes + _extraction_matches(text)
  first_mark = min((start for start, _, marked, _, _ in found if marked), default=0)
  return _differ(text, [f for f in found if f[0] >= first_mark], seen, options)[0]


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
  given in it ("..., since 2 + 3 = 5"), and a later sentence marking another value hedges; an
  answer phrase naming what math-verify does not read ("The answer is B.") parses to nothing, for
  `_equal_inline` to read. Python's power operator is read ("2**3" is 8), a box's argument may
  go without braces ("\\boxed5"), and math joined by "and", "or" or "\\lor", and equations side
  by side ("x = 2 \\quad x = 3"), are a list.

  With `single` (the prediction's side), an answer naming two or more different values parses to
  nothing, since extraction would pick one of them: "5 or 6", "The answer is 5. The answer is 6.",
  "5 = 6", "5 6" (which LaTeX adds up), "5|6"; so does one that rules a value out ("not 5").
  `options` are `verify`'s, to tell values apart.
  """
  from math_verify import parse

  text = _UNBRACED_BOX.sub(r"\\boxed{\1}", _FBOX.sub(r"\\boxed", text.strip()))
  text = _normalize_numbers(_LOGICAL_OR.sub(r"\\text{ or }", _drop_boxed_full_stops(text)))
  equations = _EQUATION_BREAK.split(text)
  if len(equations) > 1 and all("=" in e for e in equations):
    # "x = 2 \\quad x = 3" lists two equations
    text = ", ".join(e.strip().strip(",;").strip() for e in equations)
  if not text or (single and _NEGATED.search(text)):
    return []
  if _LISTING_WORD.search(text) and not _is_bare_answer(text):
    listed = _LISTING_WORD.sub(", ", text)  # "2 and 3", "x = 2 or x = 3": a list, as "2, 3"
    text = listed if _is_bare_answer(listed) else text
  if _is_bare_answer(text):
    text = _FULL_STOP.sub("", text) or text
    text = _PY_POWER.sub(lambda m: "^{" + m.group(1) + "}", text)  # "2**3" as LaTeX's "2^{3}"
    if single and any(m.group(1) is None for m in _JUXTAPOSED.finditer(text)):
      return []
    boxed = parse("\\boxed{" + text + "}", extraction_config=_latex_only(), parsing_timeout=None)
    if any(not isinstance(x, str) for x in boxed):
      if single and _equates_two_values(boxed, options):
        return []
      return _with_percent_values(boxed)
    if single and len(_NUMBER.findall(text)) > 1:
      return []
    raw = parse(text, parsing_timeout=None)
    return _with_percent_values(raw or boxed)
  marked = _marked_answer(text)
  if marked is not None:
    head, rest = marked
    if head is None:
      return []  # `_equal_inline` reads what the answer phrase names
    parsed = _parse_prose(head, single, options)
    # A later sentence that marks another value hedges ("The answer is 5. The answer is 6.").
    if single and parsed and _marks_other_value(rest, parsed[0], options):
      return []
    return parsed
  if not _box_spans(text) and any(_ALNUM.search(tail) and not _DIGIT.search(tail)
                                  for tail in _answer_tails(text)):
    # "The answer is B.\nOption B has 12 apples.": the phrase names an answer without a number,
    # which math-verify does not read (`_equal_inline` reads it), and a number elsewhere is none.
    return []
  return _parse_prose(text, single, options)


def _parse_prose(text: str, single: bool, options: dict[str, Any]) -> list:
  from math_verify import parse

  if single and _names_two_values(text, options):
    return []
  return _with_percent_values(parse(text, parsing_timeout=None))


def _marks_other_value(text: str, value, options: dict[str, Any]) -> bool:
  for _, _, marked, match, target in _extraction_matches(text):
    other = _match_value(match, target) if marked else None
    if other is not None and other != value and not _same_value(value, other, options):
      return True
  return False


# An answer phrase ("The answer is B.", "**Answer:** (C)"), which names what follows it to the end
# of its sentence (`_TAIL_STOP`).
_ANSWER_MARK = re.compile(r"\banswer\b(?:\*\*)?\s*(?:is\b\s*:?|:)\s*(?:\*\*)?\s*", re.IGNORECASE)
_TAIL_STOP = re.compile(r"\.(?=\s|$)|\n|$")
_ALNUM = re.compile(r"[A-Za-z0-9]")
_DIGIT = re.compile(r"\d")
# An answer that rules a value out ("not 5", "The answer is not $5$.") names no answer.
_NEGATED = re.compile(
    r"(?:^|\banswer\b(?:\*\*)?\s*(?:is\b|:))\s*(?:\*\*\s*)?not\s+(?=[-+\d$\\(\[{])", re.IGNORECASE)
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
  None for anything with math in it."""
  text = _TEXT_WRAPPER.sub(r"\1", text).strip(" \t\n$.")
  return text.lower() if _WORDS_ONLY.fullmatch(text) else None


def _equal_inline(prediction: str, gold: str, float_rounding: int = 6, numeric_precision: int = 15,
                  strict: bool = True) -> bool:
  """Compares on the calling thread with no time limit; raises on unexpected errors."""
  from math_verify import verify

  # A model writing markdown quotes its answer as code ("**Answer:** `5`") or bolds it ("**7**"):
  # the text is read as written without the marks, so "`5` or `6`" still hedges.
  prediction, gold = _drop_markdown(prediction), _drop_markdown(gold)
  if " ".join(prediction.split()) == " ".join(gold.split()) and prediction.strip():
    return True
  options = {"float_rounding": float_rounding, "numeric_precision": numeric_precision, "strict": strict}
  gold_parsed = _parse_answer(gold)
  pred_parsed = _parse_answer(prediction, single=True, **options)
  if not pred_parsed and not (_BOX.search(prediction) or _UNBRACED_BOX.search(prediction)):
    # Prose naming an answer math-verify finds nothing in ("The answer is B.", "Final answer:
    # yes"): what the phrase names is read as the answer on its own. Phrases naming different
    # answers name none. A prediction that boxes its answer is read by its boxes only ("The
    # answer is \\boxed{5}. No: \\boxed{6}" hedges).
    tails = _answer_tails(prediction)
    if len(tails) == 1:
      prediction = tails.pop()
      pred_parsed = _parse_answer(prediction, single=True, **options)
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
# Process backend.

_WORKER_BOOT = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_jaxagent_math_worker', sys.argv[1])\n"
    "mod = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = mod\n"
    "spec.loader.exec_module(mod)\n"
    "mod._serve(sys.argv[2])\n"
)
# A worker ends itself (SIGALRM, default action) this long past a request's limit, in case the
# parent died and nobody is left to kill it.
_WATCHDOG_GRACE_S = 5


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


class _WorkerGone(Exception):
  pass


class _ProcessWorker:
  """One worker process and its pipes; used by one caller at a time."""

  def __init__(self, options: dict[str, Any], startup_timeout_s: float):
    self._options = options
    self._startup_timeout_s = startup_timeout_s
    self._proc: subprocess.Popen | None = None
    self._buf = bytearray()
    self._ready = False

  def start(self) -> None:
    """Starts the process without waiting for it to import math-verify."""
    self._buf = bytearray()
    self._ready = False
    self._proc = subprocess.Popen(
        [sys.executable, "-c", _WORKER_BOOT, os.path.abspath(__file__), json.dumps(self._options)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, close_fds=True)

  def _ensure_ready(self) -> None:
    if self._proc is None or self._proc.poll() is not None:
      self.start()
    if self._ready:
      return
    try:
      msg = self._read(time.monotonic() + self._startup_timeout_s)
    except _WorkerGone as e:
      self.kill()
      raise RuntimeError(f"math-verify worker exited during startup: {e}") from None
    if msg is None or not msg.get("ready"):
      self.kill()
      why = "timed out" if msg is None else msg.get("error")
      raise RuntimeError(
          f"math-verify worker failed to start ({why}); check that math-verify is installed for "
          f"{sys.executable}, or raise MathVerifyConfig.startup_timeout_s")
    self._ready = True

  def compare(self, prediction: str, gold: str, timeout_s: float) -> dict | None:
    """The worker's reply, or None if it ran past `timeout_s` (the worker is then restarted)."""
    self._ensure_ready()
    deadline = time.monotonic() + timeout_s
    request = {"prediction": prediction, "gold": gold,
               "watchdog_s": math.ceil(timeout_s) + _WATCHDOG_GRACE_S}
    try:
      data = (json.dumps(request) + "\n").encode()
      view = memoryview(data)
      while view:
        view = view[os.write(self._proc.stdin.fileno(), view):]
      reply = self._read(deadline)
    except (_WorkerGone, BrokenPipeError) as e:
      self.kill()
      self.start()
      return {"equal": False, "error": f"worker died: {e}", "restarted": True}
    if reply is None:
      self.kill()
      self.start()  # the replacement imports while callers do other work
    return reply

  def _read(self, deadline: float) -> dict | None:
    fd = self._proc.stdout.fileno()
    poller = select.poll()  # not select.select: a busy trainer may hold more than 1024 fds
    poller.register(fd, select.POLLIN)
    while b"\n" not in self._buf:
      remaining = deadline - time.monotonic()
      if remaining <= 0 or not poller.poll(math.ceil(remaining * 1000)):
        return None
      chunk = os.read(fd, 65536)
      if not chunk:
        raise _WorkerGone(f"exit code {self._proc.wait()}")
      self._buf += chunk
    line, _, rest = bytes(self._buf).partition(b"\n")
    self._buf = bytearray(rest)
    return json.loads(line)

  def kill(self) -> None:
    if self._proc is not None:
      if self._proc.poll() is None:
        self._proc.kill()
      self._proc.wait()
      for pipe in (self._proc.stdin, self._proc.stdout):
        if pipe is not None:
          pipe.close()
      self._proc = None
    self._ready = False


# ----------------------------------------------------------------------------------------------
# The verifier.


class MathVerifier:
  """Thread-safe math equivalence with a per-call time limit; see the module docstring."""

  def __init__(self, config: MathVerifyConfig | None = None):
    config = MathVerifyConfig() if config is None else config
    self.config = config
    self._lock = threading.Lock()
    self._stats = {"calls": 0, "equal": 0, "unequal": 0, "timeouts": 0, "errors": 0, "busy": 0,
                   "restarts": 0}
    self._closed = False
    if config.backend == "process":
      options = dict(config.verify_options(), memory_mb=config.worker_memory_mb)
      self._idle: queue.LifoQueue[_ProcessWorker] = queue.LifoQueue()
      self._workers = [_ProcessWorker(options, config.startup_timeout_s) for _ in range(config.max_workers)]
      for w in self._workers:
        self._idle.put(w)
    else:
      import math_verify  # noqa: F401  (import now, not inside the first call's time limit)
      _silence_math_verify()
      self._slots = threading.BoundedSemaphore(config.max_workers)

  def __call__(self, prediction: str, gold: str, *, timeout_s: float | None = None) -> bool:
    return self.equal(prediction, gold, timeout_s=timeout_s)

  def equal(self, prediction: str, gold: str, *, timeout_s: float | None = None) -> bool:
    """Whether `prediction` is mathematically equivalent to `gold`; False on any failure."""
    timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
    _check_timeout("timeout_s", timeout_s)
    if not isinstance(prediction, str) or not isinstance(gold, str):
      raise TypeError(f"math_equal compares strings, got {type(prediction).__name__} and {type(gold).__name__}")
    if self._closed:
      raise RuntimeError("MathVerifier is closed")
    if self.config.backend == "process":
      outcome = self._equal_process(prediction, gold, timeout_s)
    else:
      outcome = self._equal_thread(prediction, gold, timeout_s)
    with self._lock:
      self._stats["calls"] += 1
      self._stats[outcome] += 1
    return outcome == "equal"

  def stats(self) -> dict[str, int]:
    """Counts since construction.

    calls = equal + unequal + timeouts + errors + busy (no free worker within
    `MathVerifyConfig.wait_timeout_s`);
    restarts counts worker processes replaced after a timeout or crash.
    """
    with self._lock:
      return dict(self._stats)

  def _equal_process(self, prediction: str, gold: str, timeout_s: float) -> str:
    # The wait for a worker is not part of `timeout_s` (`MathVerifyConfig.wait_timeout_s`);
    # `compare` starts the answer's clock.
    try:
      worker = self._idle.get(timeout=self.config.wait_timeout_s)
    except queue.Empty:
      return "busy"
    try:
      reply = worker.compare(prediction, gold, timeout_s)
    finally:
      self._idle.put(worker)
    if reply is None:
      with self._lock:
        self._stats["restarts"] += 1
      return "timeouts"
    if reply.get("restarted"):
      with self._lock:
        self._stats["restarts"] += 1
    if "error" in reply:
      logger.debug("math-verify error on %r vs %r: %s", prediction[:200], gold[:200], reply["error"])
      return "errors"
    return "equal" if reply["equal"] else "unequal"

  def _equal_thread(self, prediction: str, gold: str, timeout_s: float) -> str:
    if not self._slots.acquire(timeout=self.config.wait_timeout_s):
      return "busy"
    deadline = time.monotonic() + timeout_s  # the wait for a slot is not part of the limit
    box: dict[str, Any] = {}
    done = threading.Event()
    options = self.config.verify_options()

    def run():
      try:
        box["equal"] = _equal_inline(prediction, gold, **options)
      except BaseException as e:  # noqa: BLE001
        box["error"] = e
      finally:
        self._slots.release()
        done.set()

    threading.Thread(target=run, name="math-verify", daemon=True).start()
    if not done.wait(max(deadline - time.monotonic(), 0.0)):
      return "timeouts"
    if "error" in box:
      logger.debug("math-verify error on %r vs %r: %r", prediction[:200], gold[:200], box["error"])
      return "errors"
    return "equal" if box["equal"] else "unequal"

  def close(self) -> None:
    """Stops worker processes (threads of abandoned calls end on their own)."""
    self._closed = True
    if self.config.backend == "process":
      for w in self._workers:
        w.kill()

  def __enter__(self) -> MathVerifier:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


_default_lock = threading.Lock()
_default: MathVerifier | None = None


def default_verifier() -> MathVerifier:
  """The verifier that `math_equal` uses: default `MathVerifyConfig`, created on first use."""
  global _default
  with _default_lock:
    if _default is None:
      _default = MathVerifier(MathVerifyConfig())
      atexit.register(_default.close)
    return _default


def default_stats() -> dict[str, int] | None:
  """`stats()` of the verifier that `math_equal` uses, or None while nothing has started it."""
  with _default_lock:
    verifier = _default
  return None if verifier is None else verifier.stats()


def math_equal(prediction: str, gold: str, *, timeout_s: float = 5.0) -> bool:
  """Whether `prediction` equals `gold` as math (math-verify); False on timeout or any error.

  Handles numbers ("42" = "42.0", "1,000" = "1000", "$5" = "5 dollars" = "5", "12.5%" = "12.5",
  "1e3" = "1000", markdown code "`5`" = "5"), fractions and LaTeX ("0.5" = "\\frac{1}{2}",
  "\\boxed{3}" = "3"), sets and intervals ("\\{1,2\\}" = "\\{2,1\\}", "[1,2)"). A prediction
  naming two different values ("5 or 6", "5 = 6") equals neither. Returns within about
  `timeout_s` (plus a one-time worker start, and any wait for a free worker while more callers
  than its workers compare at once).
  """
  return default_verifier().equal(prediction, gold, timeout_s=timeout_s)
