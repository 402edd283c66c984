"""`benchmarks/plan_vs_measured.py`: the inputs it makes for each compiled program, and (slow)
a run of the tiny math_tool config on this CPU."""
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import plan_vs_measured


def test_materialise_fills_shapes_with_zeros_and_segment_ids_with_ones():
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  tree = {"tokens": jax.ShapeDtypeStruct((2, 3), jnp.int32, sharding=sharding),
          "segment_ids": jax.ShapeDtypeStruct((2, 3), jnp.int32, sharding=sharding),
          "rng": jax.ShapeDtypeStruct((4,), jax.random.key(0).dtype, sharding=sharding),
          "steps": 7}
  out = plan_vs_measured._materialise(tree)
  assert (np.asarray(out["tokens"]) == 0).all() and (np.asarray(out["segment_ids"]) == 1).all()
  assert out["rng"].shape == (4,) and out["steps"] == 7


@pytest.mark.slow  # plans and runs every program of a run (~60 s)
def test_tiny_config_measures_every_program():
  root = pathlib.Path(__file__).resolve().parents[2]
  proc = subprocess.run([sys.executable, "benchmarks/plan_vs_measured.py",
                         "--config=configs/math_tool.py:tiny", "--iters=1"], cwd=root,
                        capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  [line] = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  programs = json.loads(line[len("RESULT "):])["programs"]
  assert {p["program"].split("[")[0] for p in programs} >= {"update", "prefill", "generate"}
  assert all(p["measured_s"] > 0 for p in programs)
