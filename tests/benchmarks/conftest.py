"""Fixtures of the benchmark scripts' tests: run a script's `main` with given flags, read its
`RESULT` lines, and pin its clock and chip peak so that derived numbers can be checked by hand."""
import json
import sys

import numpy as np
import pytest


@pytest.fixture
def run_main(monkeypatch, capsys):
  """`run_main(module, *flags)`: calls `module.main()` with those flags and returns the parsed
  `RESULT` rows it printed, with its whole stdout as `run_main.out` and stderr as
  `run_main.err`."""
  def run(module, *flags):
    monkeypatch.setattr(sys, "argv", [module.__name__ + ".py", *flags])
    run.out = run.err = ""
    try:
      module.main()
    finally:
      captured = capsys.readouterr()
      run.out, run.err = captured.out, captured.err
    out = run.out
    return [json.loads(line[len("RESULT "):]) for line in out.splitlines()
            if line.startswith("RESULT ")]
  return run


@pytest.fixture
def unit_clock_and_peak(monkeypatch):
  """`unit_clock_and_peak(module)`: the module's `timeit` runs its function once and reports
  1 s, and its `peaks()` a chip of 1e12 FLOP/s and 1e12 B/s; so a fraction of the peak it
  prints is its FLOP count / 1e12."""
  def pin(module):
    def one_second(fn, **_):
      fn()
      return {"median_s": 1.0, "min_s": 1.0, "iters": 1}
    monkeypatch.setattr(module, "timeit", one_second)
    monkeypatch.setattr(module, "peaks", lambda: {"bf16_flops": 1e12, "hbm_bytes_s": 1e12})
  return pin


@pytest.fixture
def generate_calls(monkeypatch):
  """`generate_calls(module)`: spies on `module.Engine.generate` and returns the list each call
  appends `(cache lengths at the call, steps)` to, so a test can count the keys that every
  decode step attends over."""
  def spy(module):
    calls, real = [], module.Engine.generate

    def record(self, params, state, steps=1, kv_len=None):
      calls.append((np.asarray(state.lengths), steps))
      return real(self, params, state, steps=steps, kv_len=kv_len)
    monkeypatch.setattr(module.Engine, "generate", record)
    return calls
  return spy
