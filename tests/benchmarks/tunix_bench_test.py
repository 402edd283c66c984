"""`benchmarks/tunix_bench.py` (the peer's side of peer_tunix.py): without the peer's wheels it
says what to install instead of a traceback."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("tunix") is not None, reason="tunix is installed")
def test_without_the_peer_it_names_the_wheels_to_install():
  root = pathlib.Path(__file__).resolve().parents[2]
  proc = subprocess.run([sys.executable, "benchmarks/tunix_bench.py", "--tiny"], cwd=root,
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode != 0 and "Traceback" not in proc.stderr
  assert "needs the peer's wheels" in proc.stderr and "google-tunix==0.1.7" in proc.stderr
