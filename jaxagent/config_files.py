"""Run configs kept as Python files (`configs/<name>.py` with `get_config(variant)`), loaded
outside the command line (by one config building on another, by tests and notebooks), and the
flag parsing of the entry points that take one on the command line (`--config=path.py[:variant]`).
"""
from __future__ import annotations

import difflib
import importlib.util
import pathlib
import re
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
  # In sys.modules while it runs, as an import puts it: a dataclass defined in a config file
  # with `from __future__ import annotations` looks its module up there, and raised
  # "AttributeError: 'NoneType' object has no attribute '__dict__'" without it.
  sys.modules[spec.name] = module
  try:
    spec.loader.exec_module(module)
  except BaseException:
    if sys.modules.get(spec.name) is module:
      del sys.modules[spec.name]
    raise
  return module


def load_config(path: str | pathlib.Path, variant: str | None = None
                ) -> ml_collections.ConfigDict:
  """`get_config(variant)` of the config file at `path` (`get_config()` when `variant` is None,
  as `--config=path.py` calls it, so a `get_config` that takes no argument loads too)."""
  return load_config_module(path).get_config(*(() if variant is None else (variant,)))


def did_you_mean(key: str, known, prefix: str = "") -> str:
  """`prefix + key` for an error message, with "(did you mean prefix + K?)" when one of the
  `known` keys is close to it."""
  close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
  return f"{prefix}{key} (did you mean {prefix}{close[0]}?)" if close else f"{prefix}{key}"


# The argv that each `define_config_flag` flag reads its `--config.KEY=VALUE` overrides from,
# filled by `parse_config_flags`; by flag name.
_FLAG_ARGV: dict[str, list[str]] = {}


def define_config_flag(help_text: str, name: str = "config"):
  """An entry point's `--config=path.py[:variant]` flag (ml_collections' config-file flag, no
  default), for parsing with `parse_config_flags`.

  The flag reads its overrides from the argv that `parse_config_flags` is given, not from
  sys.argv: at its definition (the entry point's import) it would read sys.argv's --flagfile,
  and one that did not exist was a traceback from that import.
  """
  from ml_collections import config_flags
  argv: list[str] = []
  holder = config_flags.DEFINE_config_file(name, None, help_text, sys_argv=argv)
  _FLAG_ARGV[name] = argv
  return holder


def parse_config_flags(argv: list[str], config_flag) -> list[str]:
  """absl's flag parsing for an entry point with a `--config` file flag (`app.run(main,
  flags_parser=...)`): a `--config.key=value` naming a key the config lacks, or a config file
  that does not load (missing, raising, without `get_config`, or whose `get_config` returns no
  ConfigDict), is one line on stderr and exit status 1, as for other bad flags, instead of a
  traceback."""
  from absl import flags

  if (flag_argv := _FLAG_ARGV.get(config_flag.name)) is not None:
    flag_argv[:] = argv  # what the flag reads its overrides from (define_config_flag)

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
    elif (f"Unknown command line flag '{config_flag.name}." in message
          and not any(re.match(rf"-{{1,2}}{re.escape(config_flag.name)}(=|$)", a)
                      for a in argv[1:])):
      # (the overrides of a config file that was not given were "unknown flags")
      message = (f"{message}: --{config_flag.name}.KEY=VALUE sets a key of the config file; "
                 f"pass the file first, --{config_flag.name}=path.py[:variant] (such as "
                 f"--{config_flag.name}=configs/quickstart.py)")
    else:
      message += _override_type_hint(argv, config_flag.name, message)
    fail(message)
  except (AttributeError, KeyError) as e:  # raised by the config for a key it does not have
    if (unknown := _unknown_override(argv, config_flag.name)) is not None:
      fail(unknown)
    if isinstance(e, AttributeError) and getattr(e, "name", None) == "get_config":
      # (it read as "the config has no key module 'config_config' has no attribute ...")
      fail(f"the config file has no get_config function ({e}): define "
           "get_config(arg=None) returning an ml_collections.ConfigDict")
    if where := _where(e):
      # Raised in the config file's own code (os.environ["DATA_DIR"] unset, a key its
      # get_config reads before setting it), not by an override: it read as "the config has no
      # key DATA_DIR" with advice on --config.KEY=VALUE, with or without overrides.
      inner = e
      while inner.args and isinstance(inner.args[0], BaseException):  # ConfigDict's wrapping
        inner = inner.args[0]
      what = inner.args[0] if len(inner.args) == 1 and isinstance(inner.args[0], str) else inner
      if isinstance(inner, KeyError) and not str(what).startswith(("'", '"')):
        what = repr(what)  # the missing key as Python shows it: KeyError 'DATA_DIR'
      fail(f"the config file raised {type(e).__name__}{where}: {what}")
    while e.args and isinstance(e.args[0], BaseException):
      e = e.args[0]
    what = e.args[0] if len(e.args) == 1 and isinstance(e.args[0], str) else str(e)
    fail(f"the config has no key {what}\n--config.KEY=VALUE only sets keys that the config "
         "file defines (add a new one to its get_config).")
  except OSError as e:  # an override of a config file that could not be loaded
    fail(str(e))
  except Exception as e:  # noqa: BLE001 - the config file's own code (a SyntaxError, an import)
    # An override below a setting that is not a group (--config.workdir.x=1) raised a TypeError
    # in ml_collections, which read as the config file's own error.
    if (unknown := _unknown_override(argv, config_flag.name)) is not None:
      fail(unknown)
    fail(f"the config file raised {type(e).__name__}{_where(e)}: {e}")
  if len(rest) > 1:
    # The entry points read flags only, and left the rest unread: `python -m jaxagent.launch
    # configs/math_tool.py` ran the quickstart, and every flag after a `--` was dropped.
    fail(_positional_error(argv, rest[1:], config_flag.name))
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


def _positional_error(argv: list[str], extra: list[str], name: str) -> str:
  """The error for arguments that are not flags (`extra`, what absl left of `argv`)."""
  shown = " ".join(repr(a) for a in extra[:3]) + (" ..." if len(extra) > 3 else "")
  message = (f"unexpected argument{'s' if len(extra) > 1 else ''} {shown}: this command takes "
             f"flags only (--{name}=path.py[:variant], --{name}.KEY=VALUE, ...)")
  if "--" in argv[1:]:
    return message + "; the arguments after '--' are not read as flags: leave the '--' out"
  if (file := next((a for a in extra if re.fullmatch(r"[^=]+\.py(:.*)?", a)), None)) is not None:
    return message + f"; to run that config file, pass --{name}={file}"
  return message + (f"; a variant of the config file goes after it, --{name}=path.py:VARIANT, "
                    f"and a setting is --{name}.KEY=VALUE")


def _unknown_override(argv: list[str], name: str = "config") -> str | None:
  """The error for the first `--config.KEY=VALUE` of `argv` whose KEY the config file does not
  define, or None when each one names a setting (or the config cannot be loaded here).

  ml_collections named only the last part of the key, with a suggestion at the top level only:
  `--config.train.lr=1e-3` (the key is optimizer.lr) said "the config has no key 'lr'".
  """
  import ml_collections
  if (loaded := _config_and_overrides(argv, name)) is None:
    return None
  config, keys = loaded

  def shown(value) -> str:
    return repr(value) if len(repr(value)) <= 40 else type(value).__name__

  for key in keys:
    parts = key.split(".")
    node = config
    for i, part in enumerate(parts):
      here = ".".join(parts[:i])
      if (indexed := re.fullmatch(r"([^\[\]]+)((?:\[-?\d+\])*)", part)) is None:
        break  # an index of another form: ml_collections' own message
      part = indexed.group(1)
      if not isinstance(node, ml_collections.ConfigDict):
        return (f"the config has no key {key} (--{name}.{key}): {here} is a setting "
                f"({shown(node)}), not a group of settings")
      if part not in node:
        prefix = f"{here}." if here else ""
        close = [prefix + k for k in difflib.get_close_matches(part, list(node.keys()), n=2,
                                                              cutoff=0.6)]
        elsewhere = [p for p in _key_paths(config) if p.rsplit(".", 1)[-1] == part]
        hints = list(dict.fromkeys(close + elsewhere))[:3]
        hint = (f": did you mean {', '.join(hints[:-1])} or {hints[-1]}?" if len(hints) > 1
                else f": did you mean {hints[0]}?" if hints else "")
        return (f"the config has no key {key} (--{name}.{key}){hint}\n--{name}.KEY=VALUE only "
                "sets keys that the config file defines (add a new one to its get_config).")
      node, path = node[part], f"{here}.{part}" if here else part
      # An element of a list or a tuple, --config.train.len_buckets[0]=256: ml_collections
      # refused an element of a tuple or past the end with an IndexError, reported as the config
      # file's own error ("the config file raised IndexError: 0 is not a valid index ...").
      for j in map(int, re.findall(r"-?\d+", indexed.group(2))):
        if isinstance(node, tuple):
          return (f"--{name}.{key}: {path} = {shown(node)} is a tuple, whose elements cannot be "
                  f"set one by one; give the whole tuple, --{name}.{path}='(a, b, ...)'")
        if isinstance(node, ml_collections.ConfigDict):
          return (f"the config has no key {key} (--{name}.{key}): {path} is a group of "
                  "settings, not a list")
        if not isinstance(node, list):
          return (f"the config has no key {key} (--{name}.{key}): {path} is a setting "
                  f"({shown(node)}), not a list")
        if not -len(node) <= j < len(node):
          return (f"--{name}.{key}: {path} has {len(node)} elements ({shown(node)}), so no "
                  f"index {j}")
        node, path = node[j], f"{path}[{j}]"
  return None


def _config_and_overrides(argv: list[str], name: str):
  """(the config that `--name=path.py[:variant]` of `argv` loads, the keys of its
  `--name.KEY=VALUE` overrides), or None when it does not load as a ConfigDict."""
  from absl import flags
  import ml_collections
  try:
    args = flags.FLAGS.read_flags_from_files(argv[1:], force_gnu=False)
  except flags.Error:
    return None
  source, keys = None, []
  for i, arg in enumerate(args):
    if m := re.match(rf"-{{1,2}}{re.escape(name)}(=|$)", arg):
      source = arg[m.end():] if m.group(1) else (args[i + 1] if i + 1 < len(args) else None)
    elif m := re.match(rf"-{{1,2}}(no)?{re.escape(name)}\.([^=]+)", arg):
      keys.append(m.group(2))
  if source is None or not keys:
    return None
  path, *variant = source.split(":", 1)
  try:
    config = load_config_module(path).get_config(*variant)
  except Exception:  # noqa: BLE001 - the caller reports the config file's own errors
    return None
  return (config, keys) if isinstance(config, ml_collections.ConfigDict) else None


_TYPE_WORDS = {bool: "true or false (or 1 / 0)", int: "an int", float: "a number",
               str: "a string"}


def _override_type_hint(argv: list[str], name: str, message: str) -> str:
  """For absl's "flag --config.KEY=VALUE: <parse error>", a line saying what KEY takes (the type
  of its value in the config file), or "". absl's own words ("invalid literal for int() with
  base 10: '1.5'") said neither, and a None, which no typed setting takes from the command line,
  read as a typo."""
  import ml_collections
  m = re.match(rf"flag --{re.escape(name)}\.([\w.]+)=(.*?): ", message)
  if m is None or (loaded := _config_and_overrides(argv, name)) is None:
    return ""
  key, value = m.groups()
  *groups, last = key.split(".")
  node = loaded[0]
  try:
    for g in groups:
      node = node[g]
    kind = node.get_type(last)
  except Exception:  # noqa: BLE001 - no hint is better than a wrong one
    return ""
  group = node.get(last)
  if isinstance(group, ml_collections.ConfigDict):
    # (absl's words were "Failed to parse 'qwen3' as a ConfigDict: ValueError('malformed node
    # or string on line 1: <ast.Name object at 0x7f...>')" for --config.model=qwen3)
    keys = [k for k in group.keys() if not isinstance(group[k], ml_collections.ConfigDict)]
    shown = ", ".join(keys[:6]) + (", ..." if len(keys) > 6 else "")
    return (f"\n--{name}.{key} is a group of settings ({shown}), not one setting: set one of "
            f"its keys, --{name}.{key}.KEY=VALUE")
  if kind not in _TYPE_WORDS:
    return ""
  hint = f"\n--{name}.{key} takes {_TYPE_WORDS[kind]} (the type of its value in the config file)"
  if value.strip().lower() in ("none", "null"):
    hint += ("; None cannot be given on the command line (where a setting takes None, set it "
             "in the config file, in a variant of its get_config)")
  return hint


def _key_paths(config, prefix: str = "") -> list[str]:
  """The dotted path of every key of a ConfigDict, groups and settings, outermost first."""
  out = []
  for k in config.keys():
    out.append(prefix + k)
    if hasattr(config[k], "keys") and not isinstance(config[k], str):
      out += _key_paths(config[k], f"{prefix}{k}.")
  return out


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
