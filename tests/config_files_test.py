"""`jaxagent.config_files.parse_config_flags`: a config file that does not load is one line."""
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent

# An entry point as `jaxagent.launch` and `jaxagent.plan` build theirs (without their imports).
ENTRY = """
import sys
from jaxagent import config_files
config = config_files.define_config_flag("")
config_files.parse_config_flags(sys.argv, config)
print("loaded", type(config.value).__name__, config.value.get("a"))
"""


def _parse(*args):
  return subprocess.run([sys.executable, "-c", ENTRY, *args], cwd=REPO, capture_output=True,
                        text=True, timeout=60)


@pytest.mark.parametrize("source, expected", [
    # The file's own code raised: a traceback through absl and ml_collections.
    ("import ml_collections\n1 / 0\n", "the config file raised ZeroDivisionError at {path}:2: "
     "division by zero"),
    ("def get_config(arg=None:\n  pass\n", "the config file raised SyntaxError at {path}:1: "),
    ("import no_such_module_for_a_config\n", "the config file raised ModuleNotFoundError at "
     "{path}:1: No module named 'no_such_module_for_a_config'"),
    ("def get_config(arg=None):\n  raise RuntimeError('no GPU here')\n",
     "the config file raised RuntimeError at {path}:2: no GPU here"),
    # It read as "the config has no key module 'config_config' has no attribute 'get_config'".
    ("X = 1\n", "the config file has no get_config function"),
    # None (no return) ended the run in the trainer with an AttributeError on None.
    ("def get_config(arg=None):\n  pass\n",
     "the config file's get_config returned None, not an ml_collections.ConfigDict"),
    ("def get_config(arg=None):\n  return {'a': 1}\n",
     "the config file's get_config returned dict, not an ml_collections.ConfigDict"),
    # A KeyError or AttributeError of the file's own code read as a missing key of the config:
    # "the config has no key JAXAGENT_NO_SUCH_VARIABLE\n--config.KEY=VALUE only sets keys ...".
    ("import os\nDATA = os.environ['JAXAGENT_NO_SUCH_VARIABLE']\n",
     "the config file raised KeyError at {path}:2: 'JAXAGENT_NO_SUCH_VARIABLE'"),
    ("import ml_collections\ndef get_config(arg=None):\n  c = ml_collections.ConfigDict({'lr': 1})\n"
     "  c.steps = c.lr * c.epochs\n  return c\n",
     "the config file raised AttributeError at {path}:4: 'epochs'"),
])
def test_a_config_file_that_does_not_load_is_one_line(tmp_path, source, expected):
  path = tmp_path / "my_config.py"
  path.write_text(source)
  r = _parse(f"--config={path}")
  assert r.returncode == 1, (r.stdout, r.stderr[-2000:])
  assert f"FATAL Flags parsing error: {expected.format(path=path)}" in r.stderr, r.stderr[-2000:]
  assert "Traceback" not in r.stderr, r.stderr[-2000:]


def test_a_config_files_own_key_error_is_its_own_with_an_override_too(tmp_path):
  path = tmp_path / "my_config.py"
  path.write_text("import ml_collections\n"
                  "def get_config(arg=None):\n  return ml_collections.ConfigDict({'a': {}['lr']})\n")
  r = _parse(f"--config={path}", "--config.a=2")
  assert r.returncode == 1, (r.stdout, r.stderr[-2000:])
  assert (f"FATAL Flags parsing error: the config file raised KeyError at {path}:3: 'lr'\n"
          in r.stderr), r.stderr[-2000:]


def test_a_config_file_that_loads_is_parsed_with_its_overrides(tmp_path):
  path = tmp_path / "my_config.py"
  path.write_text("import ml_collections\n"
                  "def get_config(arg=None):\n  return ml_collections.ConfigDict({'a': 1})\n")
  r = _parse(f"--config={path}", "--config.a=7")
  assert r.returncode == 0 and r.stdout.strip() == "loaded ConfigDict 7", r.stderr[-2000:]


@pytest.mark.parametrize("override, expected", [
    # ml_collections named only the last part ("the config has no key 'lr'"), with a suggestion
    # for a top-level key only.
    ("--config.train.lr=1", "the config has no key train.lr (--config.train.lr): did you mean "
     "optimizer.lr or sft.lr?\n--config.KEY=VALUE only sets keys"),
    ("--config.optimizer.lrr=1", "the config has no key optimizer.lrr (--config.optimizer.lrr): "
     "did you mean optimizer.lr?"),
    ("--config.steps=1", "the config has no key steps (--config.steps): did you mean "
     "total_steps or sft.steps?"),
    # A TypeError inside ml_collections, reported as "the config file raised TypeError".
    ("--config.workdir.x=1", "the config has no key workdir.x (--config.workdir.x): workdir is a "
     "setting ('runs/x'), not a group of settings"),
    ("--config.train.rows.x=1", "the config has no key train.rows.x (--config.train.rows.x): "
     "train.rows is a setting (4), not a group of settings"),
])
def test_an_unknown_override_names_its_whole_key_and_where_it_is(tmp_path, override, expected):
  path = tmp_path / "my_config.py"
  path.write_text("import ml_collections\n"
                  "def get_config(arg=None):\n"
                  "  return ml_collections.ConfigDict(dict(workdir='runs/x', total_steps=3,\n"
                  "      train=dict(rows=4), optimizer=dict(lr=0.1), sft=dict(lr=0.2, steps=1)))\n")
  r = _parse(f"--config={path}", override)
  assert r.returncode == 1, (r.stdout, r.stderr[-2000:])
  assert f"FATAL Flags parsing error: {expected}" in r.stderr, r.stderr[-2000:]
  assert "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("override, expected", [
    # absl said only "invalid literal for int() with base 10: '1.5'" (or "could not convert
    # string to float", "Non-boolean argument"), naming no type.
    ("--config.total_steps=1.5", "flag --config.total_steps=1.5: invalid literal for int() with "
     "base 10: '1.5'\n--config.total_steps takes an int (the type of its value in the config "
     "file)\n"),
    ("--config.train.lr=abc", "--config.train.lr takes a number (the type of its value"),
    ("--config.train.tb=no", "--config.train.tb takes true or false (or 1 / 0) (the type"),
    ("--config.train.cap=None", "--config.train.cap takes an int (the type of its value in the "
     "config file); None cannot be given on the command line (where a setting takes None, set "
     "it in the config file"),
    # absl said only "Failed to parse 'qwen3' as a ConfigDict: ValueError('malformed node or
    # string on line 1: <ast.Name object at 0x...>')".
    ("--config.train=qwen3", "flag --config.train=qwen3: Failed to parse 'qwen3' as a "
     "ConfigDict: "),
    ("--config.train=qwen3", "\n--config.train is a group of settings (cap, lr, tb), not one "
     "setting: set one of its keys, --config.train.KEY=VALUE\n"),
    # (a group that is None until set: absl's words only, no traceback)
    ("--config.extra=qwen3", "flag --config.extra=qwen3: Failed to parse 'qwen3' as a "
     "ConfigDict: "),
])
def test_an_override_of_the_wrong_type_says_what_the_key_takes(tmp_path, override, expected):
  path = tmp_path / "my_config.py"
  path.write_text("import ml_collections\n"
                  "from ml_collections.config_dict import placeholder\n"
                  "def get_config(arg=None):\n"
                  "  return ml_collections.ConfigDict(dict(total_steps=3, train=dict(\n"
                  "      lr=0.1, tb=True, cap=placeholder(int)),\n"
                  "      extra=placeholder(ml_collections.ConfigDict)))\n")
  r = _parse(f"--config={path}", override)
  assert r.returncode == 1, (r.stdout, r.stderr[-2000:])
  assert expected in r.stderr, r.stderr[-2000:]
  assert "Traceback" not in r.stderr, r.stderr[-2000:]


def test_an_override_without_a_config_file_asks_for_the_file():
  """`python -m jaxagent.plan --config.total_steps=1` said only "Unknown command line flag
  'config.total_steps'"."""
  r = _parse("--config.total_steps=1")
  assert r.returncode == 1, (r.stdout, r.stderr[-2000:])
  assert ("Unknown command line flag 'config.total_steps': --config.KEY=VALUE sets a key of the "
          "config file; pass the file first, --config=path.py[:variant]") in r.stderr, r.stderr


def test_load_config_runs_a_file_that_defines_a_dataclass(tmp_path):
  """A config file with `from __future__ import annotations` and a dataclass raised
  "AttributeError: 'NoneType' object has no attribute '__dict__'" in `load_config` (the
  dataclass looks up its module in sys.modules), while --config=that_file.py loaded it."""
  from jaxagent import config_files
  path = tmp_path / "with_dataclass.py"
  path.write_text("from __future__ import annotations\n"
                  "import dataclasses\n"
                  "import ml_collections\n"
                  "@dataclasses.dataclass\n"
                  "class Schedule:\n"
                  "  warmup: int = 3\n"
                  "def get_config(arg=None):\n"
                  "  return ml_collections.ConfigDict(dict(warmup=Schedule().warmup, arg=arg))\n")
  c = config_files.load_config(path, "tiny")
  assert (c.warmup, c.arg) == (3, "tiny")
  broken = tmp_path / "broken_config.py"
  broken.write_text("raise RuntimeError('no GPU here')\n")
  with pytest.raises(RuntimeError, match="no GPU here"):
    config_files.load_config(broken)
  assert "jaxagent_config_broken_config" not in sys.modules


def test_load_config_calls_a_get_config_without_an_argument_as_the_command_line_does(tmp_path):
  # load_config passed None to it: "TypeError: get_config() takes 0 positional arguments but 1
  # was given", where --config=that_file.py loaded the file.
  from jaxagent import config_files
  path = tmp_path / "no_arg.py"
  path.write_text("import ml_collections\n"
                  "def get_config():\n  return ml_collections.ConfigDict({'a': 1})\n")
  assert config_files.load_config(path).a == 1
  r = _parse(f"--config={path}")
  assert r.returncode == 0 and r.stdout.strip() == "loaded ConfigDict 1", r.stderr[-2000:]
  path.write_text("import ml_collections\n"
                  "def get_config(arg='base'):\n  return ml_collections.ConfigDict({'a': arg})\n")
  assert config_files.load_config(path).a == "base"
  assert config_files.load_config(path, "tiny").a == "tiny"


@pytest.mark.parametrize("override, expected", [
    # ml_collections' IndexError, reported as "the config file raised IndexError: 0 is not a
    # valid index for <class 'tuple'> (in: train.buckets[0])" / "list index out of range".
    ("--config.train.buckets[0]=256", "--config.train.buckets[0]: train.buckets = (128, 256) is "
     "a tuple, whose elements cannot be set one by one; give the whole tuple, "
     "--config.train.buckets='(a, b, ...)'"),
    ("--config.train.names[2]=c", "--config.train.names[2]: train.names has 2 elements "
     "(['a', 'b']), so no index 2"),
    ("--config.total_steps[0]=1", "the config has no key total_steps[0] "
     "(--config.total_steps[0]): total_steps is a setting (3), not a list"),
    ("--config.train[0]=1", "the config has no key train[0] (--config.train[0]): train is a "
     "group of settings, not a list"),
    # (no path and no suggestion: "the config has no key 'bucket'")
    ("--config.train.bucket[0]=1", "the config has no key train.bucket[0] "
     "(--config.train.bucket[0]): did you mean train.buckets?"),
])
def test_an_indexed_override_that_cannot_be_set_says_why(tmp_path, override, expected):
  path = tmp_path / "my_config.py"
  path.write_text("import ml_collections\n"
                  "def get_config(arg=None):\n"
                  "  return ml_collections.ConfigDict(dict(total_steps=3, train=dict(\n"
                  "      buckets=(128, 256), names=['a', 'b'])))\n")
  r = _parse(f"--config={path}", override)
  assert r.returncode == 1, (r.stdout, r.stderr[-2000:])
  assert f"FATAL Flags parsing error: {expected}" in r.stderr, r.stderr[-2000:]
  assert "Traceback" not in r.stderr and "raised" not in r.stderr, r.stderr[-2000:]


def test_an_indexed_override_of_a_list_element_is_set(tmp_path):
  path = tmp_path / "my_config.py"
  path.write_text("import ml_collections\n"
                  "def get_config(arg=None):\n"
                  "  return ml_collections.ConfigDict(dict(a=[1, 2]))\n")
  r = _parse(f"--config={path}", "--config.a[1]=5")
  assert r.returncode == 0 and r.stdout.strip() == "loaded ConfigDict [1, 5]", r.stderr[-2000:]


@pytest.mark.parametrize("args, expected", [
    # `python -m jaxagent.launch configs/math_tool.py` ran the quickstart: the argument that is
    # not a flag was left unread.
    (["{path}"], "unexpected argument '{path}': this command takes flags only "
     "(--config=path.py[:variant], --config.KEY=VALUE, ...); to run that config file, pass "
     "--config={path}"),
    (["--config={path}", "tiny"], "unexpected argument 'tiny': this command takes flags only"),
    # Every flag after a `--` was dropped: the run went on with the file's own settings.
    (["--config={path}", "--", "--config.a=7"], "unexpected argument '--config.a=7': this "
     "command takes flags only (--config=path.py[:variant], --config.KEY=VALUE, ...); the "
     "arguments after '--' are not read as flags: leave the '--' out"),
])
def test_an_argument_that_is_not_a_flag_is_refused(tmp_path, args, expected):
  path = tmp_path / "my_config.py"
  path.write_text("import ml_collections\n"
                  "def get_config(arg=None):\n  return ml_collections.ConfigDict({'a': 1})\n")
  r = _parse(*(a.format(path=path) for a in args))
  assert r.returncode == 1 and "loaded" not in r.stdout, (r.stdout, r.stderr[-2000:])
  assert f"FATAL Flags parsing error: {expected.format(path=path)}" in r.stderr, r.stderr[-2000:]
  assert "Traceback" not in r.stderr, r.stderr[-2000:]


def test_the_config_flag_reads_its_overrides_from_a_flagfile(tmp_path):
  # The flag of `define_config_flag` reads the argv that `parse_config_flags` is given, with
  # its flag files expanded: overrides written in a --flagfile apply, and a later one on the
  # command line wins; a flag file that does not exist is one line.
  path = tmp_path / "my_config.py"
  path.write_text("import ml_collections\ndef get_config(arg=None):\n"
                  "  return ml_collections.ConfigDict({'a': 1})\n")
  flagfile = tmp_path / "run.flags"
  flagfile.write_text(f"--config={path}\n--config.a=2\n")
  r = _parse(f"--flagfile={flagfile}")
  assert r.returncode == 0 and "loaded ConfigDict 2" in r.stdout, (r.stdout, r.stderr[-2000:])
  r = _parse(f"--flagfile={flagfile}", "--config.a=3")
  assert r.returncode == 0 and "loaded ConfigDict 3" in r.stdout, (r.stdout, r.stderr[-2000:])
  r = _parse(f"--flagfile={tmp_path}/no_such.flags")
  assert r.returncode == 1 and "Unable to open flagfile" in r.stderr, r.stderr[-2000:]
  assert "Traceback" not in r.stderr, r.stderr[-2000:]
