"""Checkpoints of a training run (orbax): save every N steps and on demand, resume the newest
complete one on whatever mesh the run has now, and export the policy to HF safetensors.

Where it sits: `trainer.Trainer` owns a `CheckpointManager` over `<workdir>/checkpoints`; it
saves after the SFT warm start (step 0), every `checkpoint_every` RL steps, at the end and on
SIGTERM, and restores the newest usable checkpoint when the same command is rerun.
`python -m jaxagent.export` reads a checkpoint back through `export_hf`.

One checkpoint is an orbax composite in `<workdir>/checkpoints/<step>/`:

  params      the policy's boxed params (`flax.linen.LogicallyPartitioned` leaves; orbax stores
              the arrays, the logical axis names come back from the restore target)
  train       {"step": optimizer steps taken, "opt_state": the optax state}
  ref_params  the frozen KL reference (only when `loss.kl_coef > 0`): the params as RL began
  rollouts_ahead
              JSON, only with `train.off_policy_steps > 0`: the rollouts of the steps after
              this one that were already collected (sampled from earlier params), so that a
              resumed run trains on exactly what the uninterrupted run would have
  meta        JSON: format, RL step, the run config, the model config, the rng derivation,
              the grain iterator state of the prompt stream, whether the warm start ran, the
              run summary so far, a signature (path -> shape, dtype) of every saved array, a
              fingerprint of every saved array's contents (`fingerprint`), the sha256 of
              the `rollouts_ahead` item (`json_digest`), and the sha256 of the rest of the
              metadata itself (`meta_digest`, checked by `read_meta`)

Restores always go through an abstract target whose leaves carry the shardings of the current
mesh (`jaxagent.sharding.shardings`), so a checkpoint written on 8 devices loads onto 4 (or 16)
with every array resharded. A save that did not finish (killed mid-write) leaves orbax's
temporary directory behind: it is reported by name and skipped. A checkpoint that cannot be read
(an item that does not load, contents or metadata that differ from their fingerprint or
digest, rollouts that do not decode) is reported, moved to `<directory>-unreadable/`, and the previous one is
used; one written by an incompatible run (other model, task or seed; other array shapes; other
architecture settings of the model loaded under the same config, `check_model_config`) raises
`IncompatibleCheckpointError` naming the differences.

Retention (`checkpoint_keep`, `checkpoint_keep_every`) only ever deletes checkpoints of this
run: step folders whose metadata names the same model, task and seed as the checkpoint being
saved. A numbered folder in the directory that is not a jaxagent checkpoint at all (a user's
`7/`, another tool's files) makes `restore_latest` and `save` refuse, naming it, instead of
treating it as a checkpoint to restore from or to delete; an empty one (what a kill at the end
of a deletion leaves) is removed. Interrupted saves are removed by this module, not by orbax,
whose clean-up on a bucket (`gs://`, where a step folder is complete once it holds
`commit_success.txt`) deletes every folder of the directory without that file.

All processes of a multi-host job call `save` and `restore` (orbax coordinates the writes;
process 0 writes the JSON). The directory must be shared by all hosts (e.g. a GCS bucket).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import pathlib
import re
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxagent import sharding

log = logging.getLogger(__name__)

FORMAT = 1
# Settings that define what a checkpoint *is*: resuming with any of them changed is refused.
# Everything else (learning rate, total_steps, eval, logging, mesh) may change on resume, except
# where a change alters the saved arrays' layout: the optimizer state's structure depends on
# `optimizer.max_grad_norm` being on or off and on `optimizer.schedule` / `warmup_steps`, and
# `check` names those settings when their change is what makes the state not fit.
IDENTITY_KEYS = ("model", "env", "seed", "lora")
# Settings under IDENTITY_KEYS that choose how the same function is computed, or where a file
# is, not what the run computes: a resume may change them (a remat policy after running out of
# memory, another kernel, the task's data directory on another machine, or a mixture task's
# (`env.kwargs.tasks.<label>.kwargs.data_dir`, "*" standing for one label); the LoRA learner's
# forward and its dropout, training settings like the learning rate, which runs from before
# they existed leave unset). The arrays still have to fit (`check` compares every saved shape
# and dtype).
RUNTIME_KEYS = ("model.attention", "model.logprob", "model.norm_rope", "model.remat",
                "model.scan_layers", "env.kwargs.data_dir", "env.kwargs.tasks.*.kwargs.data_dir",
                "lora.forward", "lora.dropout")
_RUNTIME_KEY = re.compile("(?:" + "|".join(
    re.escape(k).replace(r"\*", r"[^.]+") for k in RUNTIME_KEYS) + r")\Z")
_TMP_SUFFIX = ".orbax-checkpoint-tmp"
_STEP_DIR = re.compile(r"^(\d+)$")
_TMP_DIR = re.compile(r"^(\d+)" + re.escape(_TMP_SUFFIX))
_ORBAX_STEP = re.compile(r"^(0|[1-9]\d*)$")  # the folder names orbax reads as steps
# Files orbax writes into every step folder it finalises (locally / on buckets), and every name
# a save of ours puts at the top of a step folder.
_ORBAX_FINAL_FILES = ("_CHECKPOINT_METADATA", "commit_success.txt")
_SAVE_ENTRIES = frozenset({"params", "train", "ref_params", "meta", "rollouts_ahead",
                           *_ORBAX_FINAL_FILES})


class CheckpointError(RuntimeError):
  """No usable checkpoint could be read."""


class IncompatibleCheckpointError(CheckpointError):
  """The checkpoint was written by a run with another model, task, seed or state layout."""


class NonFiniteParamsError(CheckpointError):
  """The params to save or export hold NaN or Inf; nothing was written."""


@jax.jit
def _nonfinite_counts(tree):
  return jax.tree.map(
      lambda x: (jnp.sum(~jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact)
                 else jnp.zeros((), jnp.int32)), tree)


def check_finite(params, what: str) -> None:
  """Raise `NonFiniteParamsError` naming the arrays of `params` that hold NaN or Inf.

  One jitted reduction over the (possibly sharded) params; every process must call it.
  """
  counts = jax.tree_util.tree_flatten_with_path(jax.device_get(_nonfinite_counts(params)))[0]
  bad = [(jax.tree_util.keystr(k), int(n)) for k, n in counts if int(n)]
  if bad:
    shown = ", ".join(f"{k} ({n})" for k, n in bad[:6])
    shown += f", and {len(bad) - 6} more" if len(bad) > 6 else ""
    raise NonFiniteParamsError(
        f"{what}: the params hold NaN or Inf ({sum(n for _, n in bad)} values in {len(bad)} "
        f"arrays: {shown}). Training has diverged; nothing was written. Lower the learning "
        f"rate or check the data, and resume from an earlier checkpoint.")


# ----------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """When to save and what to keep (from the run config; see `from_config`).

  Attributes:
    every: save every this many RL steps (0: checkpointing off: no saves, no resume).
    keep: keep the newest this many checkpoints.
    keep_every: also keep every checkpoint whose step is a multiple of this (0: none).
    async_save: write in a background thread; the step loop only waits for the copy to host.
    directory: where checkpoints live ("" : `<workdir>/checkpoints`).
  """

  every: int = 0
  keep: int = 3
  keep_every: int = 0
  async_save: bool = True
  directory: str = ""

  def __post_init__(self):
    for name in ("every", "keep_every"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"checkpoint_{name} must be an int >= 0, got {v!r}")
    if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
      raise ValueError(f"checkpoint_keep must be an int >= 1, got {self.keep!r}")

  @property
  def enabled(self) -> bool:
    return self.every > 0

  @classmethod
  def from_config(cls, config) -> "CheckpointConfig":
    """Read `checkpoint_every`, `checkpoint_keep`, `checkpoint_keep_every`,
    `checkpoint_async` and `checkpoint_dir` (all optional) from a run config."""
    get = config.get
    # Counts go to `__post_init__` as given (NumPy ints as ints), so that 2.5 or True is
    # refused there instead of being truncated to a count.
    count = lambda v: int(v) if isinstance(v, np.integer) else v
    return cls(every=count(get("checkpoint_every", 0) or 0), keep=count(get("checkpoint_keep", 3)),
               keep_every=count(get("checkpoint_keep_every", 0) or 0),
               async_save=bool(get("checkpoint_async", True)),
               directory=str(get("checkpoint_dir", "") or ""))

  def path(self, workdir: str | os.PathLike) -> epath.Path:
    return as_path(self.directory) if self.directory else as_path(workdir) / "checkpoints"


# ----------------------------------------------------------------------------- helpers
def as_path(path: str | os.PathLike) -> epath.Path:
  """A local path (`~` expanded, made absolute) or a bucket URL (`gs://...`) as an `epath.Path`."""
  text = os.fspath(path)
  return epath.Path(text if "://" in text else os.path.abspath(os.path.expanduser(text)))


def config_to_json(config) -> dict[str, Any]:
  """The run config as plain JSON types, for storing and comparing: tuples become lists, and
  inf and nan (which JSON cannot hold, and which the saved metadata would turn into null) the
  strings "inf", "-inf" and "nan", so that a run resumes with the very config it saved."""
  if hasattr(config, "to_json_best_effort"):
    out = json.loads(config.to_json_best_effort(sort_keys=True))
  else:
    out = json.loads(json.dumps(config, sort_keys=True, default=str))
  return _nonfinite_as_text(out)


def _nonfinite_as_text(x):
  if isinstance(x, dict):
    return {k: _nonfinite_as_text(v) for k, v in x.items()}
  if isinstance(x, list):
    return [_nonfinite_as_text(v) for v in x]
  if isinstance(x, float) and not math.isfinite(x):
    return str(x)  # "inf", "-inf", "nan"
  return x


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    key = f"{prefix}{k}"
    if isinstance(v, Mapping):
      out.update(_flatten(v, key + "."))
    else:
      out[key] = v
  return out


def config_diff(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
  """(dotted key, saved value, current value) for every setting that differs."""
  a, b = _flatten(saved), _flatten(current)
  missing = object()
  out = []
  for k in sorted(set(a) | set(b)):
    va, vb = a.get(k, missing), b.get(k, missing)
    if va != vb:
      out.append((k, "<unset>" if va is missing else va, "<unset>" if vb is missing else vb))
  return out


def _lora_rank(config: Mapping[str, Any]):
  """A config's (as JSON) `lora.rank`, None without a `lora` section."""
  section = config.get("lora") if isinstance(config, Mapping) else None
  return section.get("rank") if isinstance(section, Mapping) else None


def signature(tree) -> dict[str, str]:
  """`{path: "shape dtype"}` of every array leaf (concrete or abstract) of `tree`."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {jax.tree_util.keystr(p): f"{tuple(int(d) for d in x.shape)} {np.dtype(x.dtype).name}"
          for p, x in leaves}


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


@jax.jit
def _fingerprint_arrays(tree):
  def fp(x):
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
      x = x.astype(jnp.uint8)
    size = np.dtype(x.dtype).itemsize
    if size not in _UINT:  # (64-bit arrays are off in JAX by default; none are saved)
      return jnp.zeros((2,), jnp.uint32)
    bits = jax.lax.bitcast_convert_type(x, _UINT[size]).reshape(-1).astype(jnp.uint32)
    # Sums of the raw bits, plain and position-weighted, both mod 2**32: any changed value
    # changes the first, most moved values the second; integer sums give the same result in
    # any reduction order or sharding.
    weights = jnp.arange(bits.shape[0], dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weights, dtype=jnp.uint32)])
  return jax.tree.map(fp, tree)


def fingerprint(tree) -> dict[str, list[int]]:
  """`{path: [sum, weighted sum]}` of the raw bits of every array leaf of `tree`: saved with a
  checkpoint and compared after a restore, so that contents changed on disk (a flipped byte
  that leaves the files readable) are caught. Every process must call it."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(jax.device_get(_fingerprint_arrays(tree)))
  return {jax.tree_util.keystr(p): [int(v) for v in np.asarray(x)] for p, x in leaves}


def digest(tree) -> str:
  """A short hex digest of `fingerprint(tree)` (every array's raw bits), e.g. of the frozen base
  a LoRA adapter is trained over. Every process must call it."""
  text = json.dumps(fingerprint(tree), sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_lora_base(meta: Mapping[str, Any], base_digest: str, path) -> None:
  """Raise `IncompatibleCheckpointError` when a LoRA checkpoint's adapter was trained over other
  base weights than those loaded now (`digest` of the base; checkpoints without a record pass)."""
  saved = (meta.get("lora") or {}).get("base_digest")
  if saved is not None and saved != base_digest:
    model = (meta.get("config") or {}).get("model", {})
    raise IncompatibleCheckpointError(
        f"checkpoint {path} holds a LoRA adapter trained over other base weights than those "
        f"loaded now from model.path={model.get('path')!r} (digest {saved} in the checkpoint, "
        f"{base_digest} now): the adapter means nothing over another base. Load the weights it "
        "was trained over, or start fresh with another workdir.")


def _check_fingerprints(meta: Mapping[str, Any], restored: Mapping[str, Any], path) -> None:
  """Raise `CheckpointError` when a restored item's contents differ from what was saved."""
  saved = meta.get("fingerprints") or {}
  for name, tree in restored.items():
    if name not in saved:
      continue  # written before fingerprints were kept
    now = fingerprint(tree)
    bad = [k for k, v in now.items() if k in saved[name] and list(saved[name][k]) != v]
    if bad:
      raise CheckpointError(
          f"checkpoint {path} is corrupt: the contents of {name}{bad[0]}"
          + (f" and {len(bad) - 1} more arrays" if len(bad) > 1 else "")
          + " differ from what was saved (a damaged file)")


def json_digest(data) -> str:
  """The sha256 (hex) of JSON data in a canonical form (sorted keys, no spaces): saved in the
  metadata with a JSON item and compared after a restore, as `fingerprint` is for arrays."""
  text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
  return hashlib.sha256(text.encode("ascii")).hexdigest()


META_DIGEST = "meta_digest"  # the metadata's key that holds the digest of the rest of it


def meta_digest(meta: Mapping[str, Any]) -> str:
  """The `json_digest` of a checkpoint's metadata but for its own `META_DIGEST` entry (as the
  JSON file holds it: the save stores it, `read_meta` compares it)."""
  return json_digest({k: v for k, v in meta.items() if k != META_DIGEST})


def _check_meta_digest(meta: Mapping[str, Any], step_dir) -> None:
  """Raise `CheckpointError` when the metadata read from `step_dir` differs from what was saved
  (an edited or damaged file that is still valid JSON); metadata written before the digest was
  kept (none in it) passes."""
  saved = meta.get(META_DIGEST)
  if saved is None:
    return
  now = meta_digest(meta)
  if now != saved:
    raise CheckpointError(
        f"checkpoint {step_dir} is corrupt: its metadata file {step_dir}/meta/metadata differs "
        f"from what was saved (sha256 {now[:16]}..., saved {str(saved)[:16]}...; an edited or "
        "damaged file: its step, prompt-stream position or config cannot be trusted)")


def _check_json_digests(meta: Mapping[str, Any], restored: Mapping[str, Any], path) -> None:
  """Raise `CheckpointError` when a restored JSON item differs from what was saved (its
  `json_digest` in the metadata; items saved without one pass)."""
  saved = meta.get("json_digests") or {}
  for name, data in restored.items():
    if name not in saved:
      continue  # written before digests were kept
    now = json_digest(data)
    if now != saved[name]:
      raise CheckpointError(
          f"checkpoint {path} is corrupt: the contents of its {name} item differ from what "
          f"was saved (sha256 {now[:16]}..., saved {str(saved[name])[:16]}...; a damaged file)")


def _json_safe(x):
  """Plain JSON (non-finite floats become None; NumPy scalars become Python numbers)."""
  if isinstance(x, Mapping):
    return {str(k): _json_safe(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_json_safe(v) for v in x]
  if isinstance(x, np.generic):
    x = x.item()
  if isinstance(x, float) and not math.isfinite(x):
    return None
  return x


def abstract_target(tree, shardings_tree):
  """`ShapeDtypeStruct`s of `tree` carrying the shardings of `shardings_tree` (same structure;
  boxed leaves match boxed leaves), the form orbax restores into."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings_tree)


def state_target(state, mesh):
  """Restore target for a `TrainState`-like object (`step`, `params`, `opt_state`) on `mesh`:
  params and optimizer state by their logical axes, the step replicated."""
  abstract = jax.eval_shape(lambda s: s, state)
  return dataclasses.replace(
      abstract, step=jax.ShapeDtypeStruct(abstract.step.shape, abstract.step.dtype,
                                          sharding=NamedSharding(mesh, P())),
      params=abstract_target(abstract.params, sharding.shardings(abstract.params, mesh)),
      opt_state=abstract_target(abstract.opt_state, sharding.shardings(abstract.opt_state, mesh)))


def params_target(params, mesh):
  """Restore target for a (boxed) params tree on `mesh`."""
  abstract = jax.eval_shape(lambda p: p, params)
  return abstract_target(abstract, sharding.shardings(abstract, mesh))


def _all_processes_ok(ok: bool) -> bool:
  """True when `ok` holds on every process (a collective on multi-host jobs)."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils
  flags = multihost_utils.process_allgather(np.array([int(ok)], np.int32))
  return bool(np.all(flags))


def _commit_file_saves(directory: epath.Path) -> bool:
  """Whether orbax finalises saves under `directory` by writing `commit_success.txt` into the
  step folder (buckets) rather than by renaming `<step>.orbax-checkpoint-tmp` (local disks)."""
  return (ocp.path.atomicity_defaults.get_default_temporary_path_class(directory)
          is ocp.path.atomicity.CommitFileTemporaryPath)


def _meta_file(step_dir: epath.Path) -> dict[str, Any] | None:
  """The jaxagent metadata of a step folder read straight from its JSON file (no orbax), or
  None when it is missing, unreadable or not ours."""
  try:
    meta = json.loads((step_dir / "meta" / "metadata").read_text())
  except (OSError, ValueError):
    return None
  return meta if isinstance(meta, dict) and "format" in meta and "signature" in meta else None


def is_runtime_key(key: str) -> bool:
  """Whether the flattened config key `key` ("env.kwargs.data_dir") matches `RUNTIME_KEYS`."""
  return _RUNTIME_KEY.match(key) is not None


def _identity(meta: Mapping[str, Any]) -> str:
  """What makes checkpoints belong to one run: its `IDENTITY_KEYS` settings, as JSON text."""
  flat = _flatten({k: (meta.get("config") or {}).get(k) for k in IDENTITY_KEYS})
  return json.dumps({k: v for k, v in flat.items() if not is_runtime_key(k)}, sort_keys=True)


def _is_checkpoint_folder(step_dir: epath.Path) -> bool:
  """Whether a numbered folder holds a jaxagent checkpoint: readable jaxagent metadata, or
  (a damaged one, which the resume names and skips) a folder orbax finalised that holds a
  `params` or `meta` item, or one that holds nothing but what a save writes.

  The last is what a kill leaves of a checkpoint that retention was deleting: orbax deletes
  the files first, the top-level ones among the first, then the folders. Taken for a user's
  folder, it stopped every later resume of the run."""
  if _meta_file(step_dir) is not None:
    return True
  if (any((step_dir / f).exists() for f in _ORBAX_FINAL_FILES)
      and any((step_dir / d).is_dir() for d in ("params", "meta"))):
    return True
  entries = list(step_dir.iterdir())
  return bool(entries) and all(e.name.split(_TMP_SUFFIX)[0] in _SAVE_ENTRIES for e in entries)


@dataclasses.dataclass
class _OwnStepsOnly:
  """A preservation policy applying `inner` to the checkpoints `owns` recognises and keeping
  every other step folder: orbax deletes each step its policy does not preserve."""

  inner: Any
  owns: Callable[[int], bool]

  def should_preserve(self, checkpoints, *, context):
    own = [self.owns(c.step) for c in checkpoints]
    keep = iter(self.inner.should_preserve([c for c, o in zip(checkpoints, own) if o],
                                           context=context))
    return [next(keep) if o else True for o in own]


# ----------------------------------------------------------------------------- manager
@dataclasses.dataclass
class Restored:
  """What `CheckpointManager.restore` gives back (arrays placed on the target's shardings)."""

  step: int
  path: epath.Path
  state: Any                 # the target's TrainState type with restored leaves
  ref_params: Any | None
  meta: dict[str, Any]
  changed: list[tuple[str, Any, Any]]  # settings that differ from the checkpoint's (allowed)
  # The `rollouts_ahead` item when saved (checked against its digest), or what the restore's
  # `decode_ahead` made of it.
  rollouts_ahead: Any | None = None


class CheckpointManager:
  """Saves and restores training state under one directory (see the module docstring).

      mgr = CheckpointManager(workdir / "checkpoints", CheckpointConfig(every=10))
      if mgr.should_save(step):
        mgr.save(step, state, meta=..., ref_params=...)
      restored = mgr.restore_latest(state_target(state, mesh), config=config)

  Args:
    directory: the checkpoint root, local or a bucket URL (created if missing).
    cfg: cadence and retention.
    say: where user-facing messages go (skipped checkpoints, resume notes).
    read_only: never write or delete (export, inspection).
  """

  def __init__(self, directory: str | os.PathLike, cfg: CheckpointConfig = CheckpointConfig(),
               *, say: Callable[[str], None] | None = None, read_only: bool = False):
    self.directory = as_path(directory)
    # A file there listed no checkpoints (a resume started from scratch) and then every save
    # failed in orbax's background threads, after the warm start and the first steps' work.
    if self.directory.exists() and not self.directory.is_dir():
      raise CheckpointError(f"the checkpoint directory {self.directory} is a file, not a "
                            "directory: move it away, or set checkpoint_dir (or workdir) to "
                            "a directory")
    self.cfg = cfg
    self.read_only = read_only
    self.say = say or log.warning
    # Interrupted saves, listed before orbax removes them, so the resume can name them.
    self._interrupted = self.incomplete()
    # The run identity of the last save, and that of each step folder as read (`_owns`).
    self._identity: str | None = None
    self._step_identity: dict[int, str | None] = {}
    policies = [ocp.checkpoint_managers.LatestN(cfg.keep)]
    if cfg.keep_every:
      policies.append(ocp.checkpoint_managers.EveryNSteps(cfg.keep_every))
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=cfg.async_save and not read_only,
        preservation_policy=_OwnStepsOnly(
            ocp.checkpoint_managers.AnyPreservationPolicy(policies), self._owns),
        cleanup_tmp_directories=False, read_only=read_only, create=not read_only)
    self._mgr = ocp.CheckpointManager(self.directory, options=options)
    self._folders_checked = read_only

  def _refuse_foreign_folders(self) -> None:
    """Raise `CheckpointError` naming the numbered folders that are not jaxagent checkpoints
    (orbax lists every folder named by a number as a step, to restore from and to delete),
    then remove the interrupted saves. Once, before the first restore or save of a writable
    manager; every process calls it."""
    if self._folders_checked:
      return
    partial = set(self.incomplete())
    numbered = sorted((p for p in self.directory.iterdir() if _ORBAX_STEP.match(p.name)
                       and p.is_dir() and p not in partial),
                      key=lambda p: int(p.name)) if self.directory.is_dir() else []
    # An empty step folder is what a kill leaves at the very end of a checkpoint's deletion
    # (orbax removes the folder last). It holds nothing to lose; taken for a user's folder, it
    # stopped every later resume of the run.
    empty = [p for p in numbered if not any(p.iterdir())]
    foreign = [p for p in numbered if p not in empty and not _is_checkpoint_folder(p)]
    if foreign:
      shown = ", ".join(str(p) for p in foreign[:8])
      shown += f" and {len(foreign) - 8} more" if len(foreign) > 8 else ""
      raise CheckpointError(
          f"the checkpoint directory {self.directory} holds folders named like checkpoint "
          f"steps that are not jaxagent checkpoints: {shown}. Checkpoint retention would "
          f"restore from or delete them, so nothing is written here: move them out of "
          f"{self.directory}, or set checkpoint_dir (or workdir) to a directory of their own.")
    if jax.process_index() == 0:
      for p in partial:
        p.rmtree()
      for p in empty:
        p.rmdir()  # (refuses, rather than deletes, a folder that is no longer empty)
        self.say(f"removed the empty step folder {p} (left by an interrupted deletion)")
    _all_processes_ok(True)  # every process waits for the removal before saving
    if empty:
      self._mgr.reload()  # orbax listed the empty folders as steps
    self._folders_checked = True

  def _owns(self, step: int) -> bool:
    """Whether step folder `step` is a checkpoint of this run (the identity of its metadata is
    that of the last save): only those are counted and deleted by retention."""
    if self._identity is None:
      return False
    if step not in self._step_identity:
      meta = _meta_file(self.step_path(step))
      self._step_identity[step] = None if meta is None else _identity(meta)
    return self._step_identity[step] == self._identity

  # ------------------------------------------------------------------ listing
  def steps(self) -> list[int]:
    """Steps of the complete checkpoints, oldest first."""
    return sorted(self._mgr.all_steps())

  def incomplete(self) -> list[epath.Path]:
    """Folders of saves that never finished (oldest step first): orbax's temporary
    `<step>.orbax-checkpoint-tmp` folders, and on a bucket the step folders without
    `commit_success.txt` that hold nothing but what a save writes."""
    if not self.directory.is_dir():
      return []
    found = [p for p in self.directory.iterdir() if p.is_dir() and _TMP_DIR.match(p.name)]
    if _commit_file_saves(self.directory):
      found += [p for p in self.directory.iterdir()
                if _ORBAX_STEP.match(p.name) and p.is_dir()
                and not (p / "commit_success.txt").exists()
                and all(e.name.split(_TMP_SUFFIX)[0] in _SAVE_ENTRIES for e in p.iterdir())]
    return sorted(found, key=lambda p: int(re.match(r"\d+", p.name).group()))

  def step_path(self, step: int) -> epath.Path:
    return self.directory / str(step)

  def should_save(self, step: int) -> bool:
    return self.cfg.every > 0 and step % self.cfg.every == 0

  # ------------------------------------------------------------------ save
  def save(self, step: int, state, *, meta: Mapping[str, Any], ref_params=None,
           rollouts_ahead: Mapping[str, Any] | None = None) -> bool:
    """Start saving `state` (and `ref_params`) as `step`; False if that step already exists.

    `rollouts_ahead`: JSON data saved as its own item (the trainer's rollouts of later steps
    collected before this save); `Restored.rollouts_ahead` gives it back.

    Params holding NaN or Inf are never saved: `NonFiniteParamsError` names them, and the
    checkpoints already written stay as they are.

    With async saves this returns once the arrays are copied to host memory; the state may be
    updated (and donated) right after. Call `wait` before relying on the files.
    """
    self._refuse_foreign_folders()
    if step in self._mgr.all_steps():
      return False
    check_finite(state.params, f"not saving checkpoint {self.step_path(step)}")
    items = {"params": state.params, "train": {"step": state.step, "opt_state": state.opt_state}}
    if ref_params is not None:
      items["ref_params"] = ref_params
    full_meta = dict(meta)
    full_meta.update(format=FORMAT, step=int(step),
                     signature={k: signature(v) for k, v in items.items()},
                     fingerprints={k: fingerprint(v) for k, v in items.items()})
    full_meta = _json_safe(full_meta)
    self._identity = self._step_identity[step] = _identity(full_meta)
    args = {k: ocp.args.StandardSave(v) for k, v in items.items()}
    if rollouts_ahead is not None:
      ahead = _json_safe(dict(rollouts_ahead))
      full_meta["rollouts_ahead"] = True  # (`restore` reads the item when this says so)
      full_meta["json_digests"] = {"rollouts_ahead": json_digest(ahead)}
      args["rollouts_ahead"] = ocp.args.JsonSave(ahead)
    # Last: a digest of everything above, as the file will hold it (JSON's own round trip).
    full_meta[META_DIGEST] = meta_digest(json.loads(json.dumps(full_meta)))
    args["meta"] = ocp.args.JsonSave(full_meta)
    return bool(self._mgr.save(step, args=ocp.args.Composite(**args), force=True))

  def wait(self) -> None:
    """Block until pending async saves are written and committed."""
    self._mgr.wait_until_finished()

  def close(self) -> None:
    self._mgr.wait_until_finished()
    self._mgr.close()

  # ------------------------------------------------------------------ restore
  def read_meta(self, step: int) -> dict[str, Any]:
    """The JSON metadata of checkpoint `step` (`CheckpointError` when it cannot be read)."""
    try:
      out = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises KeyError, JSONDecodeError, OSError... for bad files
      raise CheckpointError(f"checkpoint {self.step_path(step)} is unreadable: "
                            f"{type(e).__name__}: {e}") from e
    meta = out["meta"]
    if not isinstance(meta, dict) or "signature" not in meta:
      raise CheckpointError(f"checkpoint {self.step_path(step)} has no jaxagent metadata")
    _check_meta_digest(meta, self.step_path(step))
    return meta

  def check(self, meta: Mapping[str, Any], *, step: int, config=None,
            items: Mapping[str, Any] | None = None) -> list[tuple[str, Any, Any]]:
    """Raise `IncompatibleCheckpointError` unless checkpoint `step` fits this run.

    Args:
      meta: the checkpoint's metadata (`read_meta`).
      config: the current run config: `IDENTITY_KEYS` must match (but for `RUNTIME_KEYS`).
      items: current (abstract) arrays by item name (`params`, `train`, `ref_params`): every
        saved array must have the same path, shape and dtype. A current item the checkpoint
        lacks is an error; a saved item not asked for is ignored.

    Returns the allowed setting changes (config keys outside `IDENTITY_KEYS`, and
    `RUNTIME_KEYS`).
    """
    path = self.step_path(step)
    if meta.get("format") != FORMAT:
      raise IncompatibleCheckpointError(
          f"checkpoint {path} has format {meta.get('format')!r}; this jaxagent reads format "
          f"{FORMAT}. Use a new workdir or the jaxagent version that wrote it.")
    problems, changed = [], []
    if config is not None:
      saved, now = meta.get("config", {}), config_to_json(config)
      # No adapter either way (a config from before the `lora` section, or rank 0): its
      # alpha and targets mean nothing.
      no_lora = not _lora_rank(saved) and not _lora_rank(now)
      for key, old, new in config_diff(saved, now):
        if no_lora and key.split(".")[0] == "lora":
          continue
        if key.split(".")[0] in IDENTITY_KEYS and not is_runtime_key(key):
          problems.append(f"config {key}: {old!r} in the checkpoint, {new!r} now")
        else:
          changed.append((key, old, new))
    saved_sig = meta.get("signature", {})
    for name, tree in (items or {}).items():
      if name not in saved_sig:
        why = (" (it was written with loss.kl_coef = 0)" if name == "ref_params" else "")
        problems.append(f"item {name!r} is not in the checkpoint{why}")
        continue
      want, have = signature(tree), saved_sig[name]
      for k in sorted(set(want) | set(have)):
        if want.get(k) != have.get(k):
          problems.append(f"{name}{k}: {have.get(k, 'absent')} in the checkpoint, "
                          f"{want.get(k, 'absent')} now")
    if problems and any(p.startswith("train['opt_state']") for p in problems):
      culprits = [f"{k}: {old!r} in the checkpoint, {new!r} now" for k, old, new in changed
                  if k.startswith("optimizer.") or k == "total_steps"]
      problems.insert(0, "the optimizer state is laid out differently" + (
          "; these settings changed and shape it: " + "; ".join(culprits) if culprits else ""))
    if problems:
      shown = problems[:12] + ([f"... and {len(problems) - 12} more"] if len(problems) > 12 else [])
      raise IncompatibleCheckpointError(
          f"checkpoint {path} does not match this run:\n  " + "\n  ".join(shown) +
          f"\nResume with the settings it was written with, or start fresh with another "
          f"workdir (or move {self.directory} away).")
    return changed

  def restore(self, step: int, state_target, *, ref_target=None, config=None,
              decode_ahead: Callable[[Any, int, Any], Any] | None = None) -> Restored:
    """Restore checkpoint `step` onto the shardings of `state_target` (see `state_target`).

    `decode_ahead(item, step, path)`, when given, turns the checkpoint's `rollouts_ahead` item
    (when it has one) into `Restored.rollouts_ahead`; a `CheckpointError` it raises (data that
    does not decode) makes the checkpoint unreadable, as a damaged array does.

    Raises `IncompatibleCheckpointError` when it does not fit (see `check`) and
    `CheckpointError` when it cannot be read.
    """
    path = self.step_path(step)
    meta = self.read_meta(step)
    items = {"params": state_target.params,
             "train": {"step": state_target.step, "opt_state": state_target.opt_state}}
    if ref_target is not None:
      items["ref_params"] = ref_target
    changed = self.check(meta, step=step, config=config, items=items)
    args = {k: ocp.args.StandardRestore(v) for k, v in items.items()}
    if meta.get("rollouts_ahead"):
      args["rollouts_ahead"] = ocp.args.JsonRestore()
    try:
      out = self._mgr.restore(step, args=ocp.args.Composite(**args))
    except Exception as e:
      raise CheckpointError(f"checkpoint {path} is corrupt or unreadable: "
                            f"{type(e).__name__}: {e}") from e
    ahead = out["rollouts_ahead"] if "rollouts_ahead" in args else None
    _check_fingerprints(meta, {k: out[k] for k in items}, path)
    if ahead is not None:
      _check_json_digests(meta, {"rollouts_ahead": ahead}, path)
      if decode_ahead is not None:
        ahead = decode_ahead(ahead, step, path)
    state = dataclasses.replace(state_target, step=out["train"]["step"], params=out["params"],
                                opt_state=out["train"]["opt_state"])
    return Restored(step=step, path=path, state=state,
                    ref_params=out["ref_params"] if ref_target is not None else None,
                    meta=meta, changed=changed, rollouts_ahead=ahead)

  def restore_params(self, step: int, target):
    """Only the policy params of checkpoint `step` (e.g. for export or evaluation)."""
    try:
      params = self._mgr.restore(step, args=ocp.args.Composite(
          params=ocp.args.StandardRestore(target)))["params"]
    except Exception as e:
      raise CheckpointError(f"checkpoint {self.step_path(step)} is corrupt or unreadable: "
                            f"{type(e).__name__}: {e}") from e
    _check_fingerprints(self.read_meta(step), {"params": params}, self.step_path(step))
    return params

  def restore_latest(self, state_target, *, ref_target=None, config=None,
                     decode_ahead: Callable[[Any, int, Any], Any] | None = None
                     ) -> Restored | None:
    """The newest checkpoint that reads, or None when there is none (`decode_ahead`: see
    `restore`).

    Interrupted saves and unreadable checkpoints (a `rollouts_ahead` item that `decode_ahead`
    refuses among them) are named (through `say`) and skipped in favour of the previous one;
    the unreadable ones newer than the one restored are moved to `<directory>-unreadable/`.
    An incompatible checkpoint raises at once: older ones of the same run would not fit either.
    When checkpoints exist but none reads, raises `CheckpointError` listing each one's problem.
    """
    self._refuse_foreign_folders()
    for p in self._interrupted:
      self.say(f"skipping incomplete checkpoint {p} (its save was interrupted)")
    failures, skipped = [], []
    for step in reversed(self.steps()):
      try:
        restored = self.restore(step, state_target, ref_target=ref_target, config=config,
                                decode_ahead=decode_ahead)
        ok = True
      except IncompatibleCheckpointError:
        raise
      except CheckpointError as e:
        restored, ok = None, False
        failures.append(str(e))
      # Every process must take the same checkpoint: one failing read fails it for all.
      if _all_processes_ok(ok):
        self._set_aside(skipped)
        return restored
      skipped.append(step)
      if ok:
        failures.append(f"checkpoint {self.step_path(step)} did not read on another process")
      self.say(f"skipping {failures[-1]}; trying the previous checkpoint")
    if failures:
      raise CheckpointError(
          f"no usable checkpoint in {self.directory}:\n  " + "\n  ".join(failures) +
          "\nMove the directory away to start from scratch.")
    return None

  def _set_aside(self, steps: list[int]) -> None:
    """Moves unreadable checkpoints newer than the one resumed from out of the way, into
    `<directory>-unreadable/<step>`, so that the resumed run can save those steps again. Nothing
    is deleted."""
    if not steps or self.read_only:
      return
    aside = self.directory.parent / f"{self.directory.name}-unreadable"
    if jax.process_index() == 0:
      aside.mkdir(parents=True, exist_ok=True)
      for step in steps:
        dest = aside / str(step)
        if dest.exists():
          dest = aside / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.step_path(step).rename(dest)
        self.say(f"moved the unreadable checkpoint {self.step_path(step)} to {dest}")
    _all_processes_ok(True)  # every process waits for the move before listing steps again
    for step in steps:
      self._step_identity.pop(step, None)
    self._mgr.reload()


# The `ModelConfig` fields that define the function the params compute. A resume with another
# value of one (an HF directory whose config.json changed under the same `model.path`, a preset
# redefined between versions) would go on training the weights as another model, with every
# array shape and the run config the same; the other fields (kernels, remat, dtypes, which the
# run config's identity keys cover, the longest sequence, special token ids) may change.
MODEL_IDENTITY_FIELDS = ("architecture", "vocab_size", "d_model", "n_layers", "n_heads",
                         "n_kv_heads", "head_dim", "ffn_dim", "rope_theta", "rope_scaling",
                         "norm_eps", "tie_embeddings", "qkv_bias", "qk_norm",
                         "sliding_window", "sliding_layers", "local_rope_theta",
                         "rope_linear_factor", "activation", "norm_plus_one", "post_norms",
                         "embed_scale", "query_pre_attn_scalar")


def check_model_config(meta: Mapping[str, Any], cfg, path) -> None:
  """Raise `IncompatibleCheckpointError` when `MODEL_IDENTITY_FIELDS` of the `ModelConfig`
  a checkpoint was written with (its `model_config` metadata) differ from `cfg`'s."""
  saved = meta.get("model_config")
  if not isinstance(saved, Mapping):
    return  # written without one
  now = json.loads(json.dumps(_json_safe(dataclasses.asdict(cfg))))
  diff = [f"model {k}: {saved[k]!r} in the checkpoint, {now.get(k)!r} now"
          for k in MODEL_IDENTITY_FIELDS if k in saved and saved[k] != now.get(k)]
  if diff:
    raise IncompatibleCheckpointError(
        f"checkpoint {path} was written by another model than the one loaded now (the same "
        f"config, other architecture settings):\n  " + "\n  ".join(diff) +
        "\nLoad the model it was written with, or start fresh with another workdir.")


# ----------------------------------------------------------------------------- export
def model_config_from_meta(meta: Mapping[str, Any]):
  """The `ModelConfig` a checkpoint was written with."""
  from jaxagent.models import ModelConfig
  d = dict(meta["model_config"])
  if d.get("rope_scaling") is not None:
    d["rope_scaling"] = tuple(d["rope_scaling"])
  d["extra_eos_token_ids"] = tuple(d.get("extra_eos_token_ids") or ())
  return ModelConfig(**d)


def _lora_of(meta: Mapping[str, Any], path):
  """The `LoraConfig` a checkpoint's adapter has, or None for full params."""
  saved = meta.get("lora")
  if not saved:
    return None
  from jaxagent.models import lora
  try:
    return lora.LoraConfig(rank=saved["rank"], alpha=saved["alpha"],
                           targets=tuple(saved["targets"]))
  except (KeyError, TypeError, ValueError) as e:
    raise IncompatibleCheckpointError(f"checkpoint {path} records a LoRA adapter this jaxagent "
                                      f"cannot read ({type(e).__name__}: {e})") from e


def _merge_lora_base(meta: Mapping[str, Any], cfg, lcfg, adapter, path):
  """The base a LoRA checkpoint's run loaded (its `config.model`), checked against the digest
  it recorded, with `adapter` merged in."""
  import ml_collections
  from jaxagent.models import lora
  from jaxagent.trainer import load_model
  model = ml_collections.ConfigDict(dict((meta.get("config") or {}).get("model") or {}))
  try:
    base_cfg, base, _ = load_model(model)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"checkpoint {path} holds a LoRA adapter; its base weights "
                          f"(model.path={model.get('path')!r}) did not load: {e}") from e
  check_lora_base(meta, digest(base), path)
  if base_cfg.vocab_size != cfg.vocab_size or base_cfg.n_layers != cfg.n_layers:
    raise IncompatibleCheckpointError(f"checkpoint {path}: the base loaded from "
                                      f"{model.get('path')!r} is another model than the run's")
  return jax.jit(lambda a, b: lora.merge(b, a, lcfg))(adapter, base)


def checkpoint_root(path: str | os.PathLike) -> epath.Path:
  """The checkpoint directory that `path` names: a run's workdir (its `checkpoints/`) or a
  checkpoint directory itself (step folders inside); `FileNotFoundError` otherwise."""
  root = as_path(path)
  if (root / "checkpoints").is_dir():
    return root / "checkpoints"
  if not (root.is_dir() and any(_STEP_DIR.match(p.name) for p in root.iterdir())):
    raise FileNotFoundError(f"no checkpoints at {root}: expected a run's workdir (with "
                            f"checkpoints/<step>/ inside) or a checkpoint directory")
  return root


def export_hf(checkpoints: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None,
              tokenizer: Any = "auto") -> pathlib.Path:
  """Write the policy of a checkpoint as an HF directory (config.json, model.safetensors and
  the tokenizer) that `transformers` and `JetStreamEngine.from_pretrained` load.

  Args:
    checkpoints: a checkpoint root (`<workdir>/checkpoints`) or a workdir containing one.
    out: the output directory.
    step: which checkpoint (default: the newest that reads: an unreadable or corrupt newer one
      is named in a warning and skipped, as a resume skips it).
    tokenizer: "auto" (the run's tokenizer, from the saved config), None (weights only; an
      `out` holding an earlier export's tokenizer files is refused), or a `Tokenizer`.
  """
  from jaxagent import models

  root = checkpoint_root(checkpoints)
  mgr = CheckpointManager(root, read_only=True)

  def read(s: int):
    meta = mgr.read_meta(s)
    # The format first: the model config of another format (or a field another jaxagent
    # version added) raised a bare KeyError or TypeError, which the CLI showed as a traceback.
    mgr.check(meta, step=s)
    try:
      cfg = model_config_from_meta(meta)
    except (KeyError, TypeError, ValueError) as e:
      raise IncompatibleCheckpointError(
          f"checkpoint {mgr.step_path(s)} holds a model config this jaxagent cannot read "
          f"({type(e).__name__}: {e}); export it with the jaxagent version that wrote it") from e
    lcfg = _lora_of(meta, mgr.step_path(s))
    if lcfg is None:
      abstract = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
    else:  # the checkpoint holds the adapter; the base is loaded as the run loaded it
      from jaxagent.models import lora
      abstract = jax.eval_shape(lambda: lora.init_lora(cfg, lcfg, jax.random.key(0)))
    target = abstract_target(abstract, sharding.shardings(abstract, sharding.make_mesh()))
    mgr.check(meta, step=s, items={"params": target})
    params = mgr.restore_params(s, target)
    check_finite(params, f"not exporting checkpoint {mgr.step_path(s)}")
    if lcfg is not None:
      adapters[s] = (lcfg, params)
      params = _merge_lora_base(meta, cfg, lcfg, params, mgr.step_path(s))
    return meta, cfg, params

  adapters = {}  # step -> (LoraConfig, adapter) of a LoRA run's checkpoints read

  try:
    steps = mgr.steps()
    if not steps:
      raise CheckpointError(f"no complete checkpoint in {root}")
    if step is not None:
      if step not in steps:
        raise CheckpointError(f"no checkpoint for step {step} in {root}; available: {steps}")
      meta, cfg, params = read(step)
    else:
      failures = []
      for s in reversed(steps):
        try:
          meta, cfg, params = read(s)
          ok = True
        except CheckpointError as e:
          ok = False
          failures.append(str(e))
        if _all_processes_ok(ok):  # every process exports the same checkpoint
          step = s
          break
        if ok:
          failures.append(f"checkpoint {mgr.step_path(s)} did not read on another process")
        log.warning("not exporting %s; trying the previous checkpoint", failures[-1])
      else:
        raise CheckpointError(f"no usable checkpoint in {root}:\n  " + "\n  ".join(failures))
  finally:
    mgr.close()
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    host = multihost_utils.process_allgather(params, tiled=True)
  else:
    host = jax.device_get(params)
  if tokenizer == "auto":
    m = meta.get("config", {}).get("model", {})
    tokenizer = models.load_tokenizer(m.get("tokenizer") or m["path"])
  out = pathlib.Path(out).expanduser()
  if jax.process_index() == 0:
    # The record of which checkpoint the weights are, staged and moved in with them.
    models.save_hf(out, cfg, host, tokenizer, extra_files={"jaxagent_export.json": json.dumps(
        {"checkpoint": str(mgr.step_path(step)), "step": step}, indent=2)})
  if step in adapters:
    lcfg, adapter = adapters[step]
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      adapter = multihost_utils.process_allgather(adapter, tiled=True)
    if jax.process_index() == 0:
      save_lora_adapter(out, cfg, lcfg, jax.device_get(adapter), meta.get("config", {}))
  elif jax.process_index() == 0:
    drop_stale_adapter(out)
  return out


def drop_stale_adapter(out) -> bool:
  """After a full-weights export into `out`: remove `<out>/adapter` when it is an earlier LoRA
  export's adapter (its two PEFT files and nothing else), which would describe another policy
  than the weights beside it. Anything else there is left as it is. True when removed."""
  from jaxagent.models import lora
  d = pathlib.Path(out).expanduser() / "adapter"
  if not d.is_dir() or {p.name for p in d.iterdir()} != {lora.PEFT_CONFIG, lora.PEFT_WEIGHTS}:
    return False
  for name in (lora.PEFT_CONFIG, lora.PEFT_WEIGHTS):  # the config first: no half adapter reads
    (d / name).unlink()
  d.rmdir()
  log.info("removed %s: an earlier export's LoRA adapter, not of the weights exported now", d)
  return True


def save_lora_adapter(out, cfg, lcfg, adapter, config: Mapping[str, Any]) -> pathlib.Path:
  """A LoRA run's export also holds its adapter alone, as a PEFT adapter directory
  `<out>/adapter` (`models.lora.save_peft`), for engines that serve adapters over the base."""
  from jaxagent.models import lora
  path = (config.get("model") or {}).get("path")
  return lora.save_peft(pathlib.Path(out) / "adapter", cfg, lcfg, adapter,
                        base_model=path if isinstance(path, str) else None)
