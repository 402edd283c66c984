"""Tests for jaxagent/rewards/verifiers.py: extraction, EM/F1 (vs the SQuAD script), unit tests."""
import collections
import re
import string
import time

import numpy as np
import pytest

from jaxagent.rewards import verifiers
from jaxagent.rewards.verifiers import (
    exact_match,
    extract_answer,
    extract_boxed,
    extract_gsm8k,
    extract_tagged,
    f1_score,
    normalize_answer,
    substring_exact_match,
    unit_test_reward,
)

# --- extraction ---------------------------------------------------------------------------------


def test_extract_tagged_takes_the_last_complete_block():
  text = "<answer>1</answer> thinking more...\n<answer>\n 2\n</answer><answer>3"
  assert extract_tagged(text) == "2"
  assert extract_tagged("<answer></answer>") == ""
  assert extract_tagged("no tags here") is None
  assert extract_tagged("<result>7</result>", tag="result") == "7"
  # A repeated opening restarts the block, as the rollout's parser reads the final answer (the
  # reward read "I think <answer>42" and scored 0 an answer the rollout took as 42).
  assert extract_tagged("<answer>I think <answer>42</answer>") == "42"
  assert extract_tagged("<answer>a<answer>b</answer><answer>c</answer>") == "c"
  # Without `innermost` opening-tag text inside a body is body text (a program that prints
  # "<code>" was cut to what followed that text).
  assert extract_tagged('<code>s = "<code>"\nprint(s)</code>', "code", innermost=False) == 's = "<code>"\nprint(s)'
  assert extract_tagged("<code>a</code> then <code>b <code> c</code>", "code", innermost=False) == "b <code> c"
  assert extract_tagged("<code>a</code><code>b", "code", innermost=False) == "a"
  with pytest.raises(ValueError, match="tag name"):
    extract_tagged("x", tag="<answer>")


@pytest.mark.parametrize("text,expected", [
    ("so \\boxed{3}.", "3"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not close the box
    ("\\boxed{1} then \\boxed{ 2 }", "2"),
    ("\\boxed{4} and finally \\boxed{5", "4"),  # an unclosed (truncated) box is skipped
    # An empty box names nothing (the trailing one was returned, and a correct answer scored 0).
    ("\\boxed{5} so the answer goes in \\boxed{}", "5"),
    ("\\boxed{ }", None),
    ("\\fbox{x^{2}}", "x^{2}"),
    ("\\boxed {7}", "7"),
    ("no box", None),
    ("\\boxed{", None),
    # A one-token argument may go without braces, as math_equal reads it.
    ("So the answer is \\boxed5.", "5"),
    ("\\boxed B", "B"),
    ("\\fbox5", "5"),
    ("\\boxed12.5", "12.5"),
    ("\\boxed\\pi", "\\pi"),
    ("\\boxed{4} then \\boxed 5", "5"),
    ("\\boxed5 then \\boxed{4}", "4"),
    ("\\boxed{\\boxed5}", "5"),
    ("\\boxed5 6", "5"),
    ("\\boxed x = 5", None),  # the whole expression was meant; no box reads it
    # A command with its own arguments, unbraced, is boxed whole (these returned None or
    # "\\sqrt", and the math rewards scored the answers 0 while math_equal read them).
    ("\\boxed\\frac12", "\\frac12"),
    ("\\boxed\\sqrt{2}.", "\\sqrt{2}"),
    ("\\boxed \\dfrac{\\sqrt{3}}{2}", "\\dfrac{\\sqrt{3}}{2}"),
    ("\\boxed\\sqrt[3]{8}", "\\sqrt[3]{8}"),
    ("\\fbox\\text{7 apples}", "\\text{7 apples}"),
    ("\\boxed\\frac12 = x", None),  # the whole expression was meant
    ("\\boxed\\frac{1}{2}{3}", None),
    ("\\boxedx", None),
])
def test_extract_boxed(text, expected):
  assert extract_boxed(text) == expected


def _reference_extract_tagged(text, tag="answer"):
  """The regex reading extract_tagged must agree with (quadratic on many open tags): a block
  holds no opening tag of its own."""
  matches = re.findall(rf"<{tag}>((?:(?!<{tag}>).)*?)</{tag}>", text, flags=re.DOTALL)
  return matches[-1].strip() if matches else None


_LETTERS = frozenset(string.ascii_letters)


def _reference_unbraced_argument(text, i):
  """The argument of a box whose name ends at `text[i]`, when it goes without braces, by LaTeX's
  one-token rule: a number ("12", "1.5"), a letter, or a command that takes no argument ("\\pi";
  "\\frac12" is no token), not followed by an operator ("\\boxed x = 5" boxes the expression)."""
  if text[i:i + 1] in _LETTERS:
    return None  # "\\boxedx" is another command
  while i < len(text) and text[i].isspace():
    i += 1
  start, j = i, i
  if text[j:j + 1].isdecimal():
    while text[j:j + 1].isdecimal():
      j += 1
    if text[j:j + 1] == "." and text[j + 1:j + 2].isdecimal():
      j += 1
      while text[j:j + 1].isdecimal():
        j += 1
    if text[j:j + 1] == "." and text[j + 1:j + 2].isdecimal():
      return None  # "1.2.3" is no number
  elif text[j:j + 1] in _LETTERS:
    j += 1
    if text[j:j + 1] in _LETTERS:
      return None
  elif text[j:j + 1] == "\\":
    j += 1
    while text[j:j + 1] in _LETTERS:
      j += 1
    if j == start + 1 or text[start + 1:j] in ("boxed", "fbox"):
      return None
    if text[j:].lstrip()[:1].isdecimal() or text[j:].lstrip()[:1] in ("{", "["):
      return _reference_command_argument(text, start, j)  # no one-token argument
  else:
    return None
  if text[j:].lstrip()[:1] and text[j:].lstrip()[0] in "=<>+-*/^_!":
    return None
  return text[start:j]


_COMMANDS_WITH_ARGUMENTS = ("frac", "dfrac", "tfrac", "sqrt", "binom", "dbinom", "tbinom", "text",
                            "textbf", "mathrm", "mathbf", "mbox")


def _reference_command_argument(text, start, j):
  """The argument of a box that is a command with its own arguments ("\\frac12",
  "\\sqrt[3]{8}"): the command (named `text[start + 1:j]`), an optional [...] and the longest
  run of one or two arguments (a braced group nesting at most one more group, or one digit)
  that no brace, digit or operator follows; None when there is none."""
  if text[start + 1:j] not in _COMMANDS_WITH_ARGUMENTS:
    return None

  def skip_spaces(k):
    while k < len(text) and text[k].isspace():
      k += 1
    return k

  k = skip_spaces(j)
  if text[k:k + 1] == "[":
    close = k + 1
    while close < len(text) and text[close] not in "[]{}":
      close += 1
    if text[close:close + 1] == "]":
      j = close + 1
  ends, k = [], j
  for _ in range(2):
    k = skip_spaces(k)
    if text[k:k + 1].isdecimal():
      k += 1
    elif text[k:k + 1] == "{":
      depth, k = 1, k + 1
      while k < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[k], 0)
        if depth > 2:
          break
        k += 1
      if depth:
        break
    else:
      break
    ends.append(k)
  for end in reversed(ends):
    after = text[end:].lstrip()[:1]
    if not (after and after in "{0123456789=<>+-*/^_!"):
      return text[start:end]
  return None


def _reference_extract_boxed(text):
  """A scan from each box to its closing brace, or its argument written without braces: what
  extract_boxed must return (quadratic)."""
  found = None
  for box in re.finditer(r"\\(?:boxed|fbox)", text):
    m = re.compile(r"\s*\{").match(text, box.end())
    if m is None:
      argument = _reference_unbraced_argument(text, box.end())
      found = argument.strip() if argument is not None else found
      continue
    depth, i = 1, m.end()
    while i < len(text):
      c = text[i]
      if c == "\\":
        i += 2
        continue
      if c == "{":
        depth += 1
      elif c == "}":
        depth -= 1
        if depth == 0:
          found = text[m.end():i].strip() or found
          break
      i += 1
  return found


def test_extraction_agrees_with_the_reference_readings():
  pieces = ["\\boxed{", "\\fbox {", "{", "}", "\\{", "\\}", "\\\\", "\\", "x", " ", "\n", "1",
            "<answer>", "</answer>", "<answer", "answer>", "<result>", "</result>",
            # boxes whose argument goes without braces
            "\\boxed", "\\fbox", "\\boxed ", "B", "12", ".", "5", "\\pi", "\\frac", "=", "+", "ab",
            # boxes of a command with its own arguments
            "\\sqrt", "\\text", "[3]", "[", "]"]
  rng = np.random.default_rng(0)
  for _ in range(6000):
    text = "".join(rng.choice(pieces, size=rng.integers(0, 16)))
    assert extract_boxed(text) == _reference_extract_boxed(text), text
    assert extract_tagged(text) == _reference_extract_tagged(text), text
    assert extract_tagged(text, "result") == _reference_extract_tagged(text, "result"), text


@pytest.mark.parametrize("extract,text", [
    (extract_boxed, "\\boxed{" * 20000),
    (extract_boxed, "\\boxed{" * 20000 + "}"),
    (extract_tagged, "<answer>" * 20000),
    (extract_tagged, "<answer>" * 20000 + "</answer>"),
])
def test_extraction_is_linear_on_adversarial_outputs(extract, text):
  # A scan from every open box or tag to the end of the text took tens of seconds here.
  start = time.perf_counter()
  extract(text)
  assert time.perf_counter() - start < 1.0


def test_extract_gsm8k():
  assert extract_gsm8k("Natalia sold 48 clips.\n#### 72") == "72"
  assert extract_gsm8k("#### 1\nwait\n####  1,000 \n") == "1,000"
  assert extract_gsm8k("#### \n") is None
  assert extract_gsm8k("42") is None
  assert extract_gsm8k("#####5") == "5"
  assert extract_gsm8k("The answer:\n##### -3") == "-3"


def test_extract_answer_priority():
  both = "\\boxed{1} #### 2 <answer>3</answer>"
  assert extract_answer(both) == "3"
  assert extract_answer(both, tag=None) == "1"
  assert extract_answer("\\boxed{1}\n#### 2") == "1"
  assert extract_answer("steps\n#### 2") == "2"
  assert extract_answer("<answer>\\boxed{3}</answer>") == "\\boxed{3}"
  assert extract_answer("I am not sure.") is None
  assert extract_answer("") is None


# --- EM / F1 --------------------------------------------------------------------------------------
# The official SQuAD v1.1 evaluation functions, typed out as an independent reference.


def squad_normalize(s):
  def remove_articles(text):
    return re.sub(r"\b(a|an|the)\b", " ", text)

  def white_space_fix(text):
    return " ".join(text.split())

  def remove_punc(text):
    exclude = set(string.punctuation)
    return "".join(ch for ch in text if ch not in exclude)

  return white_space_fix(remove_articles(remove_punc(s.lower())))


def squad_f1(prediction, ground_truth):
  prediction_tokens = squad_normalize(prediction).split()
  ground_truth_tokens = squad_normalize(ground_truth).split()
  common = collections.Counter(prediction_tokens) & collections.Counter(ground_truth_tokens)
  num_same = sum(common.values())
  if num_same == 0:
    return 0
  precision = 1.0 * num_same / len(prediction_tokens)
  recall = 1.0 * num_same / len(ground_truth_tokens)
  return (2 * precision * recall) / (precision + recall)


PAIRS = [
    ("The Eiffel Tower", "eiffel tower"),
    ("Eiffel Tower, Paris", "the Eiffel Tower"),
    ("a big red dog", "The red dog."),
    ("dog dog dog", "the dog"),
    ("Barack Obama", "Obama, Barack Hussein"),
    ("1,000 km", "1000 km"),
    ("anthem", "an them"),
    ("Théâtre du Châtelet", "theatre du chatelet"),
    ("New York City!!", "new-york city"),
    ("completely wrong", "Paris"),
]


@pytest.mark.parametrize("pred,gold", PAIRS)
def test_em_and_f1_match_squad_reference(pred, gold):
  assert normalize_answer(pred) == squad_normalize(pred)
  assert exact_match(pred, gold) == float(squad_normalize(pred) == squad_normalize(gold))
  assert f1_score(pred, gold) == pytest.approx(squad_f1(pred, gold))


def test_em_and_f1_hand_worked():
  assert normalize_answer("  The Cat's   HAT! ") == "cats hat"
  assert exact_match("The Eiffel Tower.", "eiffel tower") == 1.0
  assert exact_match("an apple", ["a pear", "Apple"]) == 1.0
  assert exact_match("apples", ["apple"]) == 0.0
  # tokens [big, red, dog] vs [red, dog]: P = 2/3, R = 1, F1 = 0.8
  assert f1_score("the big red dog", "red dog") == pytest.approx(0.8)
  # [dog, dog] vs [dog]: one shared token, P = 1/2, R = 1, F1 = 2/3
  assert f1_score("dog dog", "a dog") == pytest.approx(2 / 3)
  # max over golds: "cat" 0, "red dog" 0.8, "small red dog" (P = R = 2/3) 2/3
  assert f1_score("the big red dog", ["cat", "red dog", "small red dog"]) == pytest.approx(0.8)


def test_em_f1_missing_and_empty():
  assert exact_match(None, "x") == 0.0 and f1_score(None, ["x"]) == 0.0
  # Only articles and punctuation normalise to empty: right only against an empty reference.
  assert f1_score("The.", "a") == 1.0
  assert f1_score("The.", "dog") == 0.0
  assert f1_score("dog", "the") == 0.0
  with pytest.raises(ValueError, match="at least one"):
    exact_match("x", [])
  with pytest.raises(TypeError, match="str"):
    f1_score("x", [None])


def test_substring_exact_match():
  assert substring_exact_match("It is Paris, France.", "paris") == 1.0
  assert substring_exact_match("The answer is New York City", ["Boston", "new york"]) == 1.0
  assert substring_exact_match("10 apples", "1") == 0.0  # whole words only
  assert substring_exact_match("anything", "the") == 0.0  # an empty normalised gold never matches
  assert substring_exact_match(None, "x") == 0.0


# --- unit tests ---------------------------------------------------------------------------------


def test_unit_test_reward():
  assert unit_test_reward(3, 4) == 0.75
  assert unit_test_reward(4, 4) == 1.0
  assert unit_test_reward(0, 0) == 0.0
  assert unit_test_reward(3, 4, all_or_nothing=True) == 0.0
  assert unit_test_reward(4, 4, all_or_nothing=True) == 1.0
  value = unit_test_reward(np.int64(1), np.int32(2))
  assert value == 0.5 and type(value) is float


@pytest.mark.parametrize("args,match", [((5, 4), "exceeds"), ((-1, 4), "pass_count"), ((1, 2.0), "total"),
                                        ((True, 2), "pass_count")])
def test_unit_test_reward_rejects_bad_counts(args, match):
  with pytest.raises(ValueError, match=match):
    unit_test_reward(*args)


def test_math_equal_is_reexported():
  assert verifiers.math_equal.__module__ == "jaxagent.rewards.math_verifier"


@pytest.mark.parametrize("prediction,golds,want", [
    ("-5", "5", 0.0), ("5", "-5", 0.0), ("3.5", "35", 0.0), ("1/2", "12", 0.0), ("-5", "-5", 1.0),
    ("1,000", "1000", 1.0), ("42.0", "42", 1.0), ("0.5000001", "0.5", 1.0), ("5.0000001", "5", 0.0),
    ("7", ["6", "7"], 1.0), ("seven", "7", 0.0), (None, "7", 0.0), ("1,2", "12", 0.0),
    # exponents: a calculator or a model may write them
    ("1e20", "100000000000000000000", 1.0), ("4.2e1", "42", 1.0), ("1.5E-7", "0.00000015", 1.0),
    ("-2.5e+3", "-2500", 1.0), ("1e2", "1000", 0.0), ("1e", "1", 0.0), ("e5", "100000", 0.0),
    ("1e1234567", "1", 0.0),
    # a digit on one side of the point only, and a plus sign, as decimal.Decimal reads them
    (".5", "0.5", 1.0), ("-.5", "-0.5", 1.0), ("42.", "42", 1.0), ("+5", "5", 1.0), ("1,000.", "1000", 1.0),
    (".", "0", 0.0), ("-", "0", 0.0), ("+-5", "-5", 0.0), ("5..", "5", 0.0),
])
def test_numeric_match_keeps_signs_and_decimal_points(prediction, golds, want):
  # The SQuAD normalisation of exact_match drops them: "-5" would match "5".
  assert verifiers.numeric_match(prediction, golds) == want


def test_numeric_match_rejects_non_numeric_golds():
  with pytest.raises(ValueError, match="numeric gold"):
    verifiers.numeric_match("1", "one")
  with pytest.raises(ValueError, match="finite gold"):
    verifiers.numeric_match("1", "inf")


@pytest.mark.parametrize("gold", ["1,5", "12,0", "1,2,3", "1000,", ",5", "1,0000"])
def test_numeric_match_rejects_gold_commas_that_are_not_thousands_separators(gold):
  # Such a gold was read with its commas dropped: "1,5" (a decimal comma) became 15, so "15"
  # scored 1 and "1.5" scored 0.
  with pytest.raises(ValueError, match="thousands"):
    verifiers.numeric_match("15", gold)


@pytest.mark.parametrize("gold,prediction", [("1,000", "1000"), ("-1,234.5", "-1234.5"), ("+5", "5"),
                                             ("1,000,000", "1e6"), (" 2,500 ", "2,500")])
def test_numeric_match_reads_thousands_separators_in_golds(gold, prediction):
  assert verifiers.numeric_match(prediction, gold) == 1.0


@pytest.mark.parametrize("prediction,gold,want", [
    # A minus sign, a leading en dash and full-width forms, as math_equal reads "\u22125" (these
    # scored 0; a full-width digit alone already scored 1).
    ("\u22125", "-5", 1.0), ("\u20135", "-5", 1.0), ("\uff0d\uff15", "-5", 1.0), ("\u2212\u20135", "-5", 0.0),
    ("\uff11\uff0c\uff10\uff10\uff10", "1000", 1.0), ("\u2212.5", "-0.5", 1.0), ("\u22125", "5", 0.0),
    # Spaces between thousands groups, plain, no-break, thin or narrow no-break (these scored 0).
    ("1 000 000", "1000000", 1.0), ("1\u2009000\u2009000", "1000000", 1.0),
    ("1\u202f000\u202f000", "1000000", 1.0), ("1\u00a0000", "1000", 1.0), ("\u22121 234.5", "-1234.5", 1.0),
    # A range, or spaces that are no thousands groups, is no number.
    ("3\u20135", "-5", 0.0), ("3\u20135", "3", 0.0), ("3\u20135", "-2", 0.0), ("3\u22125", "-2", 0.0),
    ("1 23", "123", 0.0), ("5 6", "56", 0.0), ("1 000,000", "1000000", 0.0), ("1\u2009000 000", "1000000", 0.0),
    # Golds are read alike ("\u22125" raised ValueError).
    ("-5", "\u22125", 1.0), ("1000000", "1\u202f000\u202f000", 1.0), ("5", "\u22125", 0.0),
])
def test_numeric_match_reads_unicode_numbers(prediction, gold, want):
  assert verifiers.numeric_match(prediction, gold) == want


@pytest.mark.parametrize("prediction", ["9999e999999", "-9999e999999", "1e999999", "1e-999999"])
def test_numeric_match_huge_exponents_score_zero(prediction):
  # A policy's answer is data: far outside the default decimal context's range, it raised
  # decimal.Overflow (counted as the reward component's failure) instead of scoring 0.
  for gold in ("0.5", "5", "123.25"):
    assert verifiers.numeric_match(prediction, gold) == 0.0
  assert verifiers.numeric_match(prediction, ["0.5", prediction]) == 1.0  # and its own value matches


def test_package_exports_every_verifier():
  # `from jaxagent.rewards import numeric_match` failed while the other verifiers imported.
  import jaxagent.rewards as rewards
  missing = [n for n in verifiers.__all__ if n not in rewards.__all__]
  assert not missing, f"jaxagent.rewards does not export {missing}"
  assert all(getattr(rewards, n) is getattr(verifiers, n) for n in verifiers.__all__)
  assert rewards.numeric_match("1,000", "1000") == 1.0
