"""`python -m jaxagent.launch --config=configs/<name>.py[:variant] [--config.key=value ...]`.

Initialises multi-host JAX when launched on several hosts, builds the trainer from the config
and runs it. With no flags it runs the quickstart (`configs/quickstart.py`).

Multi-process: pass `--coordinator_address=HOST:PORT --num_processes=N --process_id=I` (or set
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID) and run the same command on
every process; on a Cloud TPU slice JAX finds all three itself. Only process 0 logs and writes
metrics; every process takes part in checkpoints. `launch/` has recipes for TPU VMs, GKE (xpk)
and GPU clusters (Slurm). With checkpointing on (`--config.checkpoint_every=N`), a run stopped
by SIGTERM or a first Ctrl-C once training has begun finishes its step, saves a checkpoint and
exits (0 after SIGTERM, 130 after Ctrl-C), and rerunning the same command resumes it; without it, SIGTERM ends the run as usual
and a first Ctrl-C stops it after the step (a second one interrupts at once). A second launch into a workdir (or a
local checkpoint directory) that a running launch holds stops at once, naming the process that
holds it.
"""
import errno
import logging
import os
import pathlib
import re
import signal
import socket
import tempfile

from absl import app, flags

# jax / flax are imported where a run starts: a misspelt flag or config key is named before
# their import, which takes a second or more.
from jaxagent import config_files
from jaxagent.runtime import init_runtime  # noqa: F401 (re-exported: the entry points' runtime)


def _default_config() -> str:
  for base in (pathlib.Path.cwd(), pathlib.Path(__file__).resolve().parent.parent):
    path = base / "configs" / "quickstart.py"
    if path.exists():
      return str(path)
  return "configs/quickstart.py"


# No default here: ml_collections loads a flag's default when the flag is defined (this module's
# import), applying the `--config.KEY=VALUE` overrides of sys.argv, so a misspelt key raised a
# traceback before `parse_flags` could name it. `parse_flags` supplies the quickstart instead.
_CONFIG = config_files.define_config_flag(
    "Run config file (`path.py[:variant]`; default: configs/quickstart.py).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "HOST:PORT of process 0 in a multi-process run (default: $JAX_COORDINATOR_ADDRESS).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Processes in the run (default: $JAX_NUM_PROCESSES).")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's index, 0-based (default: $JAX_PROCESS_ID).")
_FIT_CHECK = flags.DEFINE_enum(
    "fit_check", "auto", ["auto", "on", "off"],
    "Compile every program for the devices before the first step and stop if one does not fit "
    "(jaxagent.plan.check_fit). auto: on TPU/GPU, skipped on CPU; on: also on CPU (report only).")
_COMPILE_CACHE = flags.DEFINE_string(
    "compile_cache", "auto",
    "JAX's persistent compilation cache: auto (on GPU/TPU, in $JAXAGENT_COMPILE_CACHE or "
    "~/.cache/jaxagent/xla), on (also on CPU), off, or a directory. A rerun or a resumed run "
    "then loads the programs it compiled before instead of compiling them again.")
# A yes / no spelling was taken for a directory: --compile_cache=false turned the cache on, in
# ./false.
flags.register_validator(
    "compile_cache",
    lambda v: str(v).strip().lower() not in ("true", "false", "yes", "no", "1", "0", "none"),
    "takes auto, on, off or a directory (a yes / no spelling is not a directory: say on or off)")


def check_workdir(workdir, write: bool = True) -> None:
  """Raise ValueError unless `workdir` names a directory and (with `write`) this process can
  create it and write a file in it.

  Process 0 writes the run's metrics there; a read-only or mistyped path (one under a file,
  say) otherwise failed with a traceback once the model was built. An empty workdir (say
  `--config.workdir=$RUN_DIR` with the variable unset) wrote the run into the current
  directory, after moving an earlier run's metrics and samples found there to ./previous/.
  """
  if not str(workdir).strip():
    raise ValueError(f"workdir={workdir!r} is empty: set --config.workdir to the directory the "
                     "run writes to (--config.workdir=. for the current directory)")
  if "://" in str(workdir):
    # The trainer writes the workdir through local file paths: gs://bucket/run became the
    # relative directory ./gs:/bucket/run, and the metrics, samples and TensorBoard events of
    # the run stayed there on process 0's disk, while the checkpoints went to the bucket.
    raise ValueError(f"workdir={str(workdir)!r} is a URL, and the run writes its metrics, samples "
                     "and TensorBoard events to a local (or mounted) directory: set "
                     "--config.workdir to one, and --config.checkpoint_dir to the bucket folder "
                     "for checkpoints (such as --config.checkpoint_dir=gs://BUCKET/RUN/checkpoints)")
  if not write:
    return
  path = pathlib.Path(str(workdir))
  try:
    path.mkdir(parents=True, exist_ok=True)
    # A byte written through to the file system: a full disk lets a file be created but not
    # written, and the run then failed at its first metrics line, after the model was built.
    with tempfile.TemporaryFile(dir=path) as f:
      f.write(b"\n")
      f.flush()
      try:
        os.fsync(f.fileno())
      except OSError as e:  # a file system without fsync has still taken the byte
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
          raise
  except OSError as e:
    raise ValueError(f"workdir {str(path)!r} cannot be written ({e.strerror or e}): set "
                     "--config.workdir to a directory this process can create and write"
                     ) from None


_HELD_LOCKS = []  # `lock_workdir`'s open files: the locks last as long as the process


def lock_workdir(workdir, setting: str = "workdir"):
  """Hold an exclusive lock on `<workdir>/.jaxagent.lock` for the life of this process.

  Two runs launched into one workdir (a command started twice, a requeued job while the first
  still runs) both finished "successfully" with their checkpoints, metrics and TensorBoard
  events interleaved. Returns the open lock file (keep it referenced), or None on a file
  system without locks (with a warning). Raises ValueError when another process holds it,
  naming `setting`, the config key that chose the directory (the checkpoint directory is
  locked the same way: `lock_checkpoint_dir`).
  """
  import fcntl
  path = pathlib.Path(str(workdir)) / ".jaxagent.lock"
  f = open(path, "a+")
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    f.seek(0)
    holder = f.read().strip()
    f.close()
    raise ValueError(f"another run is using {setting} {str(workdir)!r} ({holder or path}): "
                     f"wait for it to end or stop it, or set --config.{setting} to another "
                     "directory") from None
  except OSError as e:
    logging.warning("cannot lock %s (%s): nothing stops a second run from using this workdir",
                    path, e)
    f.close()
    return None
  f.seek(0)
  f.truncate()
  f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
  f.flush()
  return f


def lock_checkpoint_dir(config):
  """`lock_workdir` for the run's checkpoint directory when checkpointing is on and it is local:
  two runs with their own workdirs and one `checkpoint_dir` (or one pointing into the other's
  workdir) each overwrote and deleted the other's checkpoints and ended "successfully"; a rerun
  then resumed the other run's weights. None when there is nothing to lock (a bucket cannot be
  locked: one run per bucket folder is the user's to keep), and when the checkpoint directory
  is the workdir itself, whose lock (`lock_workdir`, which `main` takes first) covers it."""
  from jaxagent.checkpoint import CheckpointConfig
  cfg = CheckpointConfig.from_config(config)
  if not cfg.enabled:
    return None
  path = cfg.path(config.workdir)
  if "://" in str(path):
    return None
  try:
    pathlib.Path(str(path)).mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ValueError(f"checkpoint directory {str(path)!r} cannot be created "
                     f"({e.strerror or e}): set --config.checkpoint_dir to a directory this "
                     "process can create and write") from None
  # A second lock on the same file from this process fails like another run's would: a run
  # with checkpoint_dir = workdir was refused as "another run", naming its own pid.
  if pathlib.Path(str(path)).resolve() == pathlib.Path(str(config.workdir)).resolve():
    return None
  return lock_workdir(path, setting="checkpoint_dir")


_EARLY_SIGTERM: list[str] = []  # a SIGTERM received before the config said what it means


def _record_sigterm(signum, frame):
  del frame
  _EARLY_SIGTERM.append(f"received {signal.Signals(signum).name}")


def _stop_on_sigterm_before_training(config):
  """With checkpointing on, SIGTERM is a stop request from the start, not only once `run` has
  begun: during the fit check and the trainer's construction (model load, first compiles) it
  ended the process with status 143, so a job script that requeues a run which exits 0 after a
  stop (launch/gpu_slurm.sbatch) ended the job instead. Returns `early_stop(trainer)`: True
  when a single-process run was asked to stop before training began (nothing to save: it says
  so, and `main` exits 0); otherwise the stop goes to `trainer.request_stop`, which `run`
  honours as a SIGTERM of its own (on several processes, so that all stop at the same step).

  `main` records a SIGTERM from its first line (`_record_sigterm`): one that came while the
  runtime started and the config was checked counts here; without checkpointing it ends the
  process as SIGTERM does by default."""
  from jaxagent.checkpoint import CheckpointConfig
  if not CheckpointConfig.from_config(config).enabled:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _EARLY_SIGTERM:
      os.kill(os.getpid(), signal.SIGTERM)
    return lambda trainer: False
  import jax
  received, built = _EARLY_SIGTERM, []

  def on_sigterm(signum, frame):
    del frame
    reason = f"received {signal.Signals(signum).name}"
    if built:
      built[0].request_stop(reason)
    else:
      received.append(reason)

  signal.signal(signal.SIGTERM, on_sigterm)

  def early_stop(trainer) -> bool:
    built.append(trainer)  # from here on the handler stops the trainer itself
    if not received:
      return False
    if jax.process_count() > 1:
      trainer.request_stop(received[0])
      return False
    print(f"{received[0]} before training began: nothing to save; rerun the same command to "
          "start (or resume) the run", flush=True)
    return True

  return early_stop


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing with one-line errors for bad `--config` overrides
  (`config_files.parse_config_flags`); without `--config`, the quickstart's config file."""
  try:
    given = flags.FLAGS.read_flags_from_files(argv[1:], force_gnu=False)
  except flags.Error:  # a --flagfile that cannot be read: named by the parse below, one line
    given = None      # (it was a traceback here)
  if given is not None and not any(re.match(r"-{1,2}config(=|$)", a) for a in given):
    argv = [argv[0], f"--config={_default_config()}", *argv[1:]]
  return config_files.parse_config_flags(argv, _CONFIG)


def main(argv):
  del argv
  # Recorded until the config says whether SIGTERM is a stop request (checkpointing on) or ends
  # the process: a SIGTERM in the first seconds (runtime start, config check) exited with 143.
  signal.signal(signal.SIGTERM, _record_sigterm)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
  logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every file it writes
  try:
    init_runtime(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  except ValueError as e:  # a missing or impossible rank / process count
    raise SystemExit(f"bad launch: {e}") from None
  import jax
  from jaxagent import compile_stats, plan
  from jaxagent.trainer import Trainer, check_config
  config = _CONFIG.value
  for key in ("workdir", "checkpoint_dir"):
    # A shell leaves the ~ of --config.workdir=~/runs/x as it is: it named ./~/runs/x.
    value = config.get(key) if hasattr(config, "get") else None
    if isinstance(value, str) and value.startswith("~"):
      config[key] = os.path.expanduser(value)
  try:
    # The settings that need no model first: the fit check compiles every program (minutes
    # on a TPU) before the trainer would have named a typo.
    check_config(config)
    # Written by process 0 only; an empty one stops every process.
    check_workdir(config.workdir, write=jax.process_index() == 0)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"bad config: {e}") from None
  early_stop = _stop_on_sigterm_before_training(config)
  if jax.process_index() == 0:
    try:
      _HELD_LOCKS.append(lock_workdir(config.workdir))  # held until this process exits
      _HELD_LOCKS.append(lock_checkpoint_dir(config))
    except ValueError as e:
      raise SystemExit(f"bad launch: {e}") from None
  cache = compile_stats.enable_persistent_cache(_COMPILE_CACHE.value)
  if cache is not None:
    logging.info("persistent compilation cache: %s", cache)
  try:
    plan.check_fit(config, _FIT_CHECK.value)
  except plan.DoesNotFit as e:
    raise SystemExit(f"the run does not fit the devices; nothing was started.\n{e}") from None
  except (ValueError, FileNotFoundError) as e:  # the plan builds the model first: as below
    raise SystemExit(f"bad config: {e}") from None
  try:
    trainer = Trainer(config)
  except (ValueError, FileNotFoundError) as e:
    # A bad setting, or a model / tokenizer path that does not exist: its message says
    # which; nothing was started.
    raise SystemExit(f"bad config: {e}") from None
  if early_stop(trainer):
    trainer.close()
    return
  run_trainer(trainer)


def run_trainer(trainer) -> None:
  """`trainer.run()`, then `trainer.close()`. An error whose message says what happened and
  what was kept is one line and exit status 1, not a traceback: unusable checkpoints or
  diverged params (`CheckpointError`), non-finite values in a step's update or the sampler's
  logits (`FloatingPointError`; the checkpoints written are unchanged), warm-start data that
  cannot be used (`SFTDataError`). A run stopped by a first Ctrl-C exits with status 130, as
  an interrupted command does, after its checkpoint (`launch ... && next` goes no further); one
  stopped by SIGTERM exits 0, which job scripts take as "requeue" (launch/gpu_slurm.sbatch)."""
  from jaxagent.checkpoint import CheckpointError
  from jaxagent.trainer import SFTDataError
  try:
    summary = trainer.run()
    if (summary or {}).get("stopped_at_step") is not None and str(
        getattr(trainer, "stop_reason", None) or "").startswith("received SIGINT"):
      raise SystemExit(130)
  except CheckpointError as e:  # unusable checkpoints or diverged params; nothing was lost
    raise SystemExit(f"checkpoint error: {e}") from None
  except SFTDataError as e:  # read as the run starts, before any training: a bad setting
    raise SystemExit(f"bad config: {e}") from None
  except FloatingPointError as e:
    raise SystemExit(f"training stopped: {e}") from None
  finally:
    trainer.close()


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
