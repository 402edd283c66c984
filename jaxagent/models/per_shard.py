"""How the model's functions split their work over the ambient mesh.

Under a mesh (`jax.sharding.use_abstract_mesh`, which `jaxagent.sharding.on_mesh` sets for the
learner's and the engine's programs), rows are split over the batch axes ("data", "fsdp") and
heads over "tensor". `constrain_batch` keeps activations split by rows; `per_shard` runs a
Pallas kernel on each device's shard (`shard_map`), since XLA's partitioner sees a kernel call
as one opaque op and would gather its inputs onto every device. Without a mesh both are the
plain computation.
"""
from __future__ import annotations

import math

import jax


_BATCH_AXES = ("data", "fsdp")


def batch_split() -> tuple[tuple[str, ...], int]:
  """The ambient mesh's batch axes with more than one device, and how many ways they split
  rows (`((), 1)` without a mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return (), 1
  axes = tuple(a for a in _BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
  return axes, math.prod(mesh.shape[a] for a in axes)


def tensor_split() -> int:
  """How many ways the ambient mesh's "tensor" axis splits heads (1 without a mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else mesh.shape.get("tensor", 1)


def constrain_batch(x):
  """Keep `x` split by rows over the batch axes ("data", "fsdp") of the ambient mesh.

  A no-op unless a mesh is set (`jax.sharding.use_abstract_mesh`; `sharding.on_mesh` sets it
  for the learner's and the engine's programs) and the rows divide evenly. Without it, XLA's
  sharding propagation may follow the fsdp-sharded weights into the residual stream and keep
  activations of the whole batch on every chip (the planner: qwen2.5-0.5b update of
  `configs/math_tool.py:qwen` on v5e:4x4 with fsdp=16, 6.68 -> 3.04 GiB per chip).
  """
  axes, n = batch_split()
  if not axes or x.shape[0] % n:
    return x
  spec = jax.sharding.PartitionSpec(axes, *([None] * (x.ndim - 1)))
  return jax.lax.with_sharding_constraint(x, spec)


def per_shard(fn, row_args, out_ndims, heads_dim: int | None, kv_heads: int = 1,
              shared=()):
  """`fn(*row_args, *shared)` (a Pallas kernel call) per shard of the ambient mesh
  (`shard_map`; `fn` itself without a mesh). XLA's partitioner sees a Pallas call as one
  opaque kernel and would gather its sharded inputs onto every device. Every array of
  `row_args` is split on axis 0 over the batch axes (when the rows divide evenly); the ones
  with more than two dims also on axis `heads_dim` (None: not split) over "tensor" when
  `kv_heads` divide evenly (each shard's query heads then map onto its own key-value heads);
  the outputs, of `out_ndims` dims (an int for one output, a tuple for several), likewise.
  The arrays of `shared` go to every shard whole."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return fn(*row_args, *shared)
  axes, n = batch_split()
  rows = axes if axes and row_args[0].shape[0] % n == 0 else None
  tp = tensor_split()
  heads = "tensor" if heads_dim is not None and tp > 1 and kv_heads % tp == 0 else None

  def spec(ndim):
    dims = [rows] + [None] * (ndim - 1)
    if ndim > 2 and heads_dim is not None:
      dims[heads_dim] = heads
    return jax.sharding.PartitionSpec(*dims)

  in_specs = (tuple(spec(a.ndim) for a in row_args)
              + (jax.sharding.PartitionSpec(),) * len(shared))
  out_specs = (spec(out_ndims) if isinstance(out_ndims, int)
               else tuple(spec(d) for d in out_ndims))
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)(*row_args, *shared)
