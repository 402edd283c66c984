"""`benchmarks/plan_vs_measured.py`: the inputs it makes for each compiled program, and (slow)
a run of the tiny math_tool config on this CPU."""
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_materialise_fills_shapes_with_zeros_and_segment_ids_with_ones():
  # In a child process: the script defines absl flags (--config) at import, which clash with
  # jaxagent.launch's when another test of this worker imported that.
  code = textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np
      from benchmarks import plan_vs_measured
      sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      tree = {"tokens": jax.ShapeDtypeStruct((2, 3), jnp.int32, sharding=sharding),
              "segment_ids": jax.ShapeDtypeStruct((2, 3), jnp.int32, sharding=sharding),
              "rng": jax.ShapeDtypeStruct((4,), jax.random.key(0).dtype, sharding=sharding),
              "steps": 7}
      out = plan_vs_measured._materialise(tree)
      assert (np.asarray(out["tokens"]) == 0).all(), out["tokens"]
      assert (np.asarray(out["segment_ids"]) == 1).all(), out["segment_ids"]
      assert out["rng"].shape == (4,) and out["steps"] == 7, out
      print("ok")
  """)
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


@pytest.mark.slow  # plans and runs every program of a run (~60 s)
def test_tiny_config_measures_every_program():
  proc = subprocess.run([sys.executable, "benchmarks/plan_vs_measured.py",
                         "--config=configs/math_tool.py:tiny", "--iters=1"], cwd=ROOT,
                        capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  [line] = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  programs = json.loads(line[len("RESULT "):])["programs"]
  assert {p["program"].split("[")[0] for p in programs} >= {"update", "prefill", "generate"}
  assert all(p["measured_s"] > 0 for p in programs)
