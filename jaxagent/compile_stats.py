"""How much of a run went into XLA compilation: a process-wide count from `jax.monitoring`.

Every distinct shape a jitted program sees is a separate compilation, and on a GPU a program
of the whole model (the generator's prefill / append at a new bucket, say) takes seconds to
compile. The trainer logs the compilations of each step (`compile/count`, `time/compile_s`,
and `eval/compile_s` for evals) so a slow step can be told apart from a slow program.
Compilations served from JAX's persistent cache (see `enable_persistent_cache`) are not
counted as compiles; they appear as `compile/cache_hits`. Each compilation is also counted
under its program's name (`jit(_append)`, say), so a run can say which programs keep compiling
(the trainer writes them to `compiles.jsonl`).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import threading

import jax

log = logging.getLogger(__name__)

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_CACHE_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"

_lock = threading.Lock()
_installed = False
_count = 0
_seconds = 0.0
_hits = 0
_by_name: dict[str, tuple[int, float]] = {}
# JAX times a persistent-cache load under the same event as a backend compile (both run inside
# `compile_or_get_cached`, on the calling thread): a cache hit marks this thread so that the
# duration that follows it is not counted as a compile.
_thread = threading.local()


@dataclasses.dataclass(frozen=True)
class CompileCounts:
  count: int = 0        # backend compilations
  seconds: float = 0.0  # their total wall time
  cache_hits: int = 0   # executables loaded from the persistent cache instead
  # program name -> (compilations, seconds); a difference keeps only names that compiled
  by_name: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)

  def __sub__(self, other: "CompileCounts") -> "CompileCounts":
    names = {}
    for name, (n, sec) in self.by_name.items():
      n0, sec0 = other.by_name.get(name, (0, 0.0))
      if n > n0:
        names[name] = (n - n0, sec - sec0)
    return CompileCounts(self.count - other.count, self.seconds - other.seconds,
                         self.cache_hits - other.cache_hits, names)

  def programs(self, top: int = 0) -> dict[str, dict[str, float]]:
    """{name: {"count", "seconds"}}, the slowest total first (the `top` slowest when > 0)."""
    items = sorted(self.by_name.items(), key=lambda kv: -kv[1][1])
    items = items[:top] if top > 0 else items
    return {name: {"count": n, "seconds": round(sec, 3)} for name, (n, sec) in items}


def _on_duration(event: str, duration: float, fun_name: str | None = None, **_) -> None:
  global _count, _seconds
  if event == _BACKEND_COMPILE:
    if getattr(_thread, "hit", False):  # an executable loaded from the cache, not compiled
      _thread.hit = False
      return
    with _lock:
      _count += 1
      _seconds += float(duration)
      name = str(fun_name) if fun_name else "?"
      n, sec = _by_name.get(name, (0, 0.0))
      _by_name[name] = (n + 1, sec + float(duration))


def _on_event(event: str, **_) -> None:
  global _hits
  if event == _CACHE_REQUEST:  # a new lookup: forget any earlier mark
    _thread.hit = False
  elif event == _CACHE_HIT:
    _thread.hit = True
    with _lock:
      _hits += 1


def install() -> None:
  """Start counting (idempotent; counts only compilations after the first call)."""
  global _installed
  with _lock:
    if _installed:
      return
    _installed = True
  jax.monitoring.register_event_duration_secs_listener(_on_duration)
  jax.monitoring.register_event_listener(_on_event)


def snapshot() -> CompileCounts:
  """Compilations so far (since `install`)."""
  with _lock:
    return CompileCounts(_count, _seconds, _hits, dict(_by_name))


def default_cache_dir() -> pathlib.Path:
  """`$JAXAGENT_COMPILE_CACHE`, else `~/.cache/jaxagent/xla`."""
  env = os.environ.get("JAXAGENT_COMPILE_CACHE")
  # (a ~ that no shell expanded, as in a quoted export or a container's env, named ./~/...)
  return (pathlib.Path(env).expanduser() if env
          else pathlib.Path.home() / ".cache" / "jaxagent" / "xla")


def enable_persistent_cache(spec: str = "auto") -> pathlib.Path | None:
  """Point JAX's persistent compilation cache at a directory, so a rerun, a resumed run or a
  second run of the same shapes loads its executables instead of compiling them again.

  `spec`: "auto" (the default directory on GPU / TPU backends; off on CPU, where compiles are
  quick and test processes are many), "on" (the default directory on any backend), "off", or a
  directory. Returns the directory in use, or None.
  """
  # A setting in another case or with spaces (--compile_cache=OFF, 'auto ') was a directory:
  # OFF turned the cache on, in ./OFF.
  if spec is not None and str(spec).strip().lower() in ("off", "auto", "on", ""):
    spec = str(spec).strip().lower()
  if spec in ("off", "", None):
    return None
  if spec == "auto" and jax.default_backend() == "cpu":
    return None
  path = "~/.cache/jaxagent/xla" if spec in ("auto", "on") else spec  # (named in the warning)
  try:
    # (no home directory, as for a container user without HOME or a passwd entry: Path.home
    # raised "RuntimeError: Could not determine home directory." and the launch failed)
    path = (default_cache_dir() if spec in ("auto", "on")
            else pathlib.Path(spec).expanduser())
    path.mkdir(parents=True, exist_ok=True)
  except (OSError, RuntimeError) as e:  # a read-only home, say: run without the cache
    log.warning("persistent compilation cache disabled: cannot create %s (%s)", path, e)
    return None
  jax.config.update("jax_compilation_cache_dir", str(path))
  # Cache every program that took a second or more to compile (JAX's default threshold).
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  return path
