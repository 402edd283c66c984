"""Math answer equivalence through math-verify, with a time limit the caller can rely on.

Sits in `rewards/` between a rollout's extracted answer and the outcome reward: the math
environments call `math_equal(extract_answer(response), gold)`.

math-verify bounds its own work with `signal.alarm`, which only works on the main thread, so
here its timeouts are off (`parsing_timeout=None`, `timeout_seconds=None`) and the limit is
enforced from outside by one of two backends (`MathVerifyConfig.backend`):

* ``"process"`` (default on POSIX): a small pool of long-lived worker processes. A request that
  runs past its limit gets its worker killed (SIGKILL) and replaced, so an input that hangs
  math-verify, such as ``(x+1)^{5000}``, costs the caller the timeout and leaves nothing running.
  (Input that is no realistic answer and known to be costly, such as ``10^{10^{10}}`` or
  ``"(" * 2000``, is refused before math-verify sees it: `_math_text._too_costly`.) Each worker
  also caps its address space and arms a kernel alarm per request that ends it if the parent is
  gone. Costs, measured on a 2-core CPU host: under a second to start a worker (not counted
  against a call's limit; bounded by `startup_timeout_s`), about 60 MB resident per started
  worker, and a 0.1 ms pipe round trip per call.
* ``"thread"``: each call runs on a daemon thread and the caller waits at most the timeout. No
  subprocesses, but an abandoned call keeps running (and holding a core) until it finishes, and
  a computation that never releases the GIL, such as sympy evaluating a huge integer power in C,
  blocks the caller too. Use it for trusted inputs, tests and notebooks.

Callers beyond `max_workers` wait for a free worker (up to `wait_timeout_s`) before their own
limit starts. Any failure (timeout, parse error, worker crash, busy pool) returns False and is
counted in `MathVerifier.stats()` so the trainer can log it. A worker that cannot start at all
is a setup error and raises.

How each side is read and compared lives in `_math_compare.py`, and the text rewrites done
before parsing in `_math_text.py`; worker processes load both by path, without importing the
`jaxagent` package (and so without JAX). This file holds the backends and the public API.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import math
import os
import queue
import select
import subprocess
import sys
import threading
import time
from typing import Any, Literal

from jaxagent.rewards import _math_compare, _math_text
from jaxagent.rewards._math_compare import _equal_inline, _silence_math_verify

logger = logging.getLogger(__name__)

Backend = Literal["process", "thread"]
_BACKENDS = ("process", "thread")


@dataclasses.dataclass(frozen=True)
class MathVerifyConfig:
  """How answers are compared and how the time limit is enforced.

  Attributes:
    timeout_s: default limit per comparison (parse both sides + verify), in seconds.
    backend: "process" (hard limit, killed on timeout) or "thread" (soft limit); see module doc.
    max_workers: concurrent comparisons (processes or threads); started lazily.
    startup_timeout_s: how long a fresh worker process may take to import math-verify.
    wait_timeout_s: how long a call may wait for a free worker when more callers than
      `max_workers` compare at once (a trainer scoring on several threads); the call's own
      `timeout_s` starts once it has one, so a correct answer is not scored 0 because others
      were slow. Past it the call returns False, counted as "busy". A process worker frees up
      within a call's limit, so "busy" means that callers queued longer than this (raise
      `max_workers`) or, with the thread backend, that abandoned calls which never finish hold
      every slot.
    worker_memory_mb: address-space cap per worker process (0 disables it).
    float_rounding, numeric_precision, strict: passed to `math_verify.verify`.
  """

  timeout_s: float = 5.0
  backend: Backend = "process" if os.name == "posix" else "thread"
  max_workers: int = 4
  startup_timeout_s: float = 60.0
  wait_timeout_s: float = 300.0
  worker_memory_mb: int = 4096
  float_rounding: int = 6
  numeric_precision: int = 15
  strict: bool = True

  def __post_init__(self):
    if self.backend not in _BACKENDS:
      raise ValueError(f"MathVerifyConfig.backend must be one of {_BACKENDS}, got {self.backend!r}")
    if self.backend == "process" and os.name != "posix":
      raise ValueError("MathVerifyConfig.backend='process' needs a POSIX system; use backend='thread'")
    _check_timeout("MathVerifyConfig.timeout_s", self.timeout_s)
    _check_timeout("MathVerifyConfig.startup_timeout_s", self.startup_timeout_s)
    _check_timeout("MathVerifyConfig.wait_timeout_s", self.wait_timeout_s)
    # (a bool is an int to isinstance: max_workers=True ran one worker)
    def is_int(v) -> bool:
      return isinstance(v, int) and not isinstance(v, bool)
    if not is_int(self.max_workers) or self.max_workers < 1:
      raise ValueError(f"MathVerifyConfig.max_workers must be an int >= 1, got {self.max_workers!r}")
    if not is_int(self.worker_memory_mb) or self.worker_memory_mb < 0:
      raise ValueError(
          f"MathVerifyConfig.worker_memory_mb must be an int >= 0 (0 = no cap), got {self.worker_memory_mb!r}")
    if not is_int(self.float_rounding) or self.float_rounding < 0:
      raise ValueError(f"MathVerifyConfig.float_rounding must be an int >= 0, got {self.float_rounding!r}")
    if not is_int(self.numeric_precision) or self.numeric_precision < 1:
      raise ValueError(f"MathVerifyConfig.numeric_precision must be an int >= 1, got {self.numeric_precision!r}")
    if not isinstance(self.strict, bool):
      # ("no" or "false" is true: math-verify compared strictly where the setting said not to)
      raise ValueError(f"MathVerifyConfig.strict must be True or False, got {self.strict!r}")

  def verify_options(self) -> dict[str, Any]:
    return {"float_rounding": self.float_rounding, "numeric_precision": self.numeric_precision,
            "strict": self.strict}


def _check_timeout(name: str, value: float) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
    raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")


# ----------------------------------------------------------------------------------------------
# Process backend.

# A worker process loads `_math_text.py` and `_math_compare.py` by path and runs the latter's
# `_serve`. `_math_text` goes into `sys.modules` under its package name first, so the import of
# it in `_math_compare` finds it there without importing the `jaxagent` package.
_WORKER_BOOT = (
    "import importlib.util, sys\n"
    "for name, path in (('jaxagent.rewards._math_text', sys.argv[1]),\n"
    "                   ('_jaxagent_math_worker', sys.argv[2])):\n"
    "  spec = importlib.util.spec_from_file_location(name, path)\n"
    "  mod = importlib.util.module_from_spec(spec)\n"
    "  sys.modules[spec.name] = mod\n"
    "  spec.loader.exec_module(mod)\n"
    "mod._serve(sys.argv[3])\n"
)
# A worker ends itself (SIGALRM, default action) this long past a request's limit, in case the
# parent died and nobody is left to kill it.
_WATCHDOG_GRACE_S = 5


class _WorkerGone(Exception):
  pass


class _ProcessWorker:
  """One worker process and its pipes; used by one caller at a time."""

  def __init__(self, options: dict[str, Any], startup_timeout_s: float):
    self._options = options
    self._startup_timeout_s = startup_timeout_s
    self._proc: subprocess.Popen | None = None
    self._buf = bytearray()
    self._ready = False

  def start(self) -> None:
    """Starts the process without waiting for it to import math-verify."""
    self._buf = bytearray()
    self._ready = False
    self._proc = subprocess.Popen(
        [sys.executable, "-c", _WORKER_BOOT, os.path.abspath(_math_text.__file__),
         os.path.abspath(_math_compare.__file__), json.dumps(self._options)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, close_fds=True)

  def _ensure_ready(self) -> None:
    if self._proc is None or self._proc.poll() is not None:
      self.start()
    if self._ready:
      return
    try:
      msg = self._read(time.monotonic() + self._startup_timeout_s)
    except _WorkerGone as e:
      self.kill()
      raise RuntimeError(f"math-verify worker exited during startup: {e}") from None
    if msg is None or not msg.get("ready"):
      self.kill()
      why = "timed out" if msg is None else msg.get("error")
      raise RuntimeError(
          f"math-verify worker failed to start ({why}); check that math-verify is installed for "
          f"{sys.executable}, or raise MathVerifyConfig.startup_timeout_s")
    self._ready = True

  def compare(self, prediction: str, gold: str, timeout_s: float) -> dict | None:
    """The worker's reply, or None if it ran past `timeout_s` (the worker is then restarted)."""
    self._ensure_ready()
    deadline = time.monotonic() + timeout_s
    request = {"prediction": prediction, "gold": gold,
               "watchdog_s": math.ceil(timeout_s) + _WATCHDOG_GRACE_S}
    try:
      data = (json.dumps(request) + "\n").encode()
      view = memoryview(data)
      while view:
        view = view[os.write(self._proc.stdin.fileno(), view):]
      reply = self._read(deadline)
    except (_WorkerGone, BrokenPipeError) as e:
      self.kill()
      self.start()
      return {"equal": False, "error": f"worker died: {e}", "restarted": True}
    if reply is None:
      self.kill()
      self.start()  # the replacement imports while callers do other work
    return reply

  def _read(self, deadline: float) -> dict | None:
    fd = self._proc.stdout.fileno()
    poller = select.poll()  # not select.select: a busy trainer may hold more than 1024 fds
    poller.register(fd, select.POLLIN)
    while b"\n" not in self._buf:
      remaining = deadline - time.monotonic()
      if remaining <= 0 or not poller.poll(math.ceil(remaining * 1000)):
        return None
      chunk = os.read(fd, 65536)
      if not chunk:
        raise _WorkerGone(f"exit code {self._proc.wait()}")
      self._buf += chunk
    line, _, rest = bytes(self._buf).partition(b"\n")
    self._buf = bytearray(rest)
    return json.loads(line)

  def kill(self) -> None:
    if self._proc is not None:
      if self._proc.poll() is None:
        self._proc.kill()
      self._proc.wait()
      for pipe in (self._proc.stdin, self._proc.stdout):
        if pipe is not None:
          pipe.close()
      self._proc = None
    self._ready = False


# ----------------------------------------------------------------------------------------------
# The verifier.


class MathVerifier:
  """Thread-safe math equivalence with a per-call time limit; see the module docstring."""

  def __init__(self, config: MathVerifyConfig | None = None):
    config = MathVerifyConfig() if config is None else config
    self.config = config
    self._lock = threading.Lock()
    self._stats = {"calls": 0, "equal": 0, "unequal": 0, "timeouts": 0, "errors": 0, "busy": 0,
                   "restarts": 0}
    self._closed = False
    if config.backend == "process":
      options = dict(config.verify_options(), memory_mb=config.worker_memory_mb)
      self._idle: queue.LifoQueue[_ProcessWorker] = queue.LifoQueue()
      self._workers = [_ProcessWorker(options, config.startup_timeout_s) for _ in range(config.max_workers)]
      for w in self._workers:
        self._idle.put(w)
    else:
      import math_verify  # noqa: F401  (import now, not inside the first call's time limit)
      _silence_math_verify()
      self._slots = threading.BoundedSemaphore(config.max_workers)

  def __call__(self, prediction: str, gold: str, *, timeout_s: float | None = None) -> bool:
    return self.equal(prediction, gold, timeout_s=timeout_s)

  def equal(self, prediction: str, gold: str, *, timeout_s: float | None = None) -> bool:
    """Whether `prediction` is mathematically equivalent to `gold`; False on any failure."""
    timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
    _check_timeout("timeout_s", timeout_s)
    if not isinstance(prediction, str) or not isinstance(gold, str):
      raise TypeError(f"math_equal compares strings, got {type(prediction).__name__} and {type(gold).__name__}")
    if self._closed:
      raise RuntimeError("MathVerifier is closed")
    if self.config.backend == "process":
      outcome = self._equal_process(prediction, gold, timeout_s)
    else:
      outcome = self._equal_thread(prediction, gold, timeout_s)
    with self._lock:
      self._stats["calls"] += 1
      self._stats[outcome] += 1
    return outcome == "equal"

  def stats(self) -> dict[str, int]:
    """Counts since construction.

    calls = equal + unequal + timeouts + errors + busy (no free worker within
    `MathVerifyConfig.wait_timeout_s`);
    restarts counts worker processes replaced after a timeout or crash.
    """
    with self._lock:
      return dict(self._stats)

  def _equal_process(self, prediction: str, gold: str, timeout_s: float) -> str:
    # The wait for a worker is not part of `timeout_s` (`MathVerifyConfig.wait_timeout_s`);
    # `compare` starts the answer's clock.
    try:
      worker = self._idle.get(timeout=self.config.wait_timeout_s)
    except queue.Empty:
      return "busy"
    try:
      reply = worker.compare(prediction, gold, timeout_s)
    finally:
      self._idle.put(worker)
    if reply is None:
      with self._lock:
        self._stats["restarts"] += 1
      return "timeouts"
    if reply.get("restarted"):
      with self._lock:
        self._stats["restarts"] += 1
    if "error" in reply:
      logger.debug("math-verify error on %r vs %r: %s", prediction[:200], gold[:200], reply["error"])
      return "errors"
    return "equal" if reply["equal"] else "unequal"

  def _equal_thread(self, prediction: str, gold: str, timeout_s: float) -> str:
    if not self._slots.acquire(timeout=self.config.wait_timeout_s):
      return "busy"
    deadline = time.monotonic() + timeout_s  # the wait for a slot is not part of the limit
    box: dict[str, Any] = {}
    done = threading.Event()
    options = self.config.verify_options()

    def run():
      try:
        box["equal"] = _equal_inline(prediction, gold, **options)
      except BaseException as e:  # noqa: BLE001
        box["error"] = e
      finally:
        self._slots.release()
        done.set()

    threading.Thread(target=run, name="math-verify", daemon=True).start()
    if not done.wait(max(deadline - time.monotonic(), 0.0)):
      return "timeouts"
    if "error" in box:
      logger.debug("math-verify error on %r vs %r: %r", prediction[:200], gold[:200], box["error"])
      return "errors"
    return "equal" if box["equal"] else "unequal"

  def close(self) -> None:
    """Stops worker processes (threads of abandoned calls end on their own)."""
    self._closed = True
    if self.config.backend == "process":
      for w in self._workers:
        w.kill()

  def __enter__(self) -> MathVerifier:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


_default_lock = threading.Lock()
_default: MathVerifier | None = None


def default_verifier() -> MathVerifier:
  """The verifier that `math_equal` uses: default `MathVerifyConfig`, created on first use."""
  global _default
  with _default_lock:
    if _default is None:
      _default = MathVerifier(MathVerifyConfig())
      atexit.register(_default.close)
    return _default


def default_stats() -> dict[str, int] | None:
  """`stats()` of the verifier that `math_equal` uses, or None while nothing has started it."""
  with _default_lock:
    verifier = _default
  return None if verifier is None else verifier.stats()


def math_equal(prediction: str, gold: str, *, timeout_s: float = 5.0) -> bool:
  """Whether `prediction` equals `gold` as math (math-verify); False on timeout or any error.

  Handles numbers ("42" = "42.0", "1,000" = "1000", "$5" = "5 dollars" = "5", "12.5%" = "12.5",
  "1e3" = "1000", markdown code "`5`" = "5", a whole answer in words "forty-two" = "42"),
  fractions and LaTeX ("0.5" = "\\frac{1}{2}", "\\boxed{3}" = "3", "\\pi \\approx 3.14" = "3.14"),
  sets and intervals ("\\{1,2\\}" = "\\{2,1\\}", "[1,2)"). A prediction
  naming two different values ("5 or 6", "5 = 6", "The answer is 5. Alternatively, 6.") equals
  neither (one that rules a value out right after its answer, "5, not 6", names 5), but equals a
  gold that is the set of them ("The roots are 2 and 3." = "2, 3"); one that corrects a marked
  answer ("The answer is 5. Wait, no, it is 6.") equals the correction, and one that rules out its
  only number ("It is not 5.") or takes its answer back ("The answer is 5. Wait, no.", "The
  answer is 5, which is wrong.") equals nothing. A sentence ending "18!" states 18; a bare "5!"
  and "$5!$" are factorials, and "5!!" is the double factorial 15; one of an expression,
  "(2n-1)!!", equals the same double factorial but no factorial of a factorial ("((2n-1)!)!",
  which math-verify would take it for) and no closed form. Returns within about
  `timeout_s` (plus a one-time worker start, and any wait for a free worker while more callers
  than its workers compare at once).
  """
  return default_verifier().equal(prediction, gold, timeout_s=timeout_s)
