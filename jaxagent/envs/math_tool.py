"""Math word problems with a persistent Python interpreter (ReTool style).

Problems are reasoning-gym `gsm_symbolic` (GSM8K-style templates with fresh numbers) and,
optionally, the numeric-answer problems of CHAMP (`champ-dataset`, competition math); or your
own, from a JSONL, ArrayRecord or Parquet file (or a glob pattern of a split's shards) per split
(`train_file`, `eval_file`, `sft_file`; see `jaxagent/envs/problem_file.py` for the record
format). The
policy writes code between `<code>` and `</code>`; the rollout runs it in the trajectory's own
sandboxed interpreter (a `PythonSession`: variables persist across turns, and `Episode.close`
ends it) and appends what it printed as `<interpreter>...</interpreter>`, an observation that
gets no loss. The policy ends with `<answer>...</answer>`.

Reward: +1 when math-verify finds the answer equal to the gold answer, -1 otherwise (component
"correct"), plus optional shaping terms (tag format, valid tool calls) whose weight a
`ProgressiveSchedule` hands to the outcome over `shaping_steps` steps. A reasoning model's
`<think>...</think>` block (Qwen3 style) is welcome where a turn opens, before anything else; an
unclosed one, or one after other text, breaks the format, and nothing inside one is an answer
or a call (the rollout does not end a turn at a closing tag written while thinking).

Demonstrations for the SFT cold start (`demonstration`) are built from the reference solution
that reasoning-gym ships with each problem (`answer_cot`, lines such as "He drank 8*3=24 ccs"):
every arithmetic step `expression = value` becomes a Python assignment, later steps refer to
earlier ones by name, and the program prints the last value. Problems with four or more steps
are split over two code cells, showing that variables persist between calls. Every step kept
reproduces the value the solution states, and a program is kept only if its result is the gold
answer to a relative 1e-6 (2904 of the 3000 problems drawn with seed 0; a dozen of them print float
noise such as 57.00000000000001 before answering 57); other problems, and all CHAMP problems, have
no demonstration and are left out of the "sft" split. Your own problems (`sft_file`) are
demonstrated the same way from their worked solutions; a GSM8K solution's calculator notes
(`<<48/2=24>>24`) give its steps (`calculator_steps`).
"""
from __future__ import annotations

import ast
import builtins
import dataclasses
import keyword
import logging
import math
import operator
import random
import re
import textwrap
from typing import Any, Mapping, Sequence

from jaxagent.agent.env import (OBSERVATION_TEMPLATES, Env, Episode, Example, NoSplitError,
                                check_shaping_settings)
from jaxagent.agent.parsers import XMLTagParser, _block_spans, _without
from jaxagent.agent.trajectory import OBSERVATION, POLICY, Trajectory, data_continuation_ids
from jaxagent.envs.problem_file import MISSING, lookup, read_problems, resolve_problem_file
from jaxagent.rewards import (Component, CompositeReward, FormatConfig, FormatReward,
                              MathAnswerReward, ProgressiveSchedule, RewardInput, RewardOutput,
                              ToolShapingConfig, ToolUseReward)
from jaxagent.tools import PythonTool, SandboxConfig, ToolResult
from jaxagent.tools.base import truncate_text

SYSTEM_PROMPT = (
    "You solve math problems with the help of a Python interpreter. To run code, write it "
    "between <code> and </code>; what it prints comes back between <interpreter> and "
    "</interpreter>. Variables persist from one code block to the next. Use print() to see "
    "results. When you know the final answer, write only the number inside <answer> and "
    "</answer>.")

log = logging.getLogger(__name__)

SOURCES = ("gsm_symbolic", "champ")
_FORMAT = FormatConfig(allowed_tags=("code", "answer"), answer_tag="answer", opaque_tags=("code",),
                       think_tag="think")
_NO_OUTPUT = "(no output: print() the values you need)"


# ----------------------------------------------------------------------------- the tool
_FENCE_LANGUAGES = frozenset({"python", "python3", "py"})


def clean_code(code: str) -> str:
  """Code as a model writes it inside `<code>`: drops Markdown fences, common indentation and
  blank edge lines. A closing fence may end the last line (`print(1)```), and a program may sit
  on the fence's own line (```python print(1)```)."""
  lines = code.splitlines()
  while lines and not lines[0].strip():
    lines.pop(0)
  while lines and not lines[-1].strip():
    lines.pop()
  fenced = bool(lines) and lines[0].strip().startswith("```")
  if fenced and len(lines) == 1:
    inner = lines[0].strip()[3:]
    inner = inner[:-3] if inner.endswith("```") else inner
    words = inner.split(maxsplit=1)
    if words and words[0].lower() in _FENCE_LANGUAGES:
      inner = words[1] if len(words) > 1 else ""
    return inner.strip() + "\n"
  if fenced:
    lines = lines[1:]
  if lines and lines[-1].strip() == "```":
    lines = lines[:-1]
  elif fenced and lines and lines[-1].rstrip().endswith("```"):
    lines[-1] = lines[-1].rstrip()[:-3]
  return textwrap.dedent("\n".join(lines)).strip("\n") + "\n"


class InterpreterTool(PythonTool):
  """One trajectory's persistent sandboxed interpreter (`<code>` blocks, cleaned first)."""

  def __init__(self, config: SandboxConfig | None = None):
    super().__init__(config, stateful=True, name="python")

  def __call__(self, args: dict[str, Any], timeout_s: float | None = None) -> ToolResult:
    code = args.get("code")
    if isinstance(code, str):
      args = {**args, "code": clean_code(code)}
    return super().__call__(args, timeout_s=timeout_s)


def _cut_middle(text: str, max_chars: int) -> str:
  """`text` in at most `max_chars` characters: its start and its end (the larger part) around a
  note of how many characters were cut; only its end when the limit cannot hold the note."""
  if len(text) <= max_chars:
    return text
  note = ""
  while True:  # the note counts itself: settles once its number's digits do
    keep = max_chars - len(note)
    fresh = f"\n... [{len(text) - keep} characters cut] ...\n"
    if fresh == note:
      break
    note = fresh
  if keep < 8:
    return text[len(text) - max_chars:]
  head = keep // 3
  return text[:head] + note + text[len(text) - (keep - head):]


# ----------------------------------------------------------------------------- demonstrations
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv}
_NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
_TOKEN = re.compile(rf"(?P<num>{_NUM})|(?P<op>[-+*/×÷])|(?P<paren>[()])|(?P<eq>=)|"
                    r"(?P<skip>[$€£%])|(?P<word>[A-Za-z][A-Za-z']*)|(?P<other>\S)")
_STOP_NAMES = frozenset("""a an the and or of in on at to for from by with per each every so
  that this these those it is are was were be been he she they we you his her their its which
  what then than more less total now left over after before all some about just only
  both""".split())


def safe_eval(expr: str, names: Mapping[str, Any] | None = None) -> Any:
  """Value of an arithmetic expression (numbers, `names`, + - * /, parentheses, unary minus),
  with Python's int / float rules."""

  def ev(node):
    if isinstance(node, ast.Expression):
      return ev(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
      return node.value
    if isinstance(node, ast.Name) and names is not None and node.id in names:
      return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
      return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
      return -ev(node.operand)
    raise ValueError(f"not plain arithmetic: {ast.dump(node)[:60]}")

  return ev(ast.parse(expr, mode="eval"))


def _close(a: float, b: float) -> bool:
  """a is b up to a relative 1e-6; never for a non-finite b or an int too large for a float."""
  try:
    return math.isfinite(b) and abs(a - b) <= 1e-6 * max(1.0, abs(b))
  except OverflowError:
    return False


# What a reference solution's arithmetic can raise (1/0, 10**400 / 3, thousands of terms).
_ARITH_ERRORS = (ValueError, SyntaxError, ArithmeticError, RecursionError, MemoryError)


def _expression(tokens: list[tuple[str, str]]) -> list[str] | None:
  """Arithmetic tokens of an equation's left side, unit words and currency dropped, or None."""
  out: list[str] = []
  for k, (kind, text) in enumerate(tokens):
    nxt = tokens[k + 1] if k + 1 < len(tokens) else ("end", "")
    if kind == "num":
      if out and (out[-1] == ")" or _is_number(out[-1])):
        return None  # two quantities with no operator between them
      out.append(text.replace(",", ""))
    elif kind == "op" or (kind == "word" and text == "x"):
      if nxt[0] == "word" and nxt[1] != "x":
        continue  # a unit such as "/day" or "boys/girl"
      op = {"×": "*", "x": "*", "÷": "/"}.get(text, text)
      if not out or out[-1] in "+-*/(":
        if op != "-":
          return None
      out.append(op)
    elif kind == "paren":
      if text == "(" and out and (out[-1] == ")" or _is_number(out[-1])):
        out.append("*")  # 2(86+66)
      out.append(text)
  return out if any(t in "+-*/" for t in out) else None


def _is_number(tok: str) -> bool:
  return bool(re.fullmatch(r"\d+(?:\.\d+)?", tok))


def cot_steps(cot: str) -> list[tuple[str, float, str]]:
  """(expression, value, unit word) of each arithmetic equation in a reference solution.

  For each `=`, the longest run of tokens before it whose arithmetic (unit words and currency
  signs dropped) evaluates to the number after it is the step's expression.
  """
  steps: list[tuple[str, float, str]] = []
  for line in cot.splitlines():
    if line.startswith("####"):
      break
    toks = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(line)]
    for i, (kind, _) in enumerate(toks):
      if kind != "eq":
        continue
      rhs = [t for t in toks[i + 1:] if t[0] != "skip"]
      if not rhs or rhs[0][0] != "num":
        continue
      value = float(rhs[0][1].replace(",", ""))
      # The step is named after the first content word following its value ("= 64 boys").
      unit = next((t.lower() for kind_, t in rhs[1:5] if kind_ == "word"
                   and t.lower() not in _STOP_NAMES), "")
      start = i
      while start > 0 and toks[start - 1][0] not in ("eq", "other"):
        start -= 1
      for s in range(start, i):
        if toks[s][0] not in ("num", "paren", "skip"):
          continue
        expr = _expression(toks[s:i])
        if expr is None:
          continue
        text = _join(expr)
        try:
          v = safe_eval(text)
        except _ARITH_ERRORS:
          continue
        if _close(v, value):
          if not any(e == text for e, _, _ in steps):
            steps.append((text, v, unit))
          break
  return steps


def _join(tokens: Sequence[str]) -> str:
  text = " ".join(tokens)
  return text.replace("( ", "(").replace(" )", ")")


def steps_program(steps: Sequence[tuple[str, float, str]]) -> tuple[list[str], list[Any]]:
  """Python assignments for `steps` (earlier results referred to by name) and their values."""
  names: list[str] = []
  values: list[Any] = []
  lines = []
  for expr, _, unit in steps:
    toks = expr.replace("(", "( ").replace(")", " )").split()
    for k, t in enumerate(toks):
      if _is_number(t):
        for name, val in reversed(list(zip(names, values))):
          if _close(float(t), val):
            toks[k] = name
            break
    # Not a keyword, nor a builtin the interpreter would lose ("print = 12" breaks the print).
    base = unit if unit.isidentifier() and unit not in _STOP_NAMES and not keyword.iskeyword(
        unit) and not hasattr(builtins, unit) else "step"
    name, n = base, 2
    while name in names:
      name, n = f"{base}_{n}", n + 1
    code = _join(toks)
    # The value as the sandbox will compute it (same operators, same int/float rules).
    value = safe_eval(code, dict(zip(names, values)))
    names.append(name)
    values.append(value)
    lines.append(f"{name} = {code}")
  return lines, values


_NOTE = re.compile(r"<<([^<>=]*)=([^<>=]*)>>")


def calculator_steps(solution: str) -> list[tuple[str, float, str]]:
  """(expression, value, unit word) of each GSM8K calculator note in a worked solution
  ("Natalia sold 48/2 = <<48/2=24>>24 clips"), as `cot_steps` gives them: a note whose
  expression is not plain arithmetic (words, `%`, `**`), or whose arithmetic does not give the
  value it states, is skipped; the text after the `####` line is not read."""
  solution = solution.split("\n####", 1)[0]
  steps: list[tuple[str, float, str]] = []
  for m in _NOTE.finditer(solution):
    value_text = m.group(2).strip().replace(",", "").lstrip("$")
    # ".5" is 0.5: the tokens below read numbers with their integer part only.
    expr_text = re.sub(r"(?<![\d.])\.(?=\d)", "0.", m.group(1))
    toks = [(t.lastgroup, t.group()) for t in _TOKEN.finditer(expr_text)]
    if not toks or any(k in ("other", "eq") or (k == "word" and t != "x") for k, t in toks):
      continue
    expr = _expression([t for t in toks if t[0] != "skip"])
    try:
      value = float(value_text)
      text = _join(expr) if expr else ""
      if not text or not _close(safe_eval(text), value):
        continue
    except _ARITH_ERRORS:
      continue
    # Named after the first content word after the note's result in its sentence
    # ("<<48/2=24>>24 clips"; none in "<<100/2=50>>50.\nThis means").
    after = []
    for t in _TOKEN.finditer(solution[m.end():].split("\n", 1)[0][:80]):
      if t.lastgroup in ("other", "eq"):
        break
      after.append(t)
    unit = next((t.group().lower() for t in after[:5] if t.lastgroup == "word"
                 and t.group().lower() not in _STOP_NAMES), "")
    if not any(e == text for e, _, _ in steps):
      steps.append((text, safe_eval(text), unit))
  return steps


def gsm_demonstration(cot: str, gold: str, *, split_at: int = 4) -> list[tuple[int, str]] | None:
  """Code-interpreter demonstration segments for a reasoning-gym solution, or a GSM8K worked
  solution with calculator notes (`<<48/2=24>>`, which give the steps; see `calculator_steps`),
  or None (also for a solution whose arithmetic cannot be replayed, e.g. a division by zero, and
  a gold that is not a finite number; a GSM8K gold may have thousands commas, "1,000")."""
  try:
    g = float(gold.replace(",", ""))
  except ValueError:
    return None
  if not math.isfinite(g):
    return None
  steps = calculator_steps(cot) or cot_steps(cot)
  last = max((k for k, (_, v, _) in enumerate(steps) if _close(v, g)), default=None)
  if last is None:
    return None
  try:
    lines, values = steps_program(steps[:last + 1])
  except _ARITH_ERRORS:
    return None
  if not _close(values[-1], g):
    return None
  names = [ln.split(" = ", 1)[0] for ln in lines]
  cells = [(lines, len(lines) - 1)]
  if len(lines) >= split_at:
    half = len(lines) // 2
    cells = [(lines[:half], half - 1), (lines[half:], len(lines) - 1)]
  segs: list[tuple[int, str]] = []
  for body, k in cells:
    code = "\n".join([*body, f"print({names[k]})"])
    segs.append((POLICY, f"<code>\n{code}\n</code>"))
    segs.append((OBSERVATION, OBSERVATION_TEMPLATES["interpreter"].format(output=f"{values[k]}\n")))
  segs.append((POLICY, f"<answer>{gold}</answer>"))
  return segs


# ----------------------------------------------------------------------------- CHAMP
_CHAMP_NUMERIC = re.compile(r"[-+]?[0-9.()*/^+\- ]*(?:sqrt\([0-9]+\)[0-9.()*/^+\- ]*)*")


def champ_problems() -> list[tuple[str, str, list[str]]]:
  """(id, problem, gold answers) of the CHAMP problems with a closed-form numeric answer."""
  try:
    import champ_dataset
  except ImportError as e:
    raise ImportError("the 'champ' source needs the champ-dataset package: "
                      "pip install champ-dataset") from e
  out = []
  for p in champ_dataset.load("v0").problems.values():
    a = re.sub(r"\s*\((?:i\.e\.|no |none ).*\)$", "", p.answer.strip())
    a = re.sub(r"\s+is the only possible value$", "", a)
    golds = [g.strip() for g in re.split(r",\s*or equivalently\s+", a)]
    golds = [g for g in golds if g and "%" not in g]
    if golds and all(_CHAMP_NUMERIC.fullmatch(g) and re.search(r"\d", g) for g in golds):
      out.append((p.identifier, p.text, golds))
  return out


def _answer_key_paths() -> tuple[str, ...]:
  """Where the installed problem sources live (located, not imported)."""
  import importlib.util
  paths = []
  for package in ("reasoning_gym", "champ_dataset"):
    spec = importlib.util.find_spec(package)
    if spec is not None:
      paths.extend(spec.submodule_search_locations or ([spec.origin] if spec.origin else []))
  return tuple(paths)


# ----------------------------------------------------------------------------- the task
# The answer is read as the env's parser reads the turn that ended with it. A code or think block
# runs to its close. One never closed runs to where an `<answer>` opens, or to the end of the
# text: the rollout stops a turn at `</answer>` and reads it as the final answer even inside an
# unclosed code block, and goes on after a turn whose code block was left open (a malformed
# call), so the policy's later answer is an answer. Inside an open think block `</answer>` does
# not end the turn (the env's parser has think_tag="think"); a turn that ends with one still open
# (EOS, budget) has its answer after the `<think>` read by the parser as here. The first block to
# open hides what it holds, a `<think>` quoted in code as much as code quoted in thought, and an
# answer holds a `<code>` tag as its text: the rollout ends `<answer>5 <code></answer>` at
# `</answer>` with the answer "5 <code>" (a `<think>` inside an answer still opens a thought,
# for the parser as here). Think blocks go first, exactly as the parser drops them; then code
# blocks outside answers (an answer never closed is no block).
def _prose(text: str) -> str:
  """`text` without its think blocks and the code blocks outside answers."""
  text = _without(text, _block_spans(text, ("code", "think"), until="answer"), "think")
  return _without(text, _block_spans(text, ("answer", "code"), until="answer",
                                     skip_unclosed=("answer",)), "code")


class SignedMathAnswer:
  """+1 when the answer equals a gold answer (math-verify), -1 otherwise.

  The answer is looked for outside `<code>` and `<think>` blocks: a program that prints an
  answer tag has not answered, and neither has a thought that tries one (`\\boxed{41}` while
  thinking, with no answer after it, scores -1). An unclosed block does not hide an answer tag
  written after it, and a `<code>` tag written inside an answer is part of it: the reward scores
  the answer that the env's parser read. A trajectory that the rollout ended otherwise than with
  an answer (its "stop_reason" in the metadata) has no `<answer>` to score, whatever its text
  holds (`\\boxed{}` and `####` are still read).
  """

  def __init__(self, timeout_s: float = 5.0):
    self._inner = MathAnswerReward(tag="answer", timeout_s=timeout_s)
    self._untagged = MathAnswerReward(tag=None, timeout_s=timeout_s)

  def __call__(self, inp: RewardInput) -> float:
    prose = dataclasses.replace(inp, response_text=_prose(inp.response_text))
    # The parser reads only an answer that ends its turn; the text can still hold a complete
    # answer block that it did not read: after an unclosed `<think>` (where `</answer>` did not
    # end the turn) with more text after it before EOS or the budget, or put together across
    # turns (`<answer><code>print(6*7)</code>` ran the code, then `42</answer>` was malformed).
    inner = self._untagged if inp.ended_without_answer else self._inner
    return 2.0 * inner(prose) - 1.0


class MathToolEnv(Env):
  """Math word problems with a persistent Python interpreter (see the module docstring).

  Args:
    sources: problem sources of the train and sft splits ("gsm_symbolic", "champ").
    eval_sources: sources of the held-out eval split. CHAMP problems are divided once, by a
      seeded shuffle, into a train half and an eval half, so no problem is in both.
    train_size, eval_size, sft_size: gsm_symbolic problems per split (no question repeats
      across splits); CHAMP adds its half on top where listed.
    train_file, eval_file: a file of your own problems ("" = none) that replaces the built-in
      sources of the train / eval split, every record of it in file order (`sources` or
      `eval_sources` and the split's size then do not apply; the trainer evaluates on the first
      `eval.size`). JSONL (`.jsonl`, `.jsonl.gz`) or ArrayRecord (`.array_record`,
      `.arrayrecord`) records that are JSON objects, or Parquet (`.parquet`) rows; a GSM8K
      answer ("... #### 72") gives its final answer (see
      `jaxagent/envs/problem_file.py`); a glob pattern (`/data/train-*.parquet`) reads a
      split's shards in sorted order. Without `sft_file` the "sft" split draws built-in
      gsm_symbolic problems, whose generated reference solutions make the code demonstrations
      (they teach the tool format, not your data), never a question of a file; with
      `sft_size=0` or `sources` without gsm_symbolic it is empty (set the trainer's
      `sft.steps=0`). The files are hidden from the policy's code like the built-in answer keys.
    sft_file: a file of your own problems with worked solutions ("" = none; may be the
      train_file) whose demonstrations make the "sft" split, every record that has one in file
      order (`sft_size` then does not apply): each `<<expr=value>>` calculator note of a GSM8K
      solution (or else each `expr = value` step) is a line of interpreter code, kept when the
      program's result is the gold answer. Records without such a solution are left out and
      counted in a warning; a file with none is an error.
    solution_key: the key of a sft_file record's worked solution ("" = `answer_key`, as in
      GSM8K, whose answer is the solution ending "#### 72").
    question_key, answer_key: the keys of a file record's question and answer.
    max_output_chars: the text between the interpreter tags is cut to this many characters (a
      failed call keeps its error over its output; see `format_observation`).
    code_timeout_s, code_memory_mb: limits of each code cell.
    format_weight, tool_weight: weights of the shaping terms (0 = off); `tool_weight` is the
      bonus per distinct code cell (not a repeat of an earlier one) that ran without an error,
      capped at 5 cells.
    shaping_steps, shaping_start: progressive schedule (0 steps = fixed weights).
    seed: seed of problem generation and of the CHAMP split.
  """

  name = "math_tool"
  # The reward components keep no state; answers are compared by the shared `MathVerifier`, which
  # is thread-safe and gives each call its full time limit however many wait for a worker.
  reward_threads = 4
  observation_template = OBSERVATION_TEMPLATES["interpreter"]

  def __init__(self, *, sources: Sequence[str] = ("gsm_symbolic",),
               eval_sources: Sequence[str] = ("gsm_symbolic",), train_size: int = 2000,
               eval_size: int = 200, sft_size: int = 256, max_output_chars: int = 512,
               code_timeout_s: float = 5.0, code_memory_mb: int = 1024,
               format_weight: float = 0.0, tool_weight: float = 0.0, shaping_steps: int = 0,
               shaping_start: float = 0.0, seed: int = 0, train_file: str = "",
               eval_file: str = "", question_key: str = "question", answer_key: str = "answer",
               sft_file: str = "", solution_key: str = ""):
    for field, value in (("sources", sources), ("eval_sources", eval_sources)):
      if isinstance(value, str) or not value or any(s not in SOURCES for s in value):
        raise ValueError(f"MathToolEnv.{field} must be a non-empty tuple drawn from {SOURCES}, "
                         f"got {value!r}")
    for field, value in (("train_size", train_size), ("eval_size", eval_size),
                         ("sft_size", sft_size)):
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"MathToolEnv.{field} must be an int >= 0, got {value!r}")
    # A float limit failed every observation: each trajectory that ran code ended 'env_error'.
    if (not isinstance(max_output_chars, int) or isinstance(max_output_chars, bool)
        or max_output_chars < 32):
      raise ValueError(f"MathToolEnv.max_output_chars must be an int >= 32, "
                       f"got {max_output_chars!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
      raise ValueError(f"MathToolEnv.seed must be an int, got {seed!r}")
    check_shaping_settings("MathToolEnv", format_weight=format_weight, tool_weight=tool_weight,
                           shaping_steps=shaping_steps, shaping_start=shaping_start)
    if not isinstance(solution_key, str):
      raise ValueError(f"MathToolEnv.solution_key must be a str (a record's key; \"\" = "
                       f"answer_key), got {solution_key!r}")
    if solution_key and not sft_file:
      raise ValueError(f"MathToolEnv.solution_key={solution_key!r} names the worked solutions of "
                       "sft_file's records, but sft_file is not set: set sft_file (it may be the "
                       "train_file), or leave solution_key \"\"")
    for field, value in (("question_key", question_key), ("answer_key", answer_key)):
      if not isinstance(value, str) or not value:
        raise ValueError(f"MathToolEnv.{field} must be a non-empty str (a record's key), "
                         f"got {value!r}")
    if question_key == answer_key:
      raise ValueError(f"MathToolEnv.question_key and answer_key must differ, both are "
                       f"{question_key!r}")
    # Checked and resolved here (a glob pattern's files listed once); exactly these files are
    # read when the split is first asked for, and hidden from the policy's code.
    # A setting repeated (sft_file is often the train_file) is resolved once.
    resolved: dict[Any, tuple] = {}
    self._files: dict[str, str] = {}  # split -> the checked path (or pattern)
    self._file_lists: dict[str, tuple] = {}  # split -> its files
    for split, path in (("train", train_file), ("eval", eval_file), ("sft", sft_file)):
      if path != "":
        key = path if isinstance(path, str) else split  # a bad value: its own error
        if key not in resolved:
          resolved[key] = resolve_problem_file(path, f"MathToolEnv.{split}_file")
        self._files[split], self._file_lists[split] = str(resolved[key][0]), resolved[key][1]
    self.question_key, self.answer_key = question_key, answer_key
    self.solution_key = solution_key or answer_key
    self.sources, self.eval_sources = tuple(sources), tuple(eval_sources)
    self.seed = seed
    self.max_output_chars = max_output_chars
    # The problem sources are importable from the sandbox's site-packages: CHAMP ships its
    # answers, and reasoning-gym regenerates every gsm_symbolic problem with its answer from the
    # split's seed. The policy's code may not read them.
    self.sandbox = SandboxConfig.from_settings(
        "MathToolEnv", {"code_timeout_s": ("timeout_s", code_timeout_s),
                        "code_memory_mb": ("memory_mb", code_memory_mb)},
        deny_read_paths=_answer_key_paths() + tuple(dict.fromkeys(
            str(f) for files in self._file_lists.values() for f in files)))
    self.parser = XMLTagParser({"code": ("python", "code")}, answer_tag="answer", strip=False,
                               think_tag=_FORMAT.think_tag)
    self._sizes = {"train": train_size, "eval": eval_size, "sft": sft_size}
    self._cache: dict[str, list[Example]] = {}
    self._shared_reads: dict[tuple, tuple[list, set[str]]] = {}  # see _file_problems
    schedule = ProgressiveSchedule(shaping_steps, start=shaping_start) if shaping_steps else None
    self._reward = CompositeReward([
        Component("correct", SignedMathAnswer(), 1.0, role="outcome"),
        Component("format", FormatReward(_FORMAT), format_weight, role="shaping"),
        Component("tool_calls", ToolUseReward(ToolShapingConfig(
            reward_per_valid_call=1.0, max_reward=5.0)), tool_weight, role="shaping"),
    ], schedule=schedule)

  # ------------------------------------------------------------------ data
  def examples(self, split: str) -> Sequence[Example]:
    """"train", "eval" (held out: no question shared with train/sft) or "sft" (problems with a
    demonstration only)."""
    if split not in self._sizes:
      raise NoSplitError(f"unknown split {split!r}; expected one of {sorted(self._sizes)}",
                         split=split)
    if split not in self._cache and split in self._files:
      self._cache[split] = self._from_file(split)
    if split not in self._cache:
      exs = self._gsm(split) if "gsm_symbolic" in self._split_sources(split) else []
      if "champ" in self._split_sources(split) and split != "sft":
        exs += self._champ(split)
        random.Random(f"{self.seed}-{split}").shuffle(exs)
      self._cache[split] = exs
    return self._cache[split]

  def _split_sources(self, split: str) -> tuple[str, ...]:
    return self.eval_sources if split == "eval" else self.sources

  def _gsm(self, split: str) -> list[Example]:
    import reasoning_gym

    # reasoning-gym seeds item i with (seed + i): the splits' seed ranges are kept disjoint.
    offsets = {"train": 0, "sft": 10_000_000, "eval": 20_000_000}
    # A question is in one split only: sft draws around train's, eval around both, and every
    # split around the files' (a file's eval question in sft would be refused by the trainer).
    earlier = {"train": (), "sft": ("train",), "eval": ("train", "sft")}[split]
    around = [s for s in ("train", "sft", "eval") if s != split and (
        s in self._files or (s in earlier and "gsm_symbolic" in self.sources))]
    seen = {ex.metadata["question"] for s in around for ex in self.examples(s)}
    size = self._sizes[split]
    if size == 0:
      return []
    # Templates repeat a question now and then, and the sft split keeps only problems with a
    # demonstration (about 97%): draw extra.
    draw = int(size * (1.5 if split == "sft" else 1.1)) + 64
    ds = reasoning_gym.create_dataset("gsm_symbolic", size=draw,
                                      seed=self.seed * 100_000_000 + offsets[split])
    out = []
    for i, item in enumerate(ds):
      q = item["question"]
      if q in seen:
        continue
      seen.add(q)
      ex = Example(id=f"{split}-gsm-{i}", prompt=self._messages(q), gold=str(item["answer"]),
                   metadata={"source": "gsm_symbolic", "question": q,
                             "answer_cot": item["metadata"]["answer_cot"]})
      if split == "sft" and self.demonstration(ex) is None:
        continue
      out.append(ex)
      if len(out) == size:
        return out
    raise ValueError(f"could only draw {len(out)} distinct gsm_symbolic problems for split "
                     f"{split!r} (wanted {size}); lower the split size")

  def _champ(self, split: str) -> list[Example]:
    probs = champ_problems()
    random.Random(f"champ-{self.seed}").shuffle(probs)
    half = len(probs) // 2
    part = probs[:half] if split == "eval" else probs[half:]
    return [Example(id=f"{split}-champ-{pid}", prompt=self._messages(text), gold=golds,
                    metadata={"source": "champ", "question": text}) for pid, text, golds in part]

  def _file_problems(self, split: str) -> list:
    """The problems of `split`'s file, read once for every split that names the same files (an
    sft_file that is the train_file): kept until each of those splits has taken them (never
    asked for, the sft split's share stays: about the memory its examples would take)."""
    files = self._file_lists[split]
    if files not in self._shared_reads:
      users = {s for s, f in self._file_lists.items() if f == files}
      probs = read_problems(self._files[split], question_key=self.question_key,
                            answer_key=self.answer_key, owner="MathToolEnv",
                            setting=f"{split}_file", files=files,
                            record_keys=(self.solution_key,) if "sft" in users else ())
      self._shared_reads[files] = (probs, users)
    probs, users = self._shared_reads[files]
    users.discard(split)
    if not users:
      del self._shared_reads[files]
    return probs

  def _from_file(self, split: str) -> list[Example]:
    probs = self._file_problems(split)
    exs = [Example(id=f"{split}-file-{p.key}", prompt=self._messages(p.question), gold=p.gold,
                   metadata={"source": "file", "question": p.question, "where": p.where})
           for p in probs]
    return self._with_demonstrations(exs, probs) if split == "sft" else exs

  def _with_demonstrations(self, exs: list[Example], probs: list) -> list[Example]:
    """The sft_file's examples whose worked solution (`solution_key`) makes a demonstration,
    each with it as `answer_cot`; how many have none is logged, and none at all is an error."""
    kept, unusable = [], []
    for ex, p in zip(exs, probs):
      solution = lookup(p.record, self.solution_key)
      ex = dataclasses.replace(ex, metadata={**ex.metadata, "answer_cot": solution})
      if isinstance(solution, str) and self.demonstration(ex) is not None:
        kept.append(ex)
      else:
        unusable.append((p.where, "no solution key" if solution is MISSING else None))
    where = f"MathToolEnv.sft_file={self._files['sft']!r}"
    if not kept:
      raise ValueError(
          f"{where}: none of its {len(exs)} records has a worked solution that makes a code "
          f"demonstration (the {self.solution_key!r} key, MathToolEnv.solution_key, as "
          "GSM8K's answer: steps with calculator notes such as '48/2 = <<48/2=24>>24' or "
          "'48/2 = 24', ending on the final answer after '####', a number); e.g. "
          f"{unusable[0][0]}. Give a file with such solutions, or leave sft_file \"\" (the "
          "warm start then uses built-in generated problems)")
    if unusable:
      missing = sum(1 for _, why in unusable if why)
      log.warning("%s: %d of %d records have no usable worked solution (%s; %d without the %r "
                  "key) and are not in the sft split; %d demonstrations kept", where,
                  len(unusable), len(exs), ", ".join(w for w, _ in unusable[:3])
                  + (", ..." if len(unusable) > 3 else ""), missing, self.solution_key,
                  len(kept))
    return kept

  @staticmethod
  def _messages(question: str):
    return ({"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question})

  # ------------------------------------------------------------------ tools
  def new_episode(self, example: Example) -> Episode:
    """A fresh interpreter per trajectory (started on the first `<code>`, closed at the end)."""
    tool = InterpreterTool(self.sandbox)
    return Episode([tool], owned=[tool])

  def format_observation(self, result: ToolResult) -> str:
    """The output between interpreter tags, cut to `max_output_chars`.

    A failed call's error says what went wrong (the exception's last line, a timeout, a
    restarted session whose variables are lost) and is kept over the output printed before it:
    it gets at least three quarters of the limit (all of it when nothing was printed), a longer
    error loses its middle so that its first and last lines stay, and the output gets the rest.
    """
    limit = self.max_output_chars
    if result.ok:
      text, _ = truncate_text(result.output if result.output.strip() else _NO_OUTPUT, limit)
      return self.observation_template.format(output=text)
    output = result.output.rstrip()
    room = limit - min(len(output) + 1, limit // 4) if output else limit
    text = _cut_middle(f"Error: {result.error}", room)
    if output:
      output, _ = truncate_text(output, limit - len(text) - 1)
      text = f"{output}\n{text}"
    return self.observation_template.format(output=text)

  def encode_observation(self, text: str, tokenizer) -> list[int]:
    # Program output is data: it must never spell the chat template's control tokens.
    return data_continuation_ids(tokenizer, text)

  # ------------------------------------------------------------------ reward
  def reward(self, trajectory: Trajectory, example: Example, tokenizer, step: int) -> RewardOutput:
    inp = trajectory.to_reward_input(tokenizer, example.gold, metadata=example.metadata,
                                     policy_only=True)
    return self._reward(inp, step=step)

  def is_success(self, out: RewardOutput) -> bool:
    return out.components.get("correct", -1.0) >= 1.0

  def demonstration(self, example: Example):
    """The reference solution as interpreter code (gsm_symbolic), or None."""
    cot = example.metadata.get("answer_cot")
    if not isinstance(cot, str) or not cot or not isinstance(example.gold, str):
      return None
    return gsm_demonstration(cot, example.gold)

