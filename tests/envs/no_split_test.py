"""`NoSplitError`: every built-in task refuses a split it does not have with it (not with words
a mixture or the trainer had to read), and `lacks_split` tells it from a split that fails to
load."""
import pathlib
import pickle
import sys

import pytest

from jaxagent.agent.env import CalculatorEnv, NoSplitError, lacks_split
from jaxagent.envs import make_env


def _code():
  return make_env("code", eval_size=4, sft_size=4, seed=1)


def _search_qa(tmp_path):
  return make_env("search_qa", data_dir=str(tmp_path), kb_seed=5, max_hops=3, num_countries=3,
                  num_cities=9, num_universities=4, num_people=24, num_companies=14,
                  train_size=30, eval_size=10, sft_size=6)


@pytest.mark.parametrize("build", [
    lambda tmp_path: make_env("quickstart", train_size=8, eval_size=4, sft_size=4),
    lambda tmp_path: make_env("math_tool", train_size=8, eval_size=4, sft_size=4),
    lambda tmp_path: _code(),
    _search_qa], ids=["quickstart", "math_tool", "code", "search_qa"])
def test_a_built_in_task_refuses_an_unknown_split_with_no_split_error(build, tmp_path):
  env = build(tmp_path)
  with pytest.raises(NoSplitError, match=r"unknown split 'test'; expected one of ") as e:
    env.examples("test")
  assert e.value.split == "test" and isinstance(e.value, ValueError)
  assert lacks_split(e.value, "test")


def test_the_mcp_task_has_no_sft_split(tmp_path):
  """MCPToolEnv has no demonstrations: its "sft" split was a ValueError a mixture recognised
  by its words only."""
  pytest.importorskip("mcp")
  server = {"command": sys.executable,
            "args": [str(pathlib.Path(__file__).parents[1] / "data" / "mcp" / "server.py")]}
  questions = tmp_path / "train.jsonl"
  questions.write_text('{"question": "What is 2+3?", "answer": "5"}\n')
  env = make_env("mcp_tools", mcp_servers=[server], train_file=str(questions))
  try:
    for split in ("sft", "test"):
      with pytest.raises(NoSplitError) as e:
        env.examples(split)
      assert e.value.split == split and lacks_split(e.value, split)
      assert ("has no demonstrations" if split == "sft" else "unknown split 'test'") in str(e.value)
    assert [ex.gold for ex in env.examples("train")] == ["5"]
  finally:
    env.close()


@pytest.mark.parametrize("error, split, lacks", [
    (NoSplitError("no demonstrations here", split="sft"), "sft", True),
    (NoSplitError("no such split"), "sft", True),  # no split named: about the one asked for
    # A missing split of something else that `examples("sft")` reads is a load failure.
    (NoSplitError("unknown split 'train'", split="train"), "sft", False),
    (NotImplementedError("no examples"), "sft", True),
    (KeyError("sft"), "sft", True), (KeyError("answer"), "sft", False),
    # Envs written before NoSplitError: their words, in a plain ValueError only.
    (ValueError("unknown split 'sft'; expected one of ['eval', 'train']"), "sft", True),
    (ValueError("No 'sft' split here"), "sft", True),
    (ValueError("MyEnv has no demonstrations"), "sft", True),
    (ValueError("MyEnv has no demonstrations"), "eval", False),
    (ValueError("file not found: sft.jsonl"), "sft", False),
    (FileNotFoundError("sft.jsonl"), "sft", False),
    (RuntimeError("unknown split 'sft'"), "sft", False)])
def test_lacks_split_tells_a_missing_split_from_one_that_fails_to_load(error, split, lacks):
  assert lacks_split(error, split) is lacks


def test_no_split_error_keeps_its_split_through_pickling():
  e = pickle.loads(pickle.dumps(NoSplitError("unknown split 'test'", split="test")))
  assert type(e) is NoSplitError and e.split == "test" and str(e) == "unknown split 'test'"


def test_the_base_env_without_examples_lacks_every_split():
  with pytest.raises(NotImplementedError) as e:
    CalculatorEnv().examples("sft")
  assert lacks_split(e.value, "sft")

