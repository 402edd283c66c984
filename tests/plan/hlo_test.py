"""Loop-aware HLO accounting against hand counts and against XLA's own analysis (CPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxagent.plan import hlo

# A TPU-style module: the loop has no known_trip_count annotation, only `i < 7` in its
# condition; the body holds one 8x8x8 matmul and an all-reduce within pairs {0,1}, {2,3}.
_HANDWRITTEN = """
HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%cond (p: (s32[], f32[8,8])) -> pred[] {
  %p = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (q: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %q = (s32[], f32[8,8]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%q), index=0
  %x.1 = f32[8,8]{1,0} get-tuple-element(%q), index=1
  %d = f32[8,8]{1,0} dot(%x.1, %x.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ar = f32[8,8]{1,0} all-reduce(%d), channel_id=1, replica_groups={{0,1},{2,3}}, use_global_device_ids=true, to_apply=%add
  %one = s32[] constant(1)
  %i.2 = s32[] add(%i.1, %one)
  ROOT %t = (s32[], f32[8,8]{1,0}) tuple(%i.2, %ar)
}

ENTRY %main (a: f32[8,8]) -> f32[8,8] {
  %a = f32[8,8]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,8]{1,0}) tuple(%zero, %a)
  %w = (s32[], f32[8,8]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[8,8]{1,0} get-tuple-element(%w), index=1
}
"""


def test_trip_count_from_loop_condition_weighs_body():
  st = hlo.analyze(_HANDWRITTEN, (2, 2), ("data", "tensor"))
  assert st.loops == 1 and st.unknown_loops == 0 and st.max_trip_count == 7
  assert st.flops == 7 * 2 * 8 * 8 * 8
  ar = st.collectives["all-reduce"]
  assert (ar.static, ar.executed) == (1, 7)
  assert ar.axes == {"tensor": 7}           # pairs {0,1}, {2,3} differ in the second mesh axis
  assert ar.bytes == 7 * 8 * 8 * 4
  assert "all-reduce 7x (tensor: 7)" in st.summary()


def test_gpu_library_gemm_calls_count():
  text = """
HloModule g

ENTRY %main (a: bf16[64,128], b: bf16[128,32]) -> bf16[64,32] {
  %a = bf16[64,128]{1,0} parameter(0)
  %b = bf16[128,32]{1,0} parameter(1)
  %g = (bf16[64,32]{1,0}, s8[1024]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %r = bf16[64,32]{1,0} get-tuple-element(%g), index=0
}
"""
  assert hlo.analyze(text).flops == 2 * 64 * 128 * 32


def _scan_matmuls(n):
  def f(x, ws):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
  return jax.jit(f).lower(jax.ShapeDtypeStruct((32, 64), jnp.float32),
                          jax.ShapeDtypeStruct((n, 64, 64), jnp.float32)).compile()


def test_scan_flops_scale_with_trip_count_where_xla_counts_body_once():
  one, five = _scan_matmuls(1), _scan_matmuls(5)
  per_layer = 2 * 32 * 64 * 64
  s1, s5 = hlo.analyze(one.as_text()), hlo.analyze(five.as_text())
  assert s1.flops == per_layer
  assert s5.flops == 5 * per_layer
  # Why this module exists: XLA's cost analysis counts the loop body once.
  xla = lambda c: (c.cost_analysis()[0] if isinstance(c.cost_analysis(), list)
                   else c.cost_analysis())["flops"]
  assert xla(five) < 2 * per_layer < s5.flops
  # HBM traffic: each layer reads its own 64x64 slice of the stacked weights, not all of them.
  assert s5.bytes_accessed > s1.bytes_accessed
  assert s5.bytes_accessed < 5 * (s1.bytes_accessed + 5 * 64 * 64 * 4)


def test_loop_free_bytes_and_flops_agree_with_xla():
  def f(a, b, c):
    return jax.nn.relu(a @ b) @ c
  shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((128, 256), (256, 512), (512, 64))]
  compiled = jax.jit(f).lower(*shapes).compile()
  st = hlo.analyze(compiled.as_text())
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, list) else ca
  assert st.flops == 2 * 128 * 256 * 512 + 2 * 128 * 512 * 64
  assert st.flops <= ca["flops"] <= 1.05 * st.flops      # XLA adds the elementwise relu
  assert 0.5 * ca["bytes accessed"] <= st.bytes_accessed <= 2.0 * ca["bytes accessed"]


def test_collectives_are_attributed_to_mesh_axes():
  devices = np.asarray(jax.devices()[:8]).reshape(2, 4)
  mesh = Mesh(devices, ("data", "tensor"))
  x_sh = NamedSharding(mesh, P("data", "tensor"))
  w_sh = NamedSharding(mesh, P("tensor", None))
  # Contracting over the tensor-sharded dim needs a reduction over `tensor`; the replicated
  # result then needs the rows from every `data` shard.
  f = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(mesh, P()))
  compiled = f.lower(jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=x_sh),
                     jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=w_sh)).compile()
  st = hlo.analyze(compiled.as_text(), mesh.devices.shape, mesh.axis_names)
  spanned = {ax for c in st.collectives.values() for ax in c.axes}
  assert any("tensor" in a for a in spanned), st.summary()
  assert any("data" in a for a in spanned), st.summary()
  assert st.flops == 2 * 8 * 16 * 32      # each chip: its 8 rows x its 16 of the 64 columns


@pytest.mark.parametrize("attrs, groups", [
    ("replica_groups={{0,1},{2,3}}", [[0, 1], [2, 3]]),
    ("replica_groups=[2,2]<=[4]", [[0, 1], [2, 3]]),
    ("replica_groups=[2,2]<=[2,2]T(1,0)", [[0, 2], [1, 3]]),
    ("source_target_pairs={{0,1},{1,0}}", [[0, 1], [1, 0]]),
    ("replica_groups={}", None),
])
def test_device_group_formats(attrs, groups):
  assert hlo._parse_groups(attrs) == groups


def test_axes_of_groups():
  assert hlo._axes([[0, 2], [1, 3]], (2, 2), ("data", "tensor")) == "data"
  assert hlo._axes(None, (2, 2), ("data", "tensor")) == "data+tensor"
  assert hlo._axes([[0, 1]], None, None) == "?"


def test_rejects_text_that_is_not_hlo():
  with pytest.raises(ValueError, match="ENTRY"):
    hlo.analyze("not an HLO module")


def test_in_place_scatter_counts_its_updates_not_the_buffer():
  # A KV-cache write: one row per slot scattered into a donated [slots, len, d] cache.
  def write(cache, rows, pos):
    return cache.at[jnp.arange(cache.shape[0]), pos].set(rows)
  cache = jax.ShapeDtypeStruct((64, 4096, 128), jnp.float32)
  rows = jax.ShapeDtypeStruct((64, 128), jnp.float32)
  pos = jax.ShapeDtypeStruct((64,), jnp.int32)
  compiled = jax.jit(write, donate_argnums=0).lower(cache, rows, pos).compile()
  assert "scatter" in compiled.as_text()
  st = hlo.analyze(compiled.as_text())
  cache_bytes = 64 * 4096 * 128 * 4
  assert st.bytes_accessed < 0.01 * cache_bytes  # reads and writes the rows, not the cache


@pytest.mark.parametrize("attrs, axes", [
    # Printed by the TPU compiler (libtpu, v5e:2x2 / v5e:2x4) for a sum over one mesh axis of
    # an array sharded P("data", "tensor") (2 x 2) or over a (2, 2, 2) data x fsdp x tensor mesh.
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}, use_global_device_ids=true",
     "data"),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_1'}, use_global_device_ids=true",
     "tensor"),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, to_apply=%add", "data+tensor"),
])
def test_mesh_axes_replica_groups_on_a_2x2_mesh(attrs, axes):
  assert hlo._axes(hlo._parse_groups(attrs), (2, 2), ("data", "tensor")) == axes


@pytest.mark.parametrize("attrs, groups, axes", [
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], device_ids=([2,2,2]T(1,0,2)) "
     "{'axis_0'}, use_global_device_ids=true", [[0, 2], [1, 3], [4, 6], [5, 7]], "fsdp"),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], device_ids=([4,2]T(1,0)) "
     "{'axis_0'}, use_global_device_ids=true", [[0, 1], [2, 3], [4, 5], [6, 7]], "tensor"),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0'}, "
     "use_global_device_ids=true", [[0, 1, 4, 5], [2, 3, 6, 7]], "data+tensor"),
    # A sub-axis: the middle factor 2 of an axis of 8 (2 above it).
    ("replica_groups=mesh['a'=8] {'a':(2)2}, to_apply=%add", [[0, 2], [1, 3], [4, 6], [5, 7]],
     "fsdp"),
])
def test_mesh_axes_replica_groups_with_device_ids(attrs, groups, axes):
  assert hlo._parse_groups(attrs) == groups
  assert hlo._axes(groups, (2, 2, 2), ("data", "fsdp", "tensor")) == axes


# Two nested loops (3 x 5, the inner one inside a `call`), an async all-gather in the inner
# body and an async all-reduce in the outer one, and a reduce-scatter run through
# async-start / async-done of a wrapped computation (the done naming it too, as the TPU
# compiler prints some).
_NESTED = """
HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%icond (p: (s32[], f32[8,8])) -> pred[] {
  %p = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%ibody (q: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %q = (s32[], f32[8,8]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%q), index=0
  %x.1 = f32[8,8]{1,0} get-tuple-element(%q), index=1
  %ags = (f32[8,2]{1,0}, f32[8,8]{1,0}) all-gather-start(%x.1), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={1}, use_global_device_ids=true
  %agd = f32[8,8]{1,0} all-gather-done(%ags)
  %d = f32[8,8]{1,0} dot(%agd, %x.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %one = s32[] constant(1)
  %i.2 = s32[] add(%i.1, %one)
  ROOT %t = (s32[], f32[8,8]{1,0}) tuple(%i.2, %d)
}

%inner (z: f32[8,8]) -> f32[8,8] {
  %z = f32[8,8]{1,0} parameter(0)
  %zero.1 = s32[] constant(0)
  %init.1 = (s32[], f32[8,8]{1,0}) tuple(%zero.1, %z)
  %w.1 = (s32[], f32[8,8]{1,0}) while(%init.1), condition=%icond, body=%ibody
  ROOT %r.1 = f32[8,8]{1,0} get-tuple-element(%w.1), index=1
}

%ocond (p2: (s32[], f32[8,8])) -> pred[] {
  %p2 = (s32[], f32[8,8]{1,0}) parameter(0)
  %i3 = s32[] get-tuple-element(%p2), index=0
  %n3 = s32[] constant(3)
  ROOT %lt3 = pred[] compare(%i3, %n3), direction=LT
}

%obody (q2: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %q2 = (s32[], f32[8,8]{1,0}) parameter(0)
  %i4 = s32[] get-tuple-element(%q2), index=0
  %x4 = f32[8,8]{1,0} get-tuple-element(%q2), index=1
  %c4 = f32[8,8]{1,0} call(%x4), to_apply=%inner
  %ars = f32[8,8]{1,0} all-reduce-start(%c4), channel_id=1, replica_groups={{0,2},{1,3}}, use_global_device_ids=true, to_apply=%add
  %ard = f32[8,8]{1,0} all-reduce-done(%ars)
  %one4 = s32[] constant(1)
  %i5 = s32[] add(%i4, %one4)
  ROOT %t4 = (s32[], f32[8,8]{1,0}) tuple(%i5, %ard)
}

%wrapped_rs (wp: f32[8,8]) -> f32[2,8] {
  %wp = f32[8,8]{1,0} parameter(0)
  ROOT %rs = f32[2,8]{1,0} reduce-scatter(%wp), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true, to_apply=%add
}

ENTRY %main (a: f32[8,8]) -> f32[2,8] {
  %a = f32[8,8]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,8]{1,0}) tuple(%zero, %a)
  %w = (s32[], f32[8,8]{1,0}) while(%init), condition=%ocond, body=%obody
  %r = f32[8,8]{1,0} get-tuple-element(%w), index=1
  %st = ((f32[8,8]{1,0}), f32[2,8]{1,0}, u32[]) async-start(%r), calls=%wrapped_rs
  ROOT %dn = f32[2,8]{1,0} async-done(%st), calls=%wrapped_rs
}
"""


def test_nested_loops_calls_and_async_pairs_are_counted_once_per_execution():
  st = hlo.analyze(_NESTED, (2, 2), ("data", "tensor"))
  assert (st.loops, st.unknown_loops, st.max_trip_count) == (2, 0, 5)
  assert st.flops == 3 * 5 * 2 * 8 * 8 * 8
  c = st.collectives
  assert (c["all-gather"].static, c["all-gather"].executed) == (1, 15)
  assert c["all-gather"].bytes == 15 * 8 * 8 * 4          # the gathered result
  assert c["all-gather"].axes == {"data+tensor": 15}
  assert (c["all-reduce"].static, c["all-reduce"].executed) == (1, 3)
  assert c["all-reduce"].axes == {"data": 3}               # {0,2}, {1,3}: the first mesh axis
  # The wrapped reduce-scatter runs once: its async-start and async-done both name it.
  assert (c["reduce-scatter"].static, c["reduce-scatter"].executed) == (1, 1)
  assert c["reduce-scatter"].bytes == 8 * 8 * 4


def test_async_wrapped_collective_traffic_is_counted_once():
  text = """
HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%wrapped_rs (wp: f32[8,8]) -> f32[2,8] {
  %wp = f32[8,8]{1,0} parameter(0)
  ROOT %rs = f32[2,8]{1,0} reduce-scatter(%wp), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true, to_apply=%add
}

ENTRY %main (a: f32[8,8]) -> f32[2,8] {
  %a = f32[8,8]{1,0} parameter(0)
  %st = ((f32[8,8]{1,0}), f32[2,8]{1,0}, u32[]) async-start(%a), calls=%wrapped_rs
  ROOT %dn = f32[2,8]{1,0} async-done(%st)
}
"""
  st = hlo.analyze(text)
  assert st.collectives["reduce-scatter"].executed == 1
  assert st.bytes_accessed == 8 * 8 * 4 + 2 * 8 * 4         # reads its operand, writes its shard
