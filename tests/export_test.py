"""`python -m jaxagent.export`: errors the command line shows as one line."""
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_a_bucket_workdir_without_out_is_refused_before_reading_checkpoints(tmp_path):
  # The default output, <workdir>/export, became the local relative path "gs:/bucket/..."
  # (a folder named "gs:" in the working directory) once the checkpoint had been read.
  r = subprocess.run([sys.executable, "-m", "jaxagent.export", "--workdir=gs://bucket/run"],
                     cwd=tmp_path, capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, JAX_PLATFORMS="cpu",
                              PYTHONPATH=os.pathsep.join([str(REPO), *sys.path])))
  assert r.returncode != 0
  assert ("export failed: --workdir=gs://bucket/run is a bucket URL and the export is a local "
          "directory: pass --out=<a local directory>") in r.stderr, r.stderr[-2000:]
  assert "Traceback" not in r.stderr
  assert not list(tmp_path.iterdir())


def test_a_tilde_in_the_flags_is_the_home_directory(tmp_path):
  # The shell does not expand "~" after "--workdir=" / "--out=": the export looked for
  # checkpoints in, and would have written to, a folder named "~" in the working directory.
  home, cwd = tmp_path / "home", tmp_path / "cwd"
  home.mkdir()
  cwd.mkdir()
  r = subprocess.run([sys.executable, "-m", "jaxagent.export", "--workdir=~/run"],
                     cwd=cwd, capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, JAX_PLATFORMS="cpu", HOME=str(home),
                              PYTHONPATH=os.pathsep.join([str(REPO), *sys.path])))
  assert r.returncode != 0
  assert f"export failed: no checkpoints at {home / 'run'}: " in r.stderr, r.stderr[-2000:]
