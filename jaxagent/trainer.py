"""The RL loop (and its SFT warm start) behind `python -m jaxagent.launch`.

One iteration: prompts from a grain pipeline -> G rollouts per prompt (multi-turn, tools on
host threads) -> rewards -> group-relative advantages -> dynamic-sampling filter -> packing ->
reference log-probs (frozen params on the same mesh) -> optimizer steps over micro-batches ->
the new params go to the generator (same buffers, no copy; a compute-dtype copy when the
masters are float32 and compute is lower) -> metrics, samples, eval, checkpoint. Single-turn
tasks are multi-turn tasks that never call a tool.

The run is built from an ml_collections config (see `configs/quickstart.py`); the config is
turned into the frozen dataclasses of each module here, at the boundary.

Checkpoints and resume (`jaxagent.checkpoint`): with `checkpoint_every > 0` the trainer saves
after the warm start (step 0), every `checkpoint_every` RL steps, at the last step (also the
one where `train.time_limit_s` runs out) and when it receives SIGTERM or a first Ctrl-C (it
finishes the current step, saves and returns; during the warm start it stops after the current
SFT step or eval and saves nothing, since step 0 is not reached; a second Ctrl-C interrupts at
once); rerunning the same command with the same
workdir resumes from the newest complete checkpoint, without redoing the warm start. Every
random choice derives from (seed, step): rollout seeds and request ids from the step, the
prompt order from the grain iterator state stored in the checkpoint, so a resumed run repeats
the uninterrupted one exactly (same hardware, same mesh).

Multi-host: the learner (warm start, reference scoring, updates) runs SPMD over the global mesh
on every process. Rollouts and evaluation run on process 0 alone, on a mesh of its local devices
with a host copy of the current params, and process 0 broadcasts the packed batch and the
metrics. Tool calls finish in nondeterministic order and time out under load, so identical
rollouts on every host could not be guaranteed; one host rolling out can. (This gathers the
params to every host each step: simple, and costly for large models.)
"""
from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import dataclasses
import functools
import io
import json
import logging
import math
import os
import pathlib
import pickle
import signal
import threading
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent import checkpoint, compile_stats, models, sharding
from jaxagent.agent.env import Env, Example, lacks_split
from jaxagent.agent.rollout import RolloutCancelled, RolloutDriver, rollout_metrics
from jaxagent.agent.trajectory import Trajectory
from jaxagent.envs import make_env
from jaxagent.generate import Engine, EngineConfig, SamplingConfig
from jaxagent.metrics import MetricsWriter, append_line, finite_json
from jaxagent.models import lora as lora_lib, param_tree
from jaxagent.models.config import run_overrides
from jaxagent.rewards import ENV_REWARD_ERROR, RewardOutput, mean_metrics, math_verifier
from jaxagent.rewards.shaping import overlong_penalty
from jaxagent.rl import advantages as adv_lib
from jaxagent.rl import packing, step as step_lib
# A run config's checks and the training data have modules of their own; their names stay
# importable from here.
from jaxagent.run_config import (  # noqa: F401 (re-exported)
    KNOWN_CONFIG_KEYS, OPTIONAL_CONFIG_KEYS, OVERLONG, _rollout_config, _time_limit_s,
    check_config, config_keys, overlong_shaping)
from jaxagent.train_data import (  # noqa: F401 (re-exported)
    PromptStream, SFTDataError, _examples_fingerprint, _sft_batches, _split_examples,
    check_examples, sft_items, sft_items_from_chat_jsonl)

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- model
def load_model(mcfg, *, architecture: models.ModelConfig | None = None
               ) -> tuple[models.ModelConfig, Any, Any]:
  """(cfg, params, tokenizer) from `config.model`.

  `path` is an HF directory, a `.gguf` file, an embedded preset, or an architecture preset
  (random init, e.g. "tiny-llama" for tests) whose vocabulary is resized to `tokenizer`'s.

  architecture: the `ModelConfig` of weights that come from elsewhere (a checkpoint's, which
    `python -m jaxagent.evaluate` restores): no weights are read or made, and `params` are
    their shapes (boxed `jax.ShapeDtypeStruct`s). `cfg` is an architecture preset's as
    always; for an HF directory or a `.gguf` file (whose config comes with its weights) it is
    `architecture` under `mcfg`'s run settings (dtypes, remat, kernels). The tokenizer
    still comes from `mcfg`.
  """
  dtype_kw = run_overrides(mcfg)
  tok = models.load_tokenizer(mcfg.get("tokenizer") or mcfg.path)
  if mcfg.path in models.PRESETS:
    cfg = models.get_config(mcfg.path, vocab_size=tok.vocab_size,
                            eos_token_id=tok.eos_id, **dtype_kw)
  elif architecture is not None:
    cfg = architecture.replace(**dtype_kw)
  if architecture is not None:
    return cfg, jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0))), tok
  if mcfg.path in models.PRESETS:
    params = models.init_params(cfg, jax.random.key(mcfg.get("init_seed", 0)),
                                std=mcfg.get("init_std", 0.02))
  else:
    cfg, params = models.load(mcfg.path, **dtype_kw)
  return cfg, params, tok


# ----------------------------------------------------------------------------- multi-host
def _encode_ahead(ready: dict) -> dict[str, Any]:
  """Rollouts collected ahead (`Trainer._ready`: step -> (metrics, packed batch or None,
  params version)) as JSON: each step's arrays in one base64 `.npz`, so that they come back
  bit for bit (`_decode_ahead`)."""
  steps = {}
  for s, (metrics, batch, version) in sorted(ready.items()):
    names = sorted(metrics)
    arrays = {"metric_names": np.array(names, dtype=str),
              "metric_values": np.array([float(metrics[k]) for k in names], np.float64)}
    arrays.update({f"batch.{k}": np.asarray(v) for k, v in (batch or {}).items()})
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    steps[str(s)] = {"params_version": int(version), "has_batch": batch is not None,
                     "npz_base64": base64.b64encode(buf.getvalue()).decode("ascii")}
  return {"format": 1, "steps": steps}


def _decode_ahead(data, after: int, path) -> dict[int, tuple]:
  """`_encode_ahead`'s JSON back as `Trainer._ready` (only the steps after `after`).

  Called inside the checkpoint's restore (`decode_ahead`): the `CheckpointError` raised for
  data that does not decode makes the resume skip this checkpoint for the previous one."""
  try:
    ready = {}
    for s, item in data["steps"].items():
      if int(s) <= after:
        continue
      with np.load(io.BytesIO(base64.b64decode(item["npz_base64"], validate=True)),
                   allow_pickle=False) as z:
        metrics = dict(zip(z["metric_names"].tolist(), z["metric_values"].tolist()))
        batch = ({k.removeprefix("batch."): z[k] for k in z.files if k.startswith("batch.")}
                 if item["has_batch"] else None)
      ready[int(s)] = (metrics, batch, int(item["params_version"]))
    return ready
  except Exception as e:  # a damaged file: any of KeyError, ValueError, binascii.Error...
    raise checkpoint.CheckpointError(
        f"checkpoint {path}: its rollouts_ahead item is unreadable ({type(e).__name__}: {e}; "
        "a damaged file)") from e


def _rollout_seed(seed: int, step: int) -> int:
  """The sampler seed of RL step `step`: a function of (seed, step) only, within uint32."""
  return (seed * 1_000_003 + step) % 2**32


def _eval_seed(seed: int) -> int:
  """The sampler seed of every eval: the rollout seed of step -1, which no RL step takes (a
  step-1 rollout and a pass@k eval used to draw the same noise at seed 0)."""
  return _rollout_seed(seed, -1)


@dataclasses.dataclass(frozen=True)
class _LeadError:
  """What `Trainer._on_lead` broadcasts in place of a result when process 0's call raised."""
  message: str


def _broadcast_from_lead(obj):
  """Process 0's `obj` (any picklable value) on every process; the identity on one process."""
  if jax.process_count() == 1:
    return obj
  from jax.experimental import multihost_utils
  lead = jax.process_index() == 0
  data = np.frombuffer(pickle.dumps(obj), np.uint8) if lead else np.zeros(0, np.uint8)
  n = int(multihost_utils.broadcast_one_to_all(np.array([data.size], np.int32))[0])
  buf = data if lead else np.zeros(n, np.uint8)
  return pickle.loads(np.asarray(multihost_utils.broadcast_one_to_all(buf)).tobytes())


def _compile_metrics(d: compile_stats.CompileCounts, count: str, seconds: str,
                     hits: str) -> dict[str, float]:
  """XLA compilations of one step or eval (`jaxagent.compile_stats`) under the given keys."""
  return {count: d.count, seconds: d.seconds, hits: d.cache_hits}


def mini_batch_rows(rows: int, minis: int, seed: int, step: int, epoch: int) -> list[np.ndarray]:
  """The row indices of each of `minis` equal mini-batches of a packed batch of `rows` rows for
  one epoch of RL step `step`: a permutation drawn from (seed, step, epoch), so every process
  of a multi-host run splits alike and a resumed run as the uninterrupted one did; each
  mini-batch's indices ascending."""
  perm = np.random.default_rng([seed % 2**32, step, epoch, 0x6D62]).permutation(rows)
  return [np.sort(part) for part in perm.reshape(minis, rows // minis)]


def _mini_batches(train) -> int:
  """`train.mini_batches` (1 when a config leaves it out: one update per epoch)."""
  return train.get("mini_batches", 1) if hasattr(train, "get") else 1


@contextlib.contextmanager
def _names_the_step(where: str):
  """Re-raise the learner's non-finite error naming the step the run logs: the learner counts
  optimizer updates, which are not the RL (or warm-start) step numbers of metrics.jsonl."""
  try:
    yield
  except FloatingPointError as e:
    err = FloatingPointError(f"{where}: {e} The checkpoints already written are unchanged.")
    # The learner's error carries the unchanged state (the one it was given was donated), as
    # its message says; a re-raise without it left the message naming an attribute it lacked.
    if hasattr(e, "state"):
      err.state = e.state
    raise err from None


def _to_host(tree):
  """Host NumPy copies of (possibly multi-host sharded) arrays: a collective on multi-host."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  from jax.experimental import multihost_utils
  return multihost_utils.process_allgather(tree, tiled=True)


# ----------------------------------------------------------------------------- trainer
def _with_overlong(out: RewardOutput, traj: Trajectory, shaping) -> RewardOutput:
  """`out` with the overlong punishment of `traj` added as component `OVERLONG` (a reward the
  env failed to compute is left as it is)."""
  if shaping is None or ENV_REWARD_ERROR in out.errors:
    return out
  cfg, coef = shaping
  if OVERLONG in out.components:
    raise ValueError(f"the task's reward already has a component named {OVERLONG!r}: it shapes "
                     "length itself; set reward.overlong_cache_tokens=0 (or rename its component)")
  value = overlong_penalty(traj.num_policy_tokens, cfg)
  return dataclasses.replace(out, total=out.total + coef * value,
                             components={**out.components, OVERLONG: value},
                             weights={**out.weights, OVERLONG: coef})


MATH_VERIFY_COUNTS = ("calls", "timeouts", "errors", "busy", "restarts")


def math_verify_metrics(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, float]:
  """`reward/math_verify/<count>`: what the shared math verifier counted between two `stats()`.

  A timeout, error or busy pool scores the answer 0 without raising, so these counts are how a
  run sees that its rewards are being cut by the verifier's limits. Empty while no task has used
  the shared verifier (`math_verifier.default_stats()` is None).
  """
  if after is None:
    return {}
  before = before or {}
  return {f"reward/math_verify/{k}": float(after[k] - before.get(k, 0)) for k in MATH_VERIFY_COUNTS}


def _env_reward_failures(outs: Sequence[RewardOutput]) -> int:
  """How many of `outs` are env.reward raises turned into data (`Trainer._reward`)."""
  return sum(ENV_REWARD_ERROR in o.errors for o in outs)


def _per_task(env, example_ids: Sequence[str], values, key: str) -> dict[str, float]:
  """The mean of `values` over the examples of each task of a mixture (`env.task_of`), as
  `key.format(label)`; nothing for an env of one task, and no key (not NaN) for a task with no
  example among `example_ids`, so that plotted curves skip the step (README)."""
  task_of = getattr(env, "task_of", None)
  if not callable(task_of):
    return {}
  by_task: dict[str, list[float]] = {}
  for i, v in zip(example_ids, values):
    by_task.setdefault(task_of(i), []).append(float(v))
  return {key.format(label): float(np.mean(vs)) for label, vs in sorted(by_task.items())}


def _pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k from n samples with c successes (Chen et al., 2021)."""
  if n - c < k:
    return 1.0
  return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))



def _rewind_jsonl(path: pathlib.Path, step: int) -> list[dict] | None:
  """Truncates a JSON-lines file of step records to those of steps <= `step`, in place (a
  writer's open handle appends at the new end), dropping lines that do not parse; returns
  the records kept, or None when there is no such file."""
  if not path.exists():
    return None
  kept = []
  for line in path.read_text().splitlines():
    try:
      rec = json.loads(line)
    except json.JSONDecodeError:
      continue
    if isinstance(rec, dict) and rec.get("step", 0) <= step:
      kept.append(rec)
  with open(path, "r+") as f:
    f.write("".join(json.dumps(r) + "\n" for r in kept))
    f.truncate()
  return kept

class Trainer:
  """Builds every piece from the config and runs SFT warm start, RL and evaluation."""

  _cancel_ahead: threading.Event | None = None  # (`__init__` sets it; see `_close_collector`)
  eval_only: bool = False  # (`__init__` sets it; also for trainers built without it, in tests)

  def __init__(self, config, *, eval_only: bool = False,
               architecture: models.ModelConfig | None = None):
    """eval_only: a trainer that only evaluates (`python -m jaxagent.evaluate`): its train
    state holds no optimizer state (Adam's moments are twice the params' memory), and
    `run`, `warm_start`, `rl_step`, `restore` and `save_checkpoint` refuse to run.

    architecture: (eval_only, full params only) the `ModelConfig` a checkpoint was written
    with (`checkpoint.model_config_from_meta`): the weights at `model.path` are not read (its
    tokenizer is) and `state.params` holds their shapes only, placed as the learner places
    params (`jax.ShapeDtypeStruct`s with shardings), for the caller to restore the
    checkpoint's params into before evaluating; so the params are never held twice."""
    if architecture is not None and not eval_only:
      raise ValueError("Trainer(architecture=...) builds an evaluation's trainer, whose params "
                       "the caller restores: pass eval_only=True")
    if architecture is not None and lora_lib.from_config(config.get("lora")) is not None:
      raise ValueError("Trainer(architecture=...) is for full params: a LoRA run's base "
                       "weights are read from model.path (its checkpoint holds the adapter)")
    self.config = config
    self.eval_only = bool(eval_only)
    c = config
    compile_stats.install()
    # Settings that need no model are checked first, so a bad value fails in a second.
    check_config(c)
    self.time_limit_s = _time_limit_s(c.train)
    sharding.check_rollout_mesh(c.rollout.get("mesh", "learner"))
    # Both optimizers are built now, so a bad RL or SFT setting fails before any work.
    (self.step_cfg, self.optimizer), (self._sft_step_cfg, self._sft_optimizer) = (
        step_lib.learner_parts(c))
    self.workdir = pathlib.Path(c.workdir).expanduser()  # as the launcher and export read it
    # The mesh before the model: a mesh that does not fit the devices fails before the load.
    # With rollout.devices = n > 0 the learner trains on all but the last n devices.
    learner_devices, rollout_devices = sharding.split_rollout_devices(
        c.rollout.get("devices", 0))
    self.mesh = sharding.make_mesh(c.mesh.data, c.mesh.fsdp, c.mesh.tensor,
                                   devices=learner_devices)
    self.env: Env = make_env(c.env.name, **dict(c.env.get("kwargs", {})))
    # A task that samples its train split (a weighted mixture's subsets) draws with the run's
    # seed unless its own kwargs set one: runs of other seeds then train on other draws.
    if callable(getattr(self.env, "use_run_seed", None)):
      self.env.use_run_seed(c.seed)
    # Before the model: a task's data file that does not read fails in a second.
    self.train_examples = _split_examples(self.env, "train")
    # (eval.size=0: no evals, so a task without an eval split runs)
    self.eval_examples = _split_examples(self.env, "eval")[:c.eval.size] if c.eval.size else []
    if c.eval.size and not self.eval_examples:
      # Every eval then returns nothing: no eval/pass@1 in the metrics or the summary, and no
      # word of why (a task built with no eval examples, e.g. its own eval_size=0).
      log.warning("eval.size=%s, but env %r has no 'eval' examples: no eval runs (no eval/"
                  "pass@1); give the task eval examples, or set eval.size=0 to say so",
                  c.eval.size, self.env.name)
    self.cfg, params, self.tok = load_model(c.model, architecture=architecture)
    # Rollouts run on process 0's local devices in multi-host jobs (see the module docstring),
    # and on the last rollout.devices ones when that is set.
    self.gen_mesh = sharding.rollout_mesh(
        c.rollout.get("mesh", "learner"), self.mesh,
        rollout_devices if rollout_devices is not None else
        None if jax.process_count() == 1 else jax.local_devices())
    train_prompts = check_examples(self.env, self.train_examples, self.tok, "train")
    # Saved with the prompt stream's position: resuming over other examples is named.
    self._train_fingerprint = _examples_fingerprint(self.train_examples, train_prompts)
    train_lens = [len(p) for p in train_prompts]
    train_prompts = set(train_prompts)
    self._eval_prompts = check_examples(self.env, self.eval_examples, self.tok, "eval")
    leaked = [ex.id for ex, p in zip(self.eval_examples, self._eval_prompts) if p in train_prompts]
    self.prompts = PromptStream(self.train_examples, c.seed)

    t = c.train
    self.loss_cfg = self.step_cfg.loss
    # With a low-rank adapter (config `lora`) the learner holds the loaded params, frozen, and
    # the train state (and the reference, a checkpoint) holds the adapter alone.
    self.lora = lora_lib.from_config(c.get("lora"))
    self.learner = step_lib.Learner(self.cfg, self.step_cfg, self.optimizer, self.mesh,
                                    lora=self.lora, base=params if self.lora else None)
    self._base_digest = None
    if self.lora is not None:
      # Recorded with every checkpoint: a resume or an export over other base weights (an HF
      # directory replaced under the same model.path) is refused.
      self._base_digest = checkpoint.digest(self.learner.base)
      if c.lora.get("init_from"):  # an adapter trained before (SFT elsewhere, an earlier run)
        params = self._adapter_from(c.lora.init_from)
      else:
        params = lora_lib.init_lora(self.cfg, self.lora, jax.random.fold_in(
            jax.random.key(c.seed), 0x10A))
    if architecture is not None:  # shapes to restore into (`evaluate.evaluate_checkpoint`)
      self.state = step_lib.TrainState(
          step=jax.device_put(np.int32(0), jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())),
          params=checkpoint.params_target(params, self.mesh), opt_state=None)
    else:
      self.state = self.learner.init(params, optimizer=not self.eval_only)
    del params
    self.ref_params = None  # set when RL starts (after the warm start), if kl_coef > 0

    r = c.rollout
    eos = tuple(sorted(self.tok.eos_ids))
    self.rollout_cfg = _rollout_config(r)
    self.overlong = overlong_shaping(c)  # added to the RL rewards, not to the evals
    mk = lambda samp: Engine(self.cfg, EngineConfig(slots=r.slots, max_len=r.max_len,
                                                    eos_ids=eos, sampling=samp),
                             mesh=self.gen_mesh)
    self.sample_engine = mk(SamplingConfig(r.temperature, r.top_p, r.top_k))
    self.greedy_engine = mk(SamplingConfig(0.0))
    self.sampler = RolloutDriver(self.sample_engine, self.env, tokenizer=self.tok,
                                 cfg=self.rollout_cfg)
    self.greedy = RolloutDriver(self.greedy_engine, self.env, tokenizer=self.tok,
                                cfg=self.rollout_cfg)
    dp = self.mesh.shape["data"] * self.mesh.shape["fsdp"]  # as resolved (either may be -1)
    self.pack_cfg = packing.config_from_train(t, dp)
    self.writer = MetricsWriter(self.workdir, tensorboard=c.log.tensorboard,
                                progress_total=c.total_steps, progress=c.log.progress)
    if self.lora is not None:
      self.writer.message(
          f"LoRA: rank {self.lora.rank}, alpha {self.lora.alpha:g}, on "
          f"{', '.join(self.lora.targets)}: {lora_lib.num_params(self.cfg, self.lora):,} "
          f"trainable parameters over a frozen base of "
          f"{sum(x.size for x in jax.tree.leaves(self.learner.base)):,}")
    if leaked:  # allowed (a check on training prompts), but then eval does not measure held-out
      self.writer.message(
          f"warning: {len(leaked)} of the {len(self.eval_examples)} eval examples have the same "
          f"prompt as a train example, so eval/pass@1 is not held out: "
          + ", ".join(map(repr, leaked[:5])) + (", ..." if len(leaked) > 5 else ""))
    self._check_prompt_lengths(train_lens)
    self._check_eval_prompt_lengths([len(p) for p in self._eval_prompts])
    self.step = 0
    self._reward_failures: list[str] = []  # this step's env.reward raises (`_reward`)
    self._reward_wait_s = 0.0  # this step's wait for rewards after its rollouts
    self._step_golds: dict[int, Any] = {}  # this step's id(trajectory) -> gold (sample dumps)
    self._success_failures = 0  # this eval's env.is_success raises (`_success`)
    self.summary: dict[str, Any] = {}
    self.ckpt_cfg = checkpoint.CheckpointConfig.from_config(c)
    self.ckpt = (checkpoint.CheckpointManager(self.ckpt_cfg.path(self.workdir), self.ckpt_cfg,
                                              say=self.writer.message)
                 if self.ckpt_cfg.enabled else None)
    self.warm_started = False
    self._cast = None  # jitted `compute_copy` for the generator (built on first use)
    self._resumed: int | None = None
    self._restore_done = False
    self._stop_reason: str | None = None
    self._stop_honoured = False  # a `run` has returned since `_stop_reason` was set
    self._interrupted: str | None = None  # where a stop cut the phase before RL short
    self._sft_loaded: tuple[list[packing.PackItem], int] | None = None  # `_pre_rl` -> `warm_start`
    # Rollouts collected ahead of the learner (`train.off_policy_steps`, `_rollouts`): the
    # collector thread (process 0's), the steps it was given (future, params version, an event
    # set when that rollout stops decoding) and the steps collected and not trained on yet
    # ((metrics, batch, params version)).
    self.off_policy_steps = int(t.get("off_policy_steps", 0) or 0)
    if rollout_devices is not None and not self.off_policy_steps:
      self.writer.message(
          f"warning: rollout.devices={len(rollout_devices)} with train.off_policy_steps=0: the "
          "learner's devices idle while the rollouts run and the rollout devices while the "
          "learner updates; set train.off_policy_steps=1 to run the two side by side")
    self._ahead_pool: concurrent.futures.ThreadPoolExecutor | None = None
    self._cancel_ahead = threading.Event()  # set while the trainer closes (`_close_collector`)
    self._inflight: dict[int, tuple[concurrent.futures.Future | None, int,
                                    threading.Event | None]] = {}
    self._ready: dict[int, tuple[dict[str, float], dict[str, np.ndarray] | None, int]] = {}
    # A collection that failed while an eval or a checkpoint waited for it (`_settle_ahead`):
    # raised when its step comes to train, as without rollouts ahead; and the prompt stream's
    # position before each step collected ahead (process 0), where a checkpoint saved over
    # such a failure resumes from.
    self._failed: dict[int, Exception] = {}
    self._prompts_before: dict[int, Any] = {}
    self._shares_devices = bool(set(self.gen_mesh.devices.flat) & set(self.mesh.devices.flat))

  def _check_trains(self, what: str) -> None:
    if self.eval_only:
      raise RuntimeError(f"Trainer.{what}: this trainer was built with eval_only=True (no "
                         "optimizer state); it only evaluates")

  def _adapter_from(self, path: str):
    """The PEFT adapter at `path` (`lora.init_from`), which must have the config's rank,
    alpha and targets."""
    lcfg, adapter = lora_lib.load_peft(pathlib.Path(path).expanduser(), self.cfg)
    # (lora.forward and lora.dropout are the run's: how it trains the adapter)
    if (lcfg.rank, lcfg.alpha, lcfg.targets) != (self.lora.rank, self.lora.alpha,
                                                 self.lora.targets):
      raise ValueError(
          f"lora.init_from={path!r} holds an adapter of rank {lcfg.rank}, alpha {lcfg.alpha!r} "
          f"on {','.join(lcfg.targets)}; the config says lora.rank={self.lora.rank}, "
          f"lora.alpha={self.lora.alpha!r}, lora.targets={','.join(self.lora.targets)}: set "
          "them to the adapter's")
    return adapter

  def _check_prompt_lengths(self, lens: Sequence[int]) -> None:
    """Train prompts too long to decode end their trajectories unsampled (stop reason
    "prompt_too_long") whenever they are drawn: counted here once, an error when all are."""
    cap = self.rollout_cfg.max_prompt_tokens
    long = [ex.id for ex, n in zip(self.train_examples, lens)
            if self.sampler.prompt_too_long(n) is not None]
    if not long:
      return
    msg = (f"{len(long)} of the {len(lens)} train prompts are too long to decode (longest "
           f"{max(lens)} tokens; rollout.max_len={self.config.rollout.max_len}, "
           f"rollout.max_total_tokens / max_prompt_tokens={self.rollout_cfg.max_total_tokens} / "
           f"{cap}): " + ", ".join(map(repr, long[:5])) + (", ..." if len(long) > 5 else ""))
    if len(long) == len(lens):
      raise ValueError(msg + "; no prompt is left to train on: raise those limits or shorten "
                       "the prompts")
    self.writer.message(f"warning: {msg}; they never train (stop reason prompt_too_long)")

  def _check_eval_prompt_lengths(self, lens: Sequence[int]) -> None:
    """Eval prompts too long to decode end unsampled and score as failures in eval/pass@1
    (and pass@k) at every eval: named once here, or the pass rate reads as the model's alone."""
    long = [ex.id for ex, n in zip(self.eval_examples, lens)
            if self.sampler.prompt_too_long(n) is not None]
    if long:
      self.writer.message(
          f"warning: {len(long)} of the {len(lens)} eval prompts are too long to decode (longest "
          f"{max(lens)} tokens; rollout.max_len={self.config.rollout.max_len}); they count as "
          "failures in every eval's pass@1 and pass@k: " + ", ".join(map(repr, long[:5]))
          + (", ..." if len(long) > 5 else ""))

  # --------------------------------------------------------------------------- eval
  def evaluate(self, tag: str = "eval", phase: str | None = None) -> dict[str, float]:
    """pass@1 (greedy) and pass@k (sampled) on the held-out split. With sample dumps on
    (`log.dump_every`, `log.dump_count`), the first `log.dump_count` greedy trajectories go to
    <workdir>/samples/eval_<phase>.{txt,jsonl} with their rewards and successes (phase: "before",
    "after_sft", default step_NNNNNN of the current step)."""
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(self.state.params)):
      raise RuntimeError("Trainer.evaluate: the params are shapes only (Trainer(architecture="
                         "...)): restore a checkpoint's params into trainer.state first")
    self._settle_ahead()
    return self._on_lead(self._evaluate, self._generator_params(), tag, phase)

  def _evaluate(self, params, tag: str, phase: str | None = None) -> dict[str, float]:
    e = self.config.eval
    exs = self.eval_examples
    if not exs:
      return {}
    t0, c0 = time.time(), compile_stats.snapshot()
    self._success_failures = 0
    trajs = self.greedy.run(params, exs, num_samples=1, seed=_eval_seed(self.config.seed),
                            request_id_offset=0)
    outs = self._score(trajs, exs, self.step)
    ok = np.array([self._success(o, ex) for o, ex in zip(outs, exs)], float)
    # What the model answered on which problems: the RL dumps hold training samples only.
    log_cfg = self.config.log
    n = log_cfg.get("dump_count", 4)
    if log_cfg.dump_every and n:
      self.dump_samples(self.step, trajs[:n], rewards=outs[:n], successes=ok[:n],
                        golds=[ex.gold for ex in exs[:n]],
                        name=f"eval_{phase or f'step_{self.step:06d}'}")
    p = float(ok.mean())
    out = {f"{tag}/pass@1": p, f"{tag}/pass@1_se": math.sqrt(p * (1 - p) / len(exs)),
           f"{tag}/num_examples": len(exs)}
    out.update(_per_task(self.env, [ex.id for ex in exs], ok, f"{tag}/task/{{}}/pass@1"))
    if e.pass_k > 1:
      trajs_k = self.sampler.run(params, exs, num_samples=e.pass_k,
                                 seed=_eval_seed(self.config.seed),
                                 request_id_offset=0)
      c = np.zeros(len(exs))
      outs_k = self._score(trajs_k, [exs[tr.group_id] for tr in trajs_k], self.step)
      for tr, o in zip(trajs_k, outs_k):
        outs.append(o)
        c[tr.group_id] += self._success(o, exs[tr.group_id])
      out[f"{tag}/pass@{e.pass_k}"] = float(np.mean([_pass_at_k(e.pass_k, int(ci), e.pass_k)
                                                     for ci in c]))
    # An env reward that raises scores the trajectory as a failure (`_reward`): without this
    # count a broken verifier read as a model that solves nothing. Counted as RL steps count.
    out[f"{tag}/errors/env_reward"] = _env_reward_failures(outs) / len(outs)
    out[f"{tag}/errors/is_success"] = self._success_failures / len(outs)
    out[f"{tag}/time_s"] = time.time() - t0
    d = compile_stats.snapshot() - c0
    out.update(_compile_metrics(d, f"{tag}/compiles", f"{tag}/compile_s",
                                f"{tag}/compile_cache_hits"))
    self._log_compiles(tag, d)
    return out

  def _log_compiles(self, phase: str, d: compile_stats.CompileCounts) -> None:
    """Which programs compiled in a step or eval, slowest first: a line of `compiles.jsonl`
    (process 0; nothing when none did)."""
    if not d.count or jax.process_index() != 0:
      return
    rec = {"step": self.step, "phase": phase, "count": d.count, "seconds": round(d.seconds, 3),
           "programs": d.programs(top=30)}
    self.workdir.mkdir(parents=True, exist_ok=True)
    append_line(self.workdir / "compiles.jsonl", json.dumps(rec))

  def _reward(self, traj: Trajectory, ex: Example, step: int) -> RewardOutput:
    """`env.reward`, with a raise turned into data: the trajectory scores 0.0 and its output
    names `ENV_REWARD_ERROR` in `errors` (counted as `reward/errors/env_reward`), the traceback
    logged. The env's own reward components are already isolated (`CompositeReward`); this
    covers the env's code around them, so one odd trajectory cannot end a long run. When every
    trajectory of a step fails the env is broken, not the samples: `_collect` raises. A return
    that is not a `RewardOutput`, or whose total is not a finite number, fails the same way."""
    out, failure = self._reward_or_failure(traj, ex, step)
    if failure is not None:
      self._reward_failures.append(failure)
    return out

  def _reward_or_failure(self, traj: Trajectory, ex: Example,
                         step: int) -> tuple[RewardOutput, str | None]:
    """`_reward` without the bookkeeping: (output, the failure's one-line description or None).
    Touches no trainer state, so several threads may run it at once (`_score`)."""
    try:
      out = self.env.reward(traj, ex, self.tok, step)
      if not isinstance(out, RewardOutput):
        raise TypeError(f"env.reward returned {type(out).__name__}, not a jaxagent.rewards."
                        "RewardOutput (e.g. RewardOutput(total, {}, {}), or a CompositeReward's)")
      if not (isinstance(out.total, (int, float, np.number)) and math.isfinite(out.total)):
        raise ValueError(f"env.reward returned a total of {out.total!r}; it must be a finite number")
      return out, None
    except Exception as e:  # noqa: BLE001 - any failure of user code becomes data
      log.warning("env %r: reward raised for example %r", self.env.name, ex.id, exc_info=True)
      return (RewardOutput(0.0, {}, {}, errors=(ENV_REWARD_ERROR,)),
              f"example {ex.id!r}: {type(e).__name__}: {e}")

  def _done_decoding(self, step: int) -> None:
    """Tell a learner waiting on this rollout (`_wait_for_decoding_ahead`) that it has stopped
    decoding (with dynamic sampling: its first round)."""
    decoded = self._inflight.get(step, (None, None, None))[2]
    if decoded is not None:
      decoded.set()

  def _reward_threads(self) -> int:
    threads = getattr(self.env, "reward_threads", 1)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
      raise ValueError(f"env {getattr(self.env, 'name', self.env)!r}: reward_threads must be an "
                       f"int >= 1 (1 scores one trajectory after another), got {threads!r}")
    return threads

  def _sample_and_score(self, params, exs: Sequence[Example], step: int, offset: int
                        ) -> tuple[list[Trajectory], list[RewardOutput]]:
    """One round of rollouts of `exs` and their rewards (in the trajectories' order). With
    `env.reward_threads` > 1 (a reward that may run beside other calls) each trajectory is
    scored as soon as it is final, on those threads, while the others still decode: a slow
    verifier's time then hides behind the rollout's instead of following it. Outputs and the
    failures recorded are those of `_score`."""
    seed, G = _rollout_seed(self.config.seed, step), self.config.train.samples_per_prompt
    threads = self._reward_threads()
    # Set only while the trainer closes (`_close_collector`): a collection under way then ends
    # at its next decode call, and before its rewards, instead of running to its end.
    cancel = {} if self._cancel_ahead is None else {"cancel": self._cancel_ahead}
    if threads <= 1:
      trajs = self.sampler.run(params, exs, num_samples=G, seed=seed, request_id_offset=offset,
                               **cancel)
      self._done_decoding(step)
      self._check_not_cancelled()
      # One thread: every reward is left when the rollout ends (time/reward_wait_s is all of it).
      t0 = time.time()
      outs = self._score(trajs, [exs[tr.group_id] for tr in trajs], step)
      self._reward_wait_s += time.time() - t0
      return trajs, outs
    futures: dict[int, concurrent.futures.Future] = {}
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="reward") as pool:
      def submit(tr: Trajectory):
        futures[tr.request_id] = pool.submit(self._reward_or_failure, tr, exs[tr.group_id], step)
      try:
        trajs = self.sampler.run(params, exs, num_samples=G, seed=seed,
                                 request_id_offset=offset, on_finish=submit, **cancel)
        self._done_decoding(step)
        self._check_not_cancelled()
      except BaseException:
        for f in futures.values():
          f.cancel()
        raise
      for tr in trajs:  # (each is reported once; this only guards a trajectory never reported)
        if tr.request_id not in futures:
          submit(tr)
      t0 = time.time()
      scored = [futures[tr.request_id].result() for tr in trajs]
      self._reward_wait_s += time.time() - t0
    self._reward_failures.extend(f for _, f in scored if f is not None)
    return trajs, [out for out, _ in scored]

  def _check_not_cancelled(self) -> None:
    if self._cancel_ahead is not None and self._cancel_ahead.is_set():
      raise RolloutCancelled("the trainer is closing: the rewards of a rollout collected ahead "
                             "are not scored")

  def _score(self, trajs: Sequence[Trajectory], exs: Sequence[Example],
             step: int) -> list[RewardOutput]:
    """`_reward` of each (trajectory, example) pair, in order: on `env.reward_threads` threads
    when the env allows more than one (rewards that wait on a sandbox or a verifier process,
    e.g. a hanging solution's 8 s, then overlap instead of adding up). Outputs, their order and
    the failures recorded are those of scoring one after another."""
    threads = min(self._reward_threads(), len(trajs))
    if threads <= 1:
      return [self._reward(tr, ex, step) for tr, ex in zip(trajs, exs)]
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="reward") as pool:
      scored = list(pool.map(lambda pair: self._reward_or_failure(*pair, step), zip(trajs, exs)))
    self._reward_failures.extend(f for _, f in scored if f is not None)
    return [out for out, _ in scored]

  def _success(self, out: RewardOutput, ex: Example) -> bool:
    """`is_success` of the env that ran `ex` (`Env.env_for`: a mixture's task); a reward that
    raised is a failure without asking the env, whose test
    may read components that the stand-in output of `_reward` lacks. An `is_success` that
    raises counts its sample as a failure (logged, counted in `_success_failures`): one odd
    sample ended the whole eval, and with it the run."""
    if ENV_REWARD_ERROR in out.errors:
      return False
    try:
      return bool(self.env.env_for(ex).is_success(out))
    except Exception:  # noqa: BLE001 - any failure of user code becomes data
      if not self._success_failures:
        log.warning("env %r: is_success raised; the sample counts as a failure",
                    getattr(self.env, "name", self.env), exc_info=True)
      self._success_failures += 1
      return False

  # --------------------------------------------------------------------------- SFT
  def warm_start(self) -> dict[str, float]:
    """SFT on demonstrations (or chat JSONL): cross-entropy on policy tokens only; batches of
    `sft.batch_size` take every item once per epoch, reshuffled each epoch (`sft.steps` may
    stop mid-epoch)."""
    self._check_trains("warm_start")
    s = self.config.sft
    if not s.steps:
      return {}
    # (`_pre_rl` reads them before the eval that comes first: a bad sft.data line fails then)
    loaded, self._sft_loaded = self._sft_loaded, None
    items, too_long = loaded or self._sft_items_that_fit(self._sft_items())
    learner = step_lib.Learner(self.cfg, self._sft_step_cfg, self._sft_optimizer, self.mesh,
                               lora=self.lora, base=self.learner.base)
    st = learner.init(self.state.params)
    batches = _sft_batches(len(items), s.batch_size, s.steps, self.config.seed)
    # One update per batch: rows rounded to micro-batches x devices (not to train.mini_batches,
    # which splits only the RL step's batch).
    sft_pack = dataclasses.replace(
        self.pack_cfg, row_multiple=self.pack_cfg.row_multiple // _mini_batches(self.config.train))
    t0 = time.time()
    losses_seen = []
    for i, idx in enumerate(batches):
      pb = packing.pack([items[j] for j in idx], sft_pack)
      self._warn_dropped("SFT step", i + 1, pb.stats)
      with _names_the_step(f"SFT warm-start step {i + 1} of {s.steps}"):
        st, m = learner.train_step(st, pb.arrays())
      losses_seen.append(m["loss"])
      self.writer.message(f"sft step {i + 1}/{s.steps}: loss {m['loss']:.4f}")
      if m.get("nonfinite"):  # train.nonfinite="skip": said as an RL step's skip is
        bad = [k for k, v in m.items() if not math.isfinite(v)] or ["grad_norm"]
        self.writer.message(
            f"warning: SFT warm-start step {i + 1} of {s.steps}: non-finite {', '.join(bad)}; "
            "the update was skipped (train.nonfinite='skip'): params and optimizer state are "
            "unchanged")
      self.writer.write(-s.steps + i, {"sft/loss": m["loss"], "sft/grad_norm": m["grad_norm"]})
      # A stop (a preemption notice) between steps ends the warm start here: waiting for the
      # rest could outlast the notice's grace period. Nothing of it is kept (see `run`).
      if i + 1 < len(batches) and self._stop_requested():
        self._interrupted = f"SFT warm-start step {i + 1} of {s.steps}"
        return {}
    # Continue RL from the warm-started weights with a fresh optimizer state.
    self.state = self.learner.init(st.params)
    return {"sft/first_loss": losses_seen[0], "sft/last_loss": losses_seen[-1],
            "sft/time_s": time.time() - t0, "sft/num_examples": len(items),
            "sft/num_too_long": too_long}

  def _sft_items(self) -> list[packing.PackItem]:
    """The warm start's sequences: `sft.data`'s conversations, or the task's demonstrations of
    its first `sft.num_examples` "sft" examples (refused when they are eval prompts)."""
    s = self.config.sft
    if s.get("data"):
      return sft_items_from_chat_jsonl(s.data, self.tok)
    try:
      pool = list(self.env.examples("sft"))[:s.num_examples]
    except Exception as e:
      if not lacks_split(e, "sft"):  # the split exists and failed to load (its data file)
        raise ValueError(
            f"sft.steps={s.steps} warm-starts on the task's 'sft' split, and env "
            f"{self.env.name!r} failed to give it (examples('sft') raised {type(e).__name__}: "
            f"{e}): fix the task's 'sft' data, give a chat JSONL file as sft.data, or set "
            "sft.steps=0") from e
      raise ValueError(
          f"sft.steps={s.steps} warm-starts on the task's 'sft' split, and env "
          f"{self.env.name!r} has none (examples('sft') raised {type(e).__name__}: {e}): "
          "return the examples to demonstrate for 'sft' (usually the train ones), give a "
          "chat JSONL file as sft.data, or set sft.steps=0") from e
    items = sft_items(self.env, pool, self.tok)
    # An `examples` that returns the eval split for every split but "train" warm-started on
    # the held-out examples, silently.
    held_out = set(self._eval_prompts)
    on_eval = [ex.id for ex in pool
               if tuple(int(t) for t in self.env.render_prompt(ex, self.tok)) in held_out]
    if on_eval:
      raise ValueError(
          f"the SFT warm start would train on {len(on_eval)} eval examples: env "
          f"{self.env.name!r} returns examples for 'sft' whose prompts are eval prompts ("
          + ", ".join(map(repr, on_eval[:5])) + (", ..." if len(on_eval) > 5 else "")
          + "), so eval/pass@1 would not be held out; return the train examples (or other "
          "non-eval ones) for 'sft', give a chat JSONL file as sft.data, or set sft.steps=0")
    return items

  def _sft_items_that_fit(self, items: list[packing.PackItem]) -> tuple[list[packing.PackItem], int]:
    """The SFT items no longer than a packed row or than the model's `max_seq_len`, and how
    many were left out.

    Packing drops a sequence longer than a row from its batch, so it would take a batch place
    and train nothing; one longer than `max_seq_len` (when `train.pack_len` is larger) would
    train at positions past what the model supports, which RL never does (its rollouts end at
    `rollout.max_len` <= `max_seq_len`). Both are left out here instead, with one message that
    counts them (and names the lines of `sft.data`). All of them too long is an error: the
    warm start would train on nothing.
    """
    row, model_len = self.pack_cfg.max_len, self.cfg.max_seq_len
    cap = min(row, model_len)
    fit = [it for it in items if len(it) <= cap]
    long = [it for it in items if len(it) > cap]
    if not long:
      return items, 0
    data = self.config.sft.get("data")
    where = ""
    if data:
      lines = ", ".join(str(it.traj_id) for it in long[:10]) + (", ..." if len(long) > 10 else "")
      where = f" ({data} lines {lines})"
    if row <= model_len:
      limit = f"train.pack_len={row}"
      keep = "raise train.pack_len to keep them"
      none = "raise train.pack_len (and the last of train.len_buckets) or shorten the SFT data"
    else:
      limit = f"the model's max_seq_len={model_len}, below train.pack_len={row},"
      keep = "the model supports no longer sequences"
      none = f"shorten the SFT data to at most {model_len} tokens a sequence"
    msg = (f"SFT warm start: {len(long)} of {len(items)} sequences{where} are longer than "
           f"{limit} (the longest has {max(len(it) for it in long)} tokens)")
    if not fit:
      raise ValueError(f"{msg}: none is left to train on; {none}")
    self.writer.message(f"{msg}; they are left out ({keep})")
    return fit, len(long)

  # --------------------------------------------------------------------------- RL
  def _generator_params(self, own_buffers: bool = False):
    """The current params as the rollout engines take them (None off process 0 on multi-host):
    with float32 masters and a lower compute dtype, a copy in the compute dtype made once per
    call (`models.param_tree.compute_copy`: bitwise the same logits, half the bytes per decode
    step); otherwise the same buffers. With `rollout.mesh = "data"` that copy is then
    replicated onto the rollout mesh (one all-gather per step).

    own_buffers: no leaf is a buffer of the train state (copied where it would be), for
    rollouts that go on while the learner's update donates that state
    (`train.off_policy_steps`)."""
    params = self.state.params
    # (Rollout devices of their own get new buffers from the transfer to them anyway.)
    own_buffers = own_buffers and self._shares_devices
    state_leaves = {id(x) for x in jax.tree.leaves(params)} if own_buffers else set()
    if self.lora is not None:  # the base with the adapter merged, in the compute dtype
      params = self.learner.merged_params(params, self.cfg.dtype)
    elif jax.process_count() == 1 and self.cfg.jnp_param_dtype != self.cfg.jnp_dtype:
      if self._cast is None:
        self._cast = jax.jit(functools.partial(param_tree.compute_copy, cfg=self.cfg))
      params = self._cast(params)
    # A jitted cast or merge hands back the leaves it leaves alone as they are.
    if state_leaves and jax.process_count() == 1:
      params = jax.tree.map(lambda x: jnp.copy(x) if id(x) in state_leaves else x, params)
    if jax.process_count() == 1:
      # Colocated (the learner's mesh): the same buffers, no copy.
      return params if self.gen_mesh is self.mesh else sharding.shard(params, self.gen_mesh)
    host = _to_host(params)
    if self.lora is None:  # cast on the host, after the gather
      host = param_tree.compute_copy(host, self.cfg)
    return sharding.shard(host, self.gen_mesh) if jax.process_index() == 0 else None

  @staticmethod
  def _on_lead(fn, *args):
    """`fn(*args)` run on process 0 and its result broadcast (plain call on one process).

    When `fn` raises on process 0, the error is broadcast in place of the result, so every
    process raises (process 0 its own exception, the others a RuntimeError naming it) instead
    of the others waiting in the broadcast until the coordinator times out.
    """
    if jax.process_count() == 1:
      return fn(*args)
    if jax.process_index() == 0:
      try:
        result = fn(*args)
      except BaseException as e:
        _broadcast_from_lead(_LeadError(f"{type(e).__name__}: {e}"))
        raise
      return _broadcast_from_lead(result)
    result = _broadcast_from_lead(None)
    if isinstance(result, _LeadError):
      raise RuntimeError(f"process 0 failed in {getattr(fn, '__name__', fn)!s}: {result.message}")
    return result

  def _rollout_groups(self, step: int, params):
    """Rollouts + rewards + advantages for one step, with DAPO dynamic sampling if enabled."""
    t, G = self.config.train, self.config.train.samples_per_prompt
    dyn = t.dynamic_sampling
    sampler = adv_lib.DynamicSampler(t.prompts_per_step, max_rounds=t.max_sampling_rounds,
                                     max_prompts_per_round=t.prompts_per_step * 4) if dyn else None
    kept_trajs, kept_rewards, kept_exs, all_trajs, reward_outs = [], [], [], [], []
    self._step_golds: dict[int, Any] = {}  # id(trajectory) -> its example's gold
    # Request ids: a block per step with room for every round's prompts, so they are unique
    # within the step. They must stay below 2**31, so late steps reuse the blocks of early
    # ones (from step 21845 with 512 prompts x 16 samples the rollout refused them and the run
    # ended): the sampler seed differs per step (`_rollout_seed`), so the samples still do.
    per_round = t.prompts_per_step * 4 * G
    steps_per_cycle = max(1, 2**31 // (t.max_sampling_rounds * per_round))
    rounds = 0
    while True:
      n = sampler.num_prompts_to_sample() if dyn else t.prompts_per_step
      exs = self.prompts.next(n)
      offset = ((step % steps_per_cycle) * t.max_sampling_rounds + rounds) * per_round
      trajs, scored = self._sample_and_score(params, exs, step, offset)
      outs = [_with_overlong(o, tr, self.overlong) for o, tr in zip(scored, trajs)]
      rewards = np.array([o.total for o in outs], np.float64)
      gids = np.array([tr.group_id for tr in trajs])
      keep = sampler.update(rewards, gids) if dyn else np.ones(len(trajs), bool)
      base = len(kept_exs)
      for tr, o, k in zip(trajs, outs, keep):
        all_trajs.append(tr)
        reward_outs.append(o)
        self._step_golds[id(tr)] = exs[tr.group_id].gold  # (for the sample dumps)
        if k:
          tr.group_id += base  # groups numbered across rounds
          kept_trajs.append(tr)
          kept_rewards.append(o.total)
      kept_exs.extend(exs)
      rounds += 1
      if not dyn or sampler.done or rounds >= t.max_sampling_rounds:
        break
    gids = np.array([tr.group_id for tr in kept_trajs])
    advs, info = adv_lib.compute_advantages(
        np.array(kept_rewards, np.float64), gids, method=t.advantage,
        zero_variance=t.zero_variance)
    # With dynamic sampling `info` sees only the accepted (informative) groups; the sampler's
    # counts cover every group sampled, e.g. 1 - informative_rate of them had zero variance.
    sampling = sampler.metrics() if dyn else {}
    return all_trajs, reward_outs, kept_trajs, advs, info, rounds, sampling

  def _rollouts(self, step: int) -> tuple[dict[str, float], dict[str, np.ndarray] | None]:
    """RL step `step`'s rollouts as (metrics, packed batch or None).

    With `train.off_policy_steps` = k = 0 they are collected now, from the current params
    (those after step - 1). With k > 0 a collector thread (on process 0) collects step s's
    rollouts while the learner runs steps s - k to s - 1: before step s trains, the steps up
    to s + k (and `total_steps`) that nobody has collected yet are handed to it with the
    current params, so step s trains on rollouts of the params after step s - 1 - k (or those
    the pipeline started from, the first k steps after a start or a resume). The host work of
    a rollout (tools, rewards, packing) and, on a device that interleaves programs, its decode
    steps overlap the update; the loss's ratio is then against that older sampler (see
    `loss.tis_cap` for the correction). Metrics: `rollout/staleness` (steps between the params
    that sampled and those the update starts from), `time/rollout_wait_s` (how long this step
    waited for its rollouts).
    """
    k, t0 = self.off_policy_steps, time.time()
    version = step - 1  # the current params: those after RL step step - 1
    if k == 0 and step not in self._ready and step not in self._inflight:
      metrics, batch = self._on_lead(self._collect_step, step, self._generator_params())
    else:
      for s in [s for s in list(self._prompts_before) if s <= step]:  # (the collector adds)
        self._prompts_before.pop(s, None)
      if step in self._failed:
        raise self._failed.pop(step)
      last = max(step, min(step + k, self.config.total_steps))
      todo = [s for s in range(step, last + 1)
              if s not in self._ready and s not in self._inflight and s not in self._failed]
      if todo:
        params = self._generator_params(own_buffers=True)
        for s in todo:
          self._submit(s, params, version)
      if step not in self._ready:
        self._ready[step] = self._take(step)
      metrics, batch, version = self._ready.pop(step)
    metrics["rollout/staleness"] = float(step - 1 - version)
    metrics["time/rollout_wait_s"] = time.time() - t0
    return metrics, batch

  def _wait_for_decoding_ahead(self) -> float:
    """On devices the rollouts share with the learner, wait until the rollout collected ahead
    has finished decoding (its rewards and packing go on): a device runs one program at a
    time, so an update dispatched earlier only delays the decode calls queued behind it (and
    they it), while started now it overlaps the rollout's host work. Seconds waited (0 with
    rollout devices of their own, or nothing in flight). With `train.off_policy_steps` >= 2
    this is the oldest rollout in flight (usually done decoding by now): the next one, queued
    behind it, starts decoding once that one's host work is done, beside the update."""
    if not self._inflight or not self._shares_devices:
      return 0.0
    t0 = time.time()
    future, _, decoded = self._inflight[min(self._inflight)]
    if future is not None and decoded is not None:
      while not decoded.wait(0.01) and not future.done():
        pass
    return time.time() - t0

  def _collect_step(self, step: int, params):
    # A NaN or inf in the logits while sampling ends the rollout with a FloatingPointError
    # that names a request id, not the step: named here as the learner's are.
    with _names_the_step(f"RL step {step}"):
      return self._collect(step, params)

  def _collect_ahead(self, step: int, params):
    """`_collect_step` on the collector thread, noting first where the prompt stream stood."""
    self._prompts_before[step] = self.prompts.get_state()
    return self._collect_step(step, params)

  def _submit(self, step: int, params, version: int) -> None:
    """Hand step `step`'s rollouts to the collector thread (on process 0; the others only
    note the step, and receive the result from process 0 in `_take`)."""
    future = decoded = None
    if jax.process_index() == 0:
      if self._ahead_pool is None:
        self._ahead_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="jaxagent-rollouts")
      decoded = threading.Event()  # (in place before the collector can look it up)
      self._inflight[step] = (None, version, decoded)
      future = self._ahead_pool.submit(self._collect_ahead, step, params)
    self._inflight[step] = (future, version, decoded)

  def _take(self, step: int) -> tuple[dict[str, float], dict[str, np.ndarray] | None, int]:
    """Wait for step `step`'s rollouts from the collector (process 0's, broadcast)."""
    future, version, _ = self._inflight.pop(step)

    def collected():
      return future.result()
    # What the other processes' error names when process 0's collection failed ("process 0
    # failed in ..."; a lambda's name said "<lambda>", and only a NaN error names the step).
    collected.__name__ = f"the rollouts of RL step {step} (collected ahead, train.off_policy_steps)"
    metrics, batch = self._on_lead(collected)
    return metrics, batch, version

  def _settle_ahead(self) -> None:
    """Wait for every rollout in flight and keep it for its step: before an eval (which
    decodes on the same engines and counts the same verifier calls) and before a checkpoint
    (which saves them, `_encode_ahead`). A collection that failed is kept too, and raised when
    its step comes to train: raised here, it ended the run in the eval or the checkpoint of an
    earlier step, and that checkpoint was not written."""
    for s in sorted(self._inflight):
      try:
        self._ready[s] = self._take(s)
      except Exception as e:  # noqa: BLE001 - raised at step s (`_rollouts`)
        self._failed[s] = e

  def rl_step(self, step: int) -> dict[str, float]:
    """One RL step: rollouts and packing (`_collect`), reference log-probs, updates."""
    self._check_trains("rl_step")
    if self.ref_params is None:
      # A step outside `run` (a loop of one's own, after `warm_start` or not): the KL reference
      # is taken as `run` takes it. It was None, and the reference scoring failed inside the
      # model with a TypeError, after the step's rollouts.
      self._freeze_reference()
    t0, c0 = time.time(), compile_stats.snapshot()
    metrics, batch = self._rollouts(step)
    if batch is not None:
      metrics["time/update_wait_s"] = self._wait_for_decoding_ahead()
    t1 = time.time()
    if batch is not None:
      batch = self._old_logps(batch)
      if self.loss_cfg.kl_coef > 0:
        ref, _ = self.learner.score(self.ref_params, batch)
        batch["ref_logps"] = np.asarray(_to_host(ref))
      epochs = max(1, self.config.train.epochs)
      minis = _mini_batches(self.config.train)
      rows = len(batch["old_logps"])
      if rows % minis:  # packing rounds rows to a multiple of it (`packing.config_from_train`)
        raise ValueError(f"RL step {step}: the packed batch has {rows} rows, not a multiple of "
                         f"train.mini_batches={minis}; pack with packing.config_from_train "
                         f"(trainer.pack_cfg.row_multiple={self.pack_cfg.row_multiple})")
      skipped = 0.0  # train/nonfinite: 1 when any update was skipped
      first, first_gap, updates = True, None, 0
      for epoch in range(epochs):
        # Each epoch its own seeded split of the rows (a trajectory lies in one row, so in one
        # mini-batch): the packer fills rows longest first, so fixed contiguous mini-batches
        # gave the first update of every epoch the longest trajectories. One whose gradient is
        # exactly 0 makes no update (`step_lib.has_gradient`: padding rows only, or every
        # advantage 0 with no KL or entropy term): an optimizer step on a zero gradient still
        # moves the weights through the moments and weight decay.
        parts = [(0, batch)] if minis == 1 else list(enumerate(
            {k: v[idx] for k, v in batch.items()}
            for idx in mini_batch_rows(rows, minis, self.config.seed, step, epoch)))
        parts = [(i, part) for i, part in parts
                 if ("loss_mask" not in part or part["loss_mask"].any())
                 and step_lib.has_gradient(self.loss_cfg, part)]
        updates += len(parts)
        for i, part in parts:
          where = (f"RL step {step}" + (f", epoch {epoch + 1} of {epochs}" if epochs > 1 else "")
                   + (f", mini-batch {i + 1} of {minis}" if minis > 1 else ""))
          with _names_the_step(where):
            try:
              self.state, m = self.learner.train_step(self.state, part)
            except FloatingPointError as e:
              # `self.state` was donated to the step: keep the unchanged state the error
              # carries, so that the trainer can still save, export or evaluate it.
              self.state = getattr(e, "state", self.state)
              raise
          if m.get("nonfinite"):  # train.nonfinite="skip": said here, not only in the metrics
            bad = [k for k, v in m.items() if not math.isfinite(v)] or ["grad_norm"]
            self.writer.message(
                f"warning: {where}: non-finite {', '.join(bad)}; the update was skipped "
                "(train.nonfinite='skip'): params, optimizer state and learning-rate schedule "
                "are unchanged (train/nonfinite=1)")
          metrics.update({f"train/{k}": v for k, v in m.items()})
          skipped = max(skipped, float(m.get("nonfinite", 0.0)))
          if first:
            first, first_gap = False, m.get("logprob_gap")
      # The other train/ metrics are the last update's (the last epoch's last mini-batch: its
      # loss, clip fractions, ratio and KL show how far the earlier updates moved the policy);
      # a skipped earlier update was overwritten by the next one's nonfinite=0, so the run's
      # metrics never showed it. The log-prob gap is the sampler's disagreement with the
      # learner only before the first update (later ones add the updates' own change): the
      # first update's (the first mini-batch's tokens).
      if "train/nonfinite" in metrics:
        metrics["train/nonfinite"] = skipped
      if first_gap is not None:
        metrics["train/logprob_gap"] = first_gap
      # Logged on every step, so its mean over a run is the fraction of steps skipped. A batch
      # whose every advantage is 0 (train.zero_variance="keep" and no reward varied) with no KL
      # or entropy term is skipped as one with nothing left to train on is.
      metrics["train/skipped_no_signal"] = 0.0 if updates else 1.0
    else:
      metrics["train/skipped_no_signal"] = 1.0
    metrics["time/update_s"] = time.time() - t1
    metrics["time/step_s"] = time.time() - t0
    d = compile_stats.snapshot() - c0
    metrics.update(_compile_metrics(d, "compile/count", "time/compile_s", "compile/cache_hits"))
    self._log_compiles("rl", d)
    return metrics

  def _old_logps(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The packed batch with the log-probs the loss's ratio is against. Without
    `loss.tis_cap`: the sampler's (`fill_unsampled_old_logps`). With it: the learner's own
    before this step's first update (the proximal policy, one scoring pass), and the sampler's
    as `behavior_logps` for the truncated importance weights (tokens the sampler never sampled
    take the learner's: weight 1)."""
    if self.loss_cfg.tis_cap is None:
      return self.fill_unsampled_old_logps(batch)
    prox, _ = self.learner.score(self.state.params, batch)
    prox = np.asarray(_to_host(prox), np.float32)
    sampler = batch["old_logps"]
    return {**batch, "old_logps": prox,
            "behavior_logps": np.where(np.isnan(sampler), prox, sampler).astype(np.float32)}

  def fill_unsampled_old_logps(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Old log-probs for trained tokens the sampler never sampled (NaN in the packed batch:
    observation tokens when the env trains on them, `Trajectory.to_pack_item`): the current
    policy's, scored before the update, as the rollout's policy would have given them (with
    `train.off_policy_steps` = k the rollout's policy is k steps older: those tokens' ratio is
    then against the learner's own log-probs, as every token's is with `loss.tis_cap`)."""
    old = batch["old_logps"]
    todo = np.isnan(old)
    if not todo.any():
      return batch
    cur, _ = self.learner.score(self.state.params, batch)
    return {**batch, "old_logps": np.where(todo, np.asarray(_to_host(cur), np.float32), old)}

  def _collect(self, step: int, params) -> tuple[dict[str, float], dict[str, np.ndarray] | None]:
    """Rollouts, rewards, advantages and packing of one step: (metrics, packed batch or None)."""
    t0 = time.time()
    self._reward_failures = []
    self._reward_wait_s = 0.0
    verify_before = math_verifier.default_stats()
    all_trajs, outs, trajs, advs, info, rounds, sampling = self._rollout_groups(step, params)
    t_roll = time.time() - t0
    metrics: dict[str, float] = math_verify_metrics(verify_before, math_verifier.default_stats())
    failed = _env_reward_failures(outs)
    if failed == len(outs):
      raise RuntimeError(
          f"RL step {step}: env {self.env.name!r}'s reward raised for all {failed} trajectories; "
          f"the first: {self._reward_failures[0] if self._reward_failures else '?'} "
          "(tracebacks in the log)")
    totals = np.array([o.total for o in outs])
    metrics["reward/errors/env_reward"] = failed / len(outs)
    metrics["reward/mean"] = float(totals.mean())
    metrics["reward/std"] = float(totals.std())
    metrics.update(mean_metrics(outs))
    metrics.update(_per_task(self.env, [tr.example_id for tr in all_trajs], totals,
                             "reward/task/{}"))
    metrics.update(rollout_metrics(all_trajs))
    metrics.update({f"adv/{k}": v for k, v in info.metrics().items()})
    metrics.update({f"adv/{k}": v for k, v in sampling.items()})
    metrics["rollout/sampling_rounds"] = rounds
    keep = np.asarray(info.keep, bool)
    obs_loss = bool(getattr(self.env, "train_on_observations", False))
    items = [tr.to_pack_item(float(a), observation_loss=obs_loss)
             for tr, a, k in zip(trajs, advs, keep) if k]
    batch = None
    trained: dict[int, float] = {}  # id(trajectory) -> the advantage the update uses
    if items:
      pb = packing.pack(items, self.pack_cfg)
      batch = pb.arrays()
      kept = [(tr, float(a)) for tr, a, k in zip(trajs, advs, keep) if k]
      trained = {id(tr): a for (tr, a), row in zip(kept, pb.item_row) if row >= 0}
      metrics["pack/efficiency"] = pb.stats["efficiency"]
      metrics["pack/rows"], metrics["pack/len"] = pb.shape
      metrics["pack/dropped_items"] = pb.stats["dropped_items"]
      metrics["pack/truncated_items"] = pb.stats["truncated_items"]
      self._warn_dropped("RL step", step, pb.stats)
      metrics["tokens/loss_fraction"] = float(batch["loss_mask"].sum() /
                                              max(1, (batch["segment_ids"] > 0).sum()))
      if not batch["loss_mask"].any():
        # Every sequence dropped (longer than a row), or none with a token to train: no update
        # (an optimizer step on a zero gradient still moves the weights through the moments and
        # the weight decay).
        batch, trained = None, {}
    metrics["time/rollout_s"] = t_roll
    metrics["time/reward_wait_s"] = self._reward_wait_s  # rewards left when the rollout ended
    if self.config.log.dump_every and step % self.config.log.dump_every == 0:
      n = self.config.log.get("dump_count", 4)
      self.dump_samples(step, all_trajs[:n], rewards=outs[:n],
                        advantages=[trained.get(id(tr)) for tr in all_trajs[:n]],
                        golds=[self._step_golds.get(id(tr)) for tr in all_trajs[:n]])
    return metrics, batch

  def _warn_dropped(self, what: str, step: int, stats: dict[str, Any]) -> None:
    """Says when packing dropped sequences longer than a row: they train on nothing."""
    if stats["dropped_items"]:
      self.writer.message(
          f"{what} {step}: packing dropped {stats['dropped_items']} of {stats['num_items']} "
          f"sequences ({stats['dropped_tokens']} tokens) longer than train.pack_len="
          f"{self.pack_cfg.max_len}; raise train.pack_len (and the last of train.len_buckets)")

  def dump_samples(self, step: int, trajs: Sequence[Trajectory],
                   rewards: Sequence[Any] | None = None,
                   advantages: Sequence[float | None] | None = None, *,
                   name: str | None = None, successes: Sequence[bool] | None = None,
                   golds: Sequence[Any] | None = None) -> None:
    """Writes `trajs` to <workdir>/samples/<name>.{txt,jsonl} (default name step_NNNNNN), each
    with its loss mask and, when given, its example's gold answer(s), its reward (a
    `RewardOutput`), whether it counts as a success (`Env.is_success`: the evals' dumps) and
    the advantage it was trained with (None:
    not trained on, its group having had equal rewards or been left out by dynamic sampling, or
    the trajectory dropped by packing as longer than a row)."""
    if jax.process_index() != 0:
      return
    # Without them a dump showed what was sampled but not how it was scored or pushed.
    def scored(i):
      out = {}
      if golds is not None:
        g = golds[i]
        out["gold"] = g if g is None or isinstance(g, str) else [str(x) for x in g]
      if rewards is not None:
        r = rewards[i]
        out["reward"] = float(r.total)
        out["reward_components"] = {k: float(v) for k, v in r.components.items()}
      if successes is not None:
        out["success"] = bool(successes[i])
      if advantages is not None:
        out["advantage"] = advantages[i]
      return out

    def scored_line(i):
      sc = scored(i)
      parts = []
      if "gold" in sc and sc["gold"] is not None:
        g = sc["gold"]
        parts.append("gold=" + (json.dumps(g, ensure_ascii=False) if isinstance(g, str)
                                else " | ".join(json.dumps(x, ensure_ascii=False) for x in g)))
      if "success" in sc:
        parts.append(f"success={'yes' if sc['success'] else 'no'}")
      if "reward" in sc:
        comps = ", ".join(f"{k} {v:.4g}" for k, v in sc["reward_components"].items())
        parts.append(f"reward={sc['reward']:.4g}" + (f" ({comps})" if comps else ""))
      if "advantage" in sc:
        a = sc["advantage"]
        parts.append("advantage=none (not trained on)" if a is None else f"advantage={a:+.4g}")
      return ("    " + " ".join(parts)) if parts else ""
    d = self.workdir / "samples"
    d.mkdir(parents=True, exist_ok=True)
    # The masks the update trains with: an env that trains on its observations (search_qa's
    # mask_observations=False) had them shown as mask=0, and the JSONL held no mask at all.
    obs_loss = bool(getattr(getattr(self, "env", None), "train_on_observations", False))
    # UTF-8 whatever the locale: sampled text is arbitrary Unicode (an ASCII locale raised
    # UnicodeEncodeError and ended the run); "replace" for what UTF-8 cannot hold.
    name = name or f"step_{step:06d}"
    with open(d / f"{name}.txt", "w", encoding="utf-8", errors="replace") as f:
      for i, tr in enumerate(trajs):
        text, line = tr.render(self.tok, observation_loss=obs_loss), scored_line(i)
        if line:  # under the header, above the token runs
          head, sep, body = text.partition("\n[")
          text = head + "\n" + line + sep + body
        f.write(text + "\n\n")
    with open(d / f"{name}.jsonl", "w", encoding="utf-8") as f:
      for i, tr in enumerate(trajs):
        mask = tr.train_mask(observation_loss=obs_loss)
        f.write(json.dumps({**tr.to_dict(), **scored(i), "loss_mask": [int(m) for m in mask]})
                + "\n")

  # --------------------------------------------------------------------------- run
  def run(self) -> dict[str, Any]:
    """Eval -> SFT warm start -> eval -> RL (eval every `eval.every` and at the end).

    Resumes from the newest checkpoint in the workdir when there is one (the warm start and
    the evals before RL are not repeated). On SIGTERM, a first Ctrl-C (SIGINT; with
    checkpointing off too) or `request_stop` it finishes the current step, saves a checkpoint
    (when checkpointing is on) and returns the summary with `stopped_at_step`; a second Ctrl-C
    goes to the handler that was there before (by default a `KeyboardInterrupt`). With
    `train.time_limit_s > 0`, once the RL steps of this invocation (timed from the first RL step,
    so not the evals before RL, the warm start or the restore) have taken that long, the step
    that finishes the budget gets the final eval and a checkpoint and the run ends as a finished
    one would, with `stopped_by: "time_limit"` and `rl_steps_done` in the summary; with
    checkpointing on, rerunning the command resumes from there (with a fresh budget).
    """
    self._check_trains("run")
    c = self.config
    t_start = time.time()
    say = self.writer.message
    if self._stop_honoured:
      # The stop (a Ctrl-C in a notebook) was for the run that returned: running again trains
      # on from the step it stopped after (a stop in the warm start, which keeps nothing of
      # it, starts it over), instead of stopping at once.
      self._stop_reason, self._interrupted, self._stop_honoured = None, None, False
      self.summary.pop("stopped_at_step", None)
      self.summary.pop("stopped_in", None)
      if self.warm_started:
        self._resumed, self._restore_done = self.step, True
    with self._stop_signals():
      start = self.restore()
      if start is None:
        earlier = self.writer.set_aside_earlier_run()
        if earlier is not None:
          say(f"starting from scratch: moved the earlier run's metrics and summary in this "
              f"workdir to {earlier}")
        self._pre_rl()
        if self._interrupted is not None:
          # Stopped before RL began: the warm start is not kept half done (a resumed run
          # would not know where it stood), so nothing is saved and a rerun starts over.
          say(f"{self._stop_reason} during the warm start (after {self._interrupted}): "
              "nothing was saved; rerun the same command to start the run over")
          self.summary["stopped_at_step"] = 0
          self.summary["stopped_in"] = self._interrupted
          return self.summary
        start = 0
        self._save(0)
      elif start >= c.total_steps:
        say(f"the run is already complete (checkpoint at step {start}, total_steps="
            f"{c.total_steps}); raise total_steps to train further")
      stopped = self._stop_requested()
      t_rl = time.time()
      for step in range(start + 1, c.total_steps + 1):
        if stopped:
          break
        self.step = step
        m = self.rl_step(step)
        out_of_time = step < c.total_steps and self._out_of_time(t_rl)
        last = step == c.total_steps or out_of_time
        if last or (c.eval.every and step % c.eval.every == 0):
          m.update(self.evaluate())
        self.writer.write(step, m)
        self.writer.progress(1, reward=m["reward/mean"], **(
            {"pass@1": m["eval/pass@1"]} if "eval/pass@1" in m else {}))
        if last or (self.ckpt is not None and self.ckpt.should_save(step)):
          self._save(step)
        stopped = self._stop_requested()
        if out_of_time and not stopped:  # (a SIGTERM in the same step takes the `_stop` path)
          # Set after the save: a resumed run does not inherit them from the checkpoint.
          self.summary["stopped_by"] = "time_limit"
          self.summary["rl_steps_done"] = step
          say(f"time limit train.time_limit_s={self.time_limit_s:g} reached at step {step} of "
              f"{c.total_steps}" + ("; rerun the same command to continue from its checkpoint"
                                    if self.ckpt is not None else ""))
          break
      if stopped and self.step < c.total_steps:
        return self._stop()
      if stopped:
        # A stop that comes once the last step is done (or before any step of a run that is
        # complete) finishes the run: taking the stop path left it without its summary.json,
        # curves and export, and said to rerun a run that had nothing left to do.
        say(f"{self._stop_reason} after the last step ({self.step} of {c.total_steps}): "
            "finishing the run")
      # Still under the stop handlers: a notice during the export or the wait for the last
      # checkpoint's write is a stop request (the run is finishing anyway), not the default
      # exit that cut that checkpoint short.
      if c.total_steps:
        last = [r for r in self.writer.history if "eval/pass@1" in r]
        if last:
          self.summary["pass@1/after_rl"] = last[-1]["eval/pass@1"]
          self.summary["pass@1/after_rl_se"] = last[-1]["eval/pass@1_se"]
      self.summary["time_s"] = time.time() - t_start
      png = self.writer.plot()
      if png:
        self.summary["curves_png"] = str(png)
      if c.get("export", False):
        self.summary["export"] = str(self.export())
      say("summary: " + json.dumps(self.summary))
      if jax.process_index() == 0:
        (self.workdir / "summary.json").write_text(finite_json(self.summary, indent=2))
      if self.ckpt is not None:
        self.ckpt.wait()
      return self.summary

  def _out_of_time(self, t_rl: float) -> bool:
    """Whether the RL loop that began at `t_rl` has used up `train.time_limit_s` (process 0's
    clock decides for every process, so all of them stop at the same step)."""
    if not self.time_limit_s:
      return False
    return bool(self._on_lead(lambda: time.time() - t_rl >= self.time_limit_s))

  def _pre_rl(self) -> None:
    """What happens once per run before RL: eval, SFT warm start, eval, the KL reference."""
    c, say = self.config, self.writer.message
    if c.sft.steps:
      # The warm start's data first: a bad line of sft.data (or a task without demonstrations)
      # ended the run only after the eval before training, minutes of work on a large eval set.
      try:
        self._sft_loaded = self._sft_items_that_fit(self._sft_items())
      except ValueError as e:  # each message names the data and the fix
        raise SFTDataError(str(e)) from e
    # With no eval examples (eval.size=0: no evals) an eval returns nothing: these wrote a
    # record of no metrics, "pass@1 ... nan" on the console and null pass@1s in the summary.
    if c.eval.before and self.eval_examples:
      m = self.evaluate(phase="before")
      self.writer.write(0, {f"before/{k.split('/', 1)[1]}": v for k, v in m.items()})
      self.summary["pass@1/before"] = m.get("eval/pass@1")
      say(f"held-out pass@1 before training: {m.get('eval/pass@1', float('nan')):.3f} "
          f"(n={len(self.eval_examples)})")
      if c.sft.steps and self._stop_requested():
        self._interrupted = "the eval before training"
        return
    if c.sft.steps:
      self.summary.update(self.warm_start())
      if self._interrupted is not None:
        return
      if self.eval_examples:
        m = self.evaluate(phase="after_sft")
        self.writer.write(0, {**m, **{f"after_sft/{k.split('/', 1)[1]}": v
                                      for k, v in m.items()}})
        self.summary["pass@1/after_sft"] = m.get("eval/pass@1")
        say(f"held-out pass@1 after SFT: {m.get('eval/pass@1', float('nan')):.3f}")
    self.warm_started = True
    self._freeze_reference()

  def _freeze_reference(self) -> None:
    """With a KL penalty, the reference is the params as RL begins: a copy, frozen from here
    (with a LoRA adapter, a copy of the adapter: the base is frozen anyway)."""
    if self.loss_cfg.kl_coef > 0:
      self.ref_params = jax.tree.map(jnp.copy, self.state.params)

  # --------------------------------------------------------------------------- checkpoints
  def checkpoint_meta(self) -> dict[str, Any]:
    """What a checkpoint records besides arrays (see `jaxagent.checkpoint`)."""
    return {
        "config": checkpoint.config_to_json(self.config),
        "model_config": dataclasses.asdict(self.cfg),
        "rng": {"seed": self.config.seed,
                "rollouts": "seed (seed * 1000003 + step) mod 2**32, request ids from the step",
                "eval": "seed (seed * 1000003 - 1) mod 2**32, request ids from 0"},
        "data": self.prompts.get_state(),
        "train_examples": self._train_fingerprint,
        "warm_started": self.warm_started,
        "ref": {"kind": "params when RL began (after the warm start)", "step": 0,
                "stored": self.ref_params is not None},
        # With an adapter the arrays are the adapter's; the base is `config.model.path`.
        "lora": (None if self.lora is None else
                 {"rank": self.lora.rank, "alpha": self.lora.alpha,
                  "targets": list(self.lora.targets), "base_digest": self._base_digest}),
        "summary": self.summary,
        "topology": {"processes": jax.process_count(), "devices": jax.device_count(),
                     "mesh": dict(self.mesh.shape)},
    }

  def save_checkpoint(self, step: int | None = None, *, wait: bool = False) -> pathlib.Path:
    """Save a checkpoint of the current state now (on demand; all processes must call it)."""
    self._check_trains("save_checkpoint")
    if self.ckpt is None:
      raise ValueError("checkpointing is off: set checkpoint_every > 0 to save checkpoints")
    if not self.warm_started:
      # A resume skips the warm start and the evals before RL: a checkpoint from before them
      # would make every later run of this workdir refuse to start.
      raise ValueError("save_checkpoint before `run` has reached RL: checkpoints are written "
                       "from the start of RL on (`run` writes step 0); use `export` to save "
                       "the initial weights")
    step = self.step if step is None else step
    # The rollouts already collected for later steps are saved with it (and the prompt stream's
    # position after them): a resume trains on what this run would have trained on.
    self._settle_ahead()
    meta = self.checkpoint_meta()
    failed = min((s for s in self._failed if s > step), default=None)
    if failed is not None:
      # Saved as it stood before that step's collection (which drew its prompts): a resume
      # collects it again, and the steps after it, from there.
      if failed in self._prompts_before:
        meta["data"] = self._prompts_before[failed]
      e = self._failed[failed]
      self.writer.message(
          f"the rollouts of RL step {failed}, collected ahead (train.off_policy_steps), failed "
          f"({type(e).__name__}: {e}); checkpoint {step} keeps those of the steps before it, and "
          f"a resume collects step {failed} again")
    ahead = {s: r for s, r in self._ready.items()
             if s > step and (failed is None or s < failed)}
    self.ckpt.save(step, self.state, meta=meta, ref_params=self.ref_params,
                   rollouts_ahead=_encode_ahead(ahead) if ahead else None)
    if wait:
      self.ckpt.wait()
    return self.ckpt.step_path(step)

  def _save(self, step: int) -> None:
    if self.ckpt is not None:
      self.save_checkpoint(step)

  def restore(self) -> int | None:
    """Resume from the newest usable checkpoint: the RL step it holds, or None (fresh start).

    Called by `run`; a second call does nothing. Metric records of later steps (written before
    an interruption, redone now) are dropped from `metrics.jsonl`.
    """
    self._check_trains("restore")
    if self._restore_done:
      return self._resumed
    # Marked done only when it has succeeded: after a restore that raised (checkpoints that do
    # not fit this run or do not read), a second `run` took it as done with nothing to resume
    # and started from scratch over those checkpoints.
    if self.ckpt is None:
      if self.ckpt_cfg.path(self.workdir).is_dir():
        self.writer.message(f"checkpoint_every=0: not resuming from the checkpoints in "
                            f"{self.ckpt_cfg.path(self.workdir)}")
      self._restore_done = True
      return None
    ref_target = (checkpoint.params_target(self.state.params, self.mesh)
                  if self.loss_cfg.kl_coef > 0 else None)
    # The rollouts collected ahead are decoded inside the restore: a checkpoint whose item
    # does not decode is skipped (and moved away) for the previous one, as a damaged array is.
    r = self.ckpt.restore_latest(checkpoint.state_target(self.state, self.mesh),
                                 ref_target=ref_target, config=self.config,
                                 decode_ahead=_decode_ahead)
    if r is None:
      self._restore_done = True
      return None
    checkpoint.check_model_config(r.meta, self.cfg, r.path)
    if self._base_digest is not None:
      checkpoint.check_lora_base(r.meta, self._base_digest, r.path)
    if not r.meta.get("warm_started"):
      raise checkpoint.CheckpointError(f"checkpoint {r.path} predates the warm start; "
                                       "this jaxagent only writes checkpoints after it")
    if r.changed:
      self.writer.message("resuming with changed settings: " + ", ".join(
          f"{k}: {old!r} -> {new!r}" for k, old, new in r.changed))
    self.state, self.ref_params = r.state, r.ref_params
    self.prompts.set_state(r.meta["data"])
    self._ready = r.rollouts_ahead or {}
    if self._ready:
      self.writer.message(
          f"resuming with the rollouts of steps {', '.join(map(str, sorted(self._ready)))}, "
          f"collected before checkpoint {r.path} was written (train.off_policy_steps)")
    saved = r.meta.get("train_examples")
    if saved is not None and saved != self._train_fingerprint:
      self.writer.message(
          f"warning: the task's train examples differ from those of checkpoint {r.path} "
          f"({saved['count']} -> {self._train_fingerprint['count']} examples, or their ids or "
          f"prompts changed): the prompt order goes on from position "
          f"{r.meta['data'].get('next_index', '?')} of the new examples' shuffle, so this epoch "
          "may repeat or skip examples")
    self.step, self.warm_started = r.step, True
    self.summary = dict(r.meta.get("summary") or {})
    self._rewind_metrics(r.step)
    self.writer.progress(min(r.step, self.config.total_steps))
    self.writer.message(f"resumed from checkpoint {r.path} (RL step {r.step} of "
                        f"{self.config.total_steps})")
    self._resumed, self._restore_done = r.step, True
    return r.step

  def _rewind_metrics(self, step: int) -> None:
    """Keep the metric and compile records up to `step` (and drop a line cut short by a
    crash): the steps after it run again, and their records would be there twice."""
    kept = [r for r in self.writer.history if r["step"] <= step]
    if self.writer.is_lead:
      kept = _rewind_jsonl(self.workdir / "metrics.jsonl", step) or kept
      _rewind_jsonl(self.workdir / "compiles.jsonl", step)
    self.writer.history = kept
    self.writer.rewind_tensorboard(step)

  @property
  def stop_reason(self) -> str | None:
    """Why the last `run` stopped before its last step ("received SIGTERM", "received SIGINT
    (Ctrl-C)", a `request_stop` reason), or None."""
    return self._stop_reason

  def request_stop(self, reason: str = "stop requested") -> None:
    """Finish the current step, save a checkpoint and return from `run` (as on SIGTERM); a
    later `run` trains on. Before `run`: it stops at its start."""
    self._stop_reason, self._stop_honoured = reason, False

  def _stop_requested(self) -> bool:
    stop = self._stop_reason is not None
    if jax.process_count() > 1:  # a notice on any host stops all of them at the same step
      from jax.experimental import multihost_utils
      flags = multihost_utils.process_allgather(np.array([int(stop)], np.int32))
      stop = bool(np.any(flags))
      if stop and self._stop_reason is None:
        self._stop_reason = "stop requested on another process"
    return stop

  def _stop(self) -> dict[str, Any]:
    if self.ckpt is None:
      self.writer.message(f"{self._stop_reason}: stopping after step {self.step} without a "
                          "checkpoint (checkpoint_every=0)")
    else:
      path = self.save_checkpoint(wait=True) if self.step not in self.ckpt.steps() else (
          self.ckpt.step_path(self.step))
      self.ckpt.wait()
      self.writer.message(f"{self._stop_reason}: saved checkpoint {path} at step {self.step}; "
                          "rerun the same command to resume")
    self.summary["stopped_at_step"] = self.step
    return self.summary

  @contextlib.contextmanager
  def _stop_signals(self):
    """While `run` runs in the main thread: SIGTERM (a preemption notice) -> `request_stop`
    when checkpointing is on; the first SIGINT (Ctrl-C) -> `request_stop` always (the step
    finishes, a checkpoint is saved when checkpointing is on, and `run` returns, so the trained
    state stays in the trainer), and the handler that was there before takes the second one (by
    default a `KeyboardInterrupt` at once). A stop requested by then is spent when `run`
    returns (not when it raises): the next `run` trains on."""
    if threading.current_thread() is not threading.main_thread():
      yield
    else:
      with self._signal_handlers():
        yield
    # (Not after an error, or a second Ctrl-C, in the middle of a step: that step is not done.)
    self._stop_honoured = self._stop_reason is not None

  @contextlib.contextmanager
  def _signal_handlers(self):
    """The handlers of `_stop_signals`, in the main thread."""

    def on_sigterm(signum, frame):
      del frame
      # Only set a flag: printing here could re-enter a write the main thread is in.
      self.request_stop(f"received {signal.Signals(signum).name}")

    def on_sigint(signum, frame):
      del signum, frame
      self.request_stop("received SIGINT (Ctrl-C)")
      signal.signal(signal.SIGINT, previous[signal.SIGINT])
      # os.write, not print: the main thread may be inside a write to sys.stderr.
      os.write(2, ("\nCtrl-C: finishing the current step, then "
                   + ("saving a checkpoint and stopping" if self.ckpt is not None else "stopping")
                   + "; press Ctrl-C again to interrupt at once\n").encode())

    handlers = {}
    # An ignored SIGINT stays ignored (a job a shell script started in the background, which
    # the terminal's Ctrl-C is not meant for), as Python leaves it.
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
      handlers[signal.SIGINT] = on_sigint
    if self.ckpt is not None:
      handlers[signal.SIGTERM] = on_sigterm
    previous = {}
    for signum, handler in handlers.items():
      old = signal.signal(signum, handler)
      # None: a handler installed outside Python, which cannot be put back; the default then.
      previous[signum] = signal.SIG_DFL if old is None else old
    try:
      yield
    finally:
      for signum, old in previous.items():
        signal.signal(signum, old)

  def export(self, out: str | pathlib.Path | None = None) -> pathlib.Path:
    """Write the current policy as an HF directory (default `<workdir>/export`)."""
    out = pathlib.Path(out).expanduser() if out is not None else self.workdir / "export"
    checkpoint.check_finite(self.state.params, f"not exporting the policy to {out}")
    # With a LoRA adapter: the base with the adapter merged in (a full model).
    params = _to_host(self.learner.merged_params(self.state.params))
    if jax.process_index() == 0:
      # The record `python -m jaxagent.export` writes: one it left here earlier named the step
      # of the weights this export replaces. These are the policy in memory, not a checkpoint.
      # Staged with the weights, so a failed export leaves the old weights and their record.
      models.save_hf(out, self.cfg, params, self.tok, extra_files={
          "jaxagent_export.json": json.dumps({"checkpoint": None, "step": self.step}, indent=2)})
    if self.lora is not None:  # and the adapter alone, as a PEFT adapter in <out>/adapter
      adapter = _to_host(self.state.params)
      if jax.process_index() == 0:
        checkpoint.save_lora_adapter(out, self.cfg, self.lora, adapter,
                                     checkpoint.config_to_json(self.config))
    elif jax.process_index() == 0:
      checkpoint.drop_stale_adapter(out)  # an earlier LoRA export's, of other weights
    if jax.process_index() == 0:
      self.writer.message(f"exported the policy to {out}")
    return out

  def _close_collector(self) -> None:
    """Stop the collector thread: steps not started are dropped, and one under way stops at
    its next decode call or before its rewards (`RolloutDriver.run(cancel=...)`): it ran to its
    end (minutes of a long agentic rollout) before a run that failed, or a second Ctrl-C, let
    the process exit."""
    if self._ahead_pool is not None:
      self._cancel_ahead.set()
      try:
        self._ahead_pool.shutdown(wait=True, cancel_futures=True)
      finally:
        self._cancel_ahead.clear()
      self._ahead_pool = None
    self._inflight.clear()

  def _close_envs(self) -> None:
    """`close()` of the env and of each member env that has one, each once, members first."""
    env = getattr(self, "env", None)
    if env is None:
      return
    seen, first = set(), None
    for e in (*env.member_envs, env):
      close = getattr(e, "close", None)
      if id(e) in seen or not callable(close):
        continue
      seen.add(id(e))
      try:
        close()
      except Exception as err:  # noqa: BLE001 - raised below, once every env is closed
        first = first or err
    if first is not None:
      raise first

  def close(self) -> None:
    """Closes the checkpoint manager, the samplers, the task's env (and a mixture's member
    envs) where it has a `close` (the MCP servers of `mcp_tools`) and the metrics writer; each
    is closed even when closing one before it raised (the first error is raised after)."""
    closers = [self._close_collector, self.sampler.close, self.greedy.close, self._close_envs,
               self.writer.close]
    if self.ckpt is not None:
      closers.insert(0, self.ckpt.close)
    first = None
    for close in closers:
      try:
        close()
      except Exception as e:  # noqa: BLE001 - raised below, once every part is closed
        first = first or e
    if first is not None:
      raise first
