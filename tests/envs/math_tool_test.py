"""math_tool: reference-solution parsing, demonstrations checked in the sandbox, splits, prompt,
parsing, +1/-1 reward, progressive shaping and the per-trajectory interpreter."""
import json

import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from jaxagent.agent.env import Example
from jaxagent.agent.trajectory import OBSERVATION, POLICY, demonstration_trajectory
from jaxagent.envs import make_env
from jaxagent.envs.math_tool import (SYSTEM_PROMPT, MathToolEnv, calculator_steps,
                                     champ_problems, clean_code, cot_steps, gsm_demonstration,
                                     safe_eval, steps_program)
from jaxagent.tools import PythonSession, ToolResult

GIRLS = ("There are 32 girls x 2 boys/girl = 64 boys in the garden.\n"
         "In total there are 32 girls + 64 boys = 96 kids in the garden\n#### 96")
WAGES = ("The carpenter works for 5 days every week and 2 weeks every month so he works for "
         "5 days/week * 2 weeks/month = 10 days/month\n"
         "If he earns €130 every day he then earns €130/day * 10 days/month = €1300/month\n"
         "A year is equal to 12 months so every year he earns €1300/month * 12 months/year = €15600\n"
         "The room's perimeter is 2(86+66) = 304\n"
         "#### 15600")


@pytest.fixture(scope="module")
def env():
  return MathToolEnv(train_size=24, eval_size=12, sft_size=6, seed=3)


# ----------------------------------------------------------------------------- demonstrations
def test_cot_steps_hand_worked():
  assert cot_steps(GIRLS) == [("32 * 2", 64, "boys"), ("32 + 64", 96, "kids")]
  steps = cot_steps(WAGES)
  assert [(e, v) for e, v, _ in steps] == [("5 * 2", 10), ("130 * 10", 1300), ("1300 * 12", 15600),
                                           ("2 * (86 + 66)", 304)]
  # "because 20 x 3 = 60": only the arithmetic right before '=' counts.
  assert cot_steps("£60 per person because 20 x 3 = 60") == [("20 * 3", 60, "")]
  # Algebra and restatements are not arithmetic steps.
  assert cot_steps("we get 2x+50=260\nleaving x=105\nSo 48=48") == []


def test_steps_program_names_and_reuses_results():
  lines, values = steps_program(cot_steps(GIRLS))
  assert lines == ["boys = 32 * 2", "kids = 32 + boys"]
  assert values == [64, 96]
  lines, values = steps_program([("3 * 4", 12, "for"), ("12 / 5", 2.4, "for")])
  assert lines == ["step = 3 * 4", "step_2 = step / 5"] and values == [12, 2.4]


def test_safe_eval_is_arithmetic_only():
  assert safe_eval("2 * (86 + 66) - -1") == 305
  assert safe_eval("7 / 2") == 3.5 and safe_eval("a + 1", {"a": 2}) == 3
  for bad in ("__import__('os')", "a + 1", "2 ** 3", "[1][0]"):
    with pytest.raises(ValueError):
      safe_eval(bad)


def test_demonstration_single_cell():
  segs = gsm_demonstration(GIRLS, "96")
  assert segs == [(POLICY, "<code>\nboys = 32 * 2\nkids = 32 + boys\nprint(kids)\n</code>"),
                  (OBSERVATION, "<interpreter>96\n</interpreter>"),
                  (POLICY, "<answer>96</answer>")]
  assert gsm_demonstration(GIRLS, "97") is None  # no step reaches the gold answer
  assert gsm_demonstration("we get 2x=210\nx=105\n#### 105", "105") is None


def test_demonstration_cells_match_the_sandbox():
  """The interpreter output written into a demonstration is what the sandbox prints."""
  cot = "He drank 8*3=24 ccs.\nSo he drank 24*2=48 calories.\nThen 48/5=9.6 more.\nIn all 9.6*5+2=50 cups.\n#### 50"
  segs = gsm_demonstration(cot, "50")
  codes = [t for r, t in segs if r == POLICY and t.startswith("<code>")]
  shown = [t for r, t in segs if r == OBSERVATION]
  assert len(codes) == 2, "four steps are split over two cells"
  with PythonSession(timeout_s=10) as session:
    for code, obs in zip(codes, shown):
      out = session.run(clean_code(code[len("<code>"):-len("</code>")]))
      assert out.ok, out.error
      assert obs == f"<interpreter>{out.output}</interpreter>"
  assert codes[1].startswith("<code>\nstep = calories / 5\n")  # the second cell reuses the first's names
  assert segs[-1] == (POLICY, "<answer>50</answer>")


@pytest.mark.parametrize("cot,gold", [
    ("5 - 5 = 0\n3 / 0.0000001 = 30000000 cats\n#### 30000000", "30000000"),  # 0 reused: 3 / 0
    ("9" * 400 + " * 2 = 5\n#### 5", "5"),  # an int too large for a float
    ("9" * 400 + " / 3 = 5\n#### 5", "5"),
    pytest.param("1" + " + 1" * 3000 + " = 3001\n#### 3001", "3001",  # deeper than the recursion
                 marks=pytest.mark.slow),  # limit; about a minute on a 2-core CPU
    ("2 + 3 = " + "9" * 400 + "\n#### 5", "5"),  # a stated value that overflows to inf
    ("He has 12 \u2212 4 = 8 apples; 20% of 50 = 10\n#### 8", "8"),
])
def test_demonstration_of_odd_solutions_is_none_not_an_error(cot, gold):
  assert gsm_demonstration(cot, gold) is None


def test_demonstration_rejects_non_finite_gold_and_keeps_builtins():
  for gold in ("inf", "-inf", "1e400", "nan"):
    assert gsm_demonstration(GIRLS, gold) is None, gold
  # A unit word naming a builtin does not shadow it ("print = 12" breaks the print below it).
  segs = gsm_demonstration("5 * 2 = 10 print\n10 + 2 = 12 sum\n#### 12", "12")
  assert segs[0] == (POLICY, "<code>\nstep = 5 * 2\nstep_2 = step + 2\nprint(step_2)\n</code>")


# ----------------------------------------------------------------------------- data and prompt
def test_splits_disjoint_deterministic_and_demonstrated(env):
  train, ev, sft = env.examples("train"), env.examples("eval"), env.examples("sft")
  assert (len(train), len(ev), len(sft)) == (24, 12, 6)
  q = lambda exs: {e.metadata["question"] for e in exs}  # noqa: E731
  assert not q(ev) & (q(train) | q(sft))
  assert all(env.demonstration(e) is not None for e in sft)
  again = MathToolEnv(train_size=24, eval_size=12, sft_size=6, seed=3)
  assert [e.metadata["question"] for e in again.examples("eval")] == [e.metadata["question"] for e in ev]
  other = MathToolEnv(train_size=24, eval_size=12, sft_size=6, seed=4)
  assert q(other.examples("eval")) != q(ev)


def test_train_and_sft_share_no_question():
  # With seed 1, sft's 38th draw repeats train's 40th question.
  env = MathToolEnv(train_size=40, eval_size=0, sft_size=38, seed=1)
  q = lambda s: {e.metadata["question"] for e in env.examples(s)}  # noqa: E731
  assert len(q("sft")) == 38 and not q("train") & q("sft")


def test_prompt_and_registry(env, smol_tok):
  ex = env.examples("train")[0]
  assert ex.prompt[0] == {"role": "system", "content": SYSTEM_PROMPT}
  assert ex.prompt[1]["content"] == ex.metadata["question"]
  text = smol_tok.decode(env.render_prompt(ex, smol_tok))
  assert "<code>" in text and ex.metadata["question"] in text
  assert text.rstrip().endswith("assistant")
  assert isinstance(make_env("math_tool", train_size=4), MathToolEnv)
  with pytest.raises(ValueError, match="sources"):
    MathToolEnv(sources=("gsm8k",))


def test_make_env_names_the_allowed_settings():
  with pytest.raises(ValueError, match=r"env 'math_tool': unknown setting 'train_sizes' \(did you "
                     r"mean 'train_size'\?\).*'eval_size'"):
    make_env("math_tool", train_sizes=4)
  with pytest.raises(ValueError, match=r"env 'code': unknown setting 'bogus'; its settings are: "
                     r"\['all_or_nothing'"):
    make_env("code", bogus=1)
  with pytest.raises(ValueError, match=r"unknown env 'maths'; registered envs: \['calculator'"):
    make_env("maths")
  with pytest.raises(ValueError, match=r"MathToolEnv.train_size must be an int >= 0, got '5'"):
    make_env("math_tool", train_size="5")
  # A float output limit was accepted, then every observation raised (each trajectory that ran
  # code ended 'env_error'); a string one said only "'<' not supported".
  for bad in (512.0, "512"):
    with pytest.raises(ValueError, match=r"MathToolEnv.max_output_chars must be an int >= 32"):
      make_env("math_tool", max_output_chars=bad)
  with pytest.raises(ValueError, match=r"MathToolEnv.seed must be an int, got 1.5"):
    make_env("math_tool", seed=1.5)
  # The reward's checks said "Component 'tool_calls': weight must be ..." and
  # "ProgressiveSchedule.num_steps must be an int >= 1" (0 is off), naming no setting.
  with pytest.raises(ValueError, match=r"MathToolEnv.tool_weight must be a finite number"):
    make_env("math_tool", tool_weight=None)
  with pytest.raises(ValueError, match=r"MathToolEnv.shaping_steps must be an int >= 0"):
    make_env("math_tool", shaping_steps=2.5)
  # The sandbox's limits said "SandboxConfig.timeout_s must be ...", a name the config lacks.
  with pytest.raises(ValueError, match=r"MathToolEnv.code_timeout_s=0 is refused: .*positive"):
    make_env("math_tool", code_timeout_s=0)
  with pytest.raises(ValueError, match=r"MathToolEnv.code_memory_mb='1024' is refused"):
    make_env("math_tool", code_memory_mb="1024")
  odd = MathToolEnv(train_size=0, eval_size=0, sft_size=0)
  assert odd.demonstration(Example(id="x", prompt="Q", gold="3", metadata={"answer_cot": 3})) is None


def test_champ_source_split_in_halves():
  probs = champ_problems()
  assert len(probs) > 100
  env = MathToolEnv(sources=("gsm_symbolic", "champ"), eval_sources=("champ",), train_size=4,
                    eval_size=0, sft_size=2)
  ev = {e.id for e in env.examples("eval")}
  tr = {e.id for e in env.examples("train") if e.metadata["source"] == "champ"}
  assert len(ev) + len(tr) == len(probs) and not {i.split("-", 2)[2] for i in ev} & {
      i.split("-", 2)[2] for i in tr}
  assert all(e.metadata["source"] == "gsm_symbolic" for e in env.examples("sft"))


def test_own_files_replace_the_train_and_eval_splits(tmp_path, make_traj, char_tok):
  # A built-in sft question put into the eval file: the sft split must draw around it (the
  # trainer refuses a warm start on eval prompts).
  sft_q = MathToolEnv(train_size=0, eval_size=0, sft_size=3, seed=5).examples("sft")[0]
  sft_q = sft_q.metadata["question"]
  train = tmp_path / "train.jsonl"
  train.write_text(json.dumps({"problem": "Natalia sold 48 clips in April and half as many in "
                                          "May. How many in all?",
                               "solution": "48/2 = <<48/2=24>>24\n48+24 = <<48+24=72>>72\n#### 72"})
                   + "\n\n" + json.dumps({"problem": "6 times 7?", "solution": 42}) + "\n")
  test = tmp_path / "test.array_record"
  writer = ArrayRecordWriter(str(test), "group_size:1")
  for q, a in ((sft_q, "12"), ("What is 100 minus 37?", 63)):
    writer.write(json.dumps({"problem": q, "solution": a}).encode())
  writer.close()
  env = MathToolEnv(train_file=str(train), eval_file=str(test), question_key="problem",
                    answer_key="solution", train_size=4, eval_size=5, sft_size=3, seed=5)
  tr, ev, sft = env.examples("train"), env.examples("eval"), env.examples("sft")
  assert [(e.id, e.gold) for e in tr] == [("train-file-1", "72"), ("train-file-3", "42")]
  assert [(e.id, e.gold) for e in ev] == [("eval-file-0", "12"), ("eval-file-1", "63")]
  assert ev[1].prompt == ({"role": "system", "content": SYSTEM_PROMPT},
                          {"role": "user", "content": "What is 100 minus 37?"})
  assert ev[0].metadata == {"source": "file", "question": sft_q, "where": "test.array_record record 0"}
  # The warm start keeps demonstrating on built-in problems, none of them a file's question.
  assert len(sft) == 3 and all(env.demonstration(e) is not None for e in sft)
  assert not {e.metadata["question"] for e in sft} & {e.metadata["question"] for e in tr + ev}
  # The files hold the answers: the policy's code may not read them.
  assert {str(train), str(test)} <= set(env.sandbox.deny_read_paths)
  for answer, expected in (("72", 1.0), ("71", -1.0)):
    out = env.reward(make_traj([(POLICY, f"<answer>{answer}</answer>")]), tr[0], char_tok, 0)
    assert out.components["correct"] == expected


def test_own_file_settings_are_checked_when_the_env_is_made(tmp_path):
  with pytest.raises(ValueError, match=r"MathToolEnv.train_file='.*p\.csv': unknown file format "
                     r"\(suffix '\.csv'\); a problem file is JSONL"):
    make_env("math_tool", train_file=str(tmp_path / "p.csv"))
  with pytest.raises(ValueError, match=r"MathToolEnv.eval_file='.*t\.jsonl': no such file"):
    make_env("math_tool", eval_file=str(tmp_path / "t.jsonl"))
  with pytest.raises(ValueError, match=r"MathToolEnv.train_file must be the path of a problem "
                     r"file, got 3"):
    make_env("math_tool", train_file=3)
  with pytest.raises(ValueError, match=r"MathToolEnv.answer_key must be a non-empty str"):
    make_env("math_tool", answer_key="")
  with pytest.raises(ValueError, match=r"question_key and answer_key must differ, both are 'q'"):
    make_env("math_tool", question_key="q", answer_key="q")
  # A bad record is found when the split is first read, and named there.
  (tmp_path / "t.jsonl").write_text('{"question": "Q?", "answer": 1}\n{"question": "Q2?"}\n')
  env = make_env("math_tool", eval_file=str(tmp_path / "t.jsonl"), train_size=0, sft_size=0)
  with pytest.raises(ValueError, match=r"(?s)MathToolEnv.eval_file=.*1 bad record \(of 2\).*t\.jsonl "
                     r"line 2: no 'answer' key"):
    env.examples("eval")


# ----------------------------------------------------------------------------- parsing and tool
def test_parser(env):
  p = env.parser.parse("Let me compute.\n<code>\n  x = 2\n  print(x)\n</code>")
  assert p.kind == "tool_call" and p.call.name == "python"
  assert clean_code(p.call.arguments["code"]) == "x = 2\nprint(x)\n"
  assert env.parser.parse("<answer> 42 </answer>").answer.strip() == "42"
  assert set(env.parser.stop_strings()) == {"</code>", "</answer>"}
  assert clean_code("```python\nprint(1)\n```") == "print(1)\n"


@pytest.mark.parametrize("code,clean", [
    # The closing fence ends the last line: the program was a SyntaxError.
    ("```python\nx = 6 * 7\nprint(x)```", "x = 6 * 7\nprint(x)\n"),
    ("\n```python\n  for i in range(2):\n      print(i)```\n", "for i in range(2):\n    print(i)\n"),
    # A program on the fence's line was dropped whole ("no output: print() the values you need").
    ("```python print(6 * 7)```", "print(6 * 7)\n"),
    ("```print(6 * 7)```", "print(6 * 7)\n"),
    # Blank space after the closing fence left the fence in the program.
    ("```python\nprint(6 * 7)\n```\n  ", "print(6 * 7)\n"),
    # Unchanged: fences on lines of their own, and a fence inside a string.
    ("\n```py\nprint(1)\n```\n\n", "print(1)\n"),
    ('x = """\n```\n"""\nprint(x)', 'x = """\n```\n"""\nprint(x)\n'),
])
def test_clean_code_reads_the_program_in_fences_a_model_writes(code, clean):
  assert clean_code(code) == clean
  compile(clean, "<code>", "exec")


def test_episode_has_a_persistent_interpreter_closed_at_the_end(env):
  ep = env.new_episode(env.examples("train")[0])
  tool = ep.tools.get("python")
  assert tool({"code": "x = 20"}).ok
  assert tool({"code": "\n    print(x + 1)\n"}).output == "21\n"
  assert env.new_episode(env.examples("train")[0]).tools.get("python") is not tool
  ep.close()
  assert not tool({"code": "print(1)"}).ok


def test_the_interpreter_cannot_read_the_problem_sources(env):
  """The policy's code could import champ_dataset and print the gold answer of a CHAMP problem,
  or regenerate the train split's gsm_symbolic problems, answers included, with reasoning-gym
  (seed 0 for the default seed); both packages sit in the sandbox's site-packages."""
  ex = env.examples("train")[0]
  ep = env.new_episode(ex)
  tool = ep.tools.get("python")
  try:
    for code in ("import champ_dataset\nprint(len(champ_dataset.load('v0').problems))",
                 "import reasoning_gym\nprint(reasoning_gym.create_dataset('gsm_symbolic', size=1, "
                 "seed=0)[0]['answer'])"):
      out = tool({"code": code})
      # Refused by the audit hook, or found empty where the kernel hides the directory.
      assert not out.ok and not out.output, (code, out)
    # The interpreter works as before, with the libraries a solution may use.
    out = tool({"code": "import math, fractions\nprint(math.comb(6, 2), fractions.Fraction(1, 3))"})
    assert out.ok and out.output == "15 1/3\n", out
  finally:
    ep.close()


def test_observation_format(env):
  assert env.format_observation(ToolResult.success("5\n")) == "<interpreter>5\n</interpreter>"
  assert "print()" in env.format_observation(ToolResult.success(""))
  long = env.format_observation(ToolResult.success("9" * 5000))
  assert len(long) < 600 and "truncated" in long
  err = env.format_observation(ToolResult.failure("NameError: y"))
  assert err == "<interpreter>Error: NameError: y</interpreter>"


def test_a_failed_calls_error_is_kept_over_long_output():
  """The error of a failed call outranks what it printed: with the output cut to the limit first,
  a timeout that restarted the session (variables lost) or the exception's last line was cut away,
  and the policy read only its printed output."""
  env = MathToolEnv(train_size=0, eval_size=0, sft_size=0, max_output_chars=256)
  wrap = len(env.observation_template.format(output=""))
  restart = ("Timed out after 5 s (wall clock); the program was stopped. The Python session was "
             "restarted: variables and imports from earlier calls are lost.")
  printed = "".join(f"{i}\n" for i in range(300))
  obs = env.format_observation(ToolResult.failure(restart, output=printed, timed_out=True))
  assert obs.startswith("<interpreter>0\n1\n2\n") and "truncated" in obs
  assert obs.endswith(f"Error: {restart}</interpreter>") and len(obs) <= 256 + wrap
  # A traceback longer than the limit keeps its first lines and its exception.
  trace = ("Traceback (most recent call last):\n"
           + '  File "<cell-1>", line 1, in f\n    return f(n + 1)\n' * 40
           + "RecursionError: maximum recursion depth exceeded")
  for output in ("", "x" * 1000):
    obs = env.format_observation(ToolResult.failure(trace, output=output))
    assert obs.startswith("<interpreter>" + ("x" if output else "Error: Traceback"))
    assert obs.endswith("RecursionError: maximum recursion depth exceeded</interpreter>")
    assert "characters cut" in obs and len(obs) <= 256 + wrap
  # A short error after short output is unchanged.
  assert (env.format_observation(ToolResult.failure("NameError: y", output="5\n"))
          == "<interpreter>5\nError: NameError: y</interpreter>")


# ----------------------------------------------------------------------------- reward
@pytest.mark.parametrize("segments,expected", [
    ([(POLICY, "<answer>96</answer>")], 1.0),
    ([(POLICY, "<answer>96.0</answer>")], 1.0),
    ([(POLICY, "The answer is \\boxed{96}")], 1.0),
    ([(POLICY, "<answer>95</answer>")], -1.0),
    ([(POLICY, "I do not know.")], -1.0),
    # The interpreter printing an answer tag is not the policy answering.
    ([(POLICY, "<code>print('<answer>96</answer>')</code>"),
      (OBSERVATION, "<interpreter><answer>96</answer></interpreter>")], -1.0),
    ([(POLICY, "<code>print(32 * 3)</code>"), (OBSERVATION, "<interpreter>96\n</interpreter>"),
      (POLICY, "<answer>96</answer>")], 1.0),
])
def test_reward_plus_minus_one(env, make_traj, char_tok, segments, expected):
  ex = env.examples("train")[0]
  ex = type(ex)(id=ex.id, prompt=ex.prompt, gold="96", metadata=ex.metadata)
  out = env.reward(make_traj(segments), ex, char_tok, step=0)
  assert out.components["correct"] == expected and out.total == expected
  assert env.is_success(out) == (expected == 1.0)


@pytest.mark.parametrize("segments,fmt", [
    ([(POLICY, "<think>\n32 * 3 = 96\n</think>\n\n<answer>96</answer>")], 1.0),
    ([(POLICY, "<think>\n\n</think>\n\n<code>print(32 * 3)</code>"),
      (OBSERVATION, "<interpreter>96\n</interpreter>"),
      (POLICY, "<think>It printed 96.</think>\n<answer>96</answer>")], 1.0),
    ([(POLICY, "First: <think>32 * 3 = 96</think><answer>96</answer>")], 0.0),
    ([(POLICY, "<think>32 * 3 = 96 <answer>96</answer>")], 0.0),  # never closed
])
def test_format_credits_a_leading_think_block(make_traj, char_tok, segments, fmt):
  """Qwen3-style reasoning models open each turn with <think>...</think>: format_weight > 0
  scored them 0 on format whatever they did."""
  env = MathToolEnv(train_size=2, eval_size=0, sft_size=0, format_weight=0.5)
  ex = env.examples("train")[0]
  ex = type(ex)(id=ex.id, prompt=ex.prompt, gold="96", metadata=ex.metadata)
  out = env.reward(make_traj(segments), ex, char_tok, step=0)
  assert out.components["format"] == fmt
  assert out.components["correct"] == 1.0  # an answer after an unclosed think is still read


@pytest.mark.parametrize("text,expected", [
    # What a thought tries is not the answer: the real one after it is.
    ("<think>maybe <answer>95</answer></think> So \\boxed{96}", 1.0),
    ("<think>\\boxed{95}</think> Hence #### 96", 1.0),
    ("<think>\\boxed{95}</think><answer>96</answer>", 1.0),
    ("<think>\\boxed{96}?</think> I am not sure.", -1.0),  # no answer outside the thought
    ("<think>\\boxed{96}?", -1.0),  # nor inside an unclosed one
    ("<code>print('<think>')</code>\n<answer>96</answer>", 1.0),  # a tag quoted in code
])
def test_answer_inside_think_block_is_not_the_answer(env, make_traj, char_tok, text, expected):
  ex = env.examples("train")[0]
  ex = type(ex)(id=ex.id, prompt=ex.prompt, gold="96", metadata=ex.metadata)
  assert env.reward(make_traj([(POLICY, text)]), ex, char_tok, 0).components["correct"] == expected


def test_reward_math_equivalence(env, make_traj, char_tok):
  ex = env.examples("train")[0]
  ex = type(ex)(id=ex.id, prompt=ex.prompt, gold="0.5", metadata=ex.metadata)
  out = env.reward(make_traj([(POLICY, "<answer>\\frac{1}{2}</answer>")]), ex, char_tok, 0)
  assert out.components["correct"] == 1.0


def test_progressive_shaping(make_traj, char_tok):
  env = MathToolEnv(train_size=2, eval_size=0, sft_size=0, format_weight=0.4, tool_weight=0.1,
                    shaping_steps=10, shaping_start=0.2)
  ex = env.examples("train")[0]
  ex = type(ex)(id=ex.id, prompt=ex.prompt, gold="7", metadata=ex.metadata)
  traj = make_traj([(POLICY, "<code>print(3 + 4)</code>"), (OBSERVATION, "<interpreter>7\n</interpreter>"),
                    (POLICY, "<answer>8</answer>")])
  traj.num_tool_calls = traj.valid_tool_calls = 1
  # Wrong answer (-1), format ok (1), one valid call (1): alpha(0)=0.2, alpha(5)=0.6, alpha(10)=1.
  for step, alpha in ((0, 0.2), (5, 0.6), (10, 1.0), (50, 1.0)):
    out = env.reward(traj, ex, char_tok, step)
    assert out.alpha == pytest.approx(alpha)
    assert out.components == {"correct": -1.0, "format": 1.0, "tool_calls": 1.0}
    assert out.total == pytest.approx(-alpha + (1 - alpha) * (0.4 + 0.1))


def test_tool_bonus_pays_only_for_code_that_ran():
  """Through the real rollout: five cells of garbage code (NameError, ZeroDivisionError) before
  a wrong answer earned the full tool bonus, as five cells that ran did."""
  from jaxagent.agent.rollout import RolloutConfig, rollout
  from tests.agent.rollout_test import TOK, FakeEngine

  env = MathToolEnv(train_size=2, eval_size=0, sft_size=0, tool_weight=0.1)
  ex = Example(id="x", prompt="Q: 6 times 7?", gold="42")
  cfg = RolloutConfig(max_turns=8, max_tokens_per_turn=64, tool_timeout_s=20, traj_tool_timeout_s=60)

  def run(cells, answer):
    cache = [TOK.encode(t) for t in [*cells, f"<answer>{answer}</answer>"]]
    engine = FakeEngine(lambda rid, t: cache[t] if t < len(cache) else [], slots=1, max_len=1024)
    (traj,) = rollout(engine, None, env, [ex], tokenizer=TOK, num_samples=1, cfg=cfg)
    assert traj.stop_reason == "answer" and traj.num_tool_calls == len(cells)
    return env.reward(traj, ex, TOK, 0)

  garbage = run(["<code>x</code>", "<code>1/0</code>"] * 2 + ["<code>y</code>"], "41")
  assert garbage.components == {"correct": -1.0, "format": 1.0, "tool_calls": 0.0}
  assert garbage.total == -1.0
  ran = run(["<code>print(6 * 7)</code>", "<code>x = 6</code>", "<code>print(x)</code>"], "42")
  assert ran.components["tool_calls"] == 3.0 and ran.total == pytest.approx(1.3)
  # One cell of three failed: two earn the bonus.
  mixed = run(["<code>x = 6</code>", "<code>print(x * z)</code>", "<code>print(x * 7)</code>"], "42")
  assert mixed.components["tool_calls"] == 2.0


def test_demonstration_scores_plus_one(env, smol_tok):
  from jaxagent.agent.trajectory import demonstration_trajectory
  for ex in env.examples("sft"):
    traj = demonstration_trajectory(env.render_prompt(ex, smol_tok), env.demonstration(ex), smol_tok)
    traj.finish("answer")
    assert env.reward(traj, ex, smol_tok, 0).components["correct"] == 1.0, ex.id


def test_rollout_keeps_one_interpreter_per_trajectory(env):
  """Through the real rollout driver: a variable set in turn 1 is printed in turn 2 of the same
  trajectory, another trajectory's interpreter does not have it, and the reward is +/-1."""
  from jaxagent.agent.rollout import RolloutConfig, rollout
  from tests.agent.rollout_test import TOK, FakeEngine

  texts = {0: ["<code>\nx = 6 * 7\n</code>", "<code>\nprint(x)\n</code>", "<answer>42</answer>"],
           1: ["<code>\nprint(x)\n</code>", "<answer>42</answer>"]}
  cache = {rid: [TOK.encode(t) for t in turns] for rid, turns in texts.items()}
  engine = FakeEngine(lambda rid, turn: cache[rid][turn] if turn < len(cache[rid]) else [],
                      slots=2, max_len=512)
  ex = env.examples("train")[0]
  ex = type(ex)(id=ex.id, prompt="Q: 6 times 7?", gold="42", metadata=ex.metadata)
  cfg = RolloutConfig(max_turns=4, max_tokens_per_turn=64, tool_timeout_s=20, traj_tool_timeout_s=60)
  first, second = rollout(engine, None, env, [ex], tokenizer=TOK, num_samples=2, cfg=cfg)
  assert first.observation_texts() == [env.format_observation(ToolResult.success("")),
                                      "<interpreter>42\n</interpreter>"]
  assert "NameError" in second.observation_texts()[0]
  assert (first.stop_reason, second.stop_reason) == ("answer", "answer")
  assert env.reward(first, ex, TOK, 0).total == 1.0
  assert first.valid_tool_calls == 2 and second.tool_errors == 1


@pytest.mark.parametrize("turns", [
    # The turn stops at </answer> inside a block never closed: the parser reads the answer.
    ["<code>print('<answer>42</answer>"],
    # A malformed call (its block left open) gets an error observation; the policy then answers.
    ["<code>\nprint(6 * 7)</answer>", "<answer>42</answer>"],
])
def test_reward_scores_the_answer_the_parser_read_after_an_unclosed_code_block(env, turns):
  """The reward and the rollout's parser agree: an unclosed `<code>` does not swallow the
  answer that ended the trajectory (it scored -1 although the rollout's final answer was 42)."""
  from jaxagent.agent.rollout import RolloutConfig, rollout
  from tests.agent.rollout_test import TOK, FakeEngine

  cache = [TOK.encode(t) for t in turns]
  engine = FakeEngine(lambda rid, turn: cache[turn] if turn < len(cache) else [], slots=1,
                      max_len=512)
  ex = Example(id="x", prompt="Q: 6 times 7?", gold="42")
  cfg = RolloutConfig(max_turns=4, max_tokens_per_turn=64, tool_timeout_s=20, traj_tool_timeout_s=60)
  (traj,) = rollout(engine, None, env, [ex], tokenizer=TOK, num_samples=1, cfg=cfg)
  assert (traj.stop_reason, traj.final_answer) == ("answer", "42")
  assert env.reward(traj, ex, TOK, 0).components["correct"] == 1.0
  # A closed program that prints an answer tag still has not answered; nor has an open one.
  for text in ("<code>print('<answer>42</answer>')</code>", "<code>print('\\boxed{42}')"):
    hand = demonstration_trajectory(TOK.encode("Q"), [(POLICY, text)], TOK)
    assert env.reward(hand, ex, TOK, 0).components["correct"] == -1.0


@pytest.mark.parametrize("turns,answer,correct", [
    # `</answer>` written while thinking ended the turn and 41 was the final answer.
    (["<think>maybe <answer>41</answer>? 6 * 7 is</think>\n<answer>42</answer>"], "42", 1.0),
    # `</code>` written while thinking ran the code and ended the turn.
    (["<think>I could run <code>print(41)</code></think><code>print(6 * 7)</code>",
      "<think>It printed 42.</think><answer>42</answer>"], "42", 1.0),
    # Never closed: the answer after the <think> is read, by the parser and by the reward.
    (["<think>6 * 7 = <answer>42</answer>" + chr(3)], "42", 1.0),
])
def test_rollout_reads_no_action_inside_a_think_block(env, turns, answer, correct):
  """The rollout agrees with the reward (which reads no answer inside a think block): the env's
  parser has think_tag="think", so a tag written while thinking neither ends the turn nor acts."""
  from jaxagent.agent.rollout import RolloutConfig, rollout
  from tests.agent.rollout_test import TOK, FakeEngine

  assert env.parser.think_tag == "think"
  cache = [TOK.encode(t) for t in turns]
  engine = FakeEngine(lambda rid, turn: cache[turn] if turn < len(cache) else [], slots=1,
                      max_len=512)
  ex = Example(id="x", prompt="Q: 6 times 7?", gold="42")
  cfg = RolloutConfig(max_turns=4, max_tokens_per_turn=128, tool_timeout_s=20,
                      traj_tool_timeout_s=60)
  (traj,) = rollout(engine, None, env, [ex], tokenizer=TOK, num_samples=1, cfg=cfg)
  assert [t.text for t in traj.turns] == turns
  assert (traj.stop_reason, traj.final_answer) == ("answer", answer)
  assert env.reward(traj, ex, TOK, 0).components["correct"] == correct
  if len(turns) == 2:
    assert traj.observation_texts() == ["<interpreter>42\n</interpreter>"]


@pytest.mark.parametrize("turn,answer", [
    ("<answer>42 <code></answer>", "42 <code>"),
    ("<think>6 * 7</think><answer>42<code></answer>", "42<code>"),
])
def test_a_code_tag_inside_an_answer_is_answer_text_for_parser_and_reward(env, turn, answer):
  """An answer holds a `<code>` tag as text: the rollout ends the turn at `</answer>` with the
  parser's answer "42 <code>", and the reward scores that answer (math-verify reads it as 42).
  The reward used to hide the unclosed code block, answer tag and all, and read no answer (-1)."""
  from jaxagent.agent.rollout import RolloutConfig, rollout
  from tests.agent.rollout_test import TOK, FakeEngine

  cache = [TOK.encode(turn)]
  engine = FakeEngine(lambda rid, t: cache[t] if t < len(cache) else [], slots=1, max_len=512)
  ex = Example(id="x", prompt="Q: 6 times 7?", gold="42")
  cfg = RolloutConfig(max_turns=2, max_tokens_per_turn=64, tool_timeout_s=20, traj_tool_timeout_s=60)
  (traj,) = rollout(engine, None, env, [ex], tokenizer=TOK, num_samples=1, cfg=cfg)
  assert (traj.stop_reason, traj.final_answer) == ("answer", answer)
  assert env.reward(traj, ex, TOK, 0).components["correct"] == 1.0
  wrong = Example(id="y", prompt="Q", gold="41")
  assert env.reward(traj, wrong, TOK, 0).components["correct"] == -1.0


@pytest.mark.parametrize("turns,stop", [
    # `</answer>` inside an open think block did not end the turn; the policy went on and ended
    # it by EOS: the parser reads no answer (one must end the turn), the reward read 42.
    (["<think>6 * 7 = <answer>42</answer> or is it 41?" + chr(3)], "eos"),
    (["<think>6 * 7 = <answer>42</answer> and now I check it again and again"], "max_tokens_per_turn"),
    # An answer block put together across turns: the code ran, then `42</answer>` was malformed.
    (["<answer><code>print(6 * 7)</code>", "42</answer>", "done." + chr(3)], "eos"),
])
def test_reward_reads_no_answer_where_the_rollout_read_none(env, turns, stop):
  from jaxagent.agent.rollout import RolloutConfig, rollout
  from tests.agent.rollout_test import TOK, FakeEngine

  cache = [TOK.encode(t) for t in turns]
  engine = FakeEngine(lambda rid, t: cache[t] if t < len(cache) else [], slots=1, max_len=512)
  ex = Example(id="x", prompt="Q: 6 times 7?", gold="42")
  cfg = RolloutConfig(max_turns=4, max_tokens_per_turn=60, tool_timeout_s=20, traj_tool_timeout_s=60)
  (traj,) = rollout(engine, None, env, [ex], tokenizer=TOK, num_samples=1, cfg=cfg)
  assert (traj.stop_reason, traj.final_answer) == (stop, None)
  assert env.reward(traj, ex, TOK, 0).components["correct"] == -1.0
  # A boxed answer is still read without an answer tag.
  boxed = demonstration_trajectory(TOK.encode("Q"), [(POLICY, "So \\boxed{42}." + chr(3))], TOK)
  boxed.finish("eos")
  assert env.reward(boxed, ex, TOK, 0).components["correct"] == 1.0
  # A trajectory not finished (no stop reason) is read as before.
  unfinished = demonstration_trajectory(TOK.encode("Q"), [(POLICY, "<answer>42</answer>")], TOK)
  assert env.reward(unfinished, ex, TOK, 0).components["correct"] == 1.0


def test_reward_is_linear_in_many_unclosed_tags():
  """12 s to score 8000 `<code>x<answer>` (a regex looked for each tag's close to the end)."""
  import time
  from jaxagent.envs.math_tool import SignedMathAnswer
  from jaxagent.rewards import RewardInput
  score = SignedMathAnswer()
  for blob in ("<code>x<answer>" * 8000, "<answer>x" * 15000, "<think>x<answer>" * 8000):
    # CPU time of this process, not wall time: a loaded machine stretched it past 1 s of wall.
    t = time.process_time()
    assert score(RewardInput(response_text=blob, gold="42")) == -1.0
    assert time.process_time() - t < 1.0, blob[:20]
  assert score(RewardInput(response_text="<code>x<answer>" * 3 + "42</answer>", gold="42")) == 1.0


# ----------------------------------------------------------------------------- your own SFT data
NATALIA = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
           "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")
WENG = ("Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n"
        "Working 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10")
BETTY = ("In the beginning, Betty has only 100 / 2 = $<<100/2=50>>50.\nBetty's grandparents gave "
         "her 15 * 2 = $<<15*2=30>>30.\nThis means, Betty needs 100 - 50 - 30 - 15 = "
         "$<<100-50-30-15=5>>5 more.\n#### 5")


def test_calculator_notes_give_the_steps():
  assert calculator_steps(NATALIA) == [("48 / 2", 24.0, "clips"), ("48 + 24", 72, "clips")]
  assert [(e, v) for e, v, _ in calculator_steps(WENG)] == [("12 / 60", 0.2), ("0.2 * 50", 10.0)]
  # A note that is not plain arithmetic, or whose result is not the stated one, is skipped.
  assert calculator_steps("<<2^3=8>> <<3*4=13>> <<.5*4=2>>2 cups\n#### 2") == [
      ("0.5 * 4", 2.0, "cups")]
  segs = gsm_demonstration(BETTY, "5")
  codes = [t for r, t in segs if r == POLICY and t.startswith("<code>")]
  assert len(codes) == 1 and codes[0].endswith("print(step_3)\n</code>") and segs[-1] == (
      POLICY, "<answer>5</answer>")
  # A GSM8K gold with a thousands comma is a number.
  assert gsm_demonstration("He pays 500*2 = $<<500*2=1000>>1000.\n#### 1,000", "1,000")[-1] == (
      POLICY, "<answer>1,000</answer>")
  with PythonSession(timeout_s=10) as session:  # the printed values are the sandbox's
    for cot, gold in ((NATALIA, "72"), (WENG, "10"), (BETTY, "5")):
      segs = gsm_demonstration(cot, gold)
      for (_, code), (_, obs) in zip(segs[0:-1:2], segs[1::2]):
        out = session.run(clean_code(code[len("<code>"):-len("</code>")]))
        assert out.ok and obs == f"<interpreter>{out.output}</interpreter>", (code, out)


def test_sft_file_makes_the_warm_start_from_your_worked_solutions(tmp_path, smol_tok, caplog):
  rows = [{"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
           "answer": NATALIA},
          {"question": "How many more does Betty need?", "answer": BETTY},
          {"question": "No steps?", "answer": "#### 7"},  # no worked solution: left out, said
          {"question": "Weng earns $12 an hour. 50 minutes?", "answer": WENG}]
  train = tmp_path / "train-00000-of-00002.jsonl"
  train.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
  (tmp_path / "train-00001-of-00002.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in rows[2:]))
  pattern = str(tmp_path / "train-*.jsonl")
  with caplog.at_level("WARNING", logger="jaxagent.envs.math_tool"):
    env = MathToolEnv(train_file=pattern, sft_file=pattern, train_size=0, eval_size=4, seed=1)
    sft = env.examples("sft")
  assert [(e.id, e.gold, e.metadata["where"]) for e in sft] == [
      ("sft-file-0-1", "72", "train-00000-of-00002.jsonl line 1"),
      ("sft-file-0-2", "5", "train-00000-of-00002.jsonl line 2"),
      ("sft-file-1-2", "10", "train-00001-of-00002.jsonl line 2")]
  assert "1 of 4 records have no usable worked solution (train-00001-of-00002.jsonl line 1; 0 " \
         "without the 'answer' key) and are not in the sft split; 3 demonstrations kept" in caplog.text
  assert [e.id for e in env.examples("train")] == ["train-file-0-1", "train-file-0-2",
                                                   "train-file-1-1", "train-file-1-2"]
  # Every shard is hidden from the policy's code; the eval split draws around the files.
  assert {str(p) for p in tmp_path.glob("train-*.jsonl")} <= set(env.sandbox.deny_read_paths)
  assert not {e.metadata["question"] for e in env.examples("eval")} & {r["question"] for r in rows}
  # With the real tokenizer, each demonstration is a well-formed ledger the reward scores +1:
  # only the policy's text trains.
  for ex in sft:
    segs = env.demonstration(ex)
    traj = demonstration_trajectory(env.render_prompt(ex, smol_tok), segs, smol_tok, env=env)
    traj.finish("answer")
    assert env.reward(traj, ex, smol_tok, 0).components["correct"] == 1.0, ex.id
    assert traj.observation_texts() == [t for r, t in segs if r == OBSERVATION]
    policy = smol_tok.decode([t for t, m in zip(traj.token_ids, traj.train_mask()) if m])
    assert "<code>" in policy and f"<answer>{ex.gold}</answer>" in policy
    assert "<interpreter>" not in policy


def test_sft_file_settings_and_a_file_without_solutions(tmp_path):
  path = tmp_path / "plain.jsonl"
  path.write_text(json.dumps({"q": "6 times 7?", "a": 42, "steps": "6*7 = <<6*7=42>>42"}) + "\n"
                  + json.dumps({"q": "Half of 9?", "a": "4.5"}) + "\n")
  env = MathToolEnv(sft_file=str(path), question_key="q", answer_key="a", solution_key="steps",
                    train_size=0, eval_size=0)
  assert [(e.id, e.gold) for e in env.examples("sft")] == [("sft-file-1", "42")]
  with pytest.raises(ValueError, match=r"MathToolEnv\.sft_file='.*plain\.jsonl': none of its 2 "
                                       r"records has a worked solution .*the 'a' key, "
                                       r"MathToolEnv\.solution_key.*plain\.jsonl line 1.*leave "
                                       r"sft_file \"\""):
    MathToolEnv(sft_file=str(path), question_key="q", answer_key="a", train_size=0,
                eval_size=0).examples("sft")
  with pytest.raises(ValueError, match=r"MathToolEnv\.solution_key='steps' names the worked "
                                       r"solutions of sft_file's records, but sft_file is not set"):
    MathToolEnv(solution_key="steps")


def test_a_glob_pattern_is_resolved_once_at_construction(tmp_path):
  # The sandbox hides the pattern's files as listed at construction; the split, read later,
  # reads exactly those: a shard written in between is neither read nor left readable.
  (tmp_path / "train-00000.jsonl").write_text(json.dumps({"question": "1+1?", "answer": 2}) + "\n")
  env = MathToolEnv(train_file=str(tmp_path / "train-*.jsonl"), train_size=0, eval_size=1,
                    sft_size=0)
  late = tmp_path / "train-00001.jsonl"
  late.write_text(json.dumps({"question": "2+2?", "answer": 4}) + "\n")
  assert [e.metadata["question"] for e in env.examples("train")] == ["1+1?"]
  assert str(late) not in env.sandbox.deny_read_paths


def test_a_file_that_is_both_train_file_and_sft_file_is_read_once(tmp_path, monkeypatch):
  from jaxagent.envs import math_tool
  reads = []
  real = math_tool.read_problems
  monkeypatch.setattr(math_tool, "read_problems",
                      lambda path, **kw: reads.append((path, kw["setting"])) or real(path, **kw))
  path = tmp_path / "gsm8k.jsonl"
  path.write_text(json.dumps({"question": "Clips?", "answer": NATALIA}) + "\n"
                  + json.dumps({"question": "Plain?", "answer": "#### 7"}) + "\n")
  other = tmp_path / "test.jsonl"
  other.write_text(json.dumps({"question": "Eval?", "answer": 3}) + "\n")
  env = MathToolEnv(train_file=str(path), sft_file=str(path), eval_file=str(other),
                    train_size=0, eval_size=0)
  assert [e.id for e in env.examples("sft")] == ["sft-file-1"]
  assert [(e.id, e.gold) for e in env.examples("train")] == [("train-file-1", "72"),
                                                             ("train-file-2", "7")]
  assert [e.id for e in env.examples("eval")] == ["eval-file-1"]
  assert reads == [(str(path), "sft_file"), (str(other), "eval_file")]
  assert env._shared_reads == {}  # nothing kept once both splits have their examples
