"""`MixtureEnv`: several tasks in one run, each trajectory run and scored by its own task."""
import numpy as np
import pytest

from jaxagent.agent import OBSERVATION, CalculatorEnv, Env, Example, RolloutConfig, RolloutDriver
from jaxagent.agent.env import NoSplitError, lacks_split
from jaxagent.agent.parsers import XMLTagParser
from jaxagent.envs import make_env
from jaxagent.envs.mixture import MixtureEnv
from jaxagent.rewards import RewardOutput
from jaxagent.tools import ToolRegistry, function_tool
from tests.agent.rollout_test import EOS, TOK, FakeEngine


class Calc(CalculatorEnv):
  """`<calc>` calls, `<result>` observations, `<answer>`; has an "sft" split."""

  def examples(self, split):
    n = {"train": 4, "eval": 3, "sft": 2}[split]
    return [Example(f"{split}{i}", f"{i}+1", gold=str(i + 1), metadata={"expression": f"{i}+1"})
            for i in range(n)]


@function_tool
def shout(text: str) -> str:
  """The text in capitals."""
  return text.upper()


class Echo(Env):
  """`<shout>` calls, `[...]` observations, `<final>` answers; no "sft" split."""

  name = "echo"
  observation_template = "[{output}]"
  reward_threads = 2

  def __init__(self):
    self.parser = XMLTagParser({"shout": ("shout", "text")}, answer_tag="final")
    self.tools = ToolRegistry([shout])

  def examples(self, split):
    if split == "sft":
      raise ValueError("no sft split")
    n = {"train": 2, "eval": 5}[split]
    return [Example(f"{split}{i}", f"say w{i}", gold=f"W{i}") for i in range(n)]

  def reward(self, trajectory, example, tokenizer, step):
    answer = trajectory.turns[-1].answer if trajectory.turns else None
    hit = float(answer == example.gold)
    return RewardOutput(total=hit, components={"match": hit}, weights={"match": 1.0})

  def is_success(self, out):
    return out.components["match"] >= 1.0


def _mixture(**kw):
  return MixtureEnv({"calc": Calc(), "echo": Echo()}, **kw)


def test_examples_are_prefixed_tagged_and_interleaved():
  env = _mixture()
  ev = env.examples("eval")
  # One task at a time, so that eval.size = n takes about n / 2 of each.
  assert [e.id for e in ev] == ["calc/eval0", "echo/eval0", "calc/eval1", "echo/eval1",
                                "calc/eval2", "echo/eval2", "echo/eval3", "echo/eval4"]
  assert [e.metadata["task"] for e in ev[:2]] == ["calc", "echo"]
  assert ev[0].metadata["expression"] == "0+1" and ev[0].gold == "1"
  assert [env.task_of(e) for e in ev[:2]] == ["calc", "echo"]
  assert env.task_of("echo/eval3") == "echo"
  assert isinstance(env.env_for(ev[0]), Calc) and isinstance(env.env_for(ev[1]), Echo)
  # A task without an "sft" split gives no demonstrations; the others still do.
  assert [e.id for e in env.examples("sft")] == ["calc/sft0", "calc/sft1"]
  assert env.demonstration(env.examples("sft")[0])[0][1] == "<calc>0+1</calc>"
  assert env.examples("train") is env.examples("train")  # built once
  # Reward threads: as far as every task allows.
  assert env.reward_threads == 1 and MixtureEnv({"a": Echo(), "b": Echo()}).reward_threads == 2


class NoSplit(Echo):
  """No "sft" split, said the way `examples` is given: `error`."""

  def __init__(self, error):
    super().__init__()
    self.error = error

  def examples(self, split):
    if split == "sft":
      raise self.error
    return super().examples(split)


@pytest.mark.parametrize("error", [
    NoSplitError("Echo has no demonstrations", split="sft"), NoSplitError("no demonstrations"),
    KeyError("sft"), NotImplementedError("no examples"),
    # Envs written before NoSplitError, which said so in words.
    ValueError("unknown split 'sft'; expected one of ['eval', 'train']"),
    ValueError("No 'sft' split here"),
    ValueError("MCPToolEnv has no demonstrations to warm-start on")])
def test_a_task_without_an_sft_split_gives_no_demonstrations(error, caplog):
  env = MixtureEnv({"calc": Calc(), "echo": NoSplit(error)})
  with caplog.at_level("WARNING", logger="jaxagent.envs.mixture"):
    assert [e.id for e in env.examples("sft")] == ["calc/sft0", "calc/sft1"]
  assert "mixture task 'echo' has no 'sft' examples" in caplog.text


@pytest.mark.parametrize("error", [
    ValueError("sft.jsonl line 3: not JSON"), ValueError("file not found"), KeyError("answer"),
    FileNotFoundError("sft.jsonl"), RuntimeError("unknown split 'sft'"),
    # Raised inside examples("sft") about another split: the sft split failed to load.
    NoSplitError("unknown split 'train'", split="train")])
def test_a_task_whose_sft_split_fails_to_load_names_the_task(error):
  """A broken "sft" data file was skipped with the warning of a task that has no "sft" split,
  so the warm start quietly trained on the other tasks only."""
  env = MixtureEnv({"calc": Calc(), "echo": NoSplit(error)})
  with pytest.raises(ValueError, match=r"mixture task 'echo' \(NoSplit\) cannot give its 'sft' "
                     rf"examples: {type(error).__name__}: ") as e:
    env.examples("sft")
  assert e.value.__cause__ is error


def test_a_built_in_task_without_the_split_is_skipped_and_a_task_without_eval_is_named():
  """The built-in tasks say "no such split" with NoSplitError, which the mixture reads by its
  class: a task without an "sft" split is left out of it; one without "eval" makes the
  mixture's eval split a NoSplitError naming the task (it was a plain ValueError)."""
  class NoSft(Echo):
    def examples(self, split):
      if split == "sft":
        return make_env("quickstart", train_size=4, eval_size=2, sft_size=2).examples("tests")
      return super().examples(split)

  class NoEval(Calc):
    def examples(self, split):
      if split == "eval":
        raise NoSplitError("NoEval keeps no held-out examples", split="eval")
      return super().examples(split)

  with pytest.raises(ValueError, match=r"mixture task 'echo' \(NoSft\) cannot give its 'sft' "
                     r"examples: NoSplitError: unknown split 'tests'") as e:
    MixtureEnv({"calc": Calc(), "echo": NoSft()}).examples("sft")  # "tests" is not "sft"
  # Its words quote "unknown split", but the trainer's warm start reads a load failure.
  assert not lacks_split(e.value, "sft")
  env = MixtureEnv({"calc": NoEval(), "echo": Echo()})
  assert [e.id for e in env.examples("sft")] == ["calc/sft0", "calc/sft1"]
  with pytest.raises(NoSplitError, match=r"mixture task 'calc' \(NoEval\) has no 'eval' split: "
                     r"NoSplitError: NoEval keeps no held-out examples") as e:
    env.examples("eval")
  assert e.value.split == "eval"
  quick = make_env("quickstart", train_size=4, eval_size=2, sft_size=2)
  with pytest.raises(NoSplitError, match=r"mixture task 'q' \(ArithmeticToolEnv\) has no "
                     r"'test' split: NoSplitError: unknown split 'test'"):
    MixtureEnv({"q": quick}).examples("test")


def test_weights_set_each_task_s_share_of_the_train_split():
  env = _mixture(weights={"calc": 1.0, "echo": 2.0})
  train = env.examples("train")
  tasks = [e.metadata["task"] for e in train]
  assert len(train) == 6 and tasks.count("calc") == 2 and tasks.count("echo") == 4
  # echo has 2 examples: each twice; calc has 4: a seeded subset of 2.
  assert sorted(e.id for e in train if e.metadata["task"] == "echo") == [
      "echo/train0", "echo/train0", "echo/train1", "echo/train1"]
  assert [e.id for e in train] == [e.id for e in _mixture(weights={"calc": 1, "echo": 2}).examples("train")]
  assert len({e.id for e in train if e.metadata["task"] == "calc"}) == 2
  zero = _mixture(weights={"calc": 0.0, "echo": 1.0}).examples("train")
  assert {e.metadata["task"] for e in zero} == {"echo"}
  # Without weights: every example once.
  assert len(_mixture().examples("train")) == 6
  # A weight too small for one example of the 6 is named, not dropped silently.
  with pytest.raises(ValueError, match=r"mixture task 'calc': weight 0.01 .* rounds to none"):
    _mixture(weights={"calc": 0.01, "echo": 1.0}).examples("train")


@pytest.mark.parametrize("kwargs, match", [
    (dict(tasks={}), "needs `tasks`"),
    (dict(tasks={"a/b": {"env": "quickstart"}}), "without '/'"),
    (dict(tasks={"a": {"env": "quickstart", "max_terms": 3}}), r"unknown key\(s\) \['max_terms'\]"),
    (dict(tasks={"a": {"env": "nope"}}), "mixture task 'a': unknown env 'nope'"),
    (dict(tasks={"a": {"env": "quickstart", "kwargs": {"max_term": 3}}}),
     "mixture task 'a': bad settings for env 'quickstart': unknown setting 'max_term'"),
    (dict(tasks={"a": {"env": "mixture"}}), "cannot hold another mixture"),
    (dict(tasks={"a": {"env": "quickstart", "weight": 1.0}, "b": {"env": "calculator"}}),
     r"either every task has one or none does; missing for \['b'\]"),
    (dict(tasks={"a": {"env": "quickstart", "weight": -1.0}}), "weight -1.0 must be a finite"),
    (dict(tasks={"a": {"env": "quickstart", "weight": 0.0}}), "all 0"),
    (dict(tasks={"a": {"env": "quickstart"}}, weights={"b": 1.0}), r"unknown task\(s\) \['b'\]"),
])
def test_bad_settings_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    make_env("mixture", **kwargs)


def test_a_task_with_another_observation_setting_is_refused():
  class Obs(Echo):
    train_on_observations = True
  with pytest.raises(ValueError, match="disagree on train_on_observations"):
    MixtureEnv({"a": Echo(), "b": Obs()})


def test_built_from_config_settings():
  env = make_env("mixture", tasks={"arith": {"env": "quickstart", "weight": 2.0,
                                            "kwargs": {"train_size": 8, "eval_size": 4}},
                                   "calc": {"env": "calculator", "weight": 1.0}})
  assert type(env.envs["arith"]).__name__ == "ArithmeticToolEnv"
  assert env.weights == {"arith": 2.0, "calc": 1.0}


def _texts(script_by_rid):
  enc = {rid: [TOK.encode(t) + ([EOS] if t.endswith("!") else []) for t in turns]
         for rid, turns in script_by_rid.items()}

  def script(rid, turn):
    turns = enc[rid]
    return turns[turn] if turn < len(turns) else [EOS]
  return script


def test_each_trajectory_stops_calls_and_observes_with_its_own_task():
  """One batch holding both tasks: a calc trajectory stops at `</calc>` and reads `<result>`;
  an echo trajectory that writes `</calc>` goes on to its own `</shout>`, calls its own tool
  and reads `[...]`; each is scored by its task's reward and success test."""
  env = _mixture()
  exs = env.examples("eval")[:2]  # calc/eval0, echo/eval0
  engine = FakeEngine(_texts({
      0: ["<calc>0+1</calc>", "<answer>1</answer>"],
      1: ["not </calc> mine <shout>w0</shout>", "<final>W0</final>"],
  }), slots=2)
  with RolloutDriver(engine, env, tokenizer=TOK, cfg=RolloutConfig(max_turns=3)) as driver:
    calc, echo = driver.run(None, exs, num_samples=1)
  assert [t.text for t in calc.turns] == ["<calc>0+1</calc>", "<answer>1</answer>"]
  assert calc.turns[0].observation_text == "<result>1</result>"
  assert [t.text for t in echo.turns] == ["not </calc> mine <shout>w0</shout>", "<final>W0</final>"]
  assert echo.turns[0].observation_text == "[W0]"
  obs = [TOK.decode(np.asarray(tr.tokens)[np.asarray(tr.roles) == OBSERVATION])
         for tr in (calc, echo)]
  assert obs == ["<result>1</result>", "[W0]"]
  outs = [env.reward(tr, ex, TOK, 0) for tr, ex in zip((calc, echo), exs)]
  assert outs[0].components["correct"] == 1.0 and outs[1].components["match"] == 1.0
  assert [env.env_for(ex).is_success(o) for ex, o in zip(exs, outs)] == [True, True]
  with pytest.raises(TypeError, match="env_for"):
    env.is_success(outs[0])


def test_the_driver_checks_every_task_s_parser():
  class NoParser(Echo):
    def __init__(self):
      super().__init__()
      self.parser = None
  with pytest.raises(ValueError, match="env 'echo' needs a `parser`"):
    RolloutDriver(FakeEngine(_texts({})), MixtureEnv({"a": Calc(), "b": NoParser()}),
                  tokenizer=TOK)


def test_eval_counts_success_by_each_task_s_test_and_logs_pass_at_1_per_task():
  """The trainer's eval asks the example's task whether it succeeded (the mixture has no test
  of its own) and logs `eval/task/<label>/pass@1` beside the overall pass@1."""
  import types

  import ml_collections

  from jaxagent.agent import Trajectory
  from jaxagent.trainer import Trainer
  env = _mixture()
  exs = env.examples("eval")[:4]  # calc0, echo0, calc1, echo1
  t = Trainer.__new__(Trainer)
  t.config = ml_collections.ConfigDict({"eval": {"pass_k": 1}, "seed": 0,
                                        "log": {"dump_every": 0, "dump_count": 0}})
  t.env, t.eval_examples, t.step = env, exs, 3
  t.greedy = types.SimpleNamespace(run=lambda params, exs, **kw: [
      Trajectory(request_id=i, group_id=i, example_id=ex.id) for i, ex in enumerate(exs)])
  t._log_compiles = lambda *a: None
  # calc0 right, echo0 wrong, calc1 wrong, echo1 right; each in its own task's components.
  hits = {"calc/eval0": 1.0, "echo/eval0": 0.0, "calc/eval1": 0.0, "echo/eval1": 1.0}

  def score(trajs, exs, step):
    return [RewardOutput(total=hits[ex.id],
                         components={("correct" if ex.id.startswith("calc") else "match"):
                                     hits[ex.id]}, weights={}) for ex in exs]
  t._score = score
  m = t._evaluate(None, "eval")
  assert m["eval/pass@1"] == 0.5 and m["eval/errors/is_success"] == 0.0
  assert m["eval/task/calc/pass@1"] == 0.5 and m["eval/task/echo/pass@1"] == 0.5
  hits.update({"echo/eval1": 0.0, "calc/eval1": 1.0})
  m = t._evaluate(None, "eval")
  assert m["eval/task/calc/pass@1"] == 1.0 and m["eval/task/echo/pass@1"] == 0.0


def test_per_task_means_and_nothing_for_one_task():
  from jaxagent.trainer import _per_task
  env = _mixture()
  ids = ["calc/a", "echo/b", "calc/c"]
  assert _per_task(env, ids, [1.0, 0.5, 0.0], "reward/task/{}") == {
      "reward/task/calc": 0.5, "reward/task/echo": 0.5}
  assert _per_task(Calc(), ids, [1.0, 0.5, 0.0], "reward/task/{}") == {}
  # A task the step drew no example of has no key (README: absent, not NaN).
  assert _per_task(env, ["calc/a"], [1.0], "reward/task/{}") == {"reward/task/calc": 1.0}
  with pytest.raises(ValueError, match="not one of this mixture's"):
    _per_task(env, ["other/x"], [1.0], "reward/task/{}")


def test_weighted_subsets_are_drawn_with_the_run_s_seed_unless_the_mixture_sets_one():
  """The subsets were drawn with the mixture's own `seed` (default 0) whatever the run's seed:
  runs of every seed trained on the same subset of each task."""
  def draw(seed=None, run_seed=None):
    env = MixtureEnv({"calc": Calc(), "echo": Echo()}, weights={"calc": 1.0, "echo": 1.0},
                     seed=seed)  # 6 examples: calc 3 of its 4, echo its 2 and 1 of them again
    if run_seed is not None:
      env.use_run_seed(run_seed)
    return [e.id for e in env.examples("train")]
  by_run_seed = {draw(run_seed=s)[:3].__repr__() for s in range(8)}
  assert len(by_run_seed) > 1  # the run's seed reaches the subsets
  assert draw(run_seed=3) == draw(seed=3) and draw() == draw(seed=0)
  # A seed of the mixture's own wins.
  assert all(draw(seed=0, run_seed=s) == draw(seed=0) for s in range(8))
  env = MixtureEnv({"calc": Calc(), "echo": Echo()}, weights={"calc": 1.0, "echo": 1.0})
  env.examples("train")
  with pytest.raises(RuntimeError, match="after the train split was drawn"):
    env.use_run_seed(1)
  with pytest.raises(ValueError, match="mixture seed must be an int, got 1.5"):
    MixtureEnv({"calc": Calc()}, seed=1.5)


def test_the_trainer_gives_a_weighted_mixture_the_run_s_seed(tmp_path):
  from configs.quickstart import get_config
  from jaxagent.trainer import Trainer
  c = get_config("tiny")
  c.workdir, c.seed, c.log.tensorboard = str(tmp_path / "run"), 5, False
  tasks = {"short": {"env": "quickstart", "weight": 1.0, "kwargs": {**c.env.kwargs, "max_terms": 3}},
           "long": {"env": "quickstart", "weight": 3.0, "kwargs": {**c.env.kwargs, "min_terms": 4}}}
  c.env.name, c.env.kwargs = "mixture", {"tasks": tasks}
  trainer = Trainer(c)
  try:
    got = [e.id for e in trainer.train_examples]
  finally:
    trainer.close()
  assert trainer.env.seed == 5
  kwargs = c.env.kwargs.to_dict()  # its tasks in the config's order
  assert got == [e.id for e in make_env("mixture", **kwargs, seed=5).examples("train")]
  assert got != [e.id for e in make_env("mixture", **kwargs, seed=0).examples("train")]


@pytest.mark.slow  # a whole tiny run, about 30 s on 2 cores; the tests above cover each part
def test_a_tiny_run_of_two_tasks_logs_each_task(tmp_path):
  import json

  from configs.quickstart import get_config
  from jaxagent.trainer import Trainer
  c = get_config("tiny")
  c.workdir = str(tmp_path / "run")
  c.total_steps, c.eval.before, c.sft.steps, c.log.tensorboard = 1, False, 0, False
  c.train.zero_variance = "keep"
  arith = dict(c.env.kwargs)
  c.env.name = "mixture"
  c.env.kwargs = {"tasks": {"short": {"env": "quickstart", "kwargs": {**arith, "max_terms": 3}},
                            "long": {"env": "quickstart", "kwargs": {**arith, "min_terms": 4}}}}
  trainer = Trainer(c)
  try:
    trainer.run()
  finally:
    trainer.close()
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  step1 = next(r for r in rows if r["step"] == 1 and "reward/mean" in r)
  assert {"reward/task/short", "reward/task/long", "eval/task/short/pass@1",
          "eval/task/long/pass@1"} <= set(step1), sorted(step1)
  samples = (tmp_path / "run" / "samples" / "step_000001.jsonl").read_text()
  assert '"short/' in samples and '"long/' in samples


def test_sft_demonstrations_are_tokenized_and_parsed_by_each_task():
  """A mixture's warm-start sequences are those of its tasks: each demonstration's
  observations are tokenized by its own task's `encode_observation`, as its rollouts are (the
  mixture's own default framed them otherwise)."""
  from jaxagent.trainer import sft_items

  class Bracketed(Calc):
    """Observations framed by ids of their own, as a task whose tool output is data."""

    def encode_observation(self, text, tokenizer):
      return [400] + tokenizer.encode(text) + [401]

  task = Bracketed()
  env = MixtureEnv({"b": task, "echo": Echo()})
  mixed, own = env.examples("sft"), task.examples("sft")
  assert [e.id for e in mixed] == ["b/sft0", "b/sft1"]
  got, want = sft_items(env, mixed, TOK), sft_items(task, own, TOK)
  assert [i.tokens.tolist() for i in got] == [i.tokens.tolist() for i in want]
  assert [i.loss_mask.tolist() for i in got] == [i.loss_mask.tolist() for i in want]
  assert 400 in got[0].tokens.tolist()
  # The mixture has no observation format of its own to fall back on.
  with pytest.raises(TypeError, match=r"env_for\(example\)\.encode_observation"):
    env.encode_observation("<result>1</result>", TOK)
  with pytest.raises(TypeError, match=r"env_for\(example\)\.format_observation"):
    env.format_observation(None)


def test_each_example_reaches_its_task_as_itself_when_splits_share_ids():
  """Ids are unique within a split, not across splits: a task whose train and eval examples
  are both numbered from 0 gets its own train example back for a train example (its prompt,
  gold and metadata), not the eval example of the same id read after it."""
  seen = []

  class Numbered(Echo):
    def examples(self, split):
      return [Example(str(i), f"{split} prompt {i}", gold=f"{split}-{i}",
                      metadata={"split": split}) for i in range(2)]

    def new_episode(self, example):
      seen.append(("episode", example))
      return super().new_episode(example)

    def reward(self, trajectory, example, tokenizer, step):
      seen.append(("reward", example))
      return super().reward(trajectory, example, tokenizer, step)

  task = Numbered()
  env = MixtureEnv({"n": task, "echo": Echo()})
  train, ev = env.examples("train"), env.examples("eval")
  tr0 = next(e for e in train if e.id == "n/0")
  ev0 = next(e for e in ev if e.id == "n/0")
  assert TOK.decode(env.render_prompt(tr0, TOK)) == "train prompt 0"
  assert TOK.decode(env.render_prompt(ev0, TOK)) == "eval prompt 0"
  env.new_episode(tr0)
  from jaxagent.agent import Trajectory
  env.reward(Trajectory(request_id=0), tr0, TOK, 0)
  env.reward(Trajectory(request_id=1), ev0, TOK, 0)
  assert [(what, ex.id, ex.gold, ex.metadata) for what, ex in seen] == [
      ("episode", "0", "train-0", {"split": "train"}),
      ("reward", "0", "train-0", {"split": "train"}),
      ("reward", "0", "eval-0", {"split": "eval"})]
  # An equal copy (an example rebuilt elsewhere) finds its task's example too, also when its
  # metadata holds arrays (whose `==` raises).
  import dataclasses
  assert TOK.decode(env.render_prompt(dataclasses.replace(tr0), TOK)) == "train prompt 0"
  arrays = MixtureEnv({"e": Echo()})
  arrays.envs["e"].examples = lambda split: [
      Example("0", f"{split} 0", metadata={"x": np.arange(3)}) for _ in range(1)]
  tr, ev = arrays.examples("train")[0], arrays.examples("eval")[0]
  rebuilt = lambda ex: dataclasses.replace(ex, metadata={**ex.metadata, "x": np.arange(3)})
  assert arrays.env_for(rebuilt(ev)) is arrays.envs["e"]
  assert TOK.decode(arrays.render_prompt(rebuilt(tr), TOK)) == "train 0"
