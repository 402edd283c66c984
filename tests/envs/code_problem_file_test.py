"""code on your own problems: a HumanEval-format JSONL(.gz), ArrayRecord or Parquet `problem_file` in
place of HumanEval (splits, demonstrations, scoring in the sandbox, the file hidden from the
solution), and every bad record named."""
import gzip
import json
import pathlib
import re
import shutil
import sys
import tempfile

import pytest

from jaxagent.envs.code import CodeEnv

CHECK = "\n\ndef check(candidate):\n    assert candidate({a}) == {b}\n    assert candidate(0) == 0\n"


def problem(i, canonical=True):
  rec = {"task_id": f"Mine/{i}", "prompt": f'def times_{i}(x):\n    """x times {i}."""\n',
         "test": CHECK.format(a=2, b=2 * i), "entry_point": f"times_{i}"}
  if canonical:
    rec["canonical_solution"] = f"    return x * {i}\n"
  return rec


def write(path, records):
  text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
  if str(path).endswith(".gz"):
    path.write_bytes(gzip.compress(text.encode()))
  else:
    path.write_text(text)
  return str(path)


def test_own_problems_replace_humaneval(tmp_path):
  path = write(tmp_path / "mine.jsonl.gz", [problem(i, canonical=i != 3) for i in range(1, 6)])
  env = CodeEnv(problem_file=path, eval_size=2, sft_size=2, seed=0)
  ids = {s: [e.id for e in env.examples(s)] for s in ("train", "eval", "sft")}
  assert sorted(ids["train"] + ids["eval"]) == [f"Mine/{i}" for i in range(1, 6)]
  assert len(ids["eval"]) == 2 and len(ids["sft"]) == 2
  assert set(ids["sft"]) <= set(ids["train"]) and "Mine/3" not in ids["sft"]
  ex = env.examples("eval")[0]
  assert f"def {ex.metadata['entry_point']}(x):" in ex.prompt[1]["content"]
  i = int(ex.id.split("/")[1])
  (demo,) = env.demonstration(env.examples("sft")[0])
  assert demo[1].startswith("<code>\ndef times_") and "    return x * " in demo[1]
  run, parses = env.score(ex.id, f"<code>\ndef times_{i}(x):\n    return x * {i}\n</code>")
  assert parses and (run.passed, run.total) == (2, 2), run
  run, _ = env.score(ex.id, f"<code>\ndef times_{i}(x):\n    return x + {i}\n</code>")
  assert (run.passed, run.total) == (0, 2), run


@pytest.fixture
def readable_dir():
  """A directory the sandbox could read (under the interpreter's prefix), removed after."""
  path = tempfile.mkdtemp(prefix="jaxagent-test-", dir=sys.prefix)
  yield pathlib.Path(path)
  shutil.rmtree(path)


def test_the_problem_file_is_hidden_from_the_solution(readable_dir):
  path = write(readable_dir / "mine.jsonl", [problem(i) for i in range(1, 4)])
  env = CodeEnv(problem_file=path, eval_size=1, sft_size=0)
  cheat = ("def times_1(x):\n    import json\n"
           f"    rows = [json.loads(r) for r in open({path!r})]\n"
           "    ns = {}\n    p = rows[0]\n"
           "    exec(p['prompt'] + p['canonical_solution'], ns)\n"
           "    return ns['times_1'](x)\n")
  run, _ = env.score("Mine/1", f"<code>\n{cheat}</code>")
  assert run.passed == 0, run


def test_a_sharded_problem_file_is_read_and_every_shard_hidden(readable_dir):
  write(readable_dir / "mine-00001.jsonl", [problem(3)])
  write(readable_dir / "mine-00000.jsonl", [problem(1), problem(2)])
  env = CodeEnv(problem_file=str(readable_dir / "mine-*.jsonl"), eval_size=1, sft_size=0)
  assert sorted(e.id for s in ("train", "eval") for e in env.examples(s)) == [
      "Mine/1", "Mine/2", "Mine/3"]
  shard = str(readable_dir / "mine-00001.jsonl")  # the second file: read it for the answer
  cheat = ("def times_3(x):\n    import json\n"
           f"    p = json.loads(open({shard!r}).readline())\n"
           "    ns = {}\n    exec(p['prompt'] + p['canonical_solution'], ns)\n"
           "    return ns['times_3'](x)\n")
  run, _ = env.score("Mine/3", f"<code>\n{cheat}</code>")
  assert run.passed == 0, run
  run, _ = env.score("Mine/3", "<code>\ndef times_3(x):\n    return x * 3\n</code>")
  assert run.passed == 2, run


def test_bad_problem_records_are_named(tmp_path):
  no_assert = {**problem(4), "test": "def check(candidate):\n    candidate(1)\n"}
  path = write(tmp_path / "bad.jsonl", [
      problem(1), {**problem(2), "task_id": "Mine/1"},
      {k: v for k, v in problem(3).items() if k != "entry_point"} | {"entrypoint": "times_3"},
      no_assert, {**problem(5), "entry_point": "times_6"}, {**problem(6), "test": "def check(:"},
      "[1, 2]", {**problem(7), "prompt": 7}])
  with pytest.raises(ValueError) as e:
    CodeEnv(problem_file=path, eval_size=1, sft_size=0)
  msg = str(e.value)
  assert "CodeEnv.problem_file=" in msg and "7 bad records (of 8)" in msg
  assert "bad.jsonl line 2: the task_id 'Mine/1' is the task_id of bad.jsonl line 1 too" in msg
  assert ("bad.jsonl line 3: no 'entry_point' key; the record has ['canonical_solution', "
          "'entrypoint', 'prompt', 'task_id', 'test']; did you mean 'entrypoint'?") in msg
  assert "bad.jsonl line 4: the test: check() contains no assert statement to count" in msg
  assert "bad.jsonl line 5: the prompt does not define the entry_point times_6()" in msg
  assert "... and 2 more" in msg  # line 6 (test syntax), 7 (not an object), 8 (prompt not text)
  for line, want in ((6, "the test does not parse as Python (SyntaxError"),
                     (7, "a record must be a JSON object with 'task_id'"),
                     (8, "'prompt' must be non-empty text, got int 7")):
    one = write(tmp_path / f"one{line}.jsonl", [open(path).read().splitlines()[line - 1]])
    with pytest.raises(ValueError, match=re.escape(f"one{line}.jsonl line 1: {want}")):
      CodeEnv(problem_file=one, eval_size=0, sft_size=0)


def test_a_canonical_solution_that_is_a_whole_function_is_named(tmp_path):
  # Some datasets store the whole function; HumanEval's canonical_solution is the body.
  whole = {**problem(8), "canonical_solution": "def times_8(x):\n    return x * 8\n"}
  with pytest.raises(ValueError, match=r"w.jsonl line 1: the prompt's signature with the "
                                       r"canonical_solution does not parse as Python.*the "
                                       r"canonical_solution is the function's indented body"):
    CodeEnv(problem_file=write(tmp_path / "w.jsonl", [whole]), eval_size=0, sft_size=0)


def test_sizes_count_the_files_problems(tmp_path):
  path = write(tmp_path / "mine.jsonl", [problem(i, canonical=i < 3) for i in range(1, 6)])
  with pytest.raises(ValueError, match=r"CodeEnv.eval_size must be in \[0, 5\) \(5 problems of "
                                       r"CodeEnv.problem_file=.*got 5"):
    CodeEnv(problem_file=path, eval_size=5, sft_size=0)
  # Demonstrations need a canonical_solution: problems 1 and 2 only.
  with pytest.raises(ValueError, match=r"CodeEnv.sft_size=3 exceeds the 2 train problems with a "
                                       r"canonical_solution \(3 have none\).*set sft_size <= 2"):
    CodeEnv(problem_file=path, eval_size=0, sft_size=3)
  assert len(CodeEnv(problem_file=path, eval_size=0, sft_size=2).examples("sft")) == 2
  for bad, message in ((str(tmp_path / "nope.jsonl"), "no such file"),
                       (str(tmp_path / "p.json"), "unknown file format"),
                       (5, "must be a str")):
    with pytest.raises(ValueError, match=f"CodeEnv.problem_file.*{message}"):
      CodeEnv(problem_file=bad, eval_size=0, sft_size=0)


def test_a_parquet_problem_file(tmp_path):
  """HumanEval as Hugging Face ships it (a Parquet file); a null canonical_solution (a row
  without one) is none, not a bad record."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  rows = [problem(i) for i in range(1, 5)]
  rows[1]["canonical_solution"] = None
  path = tmp_path / "test-00000-of-00001.parquet"
  pq.write_table(pa.Table.from_pylist(rows), str(path))
  env = CodeEnv(problem_file=str(path), eval_size=1, sft_size=0, seed=0)
  assert sorted(e.id for s in ("train", "eval") for e in env.examples(s)) == [
      f"Mine/{i}" for i in range(1, 5)]
  with pytest.raises(ValueError, match=r"CodeEnv.sft_size=4 exceeds the 3 train problems with a "
                                       r"canonical_solution \(1 have none\)"):
    CodeEnv(problem_file=str(path), eval_size=0, sft_size=4)
  rows[2]["test"] = None
  pq.write_table(pa.Table.from_pylist(rows), str(path))
  with pytest.raises(ValueError, match=r"test-00000-of-00001.parquet record 2: 'test' must be "
                                       r"non-empty text, got NoneType None"):
    CodeEnv(problem_file=str(path), eval_size=0, sft_size=0)


def test_a_parquet_problem_file_is_read_only_in_the_columns_of_its_keys(tmp_path, monkeypatch):
  """A large column the task does not use (a set's model generations) is never read; a missing
  key's error still lists every column of the file."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  read = []
  iter_batches = pq.ParquetFile.iter_batches

  def spy(self, *args, columns=None, **kwargs):
    read.append(columns)
    return iter_batches(self, *args, columns=columns, **kwargs)
  monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
  rows = [{**problem(i), "generations": ["x" * 1000] * 4, "meta": {"source": "mine"}}
          for i in range(1, 4)]
  path = tmp_path / "mine.parquet"
  pq.write_table(pa.Table.from_pylist(rows), str(path))
  env = CodeEnv(problem_file=str(path), eval_size=1, sft_size=1, seed=0)
  assert read == [["task_id", "prompt", "test", "entry_point", "canonical_solution"]]
  assert env.problem("Mine/2") == {k: v for k, v in rows[1].items()
                                   if k not in ("generations", "meta")}
  pq.write_table(pa.Table.from_pylist([{("tests" if k == "test" else k): v for k, v in r.items()}
                                       for r in rows]), str(path))
  # A key no column holds: one error for the file, from its schema (no row is read).
  reads = len(read)
  with pytest.raises(ValueError, match=r"CodeEnv.problem_file='.*mine.parquet': no record can "
                                       r"have a 'test' key, the file has no such column: its "
                                       r"columns are \['canonical_solution', 'entry_point', "
                                       r"'generations', 'meta', 'prompt', 'task_id', 'tests'\]; "
                                       r"did you mean 'tests'\?"):
    CodeEnv(problem_file=str(path), eval_size=0, sft_size=0)
  assert len(read) == reads


def test_each_problem_test_is_planned_once(tmp_path, monkeypatch):
  """The plan made to check a record is the one scoring uses (it was made twice: 60% of the
  construction time of a 20k-problem file)."""
  from jaxagent.envs import code
  planned = []
  real = code.plan_tests
  monkeypatch.setattr(code, "plan_tests", lambda test, *a, **kw: planned.append(test)
                      or real(test, *a, **kw))
  path = write(tmp_path / "mine.jsonl", [problem(i) for i in range(1, 5)])
  env = CodeEnv(problem_file=path, eval_size=1, sft_size=0, max_prompt_chars=1000)
  assert len(planned) == 4
  run, _ = env.score("Mine/3", "<code>\ndef times_3(x):\n    return x * 3\n</code>")
  assert (run.passed, run.total) == (2, 2), run
