"""Run configs kept as Python files (`configs/<name>.py` with `get_config(variant)`), loaded
outside the command line: by one config building on another, by tests and notebooks."""
from __future__ import annotations

import importlib.util
import pathlib
import types

import ml_collections


def load_config_module(path: str | pathlib.Path) -> types.ModuleType:
  """The config file at `path`, executed as a module of its own."""
  path = pathlib.Path(path)
  spec = importlib.util.spec_from_file_location(f"jaxagent_config_{path.stem}", path)
  if spec is None or spec.loader is None:
    raise FileNotFoundError(f"not a Python config file: {path}")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_config(path: str | pathlib.Path, variant: str | None = None
                ) -> ml_collections.ConfigDict:
  """`get_config(variant)` of the config file at `path`."""
  return load_config_module(path).get_config(variant)
