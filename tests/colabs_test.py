"""Every notebook in colabs/ runs top to bottom on CPU (so they cannot rot).

The install cell is skipped when jaxagent is importable, as it is in the test venv. The
quickstart trains SmolLM2-135M for a few steps (minutes on CPU): it is marked slow.
"""
import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

COLABS = pathlib.Path(__file__).resolve().parent.parent / "colabs"
SLOW = {"quickstart.ipynb"}


def test_every_notebook_is_covered():
  found = {p.name for p in COLABS.glob("*.ipynb")}
  assert found == {"quickstart.ipynb", "losses_and_packing.ipynb"}, (
      f"colabs/ holds {sorted(found)}: give each notebook a case below")


def _execute(name: str, tmp_path, timeout: int):
  nb = nbformat.read(COLABS / name, as_version=4)
  assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
      f"{name} is committed with outputs; clear them")
  env_keys = ("JAX_PLATFORMS", "XLA_FLAGS")
  saved = {k: os.environ.get(k) for k in env_keys}
  os.environ["JAX_PLATFORMS"] = "cpu"  # a CPU runtime, one device, like Colab's
  os.environ.pop("XLA_FLAGS", None)
  try:
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(COLABS)}})
    client.execute()
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]
  assert not errors
  return nb


def test_losses_and_packing_notebook(tmp_path):
  nb = _execute("losses_and_packing.ipynb", tmp_path, timeout=300)
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
  assert "max |grad| on policy tokens" in text and "packed" in text


@pytest.mark.slow
def test_quickstart_notebook(tmp_path):
  nb = _execute("quickstart.ipynb", tmp_path, timeout=1500)
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
  assert "mask=1" in text and "OBSERVATION" in text  # the ledger with its masks was shown
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "image/png" in o.get("data", {})]
  assert images, "the reward curve was not plotted"
