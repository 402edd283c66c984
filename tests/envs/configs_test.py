"""configs/math_tool.py, search_qa.py, code.py: every variant has the quickstart's keys and
settings its task accepts; the tiny variant of each runs end to end on a CPU."""
import importlib
import inspect
import json
import os
import pathlib
import subprocess
import sys

import ml_collections
import pytest

from jaxagent.config_files import load_config_module
from jaxagent.envs import REGISTRY, make_env
from tests.conftest import CPU_TEST_XLA_FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = ("math_tool", "search_qa", "code")
VARIANTS = ("", "tiny", "gpu", "qwen")
# The outcome reward each task logs (as `reward/<name>`).
OUTCOME = {"math_tool": "correct", "search_qa": "exact_match", "code": "tests"}


def _load(name: str):
  return load_config_module(ROOT / "configs" / f"{name}.py")


def _keys(cfg: ml_collections.ConfigDict, prefix="") -> set[str]:
  out = set()
  for k, v in cfg.items():
    out.add(prefix + k)
    if isinstance(v, ml_collections.ConfigDict) and k != "kwargs":
      out |= _keys(v, f"{prefix}{k}.")
  return out


@pytest.mark.parametrize("name", CONFIGS)
def test_variants_have_the_quickstart_layout(name):
  reference = _keys(_load("quickstart").get_config())
  module = _load(name)
  assert module.__doc__ and "python -m jaxagent.launch --config=configs/" in module.__doc__
  assert "Expected" in module.__doc__
  for variant in VARIANTS:
    cfg = module.get_config(variant)
    assert _keys(cfg) == reference, variant
    assert cfg.env.name == name and name in REGISTRY
    # Every env setting is a keyword of the task's constructor.
    module_name, cls = REGISTRY[name].split(":")
    params = inspect.signature(getattr(importlib.import_module(module_name), cls)).parameters
    assert set(cfg.env.kwargs) <= set(params), set(cfg.env.kwargs) - set(params)
    assert cfg.train.len_buckets[-1] == cfg.train.pack_len
    assert cfg.rollout.max_len <= cfg.train.pack_len or variant in ("gpu", "qwen")
  assert module.get_config("tiny").model.path == "tiny-llama"
  assert module.get_config("tiny").model.tokenizer == "smollm2-135m-instruct"
  with pytest.raises(ValueError, match="unknown"):
    module.get_config("huge")


# The tiny runs go in one fresh interpreter with a single CPU device: under this suite's 8 fake
# devices every step would be sharded 8 ways over two cores, several times slower.
_RUN_TINY = """
import json, sys, traceback
from jaxagent.config_files import load_config
from jaxagent.trainer import Trainer
root, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
for name in names:
    cfg = load_config(f"{root}/configs/{name}.py", "tiny")
    cfg.workdir = f"{out}/{name}"
    if name == "search_qa":
        cfg.env.kwargs.data_dir = f"{out}/tfds"
    try:
        trainer = Trainer(cfg)
        try:
            summary = trainer.run()
        finally:
            trainer.close()
        print("RESULT", json.dumps({"name": name, "summary": summary}), flush=True)
    except Exception:
        print("RESULT", json.dumps({"name": name, "error": traceback.format_exc()}), flush=True)
"""


@pytest.fixture(scope="module")
def tiny_runs(request, tmp_path_factory):
  # Only the configs whose test this session runs (math_tool in the default run; all three,
  # about 70 s on 2 cores, with -m slow).
  names = [n for n in CONFIGS if any(
      getattr(item, "originalname", "") == "test_tiny_config_runs"
      and item.callspec.params["name"] == n for item in request.session.items)]
  out = tmp_path_factory.mktemp("tiny")
  env = dict(os.environ, XLA_FLAGS=CPU_TEST_XLA_FLAGS)  # one device
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, "-c", _RUN_TINY, str(ROOT), str(out), *names],
                        capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
  results = {}
  for line in proc.stdout.splitlines():
    if line.startswith("RESULT "):
      r = json.loads(line[len("RESULT "):])
      results[r["name"]] = r
  assert results, f"the tiny runs printed no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
  return out, results


@pytest.mark.parametrize("name", [
    "math_tool", pytest.param("search_qa", marks=pytest.mark.slow),
    pytest.param("code", marks=pytest.mark.slow)])
def test_tiny_config_runs(name, tiny_runs):
  out, results = tiny_runs
  assert name in results, f"no result for {name}"
  assert "error" not in results[name], results[name].get("error")
  assert "pass@1/after_rl" in results[name]["summary"]
  run = out / name
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in rows if r["step"] >= 1 and "reward/mean" in r]
  assert [r["step"] for r in steps] == [1, 2]
  for r in steps:
    assert f"reward/{OUTCOME[name]}" in r and "reward/total" in r and "rollout/num_trajectories" in r
  assert any("sft/loss" in r for r in rows)
  assert (run / "summary.json").exists()


def test_make_env_rejects_unknown_settings():
  with pytest.raises(ValueError, match="bad settings for env 'code'"):
    make_env("code", no_such_knob=1)


def _none_leaves(cfg: ml_collections.ConfigDict, prefix="") -> list[str]:
  out = []
  for k, v in cfg.items():
    if isinstance(v, ml_collections.ConfigDict):
      out += _none_leaves(v, f"{prefix}{k}.")
    elif v is None:
      out.append(prefix + k)
  return out


@pytest.mark.parametrize("name", ("quickstart",) + CONFIGS)
def test_every_none_setting_can_be_set_from_the_command_line(name):
  # A plain None cannot be overridden by `--config.key=value` (ml_collections refuses its type),
  # so such settings are typed placeholders; this sets each one as the launcher would.
  from absl import flags
  from ml_collections import config_flags
  variants = ("", "tiny") if name == "quickstart" else VARIANTS
  for variant in variants:
    path = f"{ROOT}/configs/{name}.py:{variant}"
    keys = _none_leaves(_load(name).get_config(variant))
    assert keys, "expected some settings that default to None"
    argv = ["prog", f"--config={path}"] + [f"--config.{k}=3" for k in keys]
    fv = flags.FlagValues()
    holder = config_flags.DEFINE_config_file("config", flag_values=fv, sys_argv=argv)
    fv(argv)
    for k in keys:
      node = holder.value
      for part in k.split("."):
        node = node[part]
      assert node == 3, (variant, k, node)


def test_dual_clip_and_max_len_norm_reach_the_loss_from_the_command_line():
  from absl import flags
  from ml_collections import config_flags
  from jaxagent.rl import step as step_lib
  argv = ["prog", f"--config={ROOT}/configs/quickstart.py:tiny", "--config.loss.dual_clip=3",
          "--config.loss.agg=seq_mean_token_sum_norm", "--config.loss.max_len_norm=512",
          "--config.rollout.max_total_tokens=100"]
  fv = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", flag_values=fv, sys_argv=argv)
  fv(argv)
  (step_cfg, _), _ = step_lib.learner_parts(holder.value)
  assert step_cfg.loss.dual_clip == 3.0 and step_cfg.loss.max_len_norm == 512.0
  assert holder.value.rollout.max_total_tokens == 100


def test_own_problem_files_reach_math_tool_from_the_command_line(tmp_path, char_tok):
  from absl import flags
  from ml_collections import config_flags
  from jaxagent.agent.trajectory import POLICY, demonstration_trajectory
  train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
  train.write_text("".join(json.dumps({"problem": f"What is {i} plus {i}?", "solution":
                                       f"{i} + {i} = <<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i}"})
                           + "\n" for i in range(1, 4)))
  test.write_text(json.dumps({"problem": "What is 6 times 7?", "solution": 42}) + "\n")
  argv = ["prog", f"--config={ROOT}/configs/math_tool.py:tiny",
          f"--config.env.kwargs.train_file={train}", f"--config.env.kwargs.eval_file={test}",
          "--config.env.kwargs.question_key=problem", "--config.env.kwargs.answer_key=solution"]
  fv = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", flag_values=fv, sys_argv=argv)
  fv(argv)
  cfg = holder.value
  env = make_env(cfg.env.name, **cfg.env.kwargs)
  assert [(e.metadata["question"], e.gold) for e in env.examples("train")] == [
      (f"What is {i} plus {i}?", str(2 * i)) for i in range(1, 4)]
  (ev,) = env.examples("eval")
  assert (ev.metadata["question"], ev.gold) == ("What is 6 times 7?", "42")
  assert len(env.examples("sft")) == cfg.env.kwargs.sft_size  # built-in demonstrations
  for answer, expected in (("42", 1.0), ("41", -1.0)):
    traj = demonstration_trajectory(char_tok.encode("Q"), [(POLICY, f"<answer>{answer}</answer>")],
                                    char_tok)
    traj.finish("answer")
    assert env.reward(traj, ev, char_tok, step=0).components["correct"] == expected
  # Left at their defaults, the files are off: the built-in sources as before.
  plain = make_env("math_tool", **_load("math_tool").get_config("tiny").env.kwargs)
  assert len(plain.examples("eval")) == 4 and plain.examples("eval")[0].id == "eval-gsm-0"



def test_own_corpus_and_questions_reach_search_qa_from_the_command_line(tmp_path):
  from absl import flags
  from ml_collections import config_flags
  corpus, train, dev = tmp_path / "wiki.jsonl", tmp_path / "nq_train.jsonl", tmp_path / "nq_dev.jsonl"
  corpus.write_text("".join(json.dumps({"title": f"Town {i}", "text": f"Town {i} lies on river "
                                        f"R{i}."}) + "\n" for i in range(4)))
  train.write_text("".join(json.dumps({"question": f"Which river is Town {i} on?",
                                       "answers": [f"R{i}"]}) + "\n" for i in range(3)))
  dev.write_text(json.dumps({"question": "Which river is Town 3 on?", "answer": "R3"}) + "\n")
  argv = ["prog", f"--config={ROOT}/configs/search_qa.py:tiny",
          f"--config.env.kwargs.corpus_file={corpus}", f"--config.env.kwargs.train_file={train}",
          f"--config.env.kwargs.eval_file={dev}", f"--config.env.kwargs.data_dir={tmp_path}/kb"]
  fv = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", flag_values=fv, sys_argv=argv)
  fv(argv)
  cfg = holder.value
  env = make_env(cfg.env.name, **cfg.env.kwargs)
  assert [e.gold for e in env.examples("train")] == [["R0"], ["R1"], ["R2"]]
  assert [e.gold for e in env.examples("eval")] == [["R3"]]
  assert "(Title: Town 3): Town 3 lies on river R3." in env.search_tool({"query": "Town 3"}).output
  assert len(env.examples("sft")) == cfg.env.kwargs.sft_size  # generated demonstrations
  # Left at their defaults, the files are off: the generated knowledge base as before.
  for variant in ("", "tiny", "gpu", "qwen"):
    kwargs = _load("search_qa").get_config(variant).env.kwargs
    assert [kwargs[k] for k in ("corpus_file", "train_file", "eval_file", "titles_key")] == [""] * 4


def test_own_problem_file_reaches_code_from_the_command_line(tmp_path):
  from absl import flags
  from ml_collections import config_flags
  path = tmp_path / "mine.jsonl"
  path.write_text("".join(json.dumps({
      "task_id": f"Mine/{i}", "prompt": f"def add_{i}(x):\n    \"\"\"x + {i}.\"\"\"\n",
      "test": f"def check(candidate):\n    assert candidate(1) == {1 + i}\n",
      "entry_point": f"add_{i}", "canonical_solution": f"    return x + {i}\n"}) + "\n"
      for i in range(4)))
  argv = ["prog", f"--config={ROOT}/configs/code.py:tiny", f"--config.env.kwargs.problem_file={path}",
          "--config.env.kwargs.eval_size=1", "--config.env.kwargs.sft_size=3"]
  fv = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", flag_values=fv, sys_argv=argv)
  fv(argv)
  env = make_env(holder.value.env.name, **holder.value.env.kwargs)
  assert sorted(e.id for s in ("train", "eval") for e in env.examples(s)) == [
      f"Mine/{i}" for i in range(4)]
  assert len(env.examples("sft")) == 3
  for variant in ("", "tiny", "gpu", "qwen"):
    assert _load("code").get_config(variant).env.kwargs.problem_file == ""

# The CPU variants' warm-start data against their row length, with the real tokenizer: a
# demonstration longer than train.pack_len is left out of the warm start, and the longest ones
# are a task's hardest (search_qa's 3-hop questions): such a config would warm-start on a
# skewed sample without anyone choosing it. (The gpu / qwen variants build larger sets.)
@pytest.mark.parametrize("name", ("quickstart",) + CONFIGS)
@pytest.mark.parametrize("variant", ("", "tiny"))
def test_sft_demonstrations_fit_the_packed_rows(name, variant, smol_tok, tmp_path):
  from jaxagent.trainer import sft_items
  cfg = _load(name).get_config(variant)
  kwargs = dict(cfg.env.kwargs)
  if name == "search_qa":
    kwargs["data_dir"] = str(tmp_path)
  if "train_size" in kwargs:  # the sft split is drawn apart from train's questions
    kwargs["train_size"] = min(kwargs["train_size"], 200)
  env = make_env(cfg.env.name, **kwargs)
  items = sft_items(env, list(env.examples("sft"))[:cfg.sft.num_examples], smol_tok)
  lengths = sorted(len(it) for it in items)
  too_long = [n for n in lengths if n > cfg.train.pack_len]
  assert not too_long, (
      f"configs/{name}.py:{variant}: {len(too_long)} of {len(items)} SFT demonstrations are "
      f"longer than train.pack_len={cfg.train.pack_len} (up to {lengths[-1]} tokens) and would "
      "be left out of the warm start")
  # A rollout that follows a demonstration's shape must fit the cache too.
  assert lengths[-1] <= cfg.rollout.max_len, (name, variant, lengths[-1], cfg.rollout.max_len)


def _readme_task_module() -> str:
  import pathlib
  import re
  text = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
  start = text.index("## Your own task")
  return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def test_readme_own_task_runs_by_module_class_name(tmp_path, monkeypatch):
  """The README's own-task example, saved as mytask.py, builds through make_env("mytask:
  ReverseEnv"), rolls out (a scripted policy calling its tool, then answering), scores 1 plus
  the tool bonus and gives SFT items; bad "module:Class" names say what to fix."""
  from jaxagent import models
  from jaxagent.agent import RolloutConfig, rollout
  from jaxagent.trainer import sft_items
  from tests.agent.rollout_test import FakeEngine
  try:
    tok = models.load_tokenizer("smollm2-135m-instruct")
  except Exception as e:  # noqa: BLE001 - the GGUF ships in an optional pip package
    pytest.skip(f"SmolLM2 tokenizer unavailable: {e}")
  (tmp_path / "mytask.py").write_text(_readme_task_module())
  monkeypatch.syspath_prepend(str(tmp_path))
  env = make_env("mytask:ReverseEnv", size=8)
  ex = env.examples("eval")[0]
  word = ex.gold[::-1]
  turns = [tok.encode(f"<reverse>{word}</reverse>"), tok.encode(f"<answer>{ex.gold}</answer>")]
  fake = FakeEngine(lambda rid, k: turns[k] if k < 2 else [], slots=2, max_len=256,
                    eos_ids=tuple(sorted(tok.eos_ids)), filler=tok.encode("x")[0])
  (t,) = rollout(fake, None, env, [ex], tokenizer=tok, cfg=RolloutConfig(decode_steps=4))
  assert t.stop_reason == "answer" and t.turns[0].outcome.output == ex.gold
  assert t.valid_tool_calls == 1 and t.turns[0].observation_text == f"<result>{ex.gold}</result>"
  out = env.reward(t, ex, tok, 0)
  assert out.components["correct"] == 1.0 and out.components["tool_calls"] > 0
  assert out.total == pytest.approx(1.0 + 0.1 * out.components["tool_calls"])
  assert len(sft_items(env, env.examples("sft"), tok)) == len(env.examples("train")) == 6
  with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
    make_env("no_such_module:Env")
  with pytest.raises(ValueError, match=r"mytask.reverse is FunctionTool.*; name a subclass of "
                                       r"jaxagent.agent.Env \(in 'mytask': ReverseEnv\)"):
    make_env("mytask:reverse")
  with pytest.raises(ValueError, match=r"module 'mytask' has no attribute 'Reverse'; name a "
                                       r"subclass of jaxagent.agent.Env \(in 'mytask': ReverseEnv\)"):
    make_env("mytask:Reverse")
  # An import that fails inside the task's module is not a module missing from the path.
  (tmp_path / "brokentask.py").write_text("import no_such_dependency_xyz\n")
  with pytest.raises(ValueError, match=r"importing module 'brokentask' failed inside it: "
                                       r"ModuleNotFoundError: No module named 'no_such_dependency_xyz'"):
    make_env("brokentask:Env")
  with pytest.raises(ValueError, match="'module:Class'"):
    make_env("mytask")
