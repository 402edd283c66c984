"""Outcome verifiers: answer extraction, exact match / token F1, unit-test pass rate.

These turn a finished response into a correctness score; `rewards/components.py` adapts them to
`RewardInput` and `rewards/composite.py` weighs them with the shaping terms. Math equivalence
lives in `math_verifier.py` (it needs a time limit and worker processes) and is re-exported here
so every verifier can be imported from one place.

Exact match and F1 follow the SQuAD evaluation script, as Search-R1 does: lowercase, drop
punctuation, drop the articles a/an/the, collapse whitespace. That normalisation drops signs and
decimal points ("-5" matches "5"), so numeric answers use `numeric_match`.
"""
from __future__ import annotations

import collections
import decimal
import numbers
import re
import string
from typing import Sequence

from jaxagent.rewards._math_text import _box_spans, _brace_boxes
from jaxagent.rewards.math_verifier import math_equal

__all__ = [
    "exact_match", "extract_answer", "extract_boxed", "extract_gsm8k", "extract_tagged", "f1_score",
    "math_equal", "normalize_answer", "numeric_match", "substring_exact_match", "unit_test_reward",
]

# ----------------------------------------------------------------------------------------------
# Answer extraction.

_GSM8K = re.compile(r"####+[ \t]*([^\n]*)")  # "#####5" is 5, not "#5"
_TAG_NAME = re.compile(r"[A-Za-z_][\w\-]*")


def extract_tagged(text: str, tag: str = "answer", *, strip: bool = True,
                   innermost: bool = True) -> str | None:
  """Content of the last complete `<tag>...</tag>` block (stripped unless `strip=False`), or None.

  A block ends at the first closing tag after an opening one. With `innermost` (the default,
  for answers) it starts at the last opening tag before that closing one (`<answer>so
  <answer>42</answer>` holds "42", as the rollout's parser reads an answer); without it, at the
  first opening tag after the previous block, so that opening-tag text inside a body is body
  text (`<code>s = "<code>"</code>` holds `s = "<code>"`, as the parser reads a tool call). The
  search then goes on after the closing tag. Linear in the text however many tags are left open.
  """
  if not _TAG_NAME.fullmatch(tag):
    raise ValueError(f"tag must be a bare tag name like 'answer', got {tag!r}")
  opening, closing = f"<{tag}>", f"</{tag}>"
  found, pos = None, 0
  while (start := text.find(opening, pos)) >= 0:
    end = text.find(closing, start + len(opening))
    if end < 0:  # no later opening tag has a closing one either
      break
    if innermost:
      start = text.rfind(opening, start, end)
    found, pos = (start + len(opening), end), end + len(closing)
  if found is None:
    return None
  content = text[found[0]:found[1]]
  return content.strip() if strip else content


def extract_boxed(text: str) -> str | None:
  """Stripped content of the last `\\boxed{...}` (or `\\fbox{...}`) whose braces balance, or None.

  Escaped braces (`\\{`, `\\}`, as in sets) do not count towards the balance. A box left open
  (a truncated response) is skipped, so an earlier complete box can still be returned; so is an
  empty box ("\\boxed{5}, in \\boxed{}"), which names nothing. A box whose argument goes without
  braces is read as `math_equal` reads it: a one-token argument ("\\boxed5", "\\boxed B",
  "\\fbox\\pi"), or a command with its own arguments ("\\boxed\\sqrt{2}", "\\boxed\\frac12"), is
  the content. Linear in the text however many boxes are left open.
  """
  text = _brace_boxes(text)
  contents = [text[start:end].strip() for _, start, end in _box_spans(text)]
  return next((c for c in reversed(contents) if c), None)


def extract_gsm8k(text: str) -> str | None:
  """The rest of the line after the last GSM8K-style `#### ` marker, or None."""
  matches = [m.strip() for m in _GSM8K.findall(text)]
  matches = [m for m in matches if m]
  return matches[-1] if matches else None


def extract_answer(text: str, *, tag: str | None = "answer") -> str | None:
  """The final answer in a response, or None when it gives none.

  Looks, in order, for the last `<tag>...</tag>` block (skipped when `tag` is None), the last
  balanced `\\boxed{...}`, and the last `#### ...` marker.
  """
  if tag is not None:
    answer = extract_tagged(text, tag)
    if answer is not None:
      return answer
  answer = extract_boxed(text)
  if answer is not None:
    return answer
  return extract_gsm8k(text)


# ----------------------------------------------------------------------------------------------
# Exact match and token F1 (SQuAD / Search-R1).

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
  """SQuAD normalisation: lowercase, no punctuation, no articles, single spaces."""
  text = "".join(c for c in text.lower() if c not in _PUNCTUATION)
  return " ".join(_ARTICLES.sub(" ", text).split())


def _golds(golds: str | Sequence[str]) -> list[str]:
  golds = [golds] if isinstance(golds, str) else list(golds)
  if not golds:
    raise ValueError("golds must hold at least one reference answer, got an empty sequence")
  for g in golds:
    if not isinstance(g, str):
      raise TypeError(f"each gold answer must be a str, got {type(g).__name__}: {g!r}")
  return golds


def exact_match(prediction: str | None, golds: str | Sequence[str]) -> float:
  """1.0 if the normalised prediction equals any normalised gold, else 0.0 (None scores 0)."""
  golds = _golds(golds)
  if prediction is None:
    return 0.0
  pred = normalize_answer(prediction)
  return float(any(pred == normalize_answer(g) for g in golds))


def substring_exact_match(prediction: str | None, golds: str | Sequence[str]) -> float:
  """1.0 if any normalised gold appears as whole words inside the normalised prediction.

  Search-R1's `subem` checks plain string containment; here the match must fall on word
  boundaries so "1" does not match inside "10".
  """
  golds = _golds(golds)
  if prediction is None:
    return 0.0
  pred = f" {normalize_answer(prediction)} "
  return float(any(f" {g} " in pred for g in map(normalize_answer, golds) if g))


# Commas only as thousands separators: "1,234" is a number, "1,2,3" is not.
# An exponent ("1.5e-7", "2E+20") is read too: a calculator or a model may write one. So are a
# sign and the forms `decimal.Decimal` reads without a digit on one side of the point (".5", "42.").
_NUMBER = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,6})?")
# A gold may also carry a "+" and any of the forms `decimal.Decimal` reads (".5", "5."), but a
# comma only as a thousands separator: "1,5" is not silently read as 15.
_GOLD_COMMAS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d*)?(?:[eE][-+]?\d+)?")
# Unicode a model writes in a number (`_plain_number`): a minus sign (U+2212) and full-width
# forms ("－５", "１，０００"), an en dash as a leading minus ("–5"; "3–5" is a range and no
# number), and a space, no-break, figure, thin or narrow no-break space between thousands groups
# ("1 000 000"), one kind throughout ("1 000,000" and "1 23" are no number).
_UNICODE_NUMBER = str.maketrans({"\u2212": "-", "\uff0d": "-", "\uff0b": "+", "\uff0c": ",",
                                 "\uff0e": ".", **{chr(0xff10 + i): str(i) for i in range(10)}})
_LEADING_DASH = re.compile(r"^\u2013(?=[\d.])")
_SPACED_GROUPS = re.compile(
    r"[-+]?\d{1,3}([ \u00a0\u2007\u2009\u202f])\d{3}(?:\1\d{3})*(?:\.\d*)?(?:[eE][-+]?\d{1,6})?")
_GROUP_SPACE = re.compile(r"[ \u00a0\u2007\u2009\u202f]")
# The whole exponent range the pattern admits, without traps: in the default context a prediction
# such as "9999e999999" raised decimal.Overflow against a non-integer gold instead of scoring 0.
_EXACT = decimal.Context(prec=60, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN, traps=[])


def _plain_number(text: str) -> str:
  """`text` stripped, with the Unicode of `_UNICODE_NUMBER`, a leading en dash and spaced
  thousands groups written as ASCII ("−5" -> "-5", "–5" -> "-5", "1 000" -> "1000")."""
  text = _LEADING_DASH.sub("-", text.strip().translate(_UNICODE_NUMBER))
  return _GROUP_SPACE.sub("", text) if _SPACED_GROUPS.fullmatch(text) else text


def numeric_match(prediction: str | None, golds: str | Sequence[str]) -> float:
  """1.0 when the prediction is one of the gold numbers, else 0.0 (None or not a number scores 0).

  The prediction is a decimal number, optionally signed, with commas only as thousands
  separators and an optional exponent ("1.5e-7"); ".5" and "42." count as 0.5 and 42. A minus
  sign, an en dash before the number and full-width forms count as their ASCII ("−5" and "–5"
  are -5, "３" is 3), and so do spaces between thousands groups ("1 000 000", also thin and
  no-break spaces); a range ("3–5") is no number. The golds are read alike. An
  integer gold needs that exact integer ("42.0" and "4.2e1" count for "42"); a non-integer gold
  allows an error of 1e-6 times max(1, |gold|) (relative above 1, absolute below). A gold that
  is not a number, or has a comma that is not a thousands separator ("1,5"), is an error.
  """
  parsed = []
  for g in _golds(golds):
    plain = _plain_number(g)
    if "," in plain and not _GOLD_COMMAS.fullmatch(plain):
      raise ValueError(f"numeric_match needs numeric gold answers with commas only as thousands "
                       f"separators (1,234,567), got {g!r}; write a decimal comma as a point")
    try:
      b = decimal.Decimal(plain.replace(",", ""))
    except decimal.InvalidOperation:
      raise ValueError(f"numeric_match needs numeric gold answers, got {g!r}") from None
    if not b.is_finite():
      raise ValueError(f"numeric_match needs finite gold answers, got {g!r}")
    parsed.append(b)
  if prediction is None:
    return 0.0
  m = _NUMBER.fullmatch(_plain_number(prediction))
  if m is None:
    return 0.0
  a = decimal.Decimal(m.group(0).replace(",", ""))
  with decimal.localcontext(_EXACT):
    for b in parsed:
      if b == b.to_integral_value():
        if a == b:
          return 1.0
      elif abs(a - b) <= decimal.Decimal("1e-6") * max(1, abs(b)):
        return 1.0
  return 0.0


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
  if not pred_tokens or not gold_tokens:
    # SQuAD v2: an empty answer is right only against an empty reference.
    return float(pred_tokens == gold_tokens)
  common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
  num_same = sum(common.values())
  if num_same == 0:
    return 0.0
  precision = num_same / len(pred_tokens)
  recall = num_same / len(gold_tokens)
  return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str | None, golds: str | Sequence[str]) -> float:
  """Token-level F1 between normalised prediction and gold, maximised over golds.

  A side that normalises to no tokens (only articles and punctuation, "the", "a.") scores 1.0
  against a gold that does too and 0.0 against any other, as the SQuAD v2.0 script scores a
  no-answer: f1_score("the", "a") is 1.0. (The v1.1 script scored 0 there.)
  """
  golds = _golds(golds)
  if prediction is None:
    return 0.0
  pred_tokens = normalize_answer(prediction).split()
  return max(_f1(pred_tokens, normalize_answer(g).split()) for g in golds)


# ----------------------------------------------------------------------------------------------
# Unit tests.


def unit_test_reward(pass_count: int, total: int, *, all_or_nothing: bool = False) -> float:
  """Fraction of unit tests passed (or 1.0 only when all pass); 0.0 when there are no tests.

  The sandboxed runner lives in `jaxagent/tools/`; this only defines the reward of its counts.
  """
  for name, value in (("pass_count", pass_count), ("total", total)):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
      raise ValueError(f"unit_test_reward: {name} must be an int >= 0, got {value!r}")
  pass_count, total = int(pass_count), int(total)
  if pass_count > total:
    raise ValueError(f"unit_test_reward: pass_count ({pass_count}) exceeds total ({total})")
  if total == 0:
    return 0.0
  if all_or_nothing:
    return float(pass_count == total)
  return pass_count / total
