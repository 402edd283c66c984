"""`python -m jaxagent.export --workdir=runs/quickstart [--out=DIR] [--step=N]`.

Writes the policy of a run's newest (or the given) checkpoint as a Hugging Face directory:
config.json, model.safetensors and the tokenizer, loadable by `transformers` and by
`jaxagent.generate.jetstream.JetStreamEngine.from_pretrained` for serving. The output defaults
to `<workdir>/export`. See `jaxagent.checkpoint.export_hf`.
"""
import logging
import os
import pathlib

from absl import app, flags

_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (holds checkpoints/).",
                               required=True)
_OUT = flags.DEFINE_string("out", None, "Output directory (default: <workdir>/export).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest complete one).")


def main(argv):
  del argv
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
  logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every file it reads
  from jaxagent.runtime import init_runtime
  init_runtime()
  from jaxagent.checkpoint import CheckpointError, export_hf
  # The shell leaves a "~" after "--out=" as it is: it would name a folder "~" in the working
  # directory.
  workdir = os.path.expanduser(_WORKDIR.value)
  if _OUT.value is None and "://" in workdir:
    # <workdir>/export of a bucket workdir is no local path (pathlib makes "gs:/..." of it).
    raise SystemExit(f"export failed: --workdir={workdir} is a bucket URL and the export "
                     "is a local directory: pass --out=<a local directory>")
  out = os.path.expanduser(_OUT.value) if _OUT.value else str(pathlib.Path(workdir) / "export")
  try:
    path = export_hf(workdir, out, step=_STEP.value)
  except (CheckpointError, OSError, ValueError) as e:  # no or unusable checkpoint, an unusable
    raise SystemExit(f"export failed: {e}") from None  # --out or files there
  print(f"exported {path}", flush=True)


if __name__ == "__main__":
  app.run(main)
