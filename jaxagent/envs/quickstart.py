"""The quickstart task: arithmetic with a calculator tool, small enough to learn on a CPU.

Problems are reasoning-gym `basic_arithmetic` expressions ("Calculate 478 / 1 + -682."). The
policy may call `<calc>EXPR</calc>` and reads `<result>VALUE</result>`; it ends with
`<answer>VALUE</answer>`. Reward: 1 for the right number, else 0.

The SFT demonstrations come from a demonstrator that reaches for the calculator only on long
expressions (at least `demo_tool_min_terms` terms) and states the answer of shorter ones
directly, as a realistic cold-start set would. A 135M model cannot do multi-digit arithmetic in
its head, so after the warm start it solves the long problems and fails the short ones. When to
use the tool is one early decision per trajectory with a large reward gap, which group-relative
RL learns quickly: the quickstart shows SFT teaching the format and RL teaching when to use the
tool.
"""
from __future__ import annotations

import re
from typing import Sequence

from jaxagent.agent.env import Env, Example
from jaxagent.agent.parsers import XMLTagParser
from jaxagent.agent.trajectory import OBSERVATION, POLICY, Trajectory
from jaxagent.rewards import Component, CompositeReward, RewardInput, RewardOutput
from jaxagent.rewards.verifiers import extract_tagged
from jaxagent.tools import Calculator, ToolRegistry

SYSTEM_PROMPT = (
    "You are a careful assistant with a calculator. To compute, write <calc>expression</calc>; "
    "the result comes back as <result>value</result>. Finish with <answer>number</answer>.")

_NUM = re.compile(r"-?\d+(?:\.\d+)?")


def numeric_match(text: str | None, gold: str) -> float:
  """1.0 when `text` is the gold number (up to 1e-6 relative), else 0.0."""
  if text is None:
    return 0.0
  m = _NUM.fullmatch(text.strip().replace(",", ""))
  if m is None:
    return 0.0
  a, b = float(m.group(0)), float(gold)
  return float(abs(a - b) <= 1e-6 * max(1.0, abs(b)))


class _Correct:
  """The final `<answer>` equals the gold number."""

  def __call__(self, inp: RewardInput) -> float:
    gold = inp.gold if isinstance(inp.gold, str) else inp.gold[0]
    return numeric_match(extract_tagged(inp.response_text, "answer"), gold)


class ArithmeticToolEnv(Env):
  """Arithmetic with a calculator (see the module docstring)."""

  name = "quickstart"
  observation_template = "<result>{output}</result>"

  def __init__(self, *, min_terms: int = 3, max_terms: int = 4, min_digits: int = 2,
               max_digits: int = 3, train_size: int = 2000, eval_size: int = 200,
               sft_size: int = 256, demo_tool_min_terms: int = 4, seed: int = 0):
    if not 2 <= min_terms <= max_terms:
      raise ValueError(f"need 2 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
    if not 1 <= min_digits <= max_digits:
      raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    self.parser = XMLTagParser({"calc": ("calculator", "expression")}, answer_tag="answer")
    self.tools = ToolRegistry([Calculator()])
    self.demo_tool_min_terms = demo_tool_min_terms
    self.seed = seed
    self._sizes = {"train": train_size, "eval": eval_size, "sft": sft_size}
    self._difficulty = dict(min_terms=min_terms, max_terms=max_terms, min_digits=min_digits,
                            max_digits=max_digits)
    self._cache: dict[str, list[Example]] = {}
    self._reward = CompositeReward([Component("correct", _Correct(), 1.0, role="outcome")])

  # ------------------------------------------------------------------ data
  def examples(self, split: str) -> Sequence[Example]:
    """"train", "eval" (held out: no expression shared with train/sft) or "sft"."""
    if split not in self._sizes:
      raise ValueError(f"unknown split {split!r}; expected one of {sorted(self._sizes)}")
    if split not in self._cache:
      self._cache[split] = self._generate(split)
    return self._cache[split]

  def _generate(self, split: str) -> list[Example]:
    import reasoning_gym

    # reasoning-gym seeds item i with (seed + i): keep the splits' seed ranges disjoint.
    offsets = {"train": 0, "sft": 10_000_000, "eval": 20_000_000}
    seen = set()
    if split == "eval":
      seen = {ex.metadata["expression"] for s in ("train", "sft") for ex in self.examples(s)}
    size = self._sizes[split]
    ds = reasoning_gym.create_dataset("basic_arithmetic", size=size + len(seen) // 4 + 64,
                                      seed=self.seed * 100_000_000 + offsets[split],
                                      **self._difficulty)
    out = []
    for i, item in enumerate(ds):
      expr = item["metadata"]["expression"]
      if expr in seen:
        continue
      seen.add(expr)
      messages = ({"role": "system", "content": SYSTEM_PROMPT},
                  {"role": "user", "content": item["question"]})
      out.append(Example(id=f"{split}-{i}", prompt=messages, gold=str(item["answer"]),
                         metadata={"expression": expr,
                                   "num_terms": item["metadata"]["num_terms"]}))
      if len(out) == size:
        break
    return out

  # ------------------------------------------------------------------ reward
  def reward(self, trajectory: Trajectory, example: Example, tokenizer, step: int) -> RewardOutput:
    inp = trajectory.to_reward_input(tokenizer, example.gold, metadata=example.metadata,
                                     policy_only=True)
    return self._reward(inp, step=step)

  def is_success(self, out: RewardOutput) -> bool:
    return out.components.get("correct", 0.0) >= 1.0

  def demonstration(self, example: Example):
    """The calculator for expressions of at least `demo_tool_min_terms` terms, else a direct
    answer."""
    gold = example.gold
    expr = example.metadata["expression"]
    if example.metadata["num_terms"] >= self.demo_tool_min_terms:
      return [(POLICY, f"<calc>{expr}</calc>"),
              (OBSERVATION, self.observation_template.format(output=gold)),
              (POLICY, f"<answer>{gold}</answer>")]
    return [(POLICY, f"<answer>{gold}</answer>")]
