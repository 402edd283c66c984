"""Mesh, logical-axis rules and shardings for params, optimizer state, batches and KV caches.

Every array that crosses a jit boundary gets its sharding from here. Params carry logical
axis names (see `jaxagent.models.param_tree.param_specs`); `RULES` maps them onto the mesh axes
`("data", "fsdp", "tensor")`. A logical axis whose size does not divide the mapped mesh size
is replicated instead (e.g. SmolLM2's 3 KV heads on `tensor=2`), so every preset shards on
every mesh without hand edits; `shardings` logs a warning naming each such fallback once.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxagent._token_ids import is_int

MESH_AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")

# Logical axis -> mesh axes. One table for the whole library.
RULES: tuple[tuple[str, Any], ...] = (
    ("batch", BATCH),          # rows of a training batch / prompts
    ("slots", BATCH),          # decode slots of the KV cache
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("length", None),
    ("norm", None),
    ("lora_rank", None),     # the rank axis of low-rank adapters (`jaxagent.models.lora`)
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh axis sizes; one of them may be -1 (all remaining devices)."""

  data: int = 1
  fsdp: int = -1
  tensor: int = 1

  def __post_init__(self):
    for name in ("data", "fsdp", "tensor"):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
        raise ValueError(f"MeshConfig.{name} must be an int (a device count, or -1 for all "
                         f"remaining devices), got {v!r}")
    sizes = (self.data, self.fsdp, self.tensor)
    if sum(s == -1 for s in sizes) > 1:
      raise ValueError(f"MeshConfig: at most one axis may be -1, got data={self.data}, "
                       f"fsdp={self.fsdp}, tensor={self.tensor}")
    if any(s == 0 or s < -1 for s in sizes):
      raise ValueError(f"MeshConfig: axis sizes must be positive or -1, got {sizes}")

  def resolve(self, n_devices: int) -> tuple[int, int, int]:
    sizes = [self.data, self.fsdp, self.tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
      if n_devices % known:
        named = ", ".join(f"{a}={v}" for a, v in zip(("data", "fsdp", "tensor"), sizes))
        raise ValueError(f"MeshConfig ({named}): {n_devices} devices are not divisible by "
                         f"{known}, the product of the sizes other than -1; give those sizes a "
                         f"product that divides {n_devices}")
      sizes[sizes.index(-1)] = n_devices // known
    if math.prod(sizes) > n_devices:
      # (the advice to set an axis to -1 did not help here: the fixed sizes alone are too many)
      raise ValueError(f"MeshConfig data*fsdp*tensor = {math.prod(sizes)} but {n_devices} "
                       f"devices are available; a mesh cannot be larger than the devices: give "
                       f"sizes whose product is {n_devices}, or set one of them to -1 with "
                       f"the other two dividing {n_devices}")
    if math.prod(sizes) != n_devices:
      # An axis of -1 absorbs the rest only when the product divides the devices: data=3 on 8
      # devices was told to set one to -1, which then failed as "not divisible".
      fix = ("set one axis to -1 to absorb the rest" if n_devices % math.prod(sizes) == 0 else
             f"give sizes whose product is {n_devices} ({math.prod(sizes)} does not divide "
             f"{n_devices}, so no axis of -1 can absorb the rest)")
      raise ValueError(f"MeshConfig data*fsdp*tensor = {math.prod(sizes)} but {n_devices} "
                       f"devices are available; {fix}")
    return tuple(sizes)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A `("data", "fsdp", "tensor")` mesh over `devices` (default: all devices, or another
  mesh's `.devices` grid)."""
  devices = jax.devices() if devices is None else devices
  if isinstance(devices, np.ndarray):
    # Another mesh's device grid: its rows were taken for devices ("unhashable type").
    devices = devices.ravel()
  devices = list(devices)
  if not devices or len(set(devices)) != len(devices):
    raise ValueError(f"make_mesh: devices must be a non-empty list of distinct devices, got "
                     f"{devices!r}")
  shape = MeshConfig(data, fsdp, tensor).resolve(len(devices))
  try:
    from jax.experimental import mesh_utils
    arr = mesh_utils.create_device_mesh(shape, devices=devices)
  except Exception:  # non-TPU topologies or odd counts: plain row-major order
    arr = np.asarray(devices, dtype=object).reshape(shape)
  return Mesh(arr, MESH_AXES)


def check_mesh(mesh: Mesh, who: str) -> Mesh:
  """`mesh` if it has every axis of `MESH_AXES`, else a ValueError naming the axes it lacks.

  The learner splits batch rows over `("data", "fsdp")` and the rules table maps params onto
  all three axes; a mesh of the user's own without one of them (e.g. `("fsdp", "tensor")`)
  failed inside JAX (a KeyError 'data', or "Resource axis: data ... is not found in mesh").
  """
  missing = [a for a in MESH_AXES if a not in mesh.axis_names]
  if missing:
    sizes = ", ".join(f"{a}={n}" for a, n in mesh.shape.items())
    raise ValueError(f"{who}: the mesh has axes {tuple(mesh.axis_names)} ({sizes}) and lacks "
                     f"{tuple(missing)}; jaxagent needs a mesh with the axes {MESH_AXES} "
                     "(size 1 for an unused one): build it with "
                     "jaxagent.sharding.make_mesh(data, fsdp, tensor, devices=...)")
  return mesh


ROLLOUT_MESHES = ("learner", "data")


def check_rollout_mesh(kind: str) -> str:
  """`kind` if it names a rollout mesh (`ROLLOUT_MESHES`), else a ValueError naming the key."""
  if kind not in ROLLOUT_MESHES:
    raise ValueError(f"rollout.mesh must be one of {ROLLOUT_MESHES}, got {kind!r}")
  return kind


def split_rollout_devices(n: int, devices: Sequence[jax.Device] | None = None
                          ) -> tuple[list[jax.Device], list[jax.Device] | None]:
  """(learner devices, rollout devices) for `rollout.devices = n`: with n > 0 the last n of
  `devices` (default: all) decode and the others train, so that rollouts collected ahead
  (`train.off_policy_steps`) run beside the update instead of taking turns with it on the same
  chips; n = 0: every device trains, and the rollouts share them (None)."""
  devices = list(jax.devices() if devices is None else devices)
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
    raise ValueError(f"rollout.devices must be an int >= 0 (0: decode on the learner's "
                     f"devices), got {n!r}")
  if n == 0:
    return devices, None
  if n >= len(devices):
    raise ValueError(f"rollout.devices={n} leaves no device to train on: there are "
                     f"{len(devices)}; give the rollouts fewer (or 0 to share them)")
  if len({d.process_index for d in devices}) > 1:
    raise ValueError(f"rollout.devices={n}: a split of the devices into learner and rollout "
                     "ones is for one process; on several hosts the rollouts already run on "
                     "process 0's devices (set rollout.devices=0)")
  return devices[:-n], devices[-n:]


def rollout_mesh(kind: str, learner_mesh: Mesh,
                 devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The mesh the rollout engines decode on (config key `rollout.mesh`).

  "learner": the learner's mesh itself, so the engines read the learner's (fsdp / tensor
  sharded) params with no copy; "data": the same devices (or `devices`) all on the data axis,
  with the weights replicated, so each device decodes its own slots and no decode step gathers
  weights. On 4 GPUs with the Qwen3-0.6B shape a 256-slot rollout took 2.76 / 2.79 s on 1 / 4
  GPUs over fsdp and 2.77 / 1.38 s over data (benchmarks/RESULTS.md); it costs one copy of the
  compute-dtype weights per device, refreshed once per step. With `devices` given and kind
  "learner", a mesh over them with the learner's default layout (fsdp)."""
  if check_rollout_mesh(kind) == "data":
    devs = list(learner_mesh.devices.flat) if devices is None else list(devices)
    return make_mesh(data=len(devs), fsdp=1, tensor=1, devices=devs)
  return learner_mesh if devices is None else make_mesh(devices=devices)


def on_mesh(fn, mesh: Mesh | None):
  """`fn` traced under `mesh` (`jax.sharding.use_abstract_mesh`), so that the decoder keeps
  activations split by rows over the batch axes (`models.per_shard.constrain_batch`) instead of
  computing every row on every device. `fn` itself when `mesh` is None."""
  if mesh is None:
    return fn

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args, **kwargs)
  return wrapped


def _axis_size(mesh: Mesh, axes) -> int:
  if axes is None:
    return 1
  if isinstance(axes, str):
    axes = (axes,)
  return math.prod(mesh.shape[a] for a in axes)


def _spec_and_fallbacks(names, shape, mesh: Mesh, rules):
  """`logical_to_spec`'s spec, and for each dim that the rules map onto mesh axes of more than
  one device but whose size does not divide them, `(name, size, ((axis, axis size), ...))`."""
  table = dict(rules)
  out, used, fallbacks = [], set(), []
  for i, name in enumerate(names):
    axes = table.get(name) if name is not None else None
    if axes is not None:
      tup = (axes,) if isinstance(axes, str) else tuple(axes)
      unknown = [a for a in tup if a not in mesh.shape]
      if unknown:
        # Skipping the axis replicated the array silently: a mesh with a misspelt axis
        # ("tensors") or rules naming one held every param whole on every device.
        raise ValueError(f"sharding: the rules map logical axis {name!r} to mesh axes {tup}, "
                         f"but the mesh has axes {tuple(mesh.axis_names)} (lacks "
                         f"{tuple(unknown)}); build the mesh with jaxagent.sharding.make_mesh"
                         f"(data, fsdp, tensor) (axes {MESH_AXES}), or name only its axes in "
                         "the rules")
      tup = tuple(a for a in tup if a not in used and mesh.shape[a] > 1)
      size = _axis_size(mesh, tup) if tup else 1
      if not tup or (shape is not None and shape[i] % size):
        if tup:
          fallbacks.append((name, int(shape[i]), tuple((a, mesh.shape[a]) for a in tup)))
        axes = None
      else:
        axes = tup[0] if len(tup) == 1 else tup
        used.update(tup)
    out.append(axes)
  return P(*out), fallbacks


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int] | None, mesh: Mesh,
                    rules=RULES) -> P:
  """PartitionSpec for an array with logical axis `names` (dims that don't divide replicate)."""
  return _spec_and_fallbacks(names, shape, mesh, rules)[0]


# Replication fallbacks already logged by this process (one warning each, not one per call).
_LOGGED_FALLBACKS: set = set()


def _log_fallbacks(found: dict) -> None:
  for (name, size, axes), paths in found.items():
    if (name, size, axes) in _LOGGED_FALLBACKS:
      continue
    _LOGGED_FALLBACKS.add((name, size, axes))
    sizes = " x ".join(f"{a}={n}" for a, n in axes)
    more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
    log.warning("sharding: logical axis %r has size %d, which the mesh's %s (%d devices) does "
                "not divide: it is replicated over them instead of split (%s%s); to split it, "
                "use a mesh where %s divides %d", name, size, sizes,
                math.prod(n for _, n in axes), ", ".join(paths[:3]), more,
                " x ".join(a for a, _ in axes), size)


def _is_box(x) -> bool:
  return isinstance(x, nn.LogicallyPartitioned)


def shardings(tree, mesh: Mesh, rules=RULES):
  """A sharding tree matching `tree` (boxed params, optimizer state, or abstract versions).

  Boxed leaves are sharded by their logical names; other leaves are replicated. A dim
  whose size does not divide its mesh axes is replicated, with a warning (once per process);
  so is a boxed array whose rank differs from its names' count (an optimizer's factored
  statistics in their param's box).
  """
  found: dict = {}
  other_rank: list = []

  def one(path, x):
    if _is_box(x):
      name = jax.tree_util.keystr(path, simple=True, separator="/")
      shape = np.shape(x.value)
      if len(x.names) != len(shape):
        # Names of another array: an optimizer statistic kept in its param's box with fewer
        # dims (optax.adafactor's factored second moments). Which dim they lost is the
        # optimizer's business, so they are replicated (they are small).
        other_rank.append(f"{name} {tuple(shape)} named {tuple(x.names)}")
        return x.replace_boxed(NamedSharding(mesh, P()))
      spec, fallbacks = _spec_and_fallbacks(x.names, shape, mesh, rules)
      for f in fallbacks:
        found.setdefault(f, []).append(name)
      return x.replace_boxed(NamedSharding(mesh, spec))
    return NamedSharding(mesh, P())
  out = jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_box)
  _log_fallbacks(found)
  key = ("rank", len(other_rank), tuple(other_rank[:1]))
  if other_rank and mesh.size > 1 and key not in _LOGGED_FALLBACKS:
    _LOGGED_FALLBACKS.add(key)
    more = f" and {len(other_rank) - 3} more" if len(other_rank) > 3 else ""
    log.warning("sharding: %d arrays carry logical axis names of a different rank than their "
                "own (%s%s): they are replicated", len(other_rank), "; ".join(other_rank[:3]),
                more)
  return out


def shard(tree, mesh: Mesh, rules=RULES):
  """Place a (host or device) tree onto the mesh with `shardings(tree, mesh)`."""
  return jax.device_put(tree, shardings(tree, mesh, rules))


def init_sharded(init_fn, mesh: Mesh, *args, rules=RULES):
  """Run `init_fn(*args)` under jit with sharded outputs: nothing is materialised unsharded."""
  abstract = jax.eval_shape(init_fn, *args)
  return jax.jit(init_fn, out_shardings=shardings(abstract, mesh, rules))(*args)


def batch_spec(ndim: int) -> P:
  """Rows over data and fsdp, the rest replicated, for an array of `ndim` >= 1 dimensions."""
  if not is_int(ndim) or ndim < 1:
    # (0 or -1 gave P(BATCH): a spec for rows that a scalar does not have, refused only later
    # by device_put or jit with an error that did not name this call)
    raise ValueError(f"batch_spec: ndim must be an int >= 1 (the array's rank; rows are its "
                     f"first dimension), got {ndim!r}; a scalar is replicated(mesh)")
  return P(BATCH, *([None] * (int(ndim) - 1)))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Rows (dimension 0) of an `ndim`-dimensional array over the mesh's data and fsdp axes."""
  return NamedSharding(check_mesh(mesh, "batch_sharding"), batch_spec(ndim))


def replicated(mesh: Mesh) -> NamedSharding:
  """Every device holds the whole array."""
  return NamedSharding(mesh, P())


def kv_cache_spec(n_kv_heads: int, n_slots: int, mesh: Mesh) -> P:
  """KV cache `[layers, slots, kv_heads, length, head_dim]`: slots over data/fsdp, heads over
  tensor when divisible."""
  return logical_to_spec(("layers", "slots", "kv_heads", "length", "head_dim"),
                         (1, n_slots, n_kv_heads, 1, 1), mesh)


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None) -> bool:
  """Start JAX's multi-host runtime when this is a multi-process job; no-op on one host.

  Arguments fall back to the environment (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
  `JAX_PROCESS_ID`). On a multi-host Cloud TPU slice JAX discovers everything itself.
  Returns True when the distributed runtime was initialised.
  """
  env = os.environ
  coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
  def env_int(name: str) -> int:
    try:
      return int(env[name])
    except ValueError:
      raise ValueError(f"{name}={env[name]!r} is not an integer") from None

  if num_processes is None and env.get("JAX_NUM_PROCESSES"):
    num_processes = env_int("JAX_NUM_PROCESSES")
  if process_id is None and env.get("JAX_PROCESS_ID"):
    process_id = env_int("JAX_PROCESS_ID")
  tpu_hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
  if coordinator_address:
    if num_processes is None or process_id is None:
      raise ValueError("multi-process launch: with a coordinator address, num_processes and "
                       "process_id (or JAX_NUM_PROCESSES / JAX_PROCESS_ID) are required")
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ValueError(f"multi-process launch: process_id must be in [0, num_processes) and "
                       f"num_processes >= 1, got process_id={process_id}, "
                       f"num_processes={num_processes}")
    if num_processes == 1:
      return False
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
  elif len(tpu_hosts) > 1:
    jax.distributed.initialize()
  elif num_processes is not None and num_processes > 1:
    # Without this check every process would start alone and train its own copy of the run.
    raise ValueError(f"multi-process launch: num_processes={num_processes} but no coordinator "
                     f"address; pass --coordinator_address=HOST:PORT of process 0 (or set "
                     f"JAX_COORDINATOR_ADDRESS) on every process")
  elif num_processes is None and process_id is not None and process_id != 0:
    # A rank of a job started without its coordinator or job size: it would train alone.
    raise ValueError(f"multi-process launch: process_id={process_id} but no coordinator address "
                     f"and no num_processes; pass --coordinator_address=HOST:PORT of process "
                     f"0 and --num_processes (or set JAX_COORDINATOR_ADDRESS / "
                     f"JAX_NUM_PROCESSES) on every process")
  else:
    return False
  log.info("JAX distributed: process %d of %d, %d local / %d global devices",
           jax.process_index(), jax.process_count(), jax.local_device_count(),
           jax.device_count())
  return True
