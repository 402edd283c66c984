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
  # https://docs.cloud.google.com/tpu/docs/tpu7x: ICI 1200 GB/s bidirectional.
  tpu7x = CHIPS["TPU7x"]
  assert (tpu7x.bf16_flops, tpu7x.hbm_bytes, tpu7x.hbm_bandwidth, tpu7x.ici_bandwidth) == (
      2307e12, 192 * GiB, 7380e9, 1200e9 / 2)


@pytest.mark.skipif(not plan.has_libtpu(), reason="needs libtpu: pip install 'jaxagent[tpu]'")
@pytest.mark.tpu_aot
@pytest.mark.parametrize("topology, kind", [("v5e:2x2", "v5e"), ("v6e:2x2", "v6e"),
                                            ("v4:2x2x1", "v4")])
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


def _tiny_update_plan(topology: str, data: int) -> plan.PlanReport:
  """The update program of the quickstart's tiny config on a one-layer tiny-llama, planned for
  `topology` with a data-parallel mesh of `data` devices."""
  from configs import quickstart
  from jaxagent.models import get_config
  c = quickstart.get_config("tiny")
  c.model.tokenizer = ""
  c.mesh.update(data=data, fsdp=1, tensor=1)
  return plan.plan_run(c, topology, cfg=get_config("tiny-llama", n_layers=1),
                       options=plan.PlanOptions(programs=("update",)))


@pytest.mark.skipif(not plan.has_libtpu(), reason="needs libtpu: pip install 'jaxagent[tpu]'")
@pytest.mark.tpu_aot
def test_v4_topology_has_one_device_per_chip_as_on_v4_hosts():
  # A v4 host runs each chip's two TensorCores as one device (megacore): v4:2x2x1 is 4 chips,
  # 4 devices. libtpu's default description lists 8 cores, so a run's mesh of 4 was refused.
  devices = plan.devices_for("v4:2x2x1")
  assert len(devices) == 4 and len({tuple(d.coords) for d in devices}) == 4
  spec = plan.chip_for(devices)
  assert spec.name == "v4" and spec.source == "compiler"
  # The whole chip: its peak and (about) its 32 GiB, not half of them for one core.
  assert spec.bf16_flops == CHIPS["TPU v4"].bf16_flops
  assert 24 * GiB < spec.hbm_bytes <= 32 * GiB
  report = _tiny_update_plan("v4:2x2x1", data=4)
  assert report.n_devices == 4 and report.mesh == {"data": 4, "fsdp": 1, "tensor": 1}
  assert report.fits is True, report.render()


@pytest.mark.slow  # default-run time budget: 5-11 s of TPU compiles
@pytest.mark.skipif(not plan.has_libtpu(), reason="needs libtpu: pip install 'jaxagent[tpu]'")
@pytest.mark.tpu_aot
def test_tpu7x_topology_has_a_device_per_tensorcore_with_half_the_chip():
  # JAX runs each of a TPU7x chip's two TensorCores as a device: tpu7x:2x2x1 is 4 chips on one
  # host, 8 devices. Without TPU7x figures a plan for it had no peak, bandwidth or time estimate.
  devices = plan.devices_for("tpu7x:2x2x1")
  assert len(devices) == 8 and len({tuple(d.coords) for d in devices}) == 4
  assert len({d.process_index for d in devices}) == 1
  spec = plan.chip_for(devices)
  assert spec.name == "tpu7x" and spec.source == "compiler"
  chip = CHIPS["TPU7x"]
  assert (spec.bf16_flops, spec.hbm_bandwidth, spec.ici_bandwidth) == (
      chip.bf16_flops / 2, chip.hbm_bandwidth / 2, chip.ici_bandwidth / 2)
  # The compiler's budget for one core: (about) half the chip's 192 GiB, not all of it.
  assert 80 * GiB < spec.hbm_bytes <= 96 * GiB
  report = _tiny_update_plan("tpu7x:2x2x1", data=8)
  assert report.n_devices == 8 and report.mesh == {"data": 8, "fsdp": 1, "tensor": 1}
  assert report.fits is True, report.render()
  update = report.program("update")
  assert update.capacity == spec.hbm_bytes and 0 < update.total_bytes < update.capacity
  # A time estimate needs the chip's peak and bandwidth (none without TPU7x figures).
  assert update.est_s is not None and update.est_s > 0 and update.bound, report.render()


@pytest.mark.skipif(not plan.has_libtpu(), reason="needs libtpu: pip install 'jaxagent[tpu]'")
@pytest.mark.tpu_aot
@pytest.mark.parametrize("topology, chips, hosts", [
    ("v5e:1x1", 1, 1), ("v6e:1x1", 1, 1), ("v5e:2x2", 4, 1), ("v5e:2x4", 8, 1),
    ("v6e:2x4", 8, 1), ("v5e:2x4x1", 8, 1), ("v5e:4x4", 16, 4), ("v5p:2x2x2", 8, 2)])
def test_topologies_have_the_hosts_of_their_cloud_slices(topology, chips, hosts):
  # v5litepod-1 and -8 (v6e-1, -8) are one host: libtpu's default hosts of 2x2 chips refused
  # 1x1 and split 2x4 over two hosts, where the planner then put the rollouts on half the chips.
  devices = plan.devices_for(topology)
  assert len(devices) == chips
  assert len({d.process_index for d in devices}) == hosts


# Cloud TPU accelerator types: v4-N and v5p-N count TensorCores (two per chip), v5litepod-N
# and v6e-N count chips.
CLOUD_TYPES = [("v4-8", "v4:2x2x1", 4), ("v4-16", "v4:2x2x2", 8), ("v4-32", "v4:2x2x4", 16),
               ("v4-64", "v4:2x4x4", 32), ("v4-128", "v4:4x4x4", 64),
               ("v5p-8", "v5p:2x2x1", 4), ("v5p-16", "v5p:2x2x2", 8), ("v5p-128", "v5p:4x4x4", 64),
               ("v5litepod-1", "v5e:1x1", 1), ("v5litepod-4", "v5e:2x2", 4),
               ("v5litepod-8", "v5e:2x4", 8), ("v5litepod-16", "v5e:4x4", 16),
               ("v5litepod-256", "v5e:16x16", 256), ("v6e-8", "v6e:2x4", 8),
               ("v6e-32", "v6e:4x8", 32), ("V6E-64", "v6e:8x8", 64)]


@pytest.mark.parametrize("name, topology, chips", CLOUD_TYPES)
def test_cloud_accelerator_types_are_the_topologies_they_name(name, topology, chips):
  # `--topology=v5litepod-16` was refused ("expected '<chip>:<shape>'"), though it is how
  # Cloud TPU names a slice.
  assert plan.resolve_topology(name) == topology
  assert np.prod([int(d) for d in topology.split(":")[1].split("x")]) == chips


def test_planner_topologies_pass_through():
  for name in ("v5e:4x4", "v4:2x2x1", "v5p:4x4x4", "local"):
    assert plan.resolve_topology(name) == name


@pytest.mark.parametrize("name, expected", [
    # Slices whose shape the size alone does not fix, or that Cloud does not offer.
    ("v4-384", "'v4-384': in v4-N, N counts TensorCores (2 per chip); the planner translates "
     "N = 8 (2x2x1), 16 (2x2x2)"),
    ("v5p-4", "pass its shape as an explicit 'v5p:AxBxC' topology"),
    ("v5litepod-2", "'v5litepod-2': in v5litepod-N, N counts chips; the planner translates "
     "N = 1 (1x1), 4 (2x2), 8 (2x4), 16 (4x4), 32 (4x8), 64 (8x8), 128 (8x16), 256 (16x16). "
     "For another slice pass its shape as an explicit 'v5e:AxB' topology"),
    ("v6e-512", "explicit 'v6e:AxB' topology"),
    # Chips the planner has no figures for, and v5e under a name Cloud does not use.
    ("v3-8", "'v3-8': the planner has no chip figures for v3. The planner translates the Cloud "
     "TPU accelerator types v4-N, v5p-N"),
    # TPU7x has figures, but no Cloud accelerator type the planner reads: its shape is asked for.
    ("tpu7x-8", "'tpu7x-8': the planner translates no tpu7x-N accelerator type"),
    ("TPU7X-16", "pass the slice's shape as an explicit 'tpu7x:AxBxC' topology"),
    ("v5e-16", "'v5e-16': Cloud names v5e slices v5litepod-N"),
])
def test_cloud_types_it_cannot_translate_say_which_it_can(name, expected):
  with pytest.raises(ValueError) as e:
    plan.resolve_topology(name)
  assert expected in str(e.value), str(e.value)
  with pytest.raises(ValueError, match="translates"):
    plan.devices_for(name)  # before libtpu is asked


@pytest.mark.parametrize("name", ["h100:8", "H200:2x4", "a100:8", "nvidia-h100:8", "gpu:8",
                                  "h100 pcie:2", "h100", "H200", "h100-8", "NVIDIA A100", "gpu"])
def test_a_gpu_topology_says_to_plan_on_the_gpus(name):
  """It read "libtpu does not know the topology 'h100:8' (Invalid TPU external name: TPU h100)",
  as if the name were misspelt; a GPU name without a shape ('h100', 'h100-8') was told to
  write '<chip>:<shape>', which for a GPU the planner then refused."""
  with pytest.raises(ValueError, match=f"topology '{name}': the planner describes TPU "
                                       "topologies only.*--topology=local"):
    plan.devices_for(name)


@pytest.mark.skipif(not plan.has_libtpu(), reason="needs libtpu: pip install 'jaxagent[tpu]'")
@pytest.mark.tpu_aot
@pytest.mark.parametrize("name, chips, hosts, kind", [
    ("v4-8", 4, 1, "v4"), ("v5p-8", 4, 1, "v5p"), ("v5p-16", 8, 2, "v5p"),
    ("v5litepod-8", 8, 1, "v5e"), ("v5litepod-16", 16, 4, "v5e"), ("v6e-8", 8, 1, "v6e")])
def test_cloud_accelerator_types_describe_their_slices(name, chips, hosts, kind):
  devices = plan.devices_for(name)
  assert len(devices) == chips
  assert len({d.process_index for d in devices}) == hosts
  assert plan.CHIPS[devices[0].device_kind].name == kind


@pytest.mark.parametrize("kind,name,bandwidth", [
    ("NVIDIA H100 80GB HBM3", "H100", 3350e9), ("NVIDIA H100 PCIe", "H100 PCIe", 2000e9),
    ("NVIDIA H100 NVL", "H100 NVL", 3900e9), ("NVIDIA H200", "H200", 4800e9),
    ("NVIDIA H200 NVL", "H200 NVL", 4800e9), ("NVIDIA GH200 480GB", "GH200", 4000e9),
    ("NVIDIA GH200 144G HBM3e", "GH200 144G", 4900e9),
    ("NVIDIA A100-SXM4-80GB", "A100", 2039e9), ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe", 1935e9),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB", 1555e9), ("NVIDIA A100-PCIE-40GB", "A100 40GB", 1555e9)])
def test_gpu_kinds_take_their_own_figures(kind, name, bandwidth):
  # The PCIe H100s took the SXM part's 3350 GB/s and 989 TFLOP/s: rooflines 1.7x too high.
  # A GH200 was named an H200 (4800 GB/s for its 4000), an H200 NVL took the SXM part's 989
  # TFLOP/s, and a 40 GB A100 the 80 GB part's 2039 GB/s for its 1555.
  class Gpu:
    platform, device_kind, process_index = "gpu", kind, 0

    def memory_stats(self):
      return {}

  spec = plan.chip_for([Gpu()])
  assert (spec.name, spec.hbm_bandwidth) == (name, bandwidth)


class _Gpu:
  """A GPU as another process sees it: its allocator answers only the process that owns it."""

  platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

  def __init__(self, process_index, limit):
    self.process_index, self._limit = process_index, limit

  def memory_stats(self):
    if self.process_index != jax.process_index():
      # What jaxlib's GPU client raises for a device of another process.
      raise RuntimeError("FAILED_PRECONDITION: GetAllocatorStats() is allowed only for "
                         "addressable devices")
    return {"bytes_limit": self._limit, "bytes_in_use": 0}


def test_capacity_is_read_from_a_device_of_this_process(monkeypatch):
  # On several hosts jax.devices() starts with process 0's devices: process 1 asked device 0's
  # allocator, could not, and planned with the table's 80 GB while process 0 planned with its
  # allocator's 60 GB, so the launcher's fit check could stop one process and start the rest.
  limit = 60e9
  devices = [_Gpu(0, limit), _Gpu(0, limit), _Gpu(1, limit), _Gpu(1, limit)]
  for process in (0, 1):
    monkeypatch.setattr(jax, "process_index", lambda: process)
    spec = plan.chip_for(devices)
    assert (spec.name, spec.hbm_bytes, spec.source) == ("H100", limit, "runtime"), process
