"""`benchmarks/decode_kernel.py`: the sweep spec and a CPU run in Pallas interpret mode."""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import decode_kernel


def test_parse_sweep_is_the_product_of_the_axes():
  got = decode_kernel.parse_sweep("block_k=16,32; num_warps=2,4,8")
  assert len(got) == 6
  assert {"block_k": 32, "num_warps": 8} in got
  assert decode_kernel.parse_sweep("") == [{}]


def test_interpret_run_prints_one_line_per_setting(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", [
      "decode_kernel.py", "--models", "smollm2-135m", "--batches", "2", "--layers", "1",
      "--cached", "32", "--iters", "1", "--interpret", "--sweep", "block_k=16,32"])
  decode_kernel.main()
  rows = [json.loads(line[len("RESULT "):]) for line in capsys.readouterr().out.splitlines()
          if line.startswith("RESULT ")]
  assert [r["bench"] for r in rows] == (["decode_kernel_read_ceiling", "decode_kernel_ceiling"]
                                        + ["decode_kernel"] * 2)
  assert [r["launch"] for r in rows[2:]] == [{"block_k": 16}, {"block_k": 32}]
  assert all("error" not in r and r["us_per_layer"] > 0 for r in rows)


def test_read_ceiling_sums_the_live_blocks_and_adds_the_chained_row():
  """Whole blocks of 16 rows up to each slot's length, as the decode kernel reads them."""
  k = jax.random.normal(jax.random.key(0), (3, 2, 64, 8), jnp.float32)
  v = jax.random.normal(jax.random.key(1), (3, 2, 64, 8), jnp.float32)
  lens = jnp.array([0, 17, 64], jnp.int32)
  dep = jax.random.normal(jax.random.key(2), (3, 2, 8), jnp.float32)
  got = decode_kernel.read_ceiling(dep, k, v, lens, block_k=16, num_warps=1, num_stages=2,
                                   interpret=True)
  read = -(-lens // 16) * 16  # 0, 32, 64
  live = (jnp.arange(64)[None, :] < read[:, None])[:, None, :, None]
  want = jnp.where(live, k + v, 0).sum(axis=2) + dep[0, 0]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # tens of seconds on a 2-core CPU (the default run's time budget)
def test_rows_and_warps_as_given(monkeypatch, capsys):
  """`--rows` sets the query rows per KV head (an append's); `--warps-as-given` launches the
  sweep's warps without the warp-per-2048-entries rule (64 rows x 64 lanes: 2 warps by it)."""
  from jaxagent.models import decode_attention
  monkeypatch.setattr(decode_attention, "_warps_for_tile", decode_attention._warps_for_tile)
  seen = []
  params = decode_attention._compiler_params

  def record(interpret, num_warps, num_stages):
    seen.append(num_warps)
    return params(interpret, num_warps, num_stages)
  monkeypatch.setattr(decode_attention, "_compiler_params", record)
  for extra, want in (([], 2), (["--warps-as-given"], 1)):
    jax.clear_caches()  # launch settings are read when the kernel call is traced
    seen.clear()
    monkeypatch.setattr(sys, "argv", [
        "decode_kernel.py", "--models", "smollm2-135m", "--batches", "2", "--layers", "1",
        "--cached", "32", "--iters", "1", "--interpret", "--rows", "64",
        "--sweep", "num_warps=1", *extra])
    decode_kernel.main()
    rows = [json.loads(line[len("RESULT "):]) for line in capsys.readouterr().out.splitlines()
            if line.startswith("RESULT ")]
    assert rows[-1]["rows"] == 64 and rows[-1]["launch"] == {"num_warps": 1}
    assert seen[-1] == want, (extra, seen)


def test_trace_timer_reports_kernel_times(monkeypatch, capsys):
  """`--timer trace` adds each kernel's device time from the profiler and the bandwidth of a
  layer's bytes at that time; the kernel name searched is the launched kernel's."""
  patterns = []

  def fake(fn, pattern, iters):
    fn()
    patterns.append(pattern)
    return 50.0, iters
  monkeypatch.setattr(decode_kernel, "traced_kernel_us", fake)
  monkeypatch.setattr(sys, "argv", [
      "decode_kernel.py", "--models", "smollm2-135m", "--batches", "2", "--layers", "1",
      "--cached", "32", "--iters", "1", "--interpret", "--kernels", "read,write",
      "--timer", "trace"])
  decode_kernel.main()
  rows = [json.loads(line[len("RESULT "):]) for line in capsys.readouterr().out.splitlines()
          if line.startswith("RESULT ")]
  by = {(r["bench"], r.get("kernel")): r for r in rows}
  assert patterns == [r"^_read_kernel"] * 3 + [r"^_kernel", r"^_write_kernel"]
  for key in (("decode_kernel_read_ceiling", None), ("decode_kernel", "read"),
              ("decode_kernel", "write")):
    r = by[key]
    assert r["kernel_us"] == 50.0
    layer_bytes = r["bandwidth_tb_s"] * 1e12 * r["us_per_layer"] * 1e-6
    np.testing.assert_allclose(r["kernel_hbm_fraction"] * 50e-6 / layer_bytes,
                               r["hbm_fraction"] * r["us_per_layer"] * 1e-6 / layer_bytes,
                               rtol=1e-6)
  assert "kernel_us" not in by[("decode_kernel_ceiling", None)]


@pytest.mark.slow  # default-run time budget: 4-8 s
def test_trace_timer_on_a_cpu_reports_no_kernel_time(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", [
      "decode_kernel.py", "--models", "smollm2-135m", "--batches", "2", "--layers", "1",
      "--cached", "32", "--iters", "1", "--interpret", "--kernels", "write", "--timer",
      "trace"])
  decode_kernel.main()
  rows = [json.loads(line[len("RESULT "):]) for line in capsys.readouterr().out.splitlines()
          if line.startswith("RESULT ")]
  assert rows[-1]["bench"] == "decode_kernel" and rows[-1]["kernel_us"] is None


@pytest.mark.slow  # tens of seconds on a 2-core CPU (the default run's time budget)
def test_qkv_kernel_runs_as_the_engine_feeds_it(monkeypatch, capsys):
  """`--kernels qkv`: the raw-projection kernel with the stream's rows in front (chained) or
  apart (folded norms), for models with biases and with q / k norms."""
  for model, chained in (("smollm2-135m", "on"), ("qwen2.5-1.5b", "off"), ("qwen3-0.6b", "off")):
    monkeypatch.setattr(sys, "argv", [
        "decode_kernel.py", "--models", model, "--batches", "2", "--layers", "2",
        "--cached", "32", "--iters", "1", "--interpret", "--kernels", "qkv",
        "--chained", chained])
    decode_kernel.main()
    rows = [json.loads(line[len("RESULT "):]) for line in capsys.readouterr().out.splitlines()
            if line.startswith("RESULT ")]
    (r,) = [r for r in rows if r["bench"] == "decode_kernel"]
    assert "error" not in r and r["us_per_layer"] > 0 and r["chained"] == (chained == "on")


@pytest.mark.slow  # default-run time budget: 5-10 s; the kernel's q|k|v inputs stay in decode_attention_test
def test_qkv_inputs_are_what_the_kernel_takes():
  from jaxagent import models
  from jaxagent.models.decode_attention import flash_decode_write_qkv
  cfg = models.get_config("qwen2.5-1.5b", param_dtype="bfloat16", dtype="bfloat16")
  s, c = 2, 32
  lens = jnp.array([5, 17], jnp.int32)
  cache = jnp.zeros((s, cfg.n_kv_heads, c, cfg.head_dim), jnp.bfloat16)
  for chained in (True, False):
    qi = decode_kernel.qkv_inputs(cfg, s, lens, chained, jax.random.key(0))
    lead = cfg.d_model // cfg.head_dim if chained else 0
    assert qi["x"].shape == (s, lead + cfg.n_heads + 2 * cfg.n_kv_heads, cfg.head_dim)
    assert (qi["resid"] is None) == chained and qi["bias"] is not None
    assert qi["keep"].shape == (s, 2 * cfg.n_kv_heads, cfg.head_dim)
    out, ck, _ = flash_decode_write_qkv(qi["x"], qi["rope"], cache, cache, lens, qi["bias"],
                                        qi["qk_norm"], qi["resid"], resid_rows=lead,
                                        interpret=True)
    # Chained, the stream's rows lead the output unchanged.
    assert out.reshape(s, -1, cfg.head_dim).shape[1] == lead + cfg.n_heads
    if chained:
      np.testing.assert_array_equal(np.asarray(out[:, :lead]), np.asarray(qi["x"][:, :lead]))
    # The new key was written at each slot's length.
    assert bool(jnp.all(ck[0, :, 5] != 0)) and bool(jnp.all(ck[0, :, 6] == 0))
