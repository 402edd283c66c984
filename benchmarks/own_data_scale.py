"""Memory and time of building a search_qa env over your own corpus at real sizes.

Writes a synthetic JSONL corpus of `--passages` short passages ({id, title, text}, about 30
words each, 10 passages a title as a Wikipedia dump has them) and small train/eval question
files with gold titles (`titles_key`) under `--dir`, then, in this process, builds
`SearchQAEnv(corpus_file=..., train_file=..., eval_file=..., titles_key=..., sft_size=0)` and
both question splits, and prints the peak resident memory above the imports (MB) and the
seconds taken. With `--denied N`, it times instead what a glob pattern of N shards costs the
sandbox, which denies each file to the policy's code: a `PythonSession`'s start and a cell of
1000 file opens (each checked against the denied paths) with N denied paths and with one.
With `--generations ROWS`, it times reading a math set's Parquet train file of ROWS rows with a
large `generations` column (8 sampled solutions of 2 KB a row) as `MathToolEnv` reads it (the
first run writes the file; run it again to time the read).
CPU only; nothing here needs an accelerator.

  python benchmarks/own_data_scale.py --passages 200000 --dir /tmp/own_data_scale
  python benchmarks/own_data_scale.py --denied 500 --dir /tmp/own_data_scale
  python benchmarks/own_data_scale.py --generations 20000 --dir /tmp/own_data_scale
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import time


def write_files(root: str, passages: int, questions: int = 2000) -> dict[str, str]:
  os.makedirs(root, exist_ok=True)
  corpus = os.path.join(root, f"corpus_{passages}.jsonl")
  words = [f"w{i}" for i in range(50_000)]
  rng = random.Random(0)
  if not os.path.exists(corpus):
    with open(corpus + ".part", "w") as f:
      for i in range(passages):
        text = " ".join(rng.choice(words) for _ in range(30))
        f.write(json.dumps({"id": str(i), "title": f"Title {i // 10}", "text": text}) + "\n")
    os.replace(corpus + ".part", corpus)
  out = {"corpus_file": corpus}
  for split in ("train", "eval"):
    path = os.path.join(root, f"{split}_{passages}.jsonl")
    with open(path, "w") as f:
      for q in range(questions):
        t = rng.randrange(passages // 10)
        f.write(json.dumps({"question": f"What is in w{q} of {t}?", "answers": [f"w{q}"],
                            "titles": [f"Title {t}"]}) + "\n")
    out[f"{split}_file"] = path
  return out


def max_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def time_denied(root: str, denied: int, reps: int = 5) -> None:
  from jaxagent.tools.sandbox import PythonSession, SandboxConfig

  shards = os.path.join(root, "shards")
  os.makedirs(shards, exist_ok=True)
  files = [os.path.join(shards, f"train-{i:05d}-of-{denied:05d}.parquet") for i in range(denied)]
  for f in files:
    if not os.path.exists(f):
      open(f, "w").close()
  note = os.path.join(shards, "notes.txt")
  with open(note, "w") as f:
    f.write("x")
  cell = f"for _ in range(1000):\n    open({note!r}).read()"
  for n in (1, denied):
    starts, cells = [], []
    for _ in range(reps):
      t0 = time.perf_counter()
      session = PythonSession(SandboxConfig(timeout_s=30, extra_read_paths=(shards,),
                                            deny_read_paths=tuple(files[:n])))
      assert session.run("x = 1").ok
      starts.append(time.perf_counter() - t0)
      t1 = time.perf_counter()
      result = session.run(cell)
      cells.append(time.perf_counter() - t1)
      assert result.ok, result
      session.close()
    print(f"{n} denied path(s): session start + first cell {statistics.median(starts) * 1e3:.0f} ms, "
          f"a cell of 1000 opens {statistics.median(cells) * 1e3:.1f} ms (median of {reps})")


def time_generations(root: str, rows: int) -> None:
  import pyarrow as pa
  import pyarrow.parquet as pq

  from jaxagent.envs.problem_file import read_problems

  os.makedirs(root, exist_ok=True)
  path = os.path.join(root, f"math_{rows}.parquet")
  if not os.path.exists(path):
    rng = random.Random(0)
    table = pa.Table.from_pylist([{
        "prompt": [{"role": "user", "content": f"Question {i}?"}],
        "reward_model": {"style": "rule", "ground_truth": str(i)},
        "extra_info": {"index": i, "question": f"Question {i}?"},
        "generations": ["".join(rng.choice("0123456789 +=") for _ in range(2048))
                        for _ in range(8)]} for i in range(rows)])
    pq.write_table(table, path)
    print(f"wrote {path}; run again to time reading it (this process's peak holds the table)")
    return
  base = max_rss_mb()
  t0 = time.perf_counter()
  probs = read_problems(path, question_key="extra_info.question",
                        answer_key="reward_model.ground_truth", record_keys=())
  print(f"{len(probs)} problems of {os.path.getsize(path) / 2**20:.0f} MB Parquet: "
        f"{time.perf_counter() - t0:.2f} s, peak RSS {max_rss_mb() - base:.0f} MB above the imports")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--passages", type=int, default=200_000)
  parser.add_argument("--dir", default="/tmp/own_data_scale")
  parser.add_argument("--denied", type=int, default=0,
                      help="time the sandbox with this many denied shard files instead")
  parser.add_argument("--generations", type=int, default=0,
                      help="time reading a Parquet math set of this many rows instead")
  args = parser.parse_args()
  if args.generations:
    time_generations(args.dir, args.generations)
    return
  if args.denied:
    time_denied(args.dir, args.denied)
    return
  files = write_files(args.dir, args.passages)
  from jaxagent.envs.search_qa import SearchQAEnv
  import bm25s  # noqa: F401 - imported inside the index; counted in the baseline, not the build

  base = max_rss_mb()
  t0 = time.perf_counter()
  env = SearchQAEnv(**files, titles_key="titles", sft_size=0, retrieval_weight=0.1)
  built = time.perf_counter() - t0
  peak_build = max_rss_mb()
  t1 = time.perf_counter()
  n = len(env.examples("train")) + len(env.examples("eval"))
  splits = time.perf_counter() - t1
  size = os.path.getsize(files["corpus_file"]) / 2**20
  print(f"passages {args.passages} ({size:.0f} MB JSONL), {n} questions")
  print(f"baseline RSS after imports {base:.0f} MB")
  print(f"env build: {built:.1f} s, peak RSS {peak_build - base:.0f} MB above baseline")
  print(f"train+eval splits: {splits:.2f} s, peak RSS {max_rss_mb() - base:.0f} MB above baseline")


if __name__ == "__main__":
  main()
