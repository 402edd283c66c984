"""`python -m jaxagent.export --workdir=runs/quickstart [--out=DIR] [--step=N]`.

Writes the policy of a run's newest (or the given) checkpoint as a Hugging Face directory:
config.json, model.safetensors and the tokenizer, loadable by `transformers` and by
`jaxagent.generate.jetstream.JetStreamEngine.from_pretrained` for serving. The output defaults
to `<workdir>/export`. See `jaxagent.checkpoint.export_hf`.
"""
import logging
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
  from jaxagent.launch import init_runtime
  init_runtime()
  from jaxagent.checkpoint import CheckpointError, export_hf
  if _OUT.value is None and "://" in _WORKDIR.value:
    # <workdir>/export of a bucket workdir is no local path (pathlib makes "gs:/..." of it).
    raise SystemExit(f"export failed: --workdir={_WORKDIR.value} is a bucket URL and the export "
                     "is a local directory: pass --out=<a local directory>")
  out = _OUT.value or str(pathlib.Path(_WORKDIR.value) / "export")
  try:
    path = export_hf(_WORKDIR.value, out, step=_STEP.value)
  except (CheckpointError, OSError, ValueError) as e:  # no or unusable checkpoint, an unusable
    raise SystemExit(f"export failed: {e}") from None  # --out or files there
  print(f"exported {path}", flush=True)


if __name__ == "__main__":
  app.run(main)
