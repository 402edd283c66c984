"""Tests for jaxagent/rewards/math_verifier.py and its reading in _math_compare.py and
_math_text.py: equivalence cases, time limits, failure counting."""
import concurrent.futures
import random
import re
import threading
import time

import math_verify
import pytest

from jaxagent.rewards import _math_compare, _math_text, math_verifier
from jaxagent.rewards.math_verifier import MathVerifier, MathVerifyConfig, math_equal

EQUAL = [
    ("42", "42.0"),
    ("1,000", "1000"),
    ("1,000,000", "1000000"),
    ("1\\,000", "1000"),
    ("$5", "5"),
    ("5 dollars", "5"),
    ("0.5", "\\frac{1}{2}"),
    ("\\frac{1}{2}", "0.5"),
    ("\\dfrac{3}{4}", "0.75"),
    ("1/2", "\\frac{1}{2}"),
    ("\\boxed{3}", "3"),
    ("The final answer is \\boxed{\\frac{1}{2}}.", "0.5"),
    ("-\\frac{1}{2}", "-0.5"),
    ("\\{2, 1\\}", "\\{1,2\\}"),
    ("2, 1", "\\{1,2\\}"),
    ("[1,2)", "[1, 2)"),
    ("\\left[1,2\\right)", "[1,2)"),
    ("(-\\infty, 3]", "(-\\infty,3]"),
    ("x+1", "1+x"),
    ("\\sqrt{2}", "2^{1/2}"),
    ("3.", "3"),
    # Forms a model writes for a single number.
    ("\\$5", "5"),
    ("18 dollars.", "18"),
    ("10\\text{ cm}", "10"),
    ("$1,234.50", "1234.5"),
    ("\u22125", "-5"),  # Unicode minus
    ("\\left(1,2\\right)", "(1,2)"),
    ("5.", "5"),
    ("\\sqrt{2}", "sqrt(2)"),
    ("2^{10}", "1024"),
    ("1.5\\times10^3", "1500"),
    ("The answer is 42", "42"),
    ("The answer is 42, so 42.", "42"),  # one value named twice
    ("Adding 2 and 3 gives \\boxed{5}", "5"),  # with a box, only the box is the answer
    ("1 000", "1000"),  # a space as thousands separator
    # A percentage equals its number, as "50%" = "50" in math-verify, and its fraction.
    ("50%", "50"),
    ("12.5%", "12.5"),
    ("12.5\\%", "12.5"),
    ("7.5%", "7.5"),
    ("12.5%", "0.125"),
    ("12.5", "12.5%"),
    # Scientific notation is a number, not a product with Euler's e.
    ("1e3", "1000"),
    ("1e-3", "0.001"),
    ("1.5e3", "1500"),
    ("2.5e-3", "0.0025"),
    ("The answer is 1.5E3", "1500"),
    # A logarithm's base written as a bare subscript is not two numbers side by side.
    ("\\log_2 8", "3"),
    ("\\log_2 5", "\\log_{2}5"),
    ("x = \\log_2 5", "\\log_2 5"),
    # \fbox is a box, as extract_boxed reads it.
    ("\\fbox{7}", "7"),
    ("The answer is \\fbox{7}.", "7"),
    # With a box, only the box is the answer: working after it is not a second value.
    ("\\boxed{5}. Indeed 5 \\cdot 2 = 10", "5"),
    ("So she has \\boxed{18} dollars, which is 18 = 9 \\times 2.", "18"),
    ("The answer is \\boxed{10} (rounded from 9.97).", "10"),
    # A full stop ends the answer; it is not part of it.
    ("\\frac{1}{2}.", "1/2"),
    ("2/3.", "2/3"),
    ("\\sqrt{2}.", "\\sqrt{2}"),
    ("(1,2).", "(1,2)"),
    ("\\boxed{5.}", "5"),
    ("The answer is \\boxed{5 .}", "5"),
    # Word answers hold no math to parse; they compare as text, without case or \text{}.
    ("yes", "Yes"),
    ("\\text{Yes}", "Yes"),
    ("$\\text{yes}$.", "Yes"),
    # A marked answer ends with its sentence: a check or explanation after it is no answer.
    ("The answer is 5. Check: 5 * 2 = 10", "5"),
    ("The final answer is 5.\nVerification: 5+5=10", "5"),
    ("Answer: 5\n\nExplanation: we add 2 and 3 to get 5.", "5"),
    ("Answer:\n5\nbecause 2+3", "5"),
    ("The answer is 0.5. Since 1/2 = 0.5.", "1/2"),
    ("The answer is 5. So the final answer is 5.", "5"),
    ("The answer is $\\frac{1}{2}$. Check: 2 \\cdot \\frac12 = 1", "\\frac{1}{2}"),
    # Python's power operator.
    ("2**3", "8"),
    ("2**10", "1024"),
    ("2**(1/2)", "\\sqrt{2}"),
    # An inequality in one variable is its solution set against an interval.
    ("x < 3", "(-\\infty, 3)"),
    ("$x \\le 3$", "(-\\infty, 3]"),
    ("1 < x < 3", "(1,3)"),
    ("3 > x", "(-\\infty,3)"),
    ("(2, \\infty)", "x > 2"),
    # Prose naming an answer that holds no number: the phrase's answer on its own.
    ("The answer is B.", "B"),
    ("**Answer:** (C)", "C"),
    ("The final answer is yes.", "Yes"),
    ("I think the answer is B\nThe answer is B.", "B"),
    # A box's one-token argument may go without braces, as in LaTeX; a run of digits is one token.
    ("\\boxed5", "5"),
    ("\\boxed 5", "5"),
    ("\\fbox5", "5"),
    ("\\boxed5 6", "5"),  # LaTeX boxes the 5 only
    # A command that takes arguments is no one-token argument, and its name is read whole
    # (read as "\\boxed{\\fra}c{1}{2}" these scored 0).
    ("\\boxed\\frac{1}{2}", "1/2"),
    ("The answer is \\boxed\\frac{1}{2}.", "0.5"),
    ("\\boxed12", "12"),
    ("\\boxed B", "B"),
    ("\\boxed\\pi", "\\pi"),
    ("The answer is \\boxed5.", "5"),
    ("\\boxed 5. Check: 5 \\cdot 2 = 10", "5"),
    # A reason given in the answer's sentence is working, not another answer.
    ("The answer is $5$, since $2+3=5$.", "5"),
    ("The answer is 5 because 2 + 3 = 5", "5"),
    ("The answer is 5, as 2 + 3 = 5.", "5"),
    ("The answer is 5 (since 2 + 3 = 5).", "5"),
    ("The final answer is $\\frac{1}{2}$, because $2 \\cdot \\frac{1}{2} = 1$.", "\\frac{1}{2}"),
    ("The answer is B, because 2 is even.", "B"),
    ("The answer is as follows: 5 because 2 + 3 = 5.", "5"),
    ("The answer is as follows: 5.", "5"),
    ("The answer is the same as 5.", "5"),  # "as" after a word gives no reason
    ("The answer is B as expected.", "B"),
    # So is a remark on it after a comma (read as a hedge: these scored 0).
    ("The answer is 5, which is not divisible by 2.", "5"),
    ("The answer is 5, which is the smallest prime greater than 3.", "5"),
    ("The answer is B, which has 4 sides.", "B"),
    # An answer math-verify does not read ends with its sentence too: a later number is none.
    ("The answer is B. Note that 2 is even.", "B"),
    ("The answer is B.\nOption B has 12 apples.", "B"),
    ("The answer is yes. Indeed 4 is even.", "Yes"),
    ("The answer is:\n\n5", "5"),
    ("Not sure. The answer is 5.", "5"),
    # Display math on its own lines after an answer phrase is what it names.
    ("The final answer is\n\n$$\n5\n$$", "5"),
    ("The answer is:\n\\[\n\\frac{1}{2}\n\\]", "0.5"),
    ("### Final Answer\n5", "5"),
    ("The answer is:\n$$\n(1, 2)\n$$", "(1,2)"),
    ("The answer is (1, 2). Note that 12 is not the answer.", "(1,2)"),
    ("The answer is 2, 3.", "\\{2,3\\}"),
    ("The answer is: **5**", "5"),
    ("The answer is:\n- 5", "5"),
    ("x = 2 \\lor x = 3", "2, 3"),  # the solutions of a quadratic
    ("x = 2 \\quad x = 3", "2, 3"),
    ("x = 2 \\\\ x = 3", "2, 3"),
    ("2 and 3", "2, 3"),
    ("x = -2 or x = 3", "-2, 3"),
    # An answer quoted as markdown code is read without the quotes.
    ("The answer is `5`.", "5"),
    ("**Answer:** `5`", "5"),
    ("`5`", "5"),
    ("The answer is ``5``.", "5"),
    ("The answer is `B`.", "B"),
    ("The value of `n` is 4, so the answer is `5`.", "5"),
    ("The answer is `5`. Check: `5 * 2 = 10`", "5"),
    # So is a bold answer (a bare "**7**" was read as Python's power operator).
    ("**7**", "7"),
    ("**-3**", "-3"),
    ("**\\frac{1}{2}**", "0.5"),
    ("**B**", "B"),
    ("2 ** 3", "8"),
    ("The answer is *5*.", "5"),  # italic
    ("*-3*", "-3"),
    ("__5__", "5"),
    ("2*3*4", "24"),  # products, not emphasis
    ("(2)*3*(4)", "24"),
    # A bare answer followed by its reason, to the end of the text, is the answer.
    ("7, since 3 + 4 = 7", "7"),
    ("x = 5 since 2x = 10", "5"),
    ("5 (since 2+3=5).", "5"),
    ("B, because 2 is even", "B"),
    ("\n.   because 6", "6"),  # a head that reads nothing leaves the text to the prose reading
    # A plus-minus in a fraction's numerator names both values (math-verify cannot parse it).
    ("x = \\frac{-1 \\pm \\sqrt{5}}{2}", "\\frac{-1 \\pm \\sqrt{5}}{2}"),
    ("\\frac{-1 + \\sqrt{5}}{2}, \\frac{-1 - \\sqrt{5}}{2}", "\\frac{-1 \\pm \\sqrt{5}}{2}"),
    ("\\boxed{\\dfrac{-1\\pm\\sqrt5}{2}}", "\\frac{-1 - \\sqrt{5}}{2}, \\frac{-1 + \\sqrt{5}}{2}"),
    ("\\frac{\\pm \\sqrt{5}}{2}", "\\pm \\frac{\\sqrt{5}}{2}"),
    # A LaTeX tie is a space.
    ("1~000", "1000"),
    ("x=2~\\text{or}~x=3", "2, 3"),
    # Prose listing exactly the values of a gold of several values names them (these scored 0,
    # read as a hedge).
    ("The roots are 2 and 3.", "2, 3"),
    ("The roots are 3 and 2.", "2,3"),
    ("The roots are 2 and 3.", "\\{2, 3\\}"),
    ("The roots are 2 and 3.", "x=2, x=3"),
    ("The solutions are x = 2 and x = 3.", "2, 3"),
    ("The possible values of k are -4 and 4.", "\\pm 4"),
    ("We factor: (x-2)(x-3) = 0. So the roots are 2 and 3.", "2,3"),
    ("The roots are 2\\sqrt{2} and 3.", "2\\sqrt{2}, 3"),
    ("The roots are \u221a2 and 3.", "\\sqrt{2}, 3"),
    ("The solutions are x = 2 and x = 3, so the sum is 5.", "2, 3"),  # a conclusion drawn
    ("The roots are 2 and 3 because (x-2)(x-3) = 0.", "2, 3"),  # a reason
    # So do boxes naming exactly them (these scored 0, two boxes read as a hedge).
    ("\\boxed{2} and \\boxed{3}", "2, 3"),
    ("\\boxed{3}, \\boxed{2}", "\\{2, 3\\}"),
    ("x = \\boxed{2} or x = \\boxed{3}", "2, 3"),
    ("\\boxed{x=2} and \\boxed{x=3}", "x=2, x=3"),
    ("\\boxed{\\frac{1}{2}} and \\boxed{-3}", "-3, 1/2"),
    ("\\boxed{2} and \\boxed{3, 4}", "2, 3, 4"),
    # An empty box names nothing; it does not hide an earlier box (these scored 0).
    ("\\boxed{5} so \\boxed{}", "5"),
    ("\\boxed{} \\boxed{5}", "5"),
    ("\\boxed{5}. \\fbox{ }", "5"),
    # A multiple-choice answer spelled "option A" / "choice A" is its letter (these scored 0).
    ("Option A", "A"),
    ("The answer is option A.", "A"),
    ("The correct answer is Choice (D).", "D"),
    ("**Answer:** Option C", "C"),
    ("A", "Option A"),
    # A number with its unit inside \\text is the number (read as the symbol "7apples": scored 0).
    ("\\boxed{\\text{7 apples}}", "7"),
    ("\\boxed{\\text{7 apples}}", "7 apples"),
    ("\\text{1,000 dollars}", "1000"),
    # An unbraced box holding a command with its own arguments boxes the whole command.
    ("\\boxed\\sqrt{2}", "\\sqrt{2}"),
    ("\\boxed\\frac12", "1/2"),
    ("\\boxed\\frac{\\sqrt{5}}{2}", "\\frac{\\sqrt5}{2}"),
    ("\\boxed\\sqrt[3]{8}", "2"),  # was read as the box "\\sqrt" before "[3]{8}"
    # A tower of powers is right-associative (these were read as (2^3)^2 = 64).
    ("2**3**2", "512"),
    ("2^3^2", "512"),
    ("\\boxed{2^3^2}", "512"),
    ("2^{3}^{2}", "2^{3^{2}}"),
    ("2**(1/2)**2", "2**(1/4)"),
    # A self-correction after a marked answer revises it: the last correction naming a number is
    # the answer (the first marked value scored 1, the revised one 0).
    ("The answer is 5. Wait, no, it is 6.", "6"),
    ("The answer is 5. Actually, it is 6.", "6"),
    ("The answer is 5. Correction: the answer is 6.", "6"),
    ("The answer is 5. Wait, no, it is 6. Actually, it is 7.", "7"),
    ("The answer is 5, since 2 + 3 = 5. Wait, no: 2 + 4 = 6, so it is 6.", "6"),
    # A check after the answer is no correction.
    ("The answer is 5. Wait, let me verify: 2 + 3 = 5. Yes.", "5"),
    ("The answer is 5. Wait, that is right.", "5"),
    ("The answer is 5. No other value works.", "5"),
    ("The answer is B. Wait, I think that is right.", "B"),
    ("The answer is 5. Wait, it is 6.", "6"),
    ("The answer is 5. Wait, I made a mistake: 3 + 3 = 6.", "6"),
    ("The answer is 5.\n\nWait, let me reconsider. 3 + 3 = 6. So the answer is 6.", "6"),
    # A check that works something out leaves the answer (a correction was read as 10 or a hedge).
    ("The answer is 5. Wait, 2 * 5 = 10, so yes.", "5"),
    ("The answer is 5. Actually, 5 is the only value such that 2x = 10.", "5"),
    ("The answer is 18.\n\nWait, let me verify: 16 - 3 - 4 = 9 and 9 * 2 = 18. Yes.", "18"),
    ("The answer is B. Wait, let me check: option B has 4 sides.", "B"),
    # A concluding sentence that names one value is the answer: working before it is no hedge
    # (these scored 0).
    ("Janet sells 16-3-4=9 eggs, 9*2=18. Therefore, Janet makes $18 every day.", "18"),
    ("First 5 + 6 = 11.\nThus the total is 11.", "11"),
    ("There are 5 red and 6 blue. So she has 5 + 6 = 11 balls.", "11"),
    ("There are 5 red and 6 blue. Therefore, $x = \\frac{1}{2}$.", "1/2"),
    # A boxed word answer is the word (these scored 0).
    ("\\boxed{Yes}", "Yes"),
    ("The answer is \\boxed{\\text{No}}.", "No"),
    ("\\boxed{\\boxed{even}}", "Even"),
    # A mixed number in plain text (read as the two numbers 3 and 1/2 side by side: scored 0).
    ("3 1/2", "3.5"),
    ("The answer is 3 1/2 cups.", "7/2"),
    ("-2 3/4", "-2.75"),
    ("The answer is 5. Hmm, no: 6.", "6"),
    # A negation of another number, or a check after the answer, keeps it.
    ("x \u2260 5", "x \\neq 5"),
    ("It is not less than 5, so it is 5.", "5"),
    ("The answer is 5 since it is not even.", "5"),
    ("The answer is 5. Wait, that is right.", "5"),
    ("The answer is 5. Hmm, no, I think it is right.", "5"),
    ("The answer is 5. Wait, no. Actually it is 6.", "6"),
    ("\\boxed{5}. Wait, let me check: 2 + 3 = 5. Yes.", "5"),
    ("The answer is 5. Alternatively, 2 + 3 = 5.", "5"),  # working, not another answer
    ("The answer is 5. Alternatively, we get 5 by counting.", "5"),
    ("The answer is \\frac{1}{2}. Alternatively, 0.5.", "0.5"),
    ("The answer is B. Maybe I am wrong.", "B"),
    ("Wait, no. \\boxed{5}", "5"),
    # Letters listed in \\text are a list (read as one symbol "a,c": these scored 0).
    ("\\boxed{A, C}", "\\text{A, C}"),
    ("\\boxed{C, A}", "\\text{A, C}"),
    # What an answer phrase names is read whole, LaTeX and all (math-verify's pattern read 2 here).
    ("The answer is 2\\sqrt{2}.", "2\\sqrt{2}"),
    ("The answer is 2^{10}.", "1024"),
    ("Answer: 10^{-3}", "0.001"),
    # Unicode math math-verify does not read (these scored 0).
    ("√2", "\\sqrt{2}"),
    ("3√2", "\\sqrt{18}"),
    ("The answer is 2√2.", "2\\sqrt{2}"),
    ("x²+2x+1", "(x+1)^2"),
    ("10⁻³", "0.001"),
    ("1½", "1.5"),
    ("(-∞, 3]", "(-\\infty, 3]"),
    # Unicode forms of numbers, as numeric_match reads them (these scored 0): an en dash as a
    # leading minus, full-width forms, thin and no-break spaces between thousands groups.
    ("\u20135", "-5"),
    ("The answer is \u20135.", "-5"),
    ("\\boxed{\u20135}", "-5"),
    ("\uff0d\uff15", "-5"),
    ("\uff11\uff12\uff0e\uff15", "12.5"),
    ("1\u2009000\u2009000", "1000000"),
    ("1\u202f000\u202f000", "1000000"),
    ("1\u00a0000", "1000"),
    ("The answer is 1\u202f000.", "1000"),
    # Inline math in prose that starts with a number is one value, not also the dollars "$2"
    # (read as two values, a hedge: these scored 0).
    ("So the area is $3\\pi$.", "3\\pi"),
    ("We get $2\\sqrt{2}$", "2\\sqrt{2}"),
    # So is LaTeX written in prose without delimiters (read as its leading number).
    ("We get 2\\sqrt{2}", "2\\sqrt{2}"),
    ("The area is 25\\pi cm^2.", "25\\pi"),
    ("It equals 2^{10}.", "1024"),
    ("The area is 5 m^2.", "5"),  # a unit's power is no math of its own
    # An exclamation mark ending a sentence of prose is no factorial (these read 18! and scored 0).
    ("The answer is 18!", "18"),
    ("Answer: 18!", "18"),
    ("The answer is 18!!", "18"),
    ("The answer is 18! Check: 18 * 2 = 36", "18"),
    ("She makes 9 * 2 = 18 dollars!\nThe answer is 18!", "18"),
    # A factorial in math stays one.
    ("5!", "120"),
    ("The answer is $5!$.", "120"),
    ("The answer is 5! = 120.", "120"),
    # A factorial in prose is its value, not its operand beside the answer (these read 3 and 6,
    # a hedge, and scored 0).
    ("3! ways, so 6", "6"),
    ("There are 3! ways, so 6.", "6"),
    ("There are 3!, so 6 ways.", "6"),
    ("We count 4! orders, so 24 in all.", "24"),
    # n!! is the double factorial n(n-2)(n-4)..., not (n!)! as math-verify reads it (3!! read 720).
    ("3!!", "3"),
    ("5!!", "15"),
    ("6!!", "48"),
    ("0!!", "1"),
    ("(5)!!", "15"),
    ("\\boxed{7!!}", "105"),
    ("$5!!$", "15"),
    ("18!!", "185794560"),
    ("\\boxed{20!!}", "3715891200"),
    ("\\frac{8!!}{4!!}", "48"),
    # A double factorial of an expression is compared with another as math-verify reads both.
    ("\\boxed{(2n-1)!!}", "(2n - 1)!!"),
    ("n!! + 1", "1 + n!!"),
    ("Wow!! The answer is 5!", "5"),
    # A value ruled out right after the answer is no second answer (these were read as a hedge
    # between the two values and scored 0).
    ("The answer is 5, not 6", "5"),
    ("So the answer is 5, not 6.", "5"),
    ("6, not 5", "6"),
    ("The answer is $5$, not $6$.", "5"),
    ("The answer is \\frac{1}{2}, not 2.", "1/2"),
    ("x = 5, and not 6", "5"),
    ("There are 5 red and 6 blue. So 6, not 5.", "6"),
    # A remark that doubts the answer, or says something else of it, is no retraction; a new
    # answer after a retraction is the answer.
    ("The answer is 5, which is not wrong.", "5"),
    ("The answer is 5, which is correct.", "5"),
    ("The answer is 5, which is probably wrong.", "5"),
    ("The answer is 5, which is wrong for n = 1 only.", "5"),
    ("The answer is 5, since 2 + 2 = 5, which is wrong.", "5"),
    ("The answer is 42, which is wrong. The answer is 43.", "43"),
    ("The answer is 42, which is wrong. It is 43.", "43"),
    ("First I got 7, which is wrong. So she has 8 apples.", "8"),
    # An exact value with its rounding names both ("\\pi \\approx 3.14" scored 0 against 3.14);
    # math-verify reads the exact side.
    ("\\pi \\approx 3.14", "3.14"),
    ("\\pi \\approx 3.14", "\\pi"),
    ("\\frac{1}{3} \\approx 0.333", "1/3"),
    ("\\frac{1}{3} \\approx 0.333", "0.333"),
    ("\\frac{2}{3} \\approx 0.66", "2/3"),  # cut, not rounded: within one unit of its last digit
    ("x = \\frac{1}{3} \\approx 0.33", "0.33"),
    ("The answer is \\sqrt{2} \u2248 1.414.", "1.414"),
    ("x \\approx 3.14", "3.14"),
    # A whole answer that is a number in words is that number (these compared as text: scored 0).
    ("forty-two", "42"),
    ("Seven", "7"),
    ("The answer is seven.", "7"),
    ("**Answer:** one hundred and five", "105"),
    ("\\boxed{\\text{twelve}}", "12"),
    ("\\boxed{seven}", "7"),
    ("7", "seven"),
]

NOT_EQUAL = [
    ("7", "8"),
    ("", "5"),
    ("   ", "5"),
    ("asdf qwer", "5"),
    ("}{", "5"),
    ("0.5", "\\frac{1}{3}"),
    ("(1,2]", "[1,2)"),  # open/closed ends differ
    ("(1, 2)", "2"),  # an interval is not its right end
    ("[1, 2]", "1"),
    ("1,2", "1.2"),  # a comma here separates elements, not decimals
    ("\\{1,2\\}", "\\{1,2,3\\}"),
    ("0.3333", "\\frac{1}{3}"),  # within 6-digit rounding it differs
    ("1e3", "3e"),
    ("1 234", "235"),  # not the mixed number 1 + 234
    ("\\log_2 8", "4"),
    ("\\fbox{7}", "8"),
    ("No", "Yes"),
    ("yes", "5"),
    ("5", "yes"),
    ("x \\le 3", "(-\\infty, 3)"),
    ("x < 4", "(-\\infty, 3)"),
    ("x < 3", "y < 3"),  # two inequalities compare as written, not as sets
    ("The answer is B.", "C"),
    ("The answer is not B", "B"),
    ("The final answer is no.", "Yes"),
    ("\\boxed5 6", "6"),
    ("\\boxed5 6", "11"),
    ("The answer is B, because 2 is even.", "2"),
    ("The answer is 5, which is not divisible by 2.", "2"),
    ("The answer is B. Note that 2 is even.", "2"),
    ("The answer is B.\nOption B has 12 apples.", "12"),
    # An answer that rules a value out names no answer.
    ("not 5", "5"),
    ("The answer is not 5.", "5"),
    ("**Answer:** not $5$", "5"),
    # So does a negated statement of the only number (these scored 1).
    ("It is not 5.", "5"),
    ("The answer isn't 5.", "5"),
    ("It cannot be 5.", "5"),
    ("It is not equal to $5$.", "5"),
    ("The answer \u2260 5", "5"),
    ("5 is not the answer.", "5"),
    ("2 and 3", "3"),
    # Against a gold of several values, a list must name exactly them.
    ("The roots are 2, 3 and 4.", "2, 3"),
    ("The roots are 2 and 3.", "2, 3, 4"),
    ("The roots are 1 and 1.", "-1, 1"),
    ("The roots are 2 and 3.", "(2, 3)"),  # an interval, not a set
    ("\\boxed{2} and \\boxed{3}", "2"),  # still a hedge against one value
    ("\\boxed{2} and \\boxed{3}", "2, 3, 4"),
    ("\\boxed{2}, \\boxed{3}, \\boxed{4}", "2, 3"),
    ("\\boxed{2} and \\boxed{2}", "2, 3"),
    ("\\boxed{2} and \\boxed{y}", "2, 3"),
    ("\\boxed{2}. Wait, no: \\boxed{3}", "2, 3"),
    ("The answer is 2 and 3. Wait, no.", "2, 3"),
    ("2. Wait, no, 3", "2, 3"),
    ("The roots are not 2 and 3.", "2, 3"),  # ruled out (these scored 1 after b4f63b0)
    ("not 2, 3", "2, 3"),
    ("It cannot be 2 or 3.", "2, 3"),
    ("The roots are 2\\sqrt{2} and 3.", "2, 3"),  # read as 2 and 3 (scored 1 after b4f63b0)
    # Working is no list (these scored 1 after b4f63b0).
    ("The solutions are x = 2 and x = 2, so the sum is 3.", "2, 3"),
    ("Try 2: no. Try 3: yes.", "2, 3"),
    # A later sentence marking or offering other values hedges a list too.
    ("The answer is 2 and 3. The answer is 4 and 5.", "2, 3"),
    ("The answer is 2 and 3. Alternatively, 4.", "2, 3"),
    ("Answer: 2 and 3\nAnswer: 4", "2, 3"),
    # Quoted as code, the answer is still the one named (the quotes hid it: these scored 1).
    ("The value of `n` is 4, so the answer is `5`.", "4"),
    ("The answer is `not 5`.", "5"),
    ("```python\nprint(5)\n```\nThe answer is 6.", "5"),
    ("x = 5 since 2x = 10", "10"),
    ("B, because 2 is even", "2"),
    ("\\frac{-1 + \\sqrt{5}}{2}", "\\frac{-1 \\pm \\sqrt{5}}{2}"),  # one of the two values
    ("2", "\\frac{1 \\pm 2}{2}"),  # the gold was read as its denominator
    ("Option A", "B"),
    ("Option B", "Option A"),
    ("The answer is 5. Wait, 2 * 5 = 10, so yes.", "10"),
    # A wrong answer was read as its leading number (these scored 1).
    ("The answer is 2\\sqrt{2}.", "2"),
    ("The answer is 3\\pi.", "3"),
    ("The answer is 2x.", "2"),
    ("Answer: 10^{-3}", "10"),
    ("√12", "2"),
    ("The area is $3\\pi$.", "3"),
    # A wrong answer was read as its leading number (these scored 1).
    ("We get 2\\sqrt{2}", "2"),
    ("The area is 25\\pi cm^2.", "25"),
    ("It equals 2^{10}.", "2"),
    ("x¹²", "x^{1}"),
    ("Janet sells 16-3-4=9 eggs, 9*2=18. Therefore, Janet makes $18 every day.", "9"),
    ("\\boxed{yes}", "No"),
    ("3 1/2", "3"),
    ("3 4/2", "5"),  # no mixed number
    ("\\boxed{A}", "\\text{A, C}"),
    ("\\boxed{A, B, C}", "\\text{A, C}"),
    ("\\boxed{\\text{7 apples}}", "8"),
    ("\\boxed\\frac12 + 1", "1/2"),  # the whole expression was boxed
    ("2**3**2", "64"),
    ("2^3^2", "64"),
    ("The answer is B. Option A has 5 sides.", "A"),
    ("The answer is 18!", "6402373705728000"),  # an exclamation, not 18!
    ("3! ways, so 6", "3"),
    ("3! ways, so 6", "720"),
    ("There are 3!, so 6 ways.", "3"),
    ("3!!", "720"),
    ("3\u20135", "-5"),  # a range, no minus
    ("3\u20135", "-2"),
    ("3\u20135", "3"),
    ("3 \u20135", "-5"),
    ("1\u2009234", "1235"),
    ("5!!", "(5!)!"),
    # Nor is n!! (n!)!, though math-verify reads it so (these were credited).
    ("n!!", "(n!)!"),
    ("(2n-1)!!", "((2n-1)!)!"),
    ("\\boxed{((2n-1)!)!}", "(2n-1)!!"),
    ("x!! + 1", "(x!)! + 1"),
    ("The answer is 5, not 6", "6"),
    ("The answer is 5, not -5.", "-5"),
    ("\\pi \\approx 3.14", "3.15"),
    ("seven", "8"),
    ("seven apples", "7"),
    ("The answer is not seven.", "7"),
]

# Two or more different values in one answer hedge: none of them gets credit.
HEDGED = [
    ("5 or 6", "6"),
    ("5 or 6", "5"),
    ("The answer is 5 or 6", "6"),
    ("The answer is 5. The answer is 6.", "6"),
    ("6, not 5", "5"),
    ("x=5 or x=6", "6"),
    ("5 = 6", "6"),
    ("x = 5 = 6", "6"),
    ("5 \\lor 6", "6"),
    ("5|6", "5"),
    ("5\\\\6", "5"),
    ("5 6", "11"),
    ("5\n6", "11"),
    ("5\\quad 6", "11"),
    ("\\boxed{5}. No: \\boxed{6}", "6"),
    ("$5$ $6$", "6"),
    # Already rejected before: a list is a set, not one of its elements.
    ("5, 6", "6"),
    ("$5$ or $6$", "6"),
    # A box holding a hedge hedges as the same answer unboxed does.
    ("\\boxed{5 \\lor 6}", "6"),
    ("\\boxed{5 6}", "11"),
    ("\\boxed{x = 5 = 6}", "6"),
    ("\\fbox{5} or \\fbox{6}", "5"),
    ("5. 6.", "6"),
    ("Yes or no", "Yes"),
    ("The answer is 6. The answer is 5.", "5"),
    ("The answer is 5. Then x = 7 and the answer is 7", "5"),
    ("The answer is A. The answer is B.", "B"),
    ("The answer is A or B", "A"),
    ("\\boxed{5} or \\boxed 6", "5"),
    ("The answer is \\fbox5. No: \\fbox6", "5"),  # the phrase's "\\fbox5" undid the hedge
    ("The answer is \\fbox5. Actually \\fbox6.", "5"),
    ("\\boxed5 or \\boxed6", "6"),
    ("The answer is 5 or 6.", "5"),
    ("The answer is 5 or 6.", "6"),
    ("The roots are 2 and 3.", "2"),  # still a hedge against a gold of one value
    ("The answer is 2 or 3.", "2"),
    ("The answer is 5 or 6, since 2 + 3 = 5.", "5"),
    ("The answer is 5 as well as 6.", "5"),
    ("The answer is 5 or 6, which is odd.", "5"),
    # A sentence offering an alternative answer after a marked one hedges (these scored 1).
    ("The answer is 5. Alternatively, 6.", "5"),
    ("The answer is 5. Or maybe it is 6.", "5"),
    ("The answer is 5. Maybe 6.", "5"),
    ("The answer is B. Alternatively, C.", "B"),
    ("The answer is 5 since 2 + 3 = 5. The answer is 6.", "6"),
    ("The answer is 5 because the answer is 6.", "5"),
    ("The answer is B, because the answer is C.", "B"),
    # An answer phrase naming one of two boxes does not undo the hedge.
    ("The answer is \\boxed{5}. No: \\boxed{6}", "5"),
    ("The answer is \\boxed{5}. Actually \\boxed{6}.", "5"),
    # A logical or names both sides (math-verify alone reads "x = 2 \\lor x = 3" as 3).
    ("x = 2 \\lor x = 3", "3"),
    ("\\boxed{x = 2 \\vee x = 3}", "3"),
    # Equations side by side are a list (math-verify alone reads the chain x = 2x = 3).
    ("x = 2 \\quad x = 3", "3"),
    ("x = 2 \\\\ x = 3", "3"),
    ("a = 1 \\quad b = 2", "2"),
    ("\\boxed{5.} Then \\boxed{6.}", "5"),
    ("`5` or `6`", "5"),
    ("The answer is `5` or `6`.", "6"),
    ("`5`, not `6`", "6"),
    ("**5** or **6**", "5"),
    ("**5**, not **6**", "6"),
    ("*5* or *6*", "5"),
    ("5~or~6", "5"),
    ("7, since 3 + 4 = 7. Actually 8.", "7"),
    ("5 or 6, since 2 + 3 = 5", "5"),
    ("5 because the answer is 6", "5"),  # the reason's answer is read (scored 1 after 82dd079)
    ("5, since \\boxed{6}", "5"),
    ("\\boxed{5} \\boxed{6} \\boxed{}", "5"),
    ("Option A or option B", "A"),
    ("\\boxed{\\text{2 or 3}}", "2"),
    ("\\boxed\\sqrt{2} or \\boxed\\sqrt{3}", "\\sqrt{3}"),
    ("√2 or √3", "\\sqrt{3}"),
    ("We get $2\\sqrt{2}$ or $3$", "3"),
    ("It costs $5 or $6.", "5"),
    # A corrected answer gets no credit; nor does a correction that settles on no single value.
    ("The answer is 5. Wait, no, it is 6.", "5"),
    ("The answer is 5. Correction: the answer is 6.", "5"),
    ("The answer is 5. Wait, no, it is 6. Actually, it is 7.", "6"),
    ("The answer is 5. Wait, no: 5 or 6?", "5"),
    ("The answer is 5. Wait, it is 6.", "5"),
    ("The answer is 5. Wait, I made a mistake: 3 + 3 = 6.", "5"),
    ("The answer is B. Wait, it is C.", "B"),
    ("The answer is B. Wait, no, it is C.", "B"),
    ("The answer is 5. Hmm, no: 6.", "5"),
    # A correction that takes the answer back and names nothing leaves no answer (these scored 1).
    ("The answer is 5. Wait, no.", "5"),
    ("The answer is 5. Hmm, no, that is wrong.", "5"),
    ("The answer is 5. Actually, I made a mistake.", "5"),
    ("The answer is 5. Wait, no, that's not right.", "5"),
    ("The answer is 5. Wait, that is not correct.", "5"),
    ("The answer is B. Wait, no.", "B"),
    ("The answer is 5. Wait, no, it is 6. Hmm, no.", "6"),
    ("The answer is \\boxed{5}. Wait, no.", "5"),
    ("\\boxed{B}. Hmm, no, that is wrong.", "B"),
    # So does a remark right after the answer that calls it wrong (these scored 1).
    ("The answer is 42, which is wrong", "42"),
    ("The answer is 42, which is wrong.", "42"),
    ("The answer is 42, but that's incorrect.", "42"),
    ("The answer is 42, but it is not right.", "42"),
    ("42, which is incorrect", "42"),
    ("\\boxed{42}, which is wrong.", "42"),
    ("So it is 42, which is wrong.", "42"),
    ("The answer is B, which is wrong.", "B"),
    ("The roots are 2 and 3, which is wrong.", "2, 3"),
    ("The answer is 42, which is wrong. 2 + 2 = 4.", "4"),  # working, not another answer
    # A rounding that is none of the exact value names two values, as "5 = 6" does (42 scored 1).
    ("42 \u2248 41", "42"),
    ("42 \u2248 41", "41"),
    ("42 \\approx 41", "42"),
    ("The answer is 42 \u2248 41.", "42"),
    ("\\boxed{42 \\approx 41}", "42"),
    ("\\frac{1}{3} \\approx 0.5", "1/3"),
    # A number in words next to another number, in words or digits, is no answer of its own.
    ("seven or eight", "7"),
    ("The answer is seven. Wait, no, it is eight.", "7"),
    ("The answer is seven. Alternatively, eight.", "7"),
    ("\\boxed{seven} or \\boxed{eight}", "7"),
    ("\\boxed{Yes} or \\boxed{No}", "Yes"),
    ("She has 3 + 4 = 7 apples. So it is 18 or 19.", "18"),
    ("She has 3 + 4 = 7 apples. So it is 18 or 19.", "19"),
    ("There are 5 red and 6 blue. In total, 11 balls. Check: 11 - 5 = 6.", "11"),  # not the last
]


@pytest.fixture(scope="module")
def thread_verifier():
  with MathVerifier(MathVerifyConfig(backend="thread", max_workers=2)) as v:
    yield v


@pytest.fixture(scope="module")
def process_verifier():
  with MathVerifier(MathVerifyConfig(backend="process", max_workers=2)) as v:
    yield v


@pytest.mark.parametrize("prediction,gold", EQUAL)
def test_equal_cases(thread_verifier, prediction, gold):
  assert thread_verifier.equal(prediction, gold)


@pytest.mark.parametrize("prediction,gold", NOT_EQUAL)
def test_not_equal_cases(thread_verifier, prediction, gold):
  assert not thread_verifier.equal(prediction, gold)


@pytest.mark.parametrize("prediction,gold", HEDGED)
def test_hedged_answers_get_no_credit(thread_verifier, prediction, gold):
  assert not thread_verifier.equal(prediction, gold)


def test_many_answer_phrases_in_one_sentence_cost_linear_time(thread_verifier):
  # Each phrase's reason holds the next phrase; reading them one inside another took quadratic
  # time (and past about 1000 phrases raised RecursionError, scored 0).
  text = "The answer is B " + "because the answer is B " * 1500
  start = time.monotonic()
  assert thread_verifier.equal(text, "B", timeout_s=30.0)
  assert time.monotonic() - start < 3.0


@pytest.mark.parametrize("text", [
    "The answer is" + " " * 20000 + "B",  # a pattern starting with spaces, tried at each of them
    "The answer is " + "as is " * 4000 + "5",  # a reason after "is" names nothing: each looked back
    " __a" * 20000,  # markdown emphasis never closed: each opening looked to the end of the line
    " __a_" * 20000,
    "The answer is 5. Wait, the answer is 6. " * 1000,  # corrections of corrections
    "The answer is 5. Wait, 1" * 2000,
    "The answer is 5. " + "Maybe it is 5 apples. " * 2000,  # alternatives, each read once
    "It is not" + " " * 20000 + "x 5",  # a negation's spaces, each tried against the rest
    "The roots are " + "2 and 3 " * 3000,  # a list read against a gold of several values
    "The answer is 5, which is wrong. " * 2000,  # retractions, not read one after another
    "\\boxed{5}, which is wrong. " * 2000,
])
def test_degenerate_responses_cost_linear_time(thread_verifier, text):
  # Each is read in under 0.7 s on a quiet 2-core machine (2.5 s once with the host loaded four
  # times over); the quadratic readings these cases caught took from 14 s to minutes.
  for gold in ("5", "2, 3"):
    start = time.monotonic()
    thread_verifier.equal(text, gold, timeout_s=60.0)
    assert time.monotonic() - start < 6.0


@pytest.mark.parametrize("text", ["x" + " " * 5000 + "= 5", "2^" + " " * 5000 + "{2} + 1", "5" + "\n" * 5000])
def test_a_long_run_of_white_space_costs_linear_time(thread_verifier, text):
  # A degenerate response padded with white space: math-verify's reading of a bare answer took
  # quadratic time in the run (about 6 s here, 100 s at 20000 spaces).
  start = time.monotonic()
  assert thread_verifier.equal(text, "5", timeout_s=60.0)
  assert time.monotonic() - start < 1.0


def test_nested_boxes_cost_polynomial_time(thread_verifier):
  # A response stuck repeating "\\boxed{": each box's hedge check read every box nested in it,
  # at every level (2^depth reads; depth 20 ran past a minute).
  for word, gold in (("yes", "Yes"), ("5", "5")):
    text = "\\boxed{" * 30 + word + "}" * 30
    start = time.monotonic()
    assert thread_verifier.equal(text, gold, timeout_s=5.0)
    assert time.monotonic() - start < 2.0


def test_a_huge_number_is_no_mixed_number():
  # Read as a mixed number, its whole part went through int(), which refuses 5000 digits.
  text = "1" * 5000 + " 1/2"
  assert _math_text._normalize_numbers(text) == text


def _reference_answer_tails(text):
  """What each answer phrase names, read with one regex per phrase (quadratic in the worst case)."""
  tails = set()
  phrase = r"\banswer\b(?:\*\*)?\s*(?:is\b\s*:?|:)\s*(?:\*\*)?\s*(.+?)\s*(?:\*\*)?\s*(?:\.(?=\s|$)|\n|$)"
  for m in re.finditer(phrase, text, re.IGNORECASE):
    tail = m.group(1)
    cut = _math_compare._reason_start(tail, 0, len(tail))
    tails.add(" ".join(tail[:cut].split()))
    tails |= _reference_answer_tails(tail[cut:])
  return tails


def test_answer_tails_match_a_reference():
  pieces = ["answer", "Answer", " is ", ":", "**", " ", "\n", ".", ". ", "B", "5", "because",
            " as ", "since", ",", "x", "the ", "is"]
  rng = random.Random(0)
  named = lambda tails: {t for t in tails if re.search("[A-Za-z0-9]", t)}  # noqa: E731
  for _ in range(3000):
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 14)))
    assert named(_math_compare._answer_tails(text)) == named(_reference_answer_tails(text)), text


def _reference_words(n):
  """English words for 0 <= n < 10**6, written the other way round from `_spelled_number`."""
  units = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
           "fifteen sixteen seventeen eighteen nineteen").split()
  tens = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()

  def below_thousand(k):
    words = [units[k // 100], "hundred"] if k >= 100 else []
    k %= 100
    if k >= 20:
      words.append(tens[k // 10] + ("-" + units[k % 10] if k % 10 else ""))
    elif k or not words:
      words.append(units[k])
    return words

  if n < 1000:
    return " ".join(below_thousand(n))
  rest = below_thousand(n % 1000) if n % 1000 else []
  return " ".join(below_thousand(n // 1000) + ["thousand"] + rest)


def test_spelled_numbers_match_a_reference():
  rng = random.Random(0)
  for n in list(range(1000)) + [rng.randrange(1000, 10**6) for _ in range(2000)]:
    words = _reference_words(n)
    assert _math_text._spelled_number(words) == n, words
    assert _math_text._spelled_number(words.replace("-", " ")) == n, words
  for words in ("seven or eight", "seven seven", "twenty thirty", "hundred", "seventh", "forty-twelve",
                "one hundred and", "three thousand two million", "zero zero", "five hundred hundred"):
    assert _math_text._spelled_number(words) is None, words


def test_an_unbraced_box_reads_a_command_name_whole():
  # "\\boxed\\frac12" was read as the box "\\fra" before a "c12".
  for text in ("\\boxed\\frac12", "\\boxed\\frac{1}{2}", "\\boxed\\sqrt2", "\\boxed \\dfrac{3}{4}",
               "\\boxed\\sqrt[3]{8}"):
    assert _math_text._UNBRACED_BOX.search(text) is None, text
  assert _math_text._UNBRACED_BOX.search("\\boxed\\pi").group(1) == "\\pi"


def test_only_the_prediction_is_checked_for_hedging(thread_verifier):
  # A reference answer is trusted: prose with several numbers still reads as math-verify reads it.
  assert thread_verifier.equal("6", "Of the 5 options, the answer is 6")
  # A list answer still matches a list gold.
  assert thread_verifier.equal("$5$ or $6$", "\\{5, 6\\}")
  assert thread_verifier.equal("x=5, y=6", "x=5, y=6")


def test_process_backend_agrees_with_thread_backend(thread_verifier, process_verifier):
  for prediction, gold in EQUAL[:8] + NOT_EQUAL[:8]:
    assert process_verifier.equal(prediction, gold) == thread_verifier.equal(prediction, gold), (prediction, gold)


def test_math_equal_default_verifier():
  assert math_equal("0.5", "\\frac{1}{2}")
  assert math_equal("\\boxed{1,000}", "1000")
  assert not math_equal("41", "42")
  assert math_verifier.default_verifier().config.backend == "process"
  with pytest.raises(TypeError, match="compares strings"):
    math_equal(0.5, "0.5")


def test_process_backend_kills_a_real_hang_within_the_limit(process_verifier):
  # sympy expands (x+1)^5000 to compare it, for minutes (a power of literal numbers such as
  # 9^{9^{9}}, which it evaluates in C without releasing the GIL, is refused before it starts:
  # see the next test). A process can be stopped however it hangs.
  process_verifier.equal("1", "1")  # make sure a worker is started; startup is not timed
  before = process_verifier.stats()
  start = time.monotonic()
  assert not process_verifier.equal("(x+1)^{5000}", "5", timeout_s=1.0)
  elapsed = time.monotonic() - start
  assert elapsed < 2.5, elapsed
  after = process_verifier.stats()
  assert after["timeouts"] == before["timeouts"] + 1
  assert after["restarts"] == before["restarts"] + 1
  # The replacement worker answers normally.
  assert process_verifier.equal("2", "2.0", timeout_s=30.0)


@pytest.mark.parametrize("text", [
    "(" * 2000, "[" * 2000, "(1" * 1000, "{" * 300 + "5" + "}" * 300,
    "\\frac{" * 100 + "1" + "}{2}" * 100,  # nesting: seconds to minutes in the LaTeX parser
    "2^3^4^5", "9^{9^{9}}", "2**3**4**5", "10^{10^{7}}", "9" * 3000 + "^" + "9" * 3000,  # powers
    "\\boxed{1000000!}", "1000000!", "(1000000)!",  # factorials
    "(18!)!", "18!!!", "\\boxed{(20!)!}",  # a factorial of a factorial
    "(18!!)!", "1001!!",  # a factorial of a double factorial, a double factorial too large to write
    # A factorial of a large power or product (each ran to the time limit).
    "(10^{6})!", "(10**6)!", "{10^6}!", "(1e6)!", "\\left(10^{6}\\right)!", "(2^{20})!", "10^6!",
    "1\\,000\\,000!", "(1000 \\cdot 1000)!", "10^{10^{10}}", "2^{2^{100}}",
    # A factorial of a large absolute value, floor, binomial, spaced fraction or power of e.
    "|10^7|!", "\\lfloor 10^7/2 \\rfloor!", "{100 \\choose 50}!", "\\frac{10^{7}}{2}\\,!", "e^{100}!",
    "((18)!)!", "(\\frac{36}{2}!)!",  # a factorial of a factorial of arithmetic
    "\\Gamma(10^7)", "\\Gamma\\left(10^{7}\\right)",  # the gamma function
    "\\exp(10)!", "\\Gamma(\\Gamma(10))",  # a factorial of an exponential, a gamma of a gamma
    "\\left\\{10^6\\right\\}!", "\\{10^6\\}!",  # an escaped brace groups as a bracket does
    "((4!)!)!",  # three factorials
])
def test_pathological_input_is_refused_quickly(process_verifier, text):
  # Each took seconds to minutes inside math-verify (a timeout, or a worker killed).
  process_verifier.equal("1", "1")  # make sure a worker is started; startup is not timed
  before = process_verifier.stats()
  start = time.monotonic()
  assert not process_verifier.equal(text, "5", timeout_s=3.0)
  assert time.monotonic() - start < 1.0
  assert process_verifier.stats()["timeouts"] == before["timeouts"]


@pytest.mark.parametrize("text,costly", [
    ("e^{10^{7}}", True), ("\\pi^{10^{7}}", True), ("2e^{10^7}", True), ("x = e^{10^{7}}", True), ("e**10**7", True),
    ("e^{300000}", True), ("e^{100000}", False), ("e^2", False), ("\\pi^{2}", False), ("e^{x}", False),
    ("we^{10^7}", False),
    # An exponent that is a group of arithmetic, and an exponential.
    ("\\exp(10^{7})", True), ("\\exp\\left(10^{7}\\right)", True), ("\\exp{10^7}", True), ("e^{e^{e^{e}}}", True),
    ("e^{-10^{7}}", True), ("2^{3 \\cdot 10^6}", True), ("\\exp(-10^{400})", True), ("\\exp(2)", False),
    ("\\exp\\left(2\\right)", False), ("\\exp(\\frac{1}{2})", False), ("e^{e}", False), ("e^{e^{e}}", False),
    ("\\exp(200000)", False), ("e^{i\\pi}", False), ("2^{-100}", False), ("\\exp(x)", False),
    ("\\exp\\left\\{10^7\\right\\}", True), ("\\exp\\{10^7\\}", True), ("\\exp\\{2\\}", False),
    ("\\exp(\\exp(\\exp(e)))", True), ("\\exp 10^7", True), ("x\\exp(10^7)", True), ("\\exp(\\exp(2))", False),
    ("\\exp 2", False), ("2\\exp(3)", False),
])
def test_the_cost_guard_reads_powers_of_e_and_pi(text, costly):
  # Against a decimal gold ("0.25") math-verify evaluates e^{10^{7}}, \\exp(10^{7}) and
  # e^{e^{e^{e}}} (e^{3814279}) to round them: past the time limit. The guard read a power of a
  # number only, with numbers for exponents.
  assert _math_text._too_costly(text) is costly


@pytest.mark.parametrize("text", ["e^{10^{7}}", "\\pi^{10^{7}}", "\\exp(10^{7})", "e^{e^{e^{e}}}", "\\exp 10^7"])
def test_a_large_power_of_e_is_refused_quickly(process_verifier, text):
  process_verifier.equal("1", "1")  # make sure a worker is started; startup is not timed
  before = process_verifier.stats()
  start = time.monotonic()
  assert not process_verifier.equal(text, "0.25", timeout_s=3.0)
  assert time.monotonic() - start < 0.5
  assert process_verifier.stats()["timeouts"] == before["timeouts"]


def test_the_cost_guard_costs_linear_time():
  # CPU time of this process: the guard is single-threaded Python, and other processes on a
  # loaded machine (a wall-clock 1 s limit failed once for about 0.3 s of work) do not count.
  # Its power pattern tried each split of a run of spaces around an optional brace (3.4 s here).
  start = time.process_time()
  assert not _math_text._too_costly("2^" + " " * 20000 + "x")
  assert time.process_time() - start < 0.5


@pytest.mark.parametrize("text,costly", [
    ("(10^{6})!", True), ("(10**6)!", True), ("{10^6}!", True), ("(1e6)!", True),
    ("\\left(10^{6}\\right)!", True), ("(2^{20})!", True), ("10^{6}!", True), ("10^6!", True),
    ("\\boxed{(10^{6})!}", True), ("1\\,000\\,000!", True), ("1~000~000!", True),
    ("(1000 \\cdot 1000)!", True), ("(999999+1)!", True), ("10⁶!", True),
    ("(10^{400}-10^{399})!", True),  # a term past a float's range
    ("[10^6]!", True), ("\\left[10^{6}\\right]!", True), ("\\[ (10^6)! \\]", True), ("[2,3)!", False),
    ("\\left\\{10^6\\right\\}!", True), ("\\left\\{ \\frac{10^{7}}{2} \\right\\}!", True), ("(\\left\\{9\\right\\}!)!", True),
    ("\\left\\{5\\right\\}!", False), ("\\left\\{n\\right\\}!", False), ("\\left\\{1, 2\\right\\}", False),
    ("\\{10^6\\}!", True), ("\\{ 10^{6} \\}!", True), ("\\{5\\}!", False), ("\\{1, 2\\}!", False),
    ("(" + "1+" * 200 + "1)!", True),  # arithmetic too long to read
    ("5!", False), ("2^{10}", False), ("(2^{4})!", False), ("10^{5}!", False), ("(3)!", False),
    ("(2n)!", False), ("x^{10^6}!", False), ("\\frac{10!}{3!}", False), ("5! = 120", False),
    ("(1/0)!", False), ("1,000,000!", False),  # math-verify reads a set {1, 0, 0!}
    ("5!!", False), ("18!!", False), ("1000!!", False), ("1001!!", True), ("(18!!)!", True),
    ("18!!!", True),
])
def test_the_cost_guard_reads_a_factorial_of_arithmetic(text, costly):
  # math-verify reads "(10^{6})!" and "10^6!" as (10^6)!; the guard read only a factorial of a
  # plain number and let these through.
  assert _math_text._too_costly(text) is costly


@pytest.mark.parametrize("text,costly", [
    ("\\frac{10^7}{2}!", True), ("\\dfrac{10^7}{2}!", True), ("\\cfrac{10^{7}}{2} !", True),
    ("{\\frac{10^7}{2}}!", True), ("(\\frac{10^7}{2})!", True), ("\\frac{10^7}{2}!!", True),
    ("\\sqrt{10^{12}}!", True), ("\\sqrt[3]{10^{18}}!", True), ("\\binom{100}{50}!", True),
    ("\\dbinom{100}{50}!", True), ("\\binom{10^{400}}{2}!", True), ("2\\frac{10^7}{2}!", True),
    ("\\frac{6}{2}!", False), ("\\tfrac{6}{2}!", False), ("{\\frac{6}{2}}!", False), ("\\sqrt{9}!", False),
    ("\\sqrt[3]{27}!", False), ("\\binom{4}{2}!", False), ("\\sqrt{10^8}!", False),  # 10000! is read
    ("\\frac{n}{2}!", False), ("\\binom{n}{2}!", False), ("\\frac{1}{0}!", False), ("\\sqrt{-4}!", False),
    ("\\binom{5}{7}!", False), ("\\binom{5.5}{2}!", False), ("\\frac{10!}{3!}", False),
])
def test_the_cost_guard_reads_fractions_roots_and_binomials_in_a_factorial(text, costly):
  # A factorial of \frac{10^7}{2} (and of \binom{100}{50}) ran to the time limit: the guard read
  # no LaTeX command in the operand, and only the last group of one ("{2}"). \sqrt{10^8} was
  # refused as 10^8, not read as 10^4.
  assert _math_text._too_costly(text) is costly


@pytest.mark.parametrize("text,costly", [
    ("|10^7|!", True), ("\\left|10^7\\right|!", True), ("\\lvert 10^7 \\rvert!", True), ("\\vert 10^7 \\vert!", True),
    ("\\left\\vert -10^7 \\right\\vert!", True), ("||10^7|-|1||!", True), ("2|10^7|!", True),
    ("\\lfloor 10^7/2 \\rfloor!", True), ("\\lceil 10^7/2 \\rceil!", True),
    ("\\left\\lfloor \\frac{10^7}{2} \\right\\rfloor!", True), ("{100 \\choose 50}!", True),
    ("\\frac{{100 \\choose 50}}{2}!", True), ("\\tbinom{100}{50}!", True), ("\\left (10^6\\right)!", True),
    ("\\frac{10^{7}}{2}\\,!", True), ("(10^7)\\;!", True), ("(10^7)\\!!", True), ("(10^7)\\ !", True),
    ("(10^7)\\:!", True), ("1000000\\,!", True), ("e^{100}!", True), ("(e^{12})!", True), ("\\pi^{20}!", True),
    ("(2\\pi \\cdot 10^6)!", True), ("(10^3)(10^3)!", False), ("((10^3)(10^3))!", True),
    ("|{-5}|!", False), ("\\left|-3\\right|!", False), ("|a|!", False), ("|10^7-x|!", False),
    ("\\lfloor 7.5 \\rfloor!", False), ("\\lfloor n/2 \\rfloor!", False), ("{5 \\choose 2}!", False),
    ("{n \\choose k}!", False), ("\\frac{10}{2}\\,!", False), ("e!", False), ("\\pi!", False),
    ("(2e)!", False), ("(n+1)!", False), ("k!", False),
    ("|x| + |10^7|", False), ("(|10^7|!)!", True),
])
def test_the_cost_guard_reads_bars_floors_choose_spacing_and_constants_in_a_factorial(text, costly):
  # Each costly one ran to the time limit: the guard read no bar, floor, ceiling, \\choose,
  # spacing command before the "!" or power of e or \\pi as a factorial's operand.
  assert _math_text._too_costly(text) is costly


@pytest.mark.parametrize("text,costly", [
    ("((18)!)!", True), ("(|18|!)!", True), ("(\\frac{36}{2}!)!", True), ("(10^1)!!", True), ("(\\,(9)!\\,)!", True),
    ("\\left(|9|!\\right)!", True), ("|(9)!|!", True), ("(\\lfloor 9.5\\rfloor!)!", True), ("(8.5!)!", True),
    ("((8)!)!", False), ("(3!)!!", False), ("((3!)!)!", False), ("\\frac{10}{2}!!", False), ("(2n)!!", False),
    ("((2n)!)!", False), ("(n!)!", False), ("\\frac{1}{(9!)}!", False), ("(9)! \\cdot (9)!", False),
    # Three factorials and more: ((4!)!)! is 24!! (24! has 24 digits).
    ("((4!)!)!", True), ("(4!)!!", True), ("(((4)!)!)!", True), ("\\left(\\left(4!\\right)!\\right)!", True),
    ("(((\\frac{8}{2})!)!)!", True), ("(((3!)!)!)!", True), ("((2!)!)!", False), ("(((2n)!)!)!", False),
])
def test_the_cost_guard_reads_a_factorial_of_a_factorial_of_arithmetic(text, costly):
  # math-verify reads "((18)!)!" and "(10^1)!!" as (18!)! and (10!)!, each past the time limit:
  # the guard read such a factorial of a factorial only where its operand was a plain number.
  assert _math_text._too_costly(text) is costly


@pytest.mark.parametrize("text,costly", [
    ("e^{7}!", True), ("\\frac{10001}{3}!", True), ("(100\\pi)!", True), ("(1000\\sqrt{2})!", True),
    ("\\frac{201}{2}!", True), ("(10^{2}+0.5)!", True),
    ("e^{4}!", False), ("\\frac{199}{2}!", False), ("(\\frac{1}{2})!", False), ("(99.5)!", False),
    ("(0.1 \\cdot 3000)!", False), ("\\frac{3}{0.01}!", False), ("\\frac{10^6}{20}!", False),
    # An exponential is a power of e here too (e^{10}! is 22026.5!: 8 s against a decimal gold).
    ("\\exp(10)!", True), ("\\exp\\left(10\\right)!", True), ("(\\exp(10))!", True), ("\\exp(2)!", False),
    ("\\exp(x)!", False),
])
def test_the_cost_guard_refuses_a_large_factorial_of_no_whole_number(text, costly):
  # Against a decimal gold math-verify rounds e^{7}! (1096.6!) to as many digits as it has: 11 s.
  assert _math_text._too_costly(text) is costly


@pytest.mark.parametrize("text,costly", [
    ("\\Gamma(10^7)", True), ("\\Gamma\\left(10^7\\right)", True), ("\\Gamma{10^7}", True), ("\\Gamma (1000.5)", True),
    ("\\Gamma(1000000)", True), ("\\Gamma(5)", False), ("\\Gamma(\\frac{1}{2})", False), ("\\Gamma(n)", False),
    ("\\Gamma(10^5)", False), ("\\Gamma 10^7", False),  # math-verify reads the last as EulerGamma * 10^7
    # A gamma of a gamma (Gamma(362880), 1.9 s against a decimal gold), read as arithmetic of the inner one.
    ("\\Gamma(\\Gamma(10))", True), ("\\Gamma\\left(\\Gamma(10)\\right)", True), ("\\Gamma(3\\Gamma(9))", True),
    ("\\Gamma(\\Gamma(5))", False), ("\\Gamma(\\Gamma(\\frac{1}{2}))", False), ("\\Gamma(\\Gamma(-1))", False),
    ("\\Gamma(\\Gamma(n))", False), ("\\Gamma(\\Gamma)", False),
])
def test_the_cost_guard_reads_the_gamma_function(text, costly):
  # \\Gamma(x) is (x - 1)!: math-verify evaluates \\Gamma(10^7) past the time limit.
  assert _math_text._too_costly(text) is costly


@pytest.mark.parametrize("text,costly", [
    ("\\prod_{k=1}^{10^6} k", True), ("\\sum_{k=1}^{20000} \\frac{1}{k}", True), ("\\sum\\limits_{k=1}^{10^{6}} k", True),
    ("\\sum_{k = 0}^{5000} k", True), ("\\sum_{k=-10^6}^{0} k", True), ("\\sum_{i=1}^{10^{400}} i", True),
    ("\\sum_{k=1}^{5000} \\frac{1}{k}", False), ("\\prod_{k=1}^{5} k", False), ("\\sum_{k=1}^{100} k", False),
    ("\\sum_{k=1}^9 k", False), ("\\sum_{k=1}^{n} k", False), ("\\sum_{k=1}^{\\infty} \\frac{1}{k^2}", False),
    # Irrational summands cost more a term (200 of \\sqrt{k^3+1}: 3.7 s, 300 of \\sin{k}: 2.6 s).
    ("\\sum_{k=1}^{300} \\sqrt{k}", True), ("\\sum_{k=1}^{300} \\sin{k}", True), ("\\prod_{k=1}^{300} \\sqrt{k}", True),
    ("\\sum_{k=1}^{300} k^{1/2}", True), ("\\sum_{k=1}^{300} (k + \\sqrt{k})", True), ("\\sum_{k=1}^{300} -\\log k", True),
    ("\\sum_{k=1}^{300} k e^{k}", True), ("\\sum_{k=1}^{300} \\exp(k)", True), ("\\sum_{k=1}^{100} \\sqrt{k^3+1}", False), ("\\sum_{k=1}^{200} \\sqrt{k^3+1}", True),
    ("\\sum_{k=1}^{1000} k + \\sqrt{2}", False), ("\\left(\\sum_{k=1}^{300} k\\right)\\sqrt{2}", False),
    ("\\sum_{k=1}^{300} k^2", False), ("\\sum_{k=1}^{n} \\sqrt{k}", False),
    # A power written with \\frac (3,000 terms of k^{\\frac{1}{2}} ran to the time limit).
    ("\\sum_{k=1}^{300} k^{\\frac{1}{2}}", True), ("\\sum_{k=1}^{300} k^\\frac12", True),
    ("\\sum_{k=1}^{300} k^{-\\dfrac{3}{2}}", True), ("\\sum_{k=1}^{300} \\frac{k^2}{2}", False),
    # A sum in another's summand: the product of the counts (300 x 300 of 1/(i+j) ran to the limit).
    ("\\sum_{i=1}^{300}\\sum_{j=1}^{300} \\frac{1}{i+j}", True), ("\\sum_{i=1}^{3} \\sum_{j=1}^{300} ij", False),
    ("\\sum_{i=1}^{100} i + \\sum_{j=1}^{100} j", False), ("\\sum_{i=1}^{100} (i + \\sum_{j=1}^{100} j)", True),
])
def test_the_cost_guard_bounds_sums_and_products_by_their_terms(text, costly):
  # math-verify evaluates a sum or product with literal bounds term by term: 20,000 terms of 1/k
  # and \\prod_{k=1}^{10^6} k ran to the time limit against "0.25" (10,000 terms of 1/k: 2.3 s).
  assert _math_text._too_costly(text) is costly


def test_a_large_factorial_of_no_whole_number_is_refused_quickly(process_verifier):
  process_verifier.equal("1", "1")  # make sure a worker is started; startup is not timed
  before = process_verifier.stats()
  start = time.monotonic()
  assert not process_verifier.equal("e^{7}!", "0.25", timeout_s=3.0)
  assert time.monotonic() - start < 0.5
  assert process_verifier.stats()["timeouts"] == before["timeouts"]


@pytest.mark.parametrize("text", ["\\frac{10^7}{2}!", "{\\frac{10^7}{2}}!", "\\binom{100}{50}!",
                                  "(\\frac{10^{7}}{2})!"])
def test_a_factorial_of_a_large_fraction_or_binomial_is_refused_quickly(process_verifier, text):
  process_verifier.equal("1", "1")  # make sure a worker is started; startup is not timed
  before = process_verifier.stats()
  start = time.monotonic()
  assert not process_verifier.equal(text, "1", timeout_s=3.0)
  assert time.monotonic() - start < 0.5
  assert process_verifier.stats()["timeouts"] == before["timeouts"]


def test_small_factorials_of_fractions_roots_and_binomials_are_read(thread_verifier):
  for prediction, gold in [("\\frac{6}{2}!", "6"), ("{\\frac{6}{2}}!", "6"), ("\\sqrt{9}!", "6"),
                           ("\\binom{4}{2}!", "720"), ("\\sqrt[3]{27}!", "6"), ("\\frac{10}{2}!", "120"),
                           ("|{-5}|!", "120"), ("\\binom{5}{2}!", "3628800"), ("{5 \\choose 2}!", "3628800"),
                           ("\\lfloor 7.5 \\rfloor!", "5040"), ("\\frac{10}{2}\\,!", "120"), ("\\left\\{5\\right\\}!", "120"),
                           ("\\{5\\}!", "120")]:
    assert thread_verifier.equal(prediction, gold, timeout_s=30.0), prediction


def test_the_cost_guard_reads_factorials_in_linear_time():
  # CPU time of this process: the guard is single-threaded Python, and other processes on a
  # loaded machine (a wall-clock 1 s limit failed once for about 0.3 s of work) do not count.
  start = time.process_time()
  for text in ["(1)!" * 20000, "(1+2)! " * 20000, "2^" * 5000 + "2!", "(" + "1+" * 5000 + "1)!",
               "(" + "1+" * 5000 + "1)" + "!" * 20000, "((1)!)!" * 10000]:
    _math_text._too_costly(text)
  assert time.process_time() - start < 1.0


def test_the_cost_guard_reads_bars_and_floors_in_linear_time():
  # CPU time of this process: the guard is single-threaded Python, and other processes on a
  # loaded machine (a wall-clock 1 s limit failed once for about 0.3 s of work) do not count.
  # Bars and floors do not count towards the nesting limit: an operand that holds another
  # factorial is not read, so nested ones are not read again at each level.
  start = time.process_time()
  for text in ["|1|!" * 10000, "|" * 5000 + "1" + "|!" * 5000, "\\lfloor " * 5000 + "1" + "\\rfloor!" * 5000,
               ("|" + " " * 50) * 2000 + "!", "{1 \\choose 1}!" * 5000, "e^" * 5000 + "e!"]:
    _math_text._too_costly(text)
  assert time.process_time() - start < 1.0


def test_realistic_nesting_and_powers_are_read(thread_verifier):
  # The guard against pathological input leaves realistic answers alone.
  for prediction, gold in [("((((((((((5))))))))))", "5"), ("\\boxed{" * 30 + "5" + "}" * 30, "5"),
                           ("2^{100}", "1267650600228229401496703205376"), ("10^{100}", "10^{100}"), ("9^{9}", "387420489"),
                           ("\\boxed{5!}", "120"), ("So she has 1000000!", "1000000"),
                           ("(2^{4})!", "20922789888000"), ("10^{1}!", "3628800"), ("\\exp(2)", "e^{2}"),
                           ("\\exp\\left(2\\right)", "e^2"), ("\\prod_{k=1}^{5} k", "120"), ("\\sum_{k=1}^{100} k", "5050"),
                           ("\\exp\\left\\{2\\right\\}", "e^2")]:
    assert thread_verifier.equal(prediction, gold, timeout_s=30.0), prediction


def test_process_backend_concurrent_callers(process_verifier):
  pairs = [("0.5", "\\frac{1}{2}", True), ("3", "4", False), ("1,000", "1000", True), ("[1,2)", "(1,2]", False)] * 2
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    results = list(pool.map(lambda p: process_verifier.equal(p[0], p[1], timeout_s=30.0), pairs))
  assert results == [expected for _, _, expected in pairs]


@pytest.fixture
def blocking_verify(monkeypatch):
  """Replaces math_verify.verify with one that waits until the test ends."""
  release = threading.Event()

  def slow_verify(*args, **kwargs):
    release.wait(30)
    return True

  monkeypatch.setattr(math_verify, "verify", slow_verify)
  yield
  release.set()


def test_thread_backend_timeout_returns_false_in_bounded_time(blocking_verify):
  v = MathVerifier(MathVerifyConfig(backend="thread", max_workers=2))
  start = time.monotonic()
  assert not v.equal("1", "2", timeout_s=0.3)
  assert time.monotonic() - start < 1.5
  assert v.stats()["timeouts"] == 1 and v.stats()["calls"] == 1


def test_thread_backend_busy_when_all_workers_are_stuck(blocking_verify):
  v = MathVerifier(MathVerifyConfig(backend="thread", max_workers=1, wait_timeout_s=0.2))
  assert not v.equal("1", "2", timeout_s=0.2)  # leaves the only worker stuck
  start = time.monotonic()
  assert not v.equal("3", "3.0", timeout_s=0.2)
  assert time.monotonic() - start < 1.0
  stats = v.stats()
  assert stats["timeouts"] == 1 and stats["busy"] == 1


def _score_concurrently(v: MathVerifier, n: int) -> list[bool]:
  with concurrent.futures.ThreadPoolExecutor(n) as pool:
    return list(pool.map(lambda _: v.equal("3", "3.0", timeout_s=1.0), range(n)))


def test_thread_backend_waiting_for_a_worker_is_not_part_of_the_limit(monkeypatch):
  """More concurrent callers than workers (a trainer scoring on threads): each comparison takes
  0.4 s of a 1 s limit, so every answer is correct; the queue's wait (up to 1.2 s) scored later
  callers False ("busy" or a timeout) when it counted against their own limit."""
  def slow_verify(*args, **kwargs):
    time.sleep(0.4)
    return True

  monkeypatch.setattr(math_verify, "verify", slow_verify)
  v = MathVerifier(MathVerifyConfig(backend="thread", max_workers=1))
  assert _score_concurrently(v, 4) == [True] * 4
  stats = v.stats()
  assert stats["equal"] == 4 and stats["busy"] == stats["timeouts"] == 0


def test_process_backend_waiting_for_a_worker_is_not_part_of_the_limit(monkeypatch):
  """The same with the process pool (its worker stood in for: 0.4 s per comparison, past the
  limit it is given it times out as a real worker would)."""
  def compare(self, prediction, gold, timeout_s):
    if timeout_s < 0.4:
      time.sleep(timeout_s)
      return None
    time.sleep(0.4)
    return {"equal": True}

  monkeypatch.setattr(math_verifier._ProcessWorker, "compare", compare)
  with MathVerifier(MathVerifyConfig(backend="process", max_workers=1)) as v:
    assert _score_concurrently(v, 4) == [True] * 4
    stats = v.stats()
  assert stats["equal"] == 4 and stats["busy"] == stats["timeouts"] == 0


def test_errors_are_counted_and_score_false(monkeypatch):
  def broken_verify(*args, **kwargs):
    raise RecursionError("deep expression")

  monkeypatch.setattr(math_verify, "verify", broken_verify)
  v = MathVerifier(MathVerifyConfig(backend="thread"))
  assert not v.equal("1", "2")
  assert v.stats() == {"calls": 1, "equal": 0, "unequal": 0, "timeouts": 0, "errors": 1, "busy": 0,
                       "restarts": 0}


def test_stats_add_up(thread_verifier):
  before = thread_verifier.stats()
  thread_verifier.equal("1", "1.0")
  thread_verifier.equal("1", "2")
  after = thread_verifier.stats()
  assert after["calls"] - before["calls"] == 2
  assert after["equal"] - before["equal"] == 1
  assert after["unequal"] - before["unequal"] == 1


def test_closed_verifier_raises():
  v = MathVerifier(MathVerifyConfig(backend="thread"))
  v.close()
  with pytest.raises(RuntimeError, match="closed"):
    v.equal("1", "1")


@pytest.mark.parametrize("kwargs,match", [
    ({"backend": "gpu"}, "backend"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"timeout_s": float("inf")}, "timeout_s"),
    ({"wait_timeout_s": 0}, "wait_timeout_s"),
    ({"max_workers": 0}, "max_workers"),
    ({"worker_memory_mb": -1}, "worker_memory_mb"),
    ({"numeric_precision": 0}, "numeric_precision"),
    # A bool is an int to isinstance (one worker), and "no" was a true strict.
    ({"max_workers": True}, "max_workers must be an int >= 1, got True"),
    ({"float_rounding": False}, "float_rounding"),
    ({"strict": "no"}, "strict must be True or False, got 'no'"),
    ({"strict": 0}, "strict must be True or False"),
])
def test_config_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    MathVerifyConfig(**kwargs)


def test_call_timeout_is_validated(thread_verifier):
  with pytest.raises(ValueError, match="timeout_s"):
    thread_verifier.equal("1", "1", timeout_s=-1)
