"""Compile accounting and the persistent compilation cache switch."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxagent import compile_stats


def test_counts_backend_compiles():
  compile_stats.install()
  compile_stats.install()  # idempotent: one listener, counted once
  a, b = np.ones((7, 3), np.float32), np.ones((5, 3), np.float32)  # host arrays: no compile
  before = compile_stats.snapshot()
  f = jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)
  f(a)
  f(a)                     # cached in-process: no new compile
  mid = compile_stats.snapshot() - before
  f(b)                     # a new shape compiles again
  after = compile_stats.snapshot() - before
  assert mid.count == 1 and mid.seconds > 0
  assert after.count == 2 and after.seconds >= mid.seconds
  # Per program: this lambda's two compilations, nothing from before the first snapshot.
  assert after.by_name == {"jit(<lambda>)": (2, after.by_name["jit(<lambda>)"][1])}
  assert after.programs() == {"jit(<lambda>)": {"count": 2, "seconds": round(
      after.by_name["jit(<lambda>)"][1], 3)}}


def test_persistent_cache_switch(tmp_path, monkeypatch):
  old = jax.config.jax_compilation_cache_dir
  try:
    assert compile_stats.enable_persistent_cache("off") is None
    assert compile_stats.enable_persistent_cache("auto") is None  # CPU: off
    monkeypatch.setenv("JAXAGENT_COMPILE_CACHE", str(tmp_path / "env"))
    assert compile_stats.enable_persistent_cache("on") == tmp_path / "env"
    got = compile_stats.enable_persistent_cache(str(tmp_path / "c"))
    assert got == tmp_path / "c" and got.is_dir()
    assert jax.config.jax_compilation_cache_dir == str(got)
    # Another case or spaces: taken for a directory (OFF turned the cache on, in ./OFF).
    monkeypatch.chdir(tmp_path)
    assert compile_stats.enable_persistent_cache("OFF") is None
    assert compile_stats.enable_persistent_cache(" Auto ") is None  # CPU: off
    assert compile_stats.enable_persistent_cache("On") == tmp_path / "env"
    assert not any(p.name.strip().lower() in ("off", "auto", "on") for p in tmp_path.iterdir())
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert compile_stats.enable_persistent_cache(str(blocker / "sub")) is None  # warns, no raise
    # No home directory (a container user without HOME or a passwd entry): Path.home raised
    # "RuntimeError: Could not determine home directory." out of the launch.
    monkeypatch.delenv("JAXAGENT_COMPILE_CACHE")
    before = jax.config.jax_compilation_cache_dir
    def no_home(*_):
      raise RuntimeError("Could not determine home directory.")
    monkeypatch.setattr(compile_stats.pathlib.Path, "home", classmethod(no_home))
    monkeypatch.setattr(compile_stats.pathlib.Path, "expanduser", no_home)
    assert compile_stats.enable_persistent_cache("on") is None
    assert compile_stats.enable_persistent_cache("~/xla") is None
    assert jax.config.jax_compilation_cache_dir == before
  finally:
    jax.config.update("jax_compilation_cache_dir", old)
    # The cache initialises once per process: forget this test's directory for later tests.
    from jax.experimental.compilation_cache import compilation_cache
    compilation_cache.reset_cache()


def test_a_cache_directory_from_the_environment_expands_its_tilde(tmp_path, monkeypatch):
  """JAXAGENT_COMPILE_CACHE='~/xla' (quoted in a shell, or set in a container's env, where no
  shell expands it) made the cache ./~/xla under the current directory."""
  old = jax.config.jax_compilation_cache_dir
  try:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("JAXAGENT_COMPILE_CACHE", "~/xla")
    monkeypatch.chdir(tmp_path)
    assert compile_stats.default_cache_dir() == tmp_path / "home" / "xla"
    assert compile_stats.enable_persistent_cache("on") == tmp_path / "home" / "xla"
    assert (tmp_path / "home" / "xla").is_dir() and not (tmp_path / "~").exists()
  finally:
    jax.config.update("jax_compilation_cache_dir", old)
    from jax.experimental.compilation_cache import compilation_cache
    compilation_cache.reset_cache()


def test_persistent_cache_hit_is_not_a_compile(tmp_path):
  """A program loaded from the persistent cache counts as a cache hit only (JAX times the load
  under the same event as a backend compile)."""
  from jax.experimental.compilation_cache import compilation_cache
  compile_stats.install()
  keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
          "jax_persistent_cache_min_entry_size_bytes")
  old = {k: getattr(jax.config, k) for k in keys}
  try:
    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    x = np.ones((13, 5), np.float32)
    before = compile_stats.snapshot()
    jax.jit(lambda v: jnp.cos(v) * 7.0 - 2.0)(x).block_until_ready()
    first = compile_stats.snapshot() - before
    jax.clear_caches()  # forget the in-process executable: the next call reads the cache
    jax.jit(lambda v: jnp.cos(v) * 7.0 - 2.0)(x).block_until_ready()
    second = compile_stats.snapshot() - before - first
    assert (first.count, first.cache_hits) == (1, 0)
    assert (second.count, second.cache_hits, second.by_name) == (0, 1, {})
    jax.jit(lambda v: jnp.sin(v) + 5.0)(x).block_until_ready()  # a new program still counts
    third = compile_stats.snapshot() - before - first
    assert (third.count, third.cache_hits) == (1, 1)
  finally:
    for k, v in old.items():
      jax.config.update(k, v)
    compilation_cache.reset_cache()
