"""The README's API tour runs as written (with the arrays it leaves to the reader filled in)."""
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.conftest import CPU_TEST_XLA_FLAGS

REPO = pathlib.Path(__file__).resolve().parent.parent

# The tour uses these names without defining them: small packed arrays of the documented shapes.
_INPUTS = """
import jax.numpy as jnp
tokens = jnp.asarray([[1, 2, 3, 4, 5, 0]], jnp.int32)
segment_ids = jnp.asarray([[1, 1, 1, 2, 2, 0]], jnp.int32)
logps = old_logps = jnp.full((1, 6), -1.0)
adv = jnp.ones((1, 6))
loss_mask = jnp.asarray([[0, 1, 1, 0, 1, 0]], jnp.float32)
"""


def api_tour() -> str:
  text = (REPO / "README.md").read_text()
  start = text.index("## API tour")
  m = re.search(r"```python\n(.*?)```", text[start:], re.S)
  assert m, "README.md's API tour has no python block"
  return m.group(1)


@pytest.mark.slow  # loads SmolLM2-135M and rolls out 32 trajectories on a CPU (about 6 minutes)
def test_readme_api_tour_runs(tmp_path):
  from jaxagent import models
  try:
    models.load_tokenizer("smollm2-135m-instruct")
  except Exception as e:  # noqa: BLE001 - the tour's model ships in an optional pip package
    pytest.skip(f"SmolLM2 unavailable: {e}")
  script = tmp_path / "tour.py"
  script.write_text(_INPUTS + api_tour() + "\nprint('TOUR-OK', float(loss), len(trajs))\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {CPU_TEST_XLA_FLAGS}")
  proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0 and "TOUR-OK" in proc.stdout, proc.stderr[-4000:]
  assert "TOUR-OK" in proc.stdout.splitlines()[-1] and proc.stdout.split()[-1] == "32"


def test_readme_api_tour_is_found_and_parses():
  compile(_INPUTS + api_tour(), "README.md", "exec")


def test_readme_api_tour_rl_kernels_run():
  """The tour's last part needs no model, so the default run executes it: a renamed loss
  argument or setting fails here, not only in the slow test."""
  tour = api_tour()
  assert "# RL kernels" in tour, "README.md's API tour no longer has its '# RL kernels' part"
  scope: dict = {}
  exec(compile(_INPUTS + tour[tour.index("# RL kernels"):], "README.md", "exec"), scope)
  assert int(scope["metrics"]["num_segments"]) == 2
  assert math.isfinite(float(scope["loss"]))


# ------------------------------------------------------------- commands named in the docs
# Every `python -m jaxagent.X ...`, `python benchmarks/X.py ...` and `launch/X.sh ... -- ...`
# command written in the docs, the config headers, the launch scripts' usage comments and the
# notebooks' text passes only flags that its entry point defines, and only `--config.KEY`s that
# its config file has: a new user copies them as written.
_DOCS = ("README.md", "launch/README.md", "benchmarks/README.md", "configs/*.py", "launch/*.sh",
         "launch/*.sbatch", "colabs/*.ipynb", "benchmarks/*.py", "jaxagent/**/*.py")
_ENTRY = re.compile(r"python3? (-m jaxagent(?:\.\w+)+|benchmarks/\w+\.py)((?:[^`#;&|\n\"]|\\\n)*)")
_RECIPE = re.compile(r"launch/(?:tpu_vm|xpk|gpu_multinode)\.sh|launch/gpu_slurm\.sbatch")


def _defined_flags(path: pathlib.Path) -> set[str]:
  """The flags an entry point defines (argparse or absl), read from its source."""
  text = path.read_text()
  if "benchmarks.common import" in text or "from benchmarks import common" in text:
    text += (REPO / "benchmarks" / "common.py").read_text()
  out = set(re.findall(r'add_argument\(\s*"(--[-\w]+)"', text))
  out |= set(re.findall(r'add_argument\(\s*"-[-\w]+",\s*"(--[-\w]+)"', text))
  out |= {f"--no-{f[2:]}" for f in out if "BooleanOptionalAction" in text}
  out |= {f"--{f}" for f in re.findall(r'DEFINE_\w+\(\s*"(\w+)"', text)}
  # config_files.define_config_flag(help_text, name="config")
  for call in re.findall(r"define_config_flag\(([^)]*)\)", text):
    name = re.search(r'name\s*=\s*"(\w+)"', call)
    out.add(f"--{name.group(1) if name else 'config'}")
  out |= {f"--no{f[2:]}" for f in out if "DEFINE_bool" in text}
  return out


def _entry_point(target: str) -> pathlib.Path:
  if target.startswith("-m "):
    base = REPO / target[3:].replace(".", "/")
    return base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__main__.py"
  return REPO / target


def _doc_commands():
  """(where, entry point, argument text) of every command found in the docs."""
  for pattern in _DOCS:
    for path in sorted(REPO.glob(pattern)):
      text = path.read_text()
      if path.suffix == ".ipynb":
        text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"])
      # Join continued lines; in Python files also the `#   ` of comment blocks.
      text = re.sub(r"\\\n\s*#?", " ", text)
      where = str(path.relative_to(REPO))
      for line in text.splitlines():
        for m in _ENTRY.finditer(line):
          yield where, m.group(1), m.group(2)
        for m in _RECIPE.finditer(line):  # a recipe passes what follows ` -- ` to the launcher
          rest = line[m.end():]
          if " -- " in rest or rest.lstrip().startswith("--config"):
            yield where, "-m jaxagent.launch", rest.split(" -- ", 1)[-1]


def _has_key(cfg, dotted: str) -> bool:
  for part in dotted.split("."):
    if not hasattr(cfg, "keys") or part not in cfg:
      return False
    cfg = cfg[part]
  return True


def test_commands_in_the_docs_pass_flags_that_exist():
  from jaxagent.config_files import load_config
  configs = {}
  bad, seen = [], 0
  for where, target, args in _doc_commands():
    if (target in ("-m jaxagent.launch", "-m jaxagent.plan") or target.endswith("plan_vs_measured.py")
        or (target == "-m jaxagent.evaluate" and "--config" in args)):
      m = re.search(r"--config=(configs/\w+\.py)(?::(\w+))?", args)
      config = (m.group(1), m.group(2)) if m else ("configs/quickstart.py", None)
    else:
      config = None
    path = _entry_point(target)
    if not path.exists():
      bad.append(f"{where}: `python {target}`: no such entry point")
      continue
    known = _defined_flags(path)
    for flag in re.findall(r"(?<![\w./-])(--[\w.-]+)", args):
      seen += 1
      if flag.startswith("--config.") and config is not None:
        key = flag[len("--config."):]
        if key == "key":  # the placeholder of `--config.key=value`
          continue
        if config not in configs:
          configs[config] = load_config(REPO / config[0], config[1])
        if not _has_key(configs[config], key):
          bad.append(f"{where}: `python {target} ... {flag}`: {config[0]}:{config[1] or ''} "
                     "has no such key")
      elif flag != "--" and flag not in known:
        bad.append(f"{where}: `python {target} ... {flag}`: {path.relative_to(REPO)} defines "
                   "no such flag")
  assert seen > 100, f"found only {seen} flags in the docs: is the command pattern still right?"
  assert not bad, "\n".join(bad)


def test_config_keys_and_launch_flags_named_in_the_docs_exist():
  """`--config.KEY` settings named on their own (knobs in a config's header, tips in the
  READMEs) are keys of that config (of the quickstart's layout elsewhere), and the launcher's
  own flags named in the READMEs (absl spells them with underscores) are defined."""
  from jaxagent.config_files import load_config
  quickstart = load_config(REPO / "configs" / "quickstart.py")
  launcher = set()
  for entry in ("jaxagent/launch.py", "jaxagent/plan/__main__.py", "jaxagent/export.py",
                "jaxagent/evaluate.py"):
    launcher |= _defined_flags(REPO / entry)
  bad, seen = [], 0
  for pattern in ("README.md", "launch/README.md", "benchmarks/README.md", "configs/*.py",
                  "launch/*.sh", "launch/*.sbatch", "colabs/*.ipynb"):
    for path in sorted(REPO.glob(pattern)):
      where = str(path.relative_to(REPO))
      cfg = load_config(path) if where.startswith("configs/") else quickstart
      # A command that names its config file is checked against that config (the test above).
      text = "\n".join(_ENTRY.sub(lambda m: "" if "--config=configs/" in m.group(2) else m.group(),
                                  line)
                       for line in re.sub(r"\\\n\s*#?", " ", path.read_text()).splitlines())
      for key in re.findall(r"--config\.([\w.]+\w)", text):
        seen += 1
        if key != "key" and not _has_key(cfg, key):
          bad.append(f"{where}: --config.{key}: no such key in "
                     f"{where if where.startswith('configs/') else 'configs/quickstart.py'}")
      if path.name == "README.md":
        for flag in re.findall(r"`(--[a-z]+_[\w]+)", text):
          seen += 1
          if flag not in launcher:
            bad.append(f"{where}: `{flag}`: no entry point defines it")
  assert seen > 30, f"found only {seen} settings in the docs: is the pattern still right?"
  assert not bad, "\n".join(bad)


def test_benchmark_table_flags_exist():
  """Each row of benchmarks/README.md's table names flags of its own script (or of the script
  named just before them)."""
  bad, seen = [], 0
  for line in (REPO / "benchmarks" / "README.md").read_text().splitlines():
    m = re.match(r"\| `(\w+\.py)` \|(.*)", line)
    if not m:
      continue
    for span in re.findall(r"`([^`]+)`", m.group(2)):
      owner = re.match(r"(\w+\.py)\b", span)
      script = owner.group(1) if owner else m.group(1)
      known = _defined_flags(REPO / "benchmarks" / script)
      for flag in re.findall(r"(?<![\w-])(--[\w-]+)", span):
        seen += 1
        if flag not in known:
          bad.append(f"benchmarks/README.md, row {m.group(1)}: `{flag}` is not a flag of {script}")
  assert seen > 30, f"found only {seen} flags in the table: is the pattern still right?"
  assert not bad, "\n".join(bad)


# ------------------------------------------------------------- names the docs send readers to
_NAME_DOCS = ("README.md", "launch/README.md", "configs/*.py", "jaxagent/__init__.py",
              "jaxagent/*/__init__.py", "colabs/*.ipynb")


def _user_doc_texts():
  """(where, text) of the user-facing docs: the READMEs, the config files' headers, the public
  packages' docstrings and the notebooks' text cells."""
  for pattern in _NAME_DOCS:
    for path in sorted(REPO.glob(pattern)):
      text = path.read_text()
      if path.suffix == ".ipynb":
        text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"]
                         if c["cell_type"] == "markdown")
      elif path.suffix == ".py":
        text = text.split('"""')[1] if text.lstrip().startswith('"""') else ""
      yield str(path.relative_to(REPO)), text


def _source_index():
  """class name -> module, and module short name -> module, over the package's source."""
  classes, modules = {}, {}
  for path in sorted((REPO / "jaxagent").rglob("*.py")):
    module = ".".join(path.relative_to(REPO).with_suffix("").parts)
    if path.stem == "__init__":
      module = module.rsplit(".", 1)[0]
    elif path.stem != "__main__":
      modules.setdefault(path.stem, module)
    for name in re.findall(r"^class (\w+)", path.read_text(), re.M):
      classes.setdefault(name, module)
  return classes, modules


def _has(obj, attr: str) -> bool:
  return hasattr(obj, attr) or attr in getattr(obj, "__dataclass_fields__", {})


def test_code_names_in_the_docs_exist():
  """Every `jaxagent.x.y` the docs name imports, and every `Class.attribute` (a setting such as
  `EngineConfig.share_prompts`, a method such as `Engine.prepare`) or `some_module.function`
  they quote in backticks is there: a rename must take the docs along."""
  import importlib
  classes, modules = _source_index()

  def resolve(dotted: str) -> bool:
    parts = dotted.split(".")
    base = REPO.joinpath(*parts)
    if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
      return True  # a module, not imported: the entry points define flags when imported
    if dotted.startswith("jaxagent.generate.jetstream."):
      # Importing the adapter imports google-jetstream (seconds): read its top-level names.
      source = (REPO / "jaxagent" / "generate" / "jetstream.py").read_text()
      return bool(re.search(rf"^(class|def) {parts[3]}\b", source, re.M))
    for i in range(len(parts), 0, -1):
      try:
        obj = importlib.import_module(".".join(parts[:i]))
      except ImportError:
        continue
      for part in parts[i:]:
        if not _has(obj, part):
          return False
        obj = getattr(obj, part, None)
      return True
    return False

  bad, seen = [], 0
  for where, text in _user_doc_texts():
    for dotted in sorted(set(re.findall(r"(?<![\w/.~])jaxagent(?:\.\w+)+", text))):
      if dotted.endswith((".log", ".lock")):  # files of that name (launch/tpu_vm.sh's log)
        continue
      seen += 1
      if not resolve(dotted):
        bad.append(f"{where}: {dotted} does not exist")
    for span in re.findall(r"`([^`\n]+)`", text):
      if span.startswith("-") or "/" in span:  # a flag, a config key or a path
        continue
      for owner, attr in re.findall(r"(?<![\w.])([A-Za-z_]\w*)\.([A-Za-z_]\w*)(?![\w.])", span):
        # Classes by their CamelCase names; modules only by unambiguous snake_case names
        # (`decode_mlp.swiglu_rms`): `env.name` or `config.json` are config keys and files.
        if owner[0].isupper() and owner in classes:
          obj = getattr(importlib.import_module(classes[owner]), owner)
        elif "_" in owner and owner in modules:
          obj = importlib.import_module(modules[owner])
        else:
          continue
        seen += 1
        if not _has(obj, attr):
          bad.append(f"{where}: `{span}`: {owner} has no {attr!r}")
  assert seen > 25, f"found only {seen} names in the docs: is the pattern still right?"
  assert not bad, "\n".join(bad)


# ------------------------------------------------------------- numbers that go stale silently
def test_quickstart_numbers_in_the_readme_are_the_configs():
  """The README's main-job result names the held-out size and GRPO step count of
  configs/quickstart.py: a change to either must come with a new measurement in the README."""
  from jaxagent.config_files import load_config
  c = load_config(REPO / "configs" / "quickstart.py")
  text = re.sub(r"\s+", " ", (REPO / "README.md").read_text())
  m = re.search(r"held-out pass@1 \(n=(\d+), greedy\).*? after (\d+) GRPO steps", text)
  assert m, "README.md no longer states the main job's held-out n and GRPO steps"
  assert int(m.group(1)) == c.eval.size, (
      f"README.md quotes n={m.group(1)} held-out problems; configs/quickstart.py evaluates "
      f"{c.eval.size}: rerun the main job and update the README's numbers")
  assert int(m.group(2)) == c.total_steps, (
      f"README.md quotes {m.group(2)} GRPO steps; configs/quickstart.py runs {c.total_steps}: "
      "rerun the main job and update the README's numbers")


def test_config_headers_name_the_eval_size_of_their_measured_variant():
  """A config header's measured `gpu` result names its held-out n: the variant's eval.size."""
  from jaxagent.config_files import load_config
  seen = 0
  for name in ("math_tool", "search_qa", "code"):
    path = REPO / "configs" / f"{name}.py"
    header = re.sub(r"\s+", " ", path.read_text().split('"""')[1])
    m = re.search(r"\bgpu \(measured[^\n]*?\(n=(\d+)", header)
    assert m, f"{path.name}: the gpu variant's measured result no longer names its n"
    seen += 1
    size = load_config(path, "gpu").eval.size
    assert int(m.group(1)) == size, (
        f"{path.name}'s header quotes n={m.group(1)} for the gpu variant, which evaluates "
        f"{size} held-out examples")
  assert seen == 3


def test_readme_counts_the_gpu_tests():
  """The README's `pytest -m gpu tests/gpu` command says how many tests it runs."""
  m = re.search(r"pytest -m gpu tests/gpu -n 0`\s*\((\d+) tests",
                (REPO / "README.md").read_text())
  assert m, "README.md no longer says how many tests `pytest -m gpu tests/gpu` runs"
  proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                         "-n", "0", "-p", "no:cacheprovider", "tests/gpu"],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
  found = re.search(r"(\d+) tests? collected", proc.stdout)
  assert found, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert int(found.group(1)) == int(m.group(1)), (
      f"README.md says {m.group(1)} GPU tests; tests/gpu has {found.group(1)}: run them on a "
      "GPU and update the README (and benchmarks/RESULTS.md)")
