"""`benchmarks/compile_time.py`: a tiny CPU run of each mode and its option checks."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from benchmarks import compile_time

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny-llama", "--slots", "4", "--max-len", "64", "--dtype", "float32",
        "--steps", "4"]


@pytest.mark.slow  # a script run of tens of seconds on a 2-core CPU (the default run's time budget)
def test_a_tiny_run_times_each_program_kind():
  # In a child process without the suite's persistent compilation cache: a program an earlier
  # test compiled identically (and the cache kept, which it does when the compile took over
  # 0.2 s on a loaded host) loads from it and counts as no compile.
  proc = subprocess.run([sys.executable, "benchmarks/compile_time.py", *TINY, "--rows", "2",
                         "--prompt-len", "8", "--chunk", "4", "--variants",
                         "stacked/xla,stacked/no_such_attention"], cwd=ROOT,
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu",
                                 JAX_ENABLE_COMPILATION_CACHE="false"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines()
          if line.startswith("RESULT ")]
  [r] = rows  # the unknown attention path fails on its own; the other variant still reports
  assert "FAILED stacked/no_such_attention" in proc.stdout
  assert (r["layout"], r["attention"]) == ("stacked", "xla")
  for kind in ("prefill_insert", "generate", "append"):
    assert r[f"{kind}_programs"] >= 1
    assert 0 < r[f"{kind}_compile_s"] <= r[f"{kind}_wall_s"]


@pytest.mark.slow  # a script run of tens of seconds on a 2-core CPU (the default run's time budget)
def test_a_tiny_schedule_counts_the_programs_it_compiled():
  # In a child process: the count reads the jitted functions' in-process caches, which other
  # tests of the same xdist worker left in a state that read 0 for every program in one CI run.
  proc = subprocess.run([sys.executable, "benchmarks/compile_time.py", *TINY, "--variants",
                         "stacked/xla", "--schedule", "3"], cwd=ROOT, capture_output=True,
                        text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  [r] = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines()
         if line.startswith("RESULT ")]
  assert r["bench"] == "compile_schedule"
  assert r["total_programs"] == sum(r["programs"].values()) >= 3
  # `compiles` counts backend compilations: an earlier test's identical program may come from
  # the persistent compilation cache instead.
  assert r["compiles"] >= 0 and r["compile_s"] >= 0


def test_a_variant_without_its_attention_path_is_refused(run_main):
  with pytest.raises(SystemExit):
    run_main(compile_time, *TINY, "--variants", "stacked/xla,per_layer")
  assert "each entry is layout/attention" in run_main.err and "'per_layer'" in run_main.err
