"""The quickstart task: arithmetic with a calculator tool, small enough to learn on a CPU.

Problems are reasoning-gym `basic_arithmetic` expressions ("Calculate 478 / 1 + -682."). The
policy may call `<calc>EXPR</calc>` and reads `<result>VALUE</result>`; it ends with
`<answer>VALUE</answer>`. Reward: 1 for the right number, else 0.

Problems come in two tiers: "easy" (two small numbers, + or -) and "hard" (several
multi-digit numbers, all four operators). The SFT demonstrations come from a demonstrator that
answers easy problems in its head and reaches for the calculator on hard ones, as a realistic
cold-start set would. After the warm start the model has the format and answers from memory;
a 135M model gets some easy problems right that way and almost no hard ones. When to use the
tool is one early decision per trajectory with a large reward gap, which group-relative RL
learns quickly: the quickstart shows SFT teaching the format and RL teaching when to use the
tool.
"""
from __future__ import annotations

import ast
import operator
from fractions import Fraction
from typing import Sequence

import numpy as np

from jaxagent.agent.env import Env, Example, NoSplitError
from jaxagent.agent.parsers import XMLTagParser
from jaxagent.agent.trajectory import OBSERVATION, POLICY, Trajectory
from jaxagent.rewards import Component, CompositeReward, RewardInput, RewardOutput
from jaxagent.rewards.verifiers import extract_tagged, numeric_match
from jaxagent.tools import Calculator, ToolRegistry

SYSTEM_PROMPT = (
    "You are a careful assistant with a calculator. To compute, write <calc>expression</calc>; "
    "the result comes back as <result>value</result>. Finish with <answer>number</answer>.")

_MAX_PRODUCT_DIGITS = 12  # see ArithmeticToolEnv.__init__
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv}


def exact_value(expression: str) -> Fraction:
  """The exact value of a problem's expression (integers, + - * /, parentheses, unary minus)."""

  def ev(node):
    if isinstance(node, ast.Expression):
      return ev(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
      return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      return _OPS[type(node.op)](ev(node.left), ev(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
      return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
    raise ValueError(f"not integer arithmetic: {expression!r}")

  return ev(ast.parse(expression, mode="eval"))


class _Correct:
  """The final `<answer>` equals the gold number."""

  def __call__(self, inp: RewardInput) -> float:
    gold = inp.gold if isinstance(inp.gold, str) else inp.gold[0]
    return numeric_match(extract_tagged(inp.response_text, "answer"), gold)


class ArithmeticToolEnv(Env):
  """Arithmetic with a calculator (see the module docstring)."""

  name = "quickstart"
  reward_threads = 4  # the reward keeps no state (a number match)
  observation_template = "<result>{output}</result>"

  def __init__(self, *, min_terms: int = 3, max_terms: int = 4, min_digits: int = 2,
               max_digits: int = 3, easy_fraction: float = 0.5, easy_max_digits: int = 2,
               sft_easy_fraction: float | None = None, train_size: int = 2000,
               eval_size: int = 200, sft_size: int = 256, seed: int = 0):
    # Counts and the seed: a negative size drew a short split of arbitrary length (train_size=-5
    # gave 173 problems), and other bad values failed deep inside reasoning-gym or numpy.
    for field, value in (("min_terms", min_terms), ("max_terms", max_terms),
                         ("min_digits", min_digits), ("max_digits", max_digits),
                         ("easy_max_digits", easy_max_digits), ("train_size", train_size),
                         ("eval_size", eval_size), ("sft_size", sft_size), ("seed", seed)):
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"ArithmeticToolEnv.{field} must be an int >= 0, got {value!r}")
    if easy_max_digits < 1:
      raise ValueError(f"ArithmeticToolEnv.easy_max_digits must be >= 1, got {easy_max_digits}")
    if not 2 <= min_terms <= max_terms:
      raise ValueError(f"need 2 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
    if not 1 <= min_digits <= max_digits:
      raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    # reasoning-gym picks a division's divisor by trial division up to the square root of the
    # dividend, which can be the product of up to max_terms - 1 numbers of max_digits digits.
    # Measured (default split sizes, 3 seeds): products of up to 12 digits generate in under
    # 3 s; 14 digits took up to 25 s, 16 digits up to 3 minutes, 21 digits (3 digits, 8 terms)
    # one problem of 44 s, and max_digits=9 with 4 terms did not finish.
    if max_digits * (max_terms - 1) > _MAX_PRODUCT_DIGITS:
      raise ValueError(
          f"ArithmeticToolEnv: max_digits={max_digits} with max_terms={max_terms} makes problems "
          f"whose generation (reasoning-gym's trial division of products of up to max_terms - 1 "
          f"numbers) takes minutes to hours; keep max_digits * (max_terms - 1) <= "
          f"{_MAX_PRODUCT_DIGITS} (it is {max_digits * (max_terms - 1)}): lower max_digits or "
          "max_terms")
    sft_easy_fraction = easy_fraction if sft_easy_fraction is None else sft_easy_fraction
    for name, f in (("easy_fraction", easy_fraction), ("sft_easy_fraction", sft_easy_fraction)):
      # A string or None failed the comparison with a TypeError that named no setting.
      if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
        raise ValueError(f"ArithmeticToolEnv.{name} must be a number in [0, 1], got {f!r}")
    self.parser = XMLTagParser({"calc": ("calculator", "expression")}, answer_tag="answer")
    self.tools = ToolRegistry([Calculator()])
    self.easy_fraction = {"train": easy_fraction, "eval": easy_fraction,
                          "sft": sft_easy_fraction}
    self.seed = seed
    self._sizes = {"train": train_size, "eval": eval_size, "sft": sft_size}
    self._tiers = {
        "hard": dict(min_terms=min_terms, max_terms=max_terms, min_digits=min_digits,
                     max_digits=max_digits),
        "easy": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=easy_max_digits,
                     operators=("+", "-"), allow_parentheses=False, allow_negation=False),
    }
    self._cache: dict[str, list[Example]] = {}
    self._reward = CompositeReward([Component("correct", _Correct(), 1.0, role="outcome")])

  # ------------------------------------------------------------------ data
  def examples(self, split: str) -> Sequence[Example]:
    """"train", "eval" (held out) or "sft"; no expression is in two splits."""
    if split not in self._sizes:
      raise NoSplitError(f"unknown split {split!r}; expected one of {sorted(self._sizes)}",
                         split=split)
    if split not in self._cache:
      self._cache[split] = self._generate(split)
    return self._cache[split]

  def _generate(self, split: str) -> list[Example]:
    import reasoning_gym

    # reasoning-gym seeds item i with (seed + i): keep the splits' and tiers' seed ranges
    # disjoint.
    offsets = {"train": 0, "sft": 10_000_000, "eval": 20_000_000}
    # A problem is in one split only: sft draws around train's (an SFT answer would otherwise
    # come back as an RL problem), eval around both.
    earlier = {"train": (), "sft": ("train",), "eval": ("train", "sft")}[split]
    seen = {ex.metadata["expression"] for s in earlier for ex in self.examples(s)}
    size = self._sizes[split]
    n_easy = round(size * self.easy_fraction[split])
    out = []
    for t, (tier, n) in enumerate((("easy", n_easy), ("hard", size - n_easy))):
      if n == 0:
        continue
      ds = reasoning_gym.create_dataset(
          "basic_arithmetic", size=2 * n + len(seen) + 64,
          seed=self.seed * 100_000_000 + offsets[split] + t * 5_000_000, **self._tiers[tier])
      got = 0
      for i, item in enumerate(ds):
        expr = item["metadata"]["expression"]
        if expr in seen:
          continue
        # reasoning-gym computes the answer with floor division: where a division is not exact
        # ("-99 / -( -60 + 75 + 16 )", answer 3) the gold is not the value the question asks
        # for, nor what the calculator returns. Such problems are skipped.
        try:
          if exact_value(expr) != int(item["answer"]):
            continue
        except (ValueError, ZeroDivisionError):
          continue
        seen.add(expr)
        messages = ({"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": item["question"]})
        out.append(Example(id=f"{split}-{tier}-{i}", prompt=messages, gold=str(item["answer"]),
                           metadata={"expression": expr, "tier": tier,
                                     "num_terms": item["metadata"]["num_terms"]}))
        got += 1
        if got == n:
          break
      if got < n:
        # A small problem space (few digits, terms or operators) runs out of distinct
        # expressions; a shorter split (or an eval split without its easy tier) would go unseen.
        raise ValueError(f"quickstart: could only draw {got} distinct {tier} problems for split "
                         f"{split!r} (wanted {n}; problems of other splits are excluded); lower "
                         "train_size / eval_size / sft_size or widen the problems (more digits "
                         "or terms)")
    # Interleave the tiers in a fixed pseudo-random order.
    order = np.random.default_rng(self.seed + offsets[split]).permutation(len(out))
    return [out[i] for i in order]

  # ------------------------------------------------------------------ reward
  def reward(self, trajectory: Trajectory, example: Example, tokenizer, step: int) -> RewardOutput:
    inp = trajectory.to_reward_input(tokenizer, example.gold, metadata=example.metadata,
                                     policy_only=True)
    return self._reward(inp, step=step)

  def is_success(self, out: RewardOutput) -> bool:
    return out.components.get("correct", 0.0) >= 1.0

  def demonstration(self, example: Example):
    """The demonstrator's solution: a direct answer for easy problems, the calculator for
    hard ones."""
    gold = example.gold
    if example.metadata["tier"] == "easy":
      return [(POLICY, f"<answer>{gold}</answer>")]
    return [(POLICY, f"<calc>{example.metadata['expression']}</calc>"),
            (OBSERVATION, self.observation_template.format(output=gold)),
            (POLICY, f"<answer>{gold}</answer>")]
