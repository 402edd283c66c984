"""`python -m jaxagent.launch --config=configs/<name>.py[:variant] [--config.key=value ...]`.

Initialises multi-host JAX when launched on several hosts, builds the trainer from the config
and runs it. With no flags it runs the quickstart (`configs/quickstart.py`).
"""
import logging
import os
import pathlib
import sys

from absl import app, flags
from ml_collections import config_flags

from jaxagent import sharding


def _default_config() -> str:
  for base in (pathlib.Path.cwd(), pathlib.Path(__file__).resolve().parent.parent):
    path = base / "configs" / "quickstart.py"
    if path.exists():
      return str(path)
  return "configs/quickstart.py"


_CONFIG = config_flags.DEFINE_config_file("config", _default_config(),
                                          "Run config file (`path.py[:variant]`).")


def main(argv):
  del argv
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
  sharding.initialize_distributed()
  import jax
  jax.config.update("jax_threefry_partitionable", True)
  from jaxagent.trainer import Trainer
  trainer = Trainer(_CONFIG.value)
  try:
    trainer.run()
  finally:
    trainer.close()


if __name__ == "__main__":
  app.run(main)
