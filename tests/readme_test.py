"""The README's API tour runs as written (with the arrays it leaves to the reader filled in)."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.conftest import CPU_TEST_XLA_FLAGS

REPO = pathlib.Path(__file__).resolve().parent.parent

# The tour uses these names without defining them: small packed arrays of the documented shapes.
_INPUTS = """
import jax.numpy as jnp
tokens = jnp.asarray([[1, 2, 3, 4, 5, 0]], jnp.int32)
segment_ids = jnp.asarray([[1, 1, 1, 2, 2, 0]], jnp.int32)
logps = old_logps = jnp.full((1, 6), -1.0)
adv = jnp.ones((1, 6))
loss_mask = jnp.asarray([[0, 1, 1, 0, 1, 0]], jnp.float32)
"""


def api_tour() -> str:
  text = (REPO / "README.md").read_text()
  start = text.index("## API tour")
  m = re.search(r"```python\n(.*?)```", text[start:], re.S)
  assert m, "README.md's API tour has no python block"
  return m.group(1)


@pytest.mark.slow  # loads SmolLM2-135M and rolls out 32 trajectories on a CPU (about 6 minutes)
def test_readme_api_tour_runs(tmp_path):
  from jaxagent import models
  try:
    models.load_tokenizer("smollm2-135m-instruct")
  except Exception as e:  # noqa: BLE001 - the tour's model ships in an optional pip package
    pytest.skip(f"SmolLM2 unavailable: {e}")
  script = tmp_path / "tour.py"
  script.write_text(_INPUTS + api_tour() + "\nprint('TOUR-OK', float(loss), len(trajs))\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {CPU_TEST_XLA_FLAGS}")
  proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0 and "TOUR-OK" in proc.stdout, proc.stderr[-4000:]
  assert "TOUR-OK" in proc.stdout.splitlines()[-1] and proc.stdout.split()[-1] == "32"


def test_readme_api_tour_is_found_and_parses():
  compile(_INPUTS + api_tour(), "README.md", "exec")
