"""Per-chip capacity and peaks: compile-only TPU devices get the compiler's own HBM budget."""
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxagent import plan
from jaxagent.plan.chips import CHIPS, GiB


def test_table_matches_the_datasheets():
  # Cloud TPU docs (per chip: bf16 peak, HBM, HBM bandwidth, ICI one way).
  v5e, v5p, v6e, v4 = CHIPS["TPU v5 lite"], CHIPS["TPU v5"], CHIPS["TPU v6 lite"], CHIPS["TPU v4"]
  assert (v5e.bf16_flops, v5e.hbm_bytes, v5e.hbm_bandwidth, v5e.ici_bandwidth) == (
      197e12, 16 * GiB, 819e9, 1600e9 / 8)
  assert (v5p.bf16_flops, v5p.hbm_bytes, v5p.hbm_bandwidth, v5p.ici_bandwidth) == (
      459e12, 95 * GiB, 2765e9, 4800e9 / 8)
  assert (v6e.bf16_flops, v6e.hbm_bytes) == (918e12, 32 * GiB)
  assert (v4.bf16_flops, v4.hbm_bytes, v4.hbm_bandwidth) == (275e12, 32 * GiB, 1200e9)


@pytest.mark.skipif(not plan.has_libtpu(), reason="needs libtpu: pip install 'jaxagent[tpu]'")
@pytest.mark.tpu_aot
@pytest.mark.parametrize("topology, kind", [("v5e:2x2", "v5e"), ("v6e:2x2", "v6e")])
def test_compile_only_capacity_is_what_the_compiler_lets_a_program_use(topology, kind):
  devices = plan.devices_for(topology)
  spec = plan.chip_for(devices)
  assert spec.name == kind and spec.source == "compiler"
  sh = NamedSharding(Mesh(np.asarray(devices[:1]), ("x",)), P())
  read = jax.jit(lambda a: a[:8])

  def compiles(nbytes):
    try:
      read.lower(jax.ShapeDtypeStruct((int(nbytes),), np.int8, sharding=sh)).compile()
      return True
    except Exception as e:
      assert "RESOURCE_EXHAUSTED" in str(e), e
      return False

  # A plan that says "fits" must be a program the compiler accepts, and the other way round.
  assert compiles(spec.hbm_bytes - 64 * 2 ** 20)
  assert not compiles(spec.hbm_bytes + 64 * 2 ** 20)
