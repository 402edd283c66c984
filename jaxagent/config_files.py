"""Run configs kept as Python files (`configs/<name>.py` with `get_config(variant)`), loaded
outside the command line (by one config building on another, by tests and notebooks), and the
flag parsing of the entry points that take one on the command line (`--config=path.py[:variant]`).
"""
from __future__ import annotations

import difflib
import importlib.util
import pathlib
import sys
import traceback
import types
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the models and the generator import this module; keep it light
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


def did_you_mean(key: str, known, prefix: str = "") -> str:
  """`prefix + key` for an error message, with "(did you mean prefix + K?)" when one of the
  `known` keys is close to it."""
  close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
  return f"{prefix}{key} (did you mean {prefix}{close[0]}?)" if close else f"{prefix}{key}"


def parse_config_flags(argv: list[str], config_flag) -> list[str]:
  """absl's flag parsing for an entry point with a `--config` file flag (`app.run(main,
  flags_parser=...)`): a `--config.key=value` naming a key the config lacks, or a config file
  that does not load (missing, raising, without `get_config`, or whose `get_config` returns no
  ConfigDict), is one line on stderr and exit status 1, as for other bad flags, instead of a
  traceback."""
  from absl import flags

  def fail(message: str):
    print(f"FATAL Flags parsing error: {message}\nPass --helpshort or --helpfull to see help on "
          "flags.", file=sys.stderr)
    sys.exit(1)

  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    message = str(e)
    if "Error whilst parsing config file:" in message:
      # The config file's get_config raised (an unknown variant, say): its own message, not the
      # traceback that ml_collections wraps around it.
      head = message.split("Error whilst parsing config file:", 1)[0]
      message = head + [line for line in message.splitlines() if line.strip()][-1]
    fail(message)
  except (AttributeError, KeyError) as e:  # raised by the config for a key it does not have
    if isinstance(e, AttributeError) and getattr(e, "name", None) == "get_config":
      # (it read as "the config has no key module 'config_config' has no attribute ...")
      fail(f"the config file has no get_config function ({e}): define "
           "get_config(arg=None) returning an ml_collections.ConfigDict")
    while e.args and isinstance(e.args[0], BaseException):
      e = e.args[0]
    what = e.args[0] if len(e.args) == 1 and isinstance(e.args[0], str) else str(e)
    fail(f"the config has no key {what}\n--config.KEY=VALUE only sets keys that the config "
         "file defines (add a new one to its get_config).")
  except OSError as e:  # an override of a config file that could not be loaded
    fail(str(e))
  except Exception as e:  # noqa: BLE001 - the config file's own code (a SyntaxError, an import)
    fail(f"the config file raised {type(e).__name__}{_where(e)}: {e}")
  try:
    if config_flag.value is not None:
      config_flag.value.keys()  # a config file that could not be loaded raises its error here
  except OSError as e:
    fail(str(e))
  import ml_collections
  value = config_flag.value
  if config_flag.present and not isinstance(value, ml_collections.ConfigDict):
    # None (a get_config without `return`) failed inside the trainer with an AttributeError.
    fail(f"the config file's get_config returned "
         f"{'None' if value is None else type(value).__name__}, not an "
         "ml_collections.ConfigDict")
  return rest


def _where(e: BaseException) -> str:
  """" at FILE:LINE" of the innermost frame of `e`'s traceback outside absl, ml_collections and
  Python's import machinery (the config file's line, or one of a module it imports), or ""."""
  if isinstance(e, SyntaxError) and e.filename:  # raised where the file was compiled
    return f" at {e.filename}:{e.lineno}"
  frames = [f for f in traceback.extract_tb(e.__traceback__)
            if not f.filename.startswith("<") and f.filename != __file__ and not any(
                part in ("absl", "ml_collections", "importlib")
                for part in pathlib.Path(f.filename).parts)]
  return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
