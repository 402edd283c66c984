"""`python -m jaxagent.plan`: bad input is one line and exit status 1, never a traceback."""
import os
import pathlib
import subprocess
import sys

import pytest

from jaxagent import plan

REPO = pathlib.Path(__file__).resolve().parent.parent.parent
TINY = ["--config=configs/quickstart.py:tiny", "--config.model.tokenizer="]


def _plan(*args):
  return subprocess.run([sys.executable, "-m", "jaxagent.plan", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


_NEEDS_LIBTPU = [pytest.mark.skipif(not plan.has_libtpu(), reason="needs libtpu: pip install 'jaxagent[tpu]'"),
                 pytest.mark.tpu_aot]


def test_a_misspelt_key_is_named_before_jax_is_imported():
  # `jaxagent.plan` imports its modules (and so jax) on first use of a name.
  code = ("import runpy, sys\n"
          "sys.argv = ['jaxagent.plan', *sys.argv[1:]]\n"
          "try:\n  runpy.run_module('jaxagent.plan', run_name='__main__')\n"
          "except SystemExit as e:\n  print('exit', e.code, 'jax' in sys.modules)\n")
  r = subprocess.run([sys.executable, "-c", code, *TINY, "--config.trian.rows=3"], cwd=REPO,
                     capture_output=True, text=True, timeout=300,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert "did you mean train?" in r.stderr, r.stderr[-2000:]
  assert r.stdout.strip() == "exit 1 False", (r.stdout, r.stderr[-2000:])


def test_names_are_imported_on_first_use():
  import jaxagent.plan as p
  assert p.plan_run is p.planner.plan_run and p.knobs is p.report.knobs
  assert set(p.__all__) <= set(dir(p))
  with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
    p.no_such_name  # noqa: B018


@pytest.mark.parametrize("args, expected", [
    (["--topology=v5e"], "bad plan input: topology 'v5e': expected '<chip>:<shape>'"),
    (["--topology=v5litepod-2"], "bad plan input: topology 'v5litepod-2': in v5litepod-N, N "
     "counts chips; the planner translates N = 1 (1x1), 4 (2x2), 8 (2x4)"),
    (["--config.trian.rows=3"], "the config has no key trian.rows (--config.trian.rows): did you "
     "mean train?"),
    (["--config=configs/no_such_config.py"], "No such file or directory"),
    (["--programs=decode"], "bad plan input: PlanOptions.programs: unknown ['decode']"),
    (["--rows=0"], "bad plan input: PlanOptions.rows must be None or a positive int, got 0"),
    (["--config.model.path=no-such-model"], "bad plan input: model.path 'no-such-model'"),
    (["--config.model.path="], "bad plan input: the config names no model: set model.path"),
    # A --flagfile that does not exist was a traceback from the import of jaxagent.plan's main.
    (["--flagfile=/no/such/flagfile"], "FATAL Flags parsing error: ERROR:: Unable to open "
     "flagfile: [Errno 2] No such file or directory: '/no/such/flagfile'"),
    pytest.param(["--topology=v9:2x2"], "bad plan input: libtpu does not know the topology 'v9:2x2'",
                 marks=_NEEDS_LIBTPU),
    pytest.param(["--topology=v5e:2x2", "--config.mesh.data=3", "--config.mesh.fsdp=1"],
                 "bad plan input: MeshConfig data*fsdp*tensor = 3 but 4 devices", marks=_NEEDS_LIBTPU),
])
def test_bad_input_is_one_line_not_a_traceback(args, expected):
  r = _plan(*TINY, *args)
  assert r.returncode == 1, r.stderr[-2000:]
  assert expected in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert "--json: " not in r.stderr, r.stderr[-2000:]  # not every flag's help after it


@pytest.mark.parametrize("edit, expected", [
    ('del c["model"]', "bad plan input: the config names no model: set model.path"),
    ('del c.model["path"]', "bad plan input: the config names no model: set model.path"),
    ('del c.model["param_dtype"]', "bad plan input: the config has no key 'param_dtype'"),
    # A misspelt key in the file: the launcher refuses it, so the plan must not plan without it.
    ("c.rollout.max_promt_tokens = 32", "bad plan input: unknown config key(s): "
     "rollout.max_promt_tokens (did you mean rollout.max_prompt_tokens?)"),
    # ... and the env's own settings, which the trainer's env refuses (the plan ignored them).
    ("c.env.kwargs.max_term = 3", "bad plan input: bad settings for env 'quickstart': unknown "
     "setting 'max_term' (did you mean 'max_terms'?)"),
])
def test_config_file_missing_or_misspelling_a_key_is_one_line(tmp_path, edit, expected):
  config = tmp_path / "cfg.py"
  config.write_text("from configs import quickstart\n\n\ndef get_config(arg=None):\n"
                    "  c = quickstart.get_config('tiny')\n  c.model.tokenizer = ''\n"
                    f"  {edit}\n  return c\n")
  r = _plan(f"--config={config}")
  assert r.returncode == 1, r.stderr[-2000:]
  assert expected in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_missing_config_flag_is_one_line():
  r = _plan()
  assert r.returncode == 1 and r.stderr.strip() == (
      "bad plan input: --config is required, e.g. --config=configs/quickstart.py"), r.stderr


@pytest.mark.skipif(not plan.has_libtpu(), reason="needs libtpu: pip install 'jaxagent[tpu]'")
@pytest.mark.tpu_aot
def test_a_program_that_fails_to_compile_is_a_failed_plan():
  # cuDNN attention exists on no TPU: the update cannot be built for v5e, so the plan must not
  # exit 0 as if the run could go ahead.
  r = _plan(*TINY, "--topology=v5e:2x2", "--programs=update", "--config.model.attention=cudnn")
  assert "compile failed" in r.stdout, r.stdout
  assert r.returncode == 1, (r.stdout, r.stderr[-2000:])


@pytest.mark.slow  # default-run time budget: a TPU compile in a process of its own; the name mapping stays in chips_test
@pytest.mark.skipif(not plan.has_libtpu(), reason="needs libtpu: pip install 'jaxagent[tpu]'")
@pytest.mark.tpu_aot
def test_cloud_accelerator_type_is_planned_as_the_topology_it_names():
  # `--topology=v5litepod-4` was bad input; it is the v5e:2x2 slice, and the report says so.
  r = _plan(*TINY, "--topology=v5litepod-4", "--programs=update")
  assert r.returncode == 0, r.stderr[-2000:]
  assert "on v5litepod-4 (= v5e:2x2) (4 x v5e" in r.stdout, r.stdout
