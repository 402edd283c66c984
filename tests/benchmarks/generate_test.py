"""`benchmarks/generate.py`: its options and its roofline's bytes (the decode measurements are
GPU runs)."""
import json
import sys

import numpy as np
import pytest

from benchmarks import generate
from jaxagent import models


@pytest.mark.parametrize("args, message", [
    (["--share", "yes"], "--share: unknown value(s) ['yes']"),
    (["--prepare", "on,of"], "--prepare: unknown value(s) ['of']"),
])
def test_a_misspelt_switch_is_refused_before_anything_runs(monkeypatch, args, message):
  # Any value but "on" used to run the "off" setting without a word.
  monkeypatch.setattr(sys, "argv", ["generate.py", "--models", "tiny-qwen3", *args])
  monkeypatch.setattr(generate, "run", lambda *a, **k: pytest.fail("a measurement ran"))
  with pytest.raises(SystemExit) as e:
    generate.main()
  assert message in str(e.value)


def test_the_roofline_counts_the_keys_the_timed_steps_hold(monkeypatch, capsys, generate_calls):
  # Each decode step writes its token's K/V and attends over every cached key: counted from
  # the lengths the engine's cache holds at each generate call of the timed pass.
  monkeypatch.setattr(generate, "peaks", lambda: {"bf16_flops": 1e12, "hbm_bytes_s": 1e12})
  calls = generate_calls(generate)
  generate.run("tiny-qwen2", 4, 16, 32, 8, False)
  [row] = [json.loads(line[len("RESULT "):]) for line in capsys.readouterr().out.splitlines()
           if line.startswith("RESULT ")]
  timed = calls[len(calls) // 2:]  # the second of the two identical passes
  keys = [lens + i + 1 for lens, steps in timed for i in range(steps)]
  assert row["new_tokens"] == len(keys) == 32
  mean_keys = float(np.mean(keys))  # 16 + 16.5: the old prompt + new / 2 was 32.0
  cfg = models.get_config("tiny-qwen2")
  kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2
  assert row["avg_kv_gb"] == pytest.approx(4 * mean_keys * kv / 1e9)
  assert row["roofline_step_ms"] == pytest.approx(
      (cfg.num_params() * 2 + 4 * mean_keys * kv) / 1e12 * 1e3)
