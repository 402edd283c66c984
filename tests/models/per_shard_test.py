"""`per_shard` on 8 fake CPU devices: rows split over the batch axes when they divide, heads
over "tensor" when the kv heads divide, `shared` arrays whole, the plain call without a mesh."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent import sharding
from jaxagent.models.per_shard import batch_split, per_shard, tensor_split


def _probe(x, y, w):
  """Each shard's local row and head counts, written into its outputs."""
  return (x + (x.shape[0] * 1000 + x.shape[2]) + 0 * w.sum(),
          y * 0 + y.shape[0] + (w.sum() - w.size))


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 8, 1), (1, 2, 4), (1, 1, 8)])
@pytest.mark.parametrize("rows", [8, 6])
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_per_shard_splits_as_promised(mesh_shape, rows, kv_heads):
  mesh = sharding.make_mesh(*mesh_shape)
  d, f, t = mesh_shape
  x, y, w = jnp.zeros((rows, 5, 8, 3)), jnp.zeros((rows, 7)), jnp.ones((4, 4))

  def run(x, y, w):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      assert batch_split()[1] == d * f and tensor_split() == t
      return per_shard(_probe, (x, y), (4, 2), heads_dim=2, kv_heads=kv_heads, shared=(w,))
  with jax.sharding.set_mesh(mesh):
    ox, oy = jax.jit(run)(x, y, w)
  local_rows = rows // (d * f) if rows % (d * f) == 0 else rows
  local_heads = 8 // t if t > 1 and kv_heads % t == 0 else 8
  np.testing.assert_array_equal(ox, np.full(x.shape, local_rows * 1000 + local_heads))
  np.testing.assert_array_equal(oy, np.full(y.shape, local_rows))


def test_per_shard_without_a_mesh_is_the_plain_call():
  x, y, w = jnp.zeros((6, 5, 8, 3)), jnp.zeros((6, 7)), jnp.ones((4, 4))
  assert batch_split() == ((), 1) and tensor_split() == 1
  ox, oy = per_shard(_probe, (x, y), (4, 2), heads_dim=2, kv_heads=2, shared=(w,))
  np.testing.assert_array_equal(ox, np.full(x.shape, 6008))
  np.testing.assert_array_equal(oy, np.full(y.shape, 6))
