"""Runs tool calls off the caller's thread, with per-call timeouts, and returns futures.

Where this sits: the rollout driver (`jaxagent.agent`) submits each parsed tool call here and
keeps decoding other trajectories while it runs (DESIGN decision 5: tools never stall the
device). Each call's future resolves to a `ToolResult`; a tool that raises, hangs past its
timeout, returns the wrong type or is called with bad arguments resolves to
`ToolResult(ok=False, error=...)`. Nothing a tool does raises in the caller.

Two execution paths, chosen per tool by its optional `execution` attribute:

* `"thread"` (default): the tool runs on a host thread. Python cannot kill a thread, so a call
  that overruns its timeout is *abandoned*: a watchdog resolves its future at the deadline with a
  timeout result, the stuck thread is left to finish (its late result is discarded), and a
  replacement thread keeps the pool at `max_workers` live threads while live and abandoned
  threads together number at most `max_workers + max_stuck_threads`. Past that no thread is
  started (a call that times out leaves its pool one thread smaller), and when abandoned threads
  hold every place, calls fail fast with an "executor saturated" error instead of waiting
  forever. Threads are daemons, so stuck ones do
  not block interpreter exit. Use this path for I/O-bound tools (search, sandboxed interpreters
  whose work happens in a child process).
* `"process"`: the tool and its arguments are pickled to a long-lived worker process (spawn
  start method: a fresh interpreter, not a fork of this one). On timeout the worker and its
  children are killed and replaced, so CPU-bound pure-Python tools can neither hold this
  process's GIL nor outlive their timeout. The tool must be picklable (module-level function or
  class). Each call runs on a copy of the tool unpickled in the worker, so what a tool keeps
  between calls (a running total, a session) does not carry over from one call to the next, and
  the caller's object never changes: a stateful tool runs on a thread. As with any spawned
  process, a worker first imports the script that started Python (so that tools defined there
  unpickle): a script that runs process tools keeps its work under `if __name__ ==
  "__main__":`, or each new worker runs that work again (a whole rollout, say) before it takes
  its first call. Untrusted code belongs in `jaxagent.tools.sandbox`, which adds real isolation.

Done-callbacks on the returned futures run on executor threads (the watchdog for timeouts): keep
them short.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import heapq
import inspect
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import numbers
import pickle
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import psutil

from jaxagent.tools.base import (
    Tool,
    ToolArgumentError,
    ToolRegistry,
    ToolResult,
    UnknownToolError,
    normalize_result,
    validate_arguments,
)

log = logging.getLogger(__name__)

# The longest single wait; longer (or infinite) time limits are waited out in slices of this.
_MAX_WAIT_S = 3600.0

# Why `shutdown(wait=True)` stops running queued calls (see `ToolExecutor.shutdown`).
_QUEUE_ENDED = ("the tool executor was shut down and a call ran out its time limit during the shutdown, so "
                "the calls still waiting were dropped instead of each waiting out its own limit")


def invoke_tool(tool: Tool, args: Any, *, max_output_chars: int | None = None,
                timeout_s: float | None = None) -> ToolResult:
    """Calls `tool(args)` on this thread, turning any exception or bad return value into data.

    An async tool (`async def __call__`, or `function_tool` of an `async def`) is awaited in an
    event loop of this thread, and cancelled at `timeout_s`.

    A tool with `takes_timeout = True` is called as `tool(args, timeout_s=timeout_s)` when a
    limit is given, and is expected to stop itself within it.
    """
    name = getattr(tool, "name", type(tool).__name__)
    start = time.monotonic()
    try:
        out = tool(args, timeout_s=timeout_s) if timeout_s is not None and _takes_timeout(tool) else tool(args)
        if inspect.isawaitable(out):
            out = _await(out, timeout_s, name)
        result = normalize_result(out, tool_name=name, max_output_chars=max_output_chars)
    except BaseException as e:  # noqa: BLE001 - a failing tool is an observation, not a crash.
        if isinstance(e, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
            raise
        log.debug("tool %r raised", name, exc_info=True)
        result = normalize_result(ToolResult.failure(f"tool {name!r} raised {_describe_exception(e)}"),
                                  tool_name=name, max_output_chars=max_output_chars)
    return dataclasses.replace(result, duration_s=time.monotonic() - start)


def _await(awaitable: Any, timeout_s: float | None, name: str) -> Any:
    """The result of an async tool's call, run to completion in an event loop of this thread.

    With a limit the coroutine is cancelled at it (the executor's watchdog answers the call at
    the same moment), so an async tool does not keep running after its timeout.
    """
    async def main():
        if timeout_s is None:
            return await awaitable
        try:
            return await asyncio.wait_for(awaitable, timeout_s)
        except asyncio.TimeoutError:
            return ToolResult.failure(f"tool {name!r} timed out after {timeout_s:g} s", timed_out=True)

    return asyncio.run(main())


def _describe_exception(e: BaseException) -> str:
    """`Type: message`, even for an exception whose `__str__` itself raises."""
    try:
        message = str(e)
    except BaseException:  # noqa: BLE001
        message = "<the exception's message could not be turned into text>"
    return f"{type(e).__name__}: {message}"


def _as_seconds(value: Any) -> float | None:
    """`value` as a float number of seconds, or None when it is not a number (NaN included)."""
    if isinstance(value, bool):
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return None if seconds != seconds else seconds


def _shutdown_limit(value: Any, name: str) -> float:
    """`value` checked as a shutdown's wait limit: a positive number of seconds (inf: no limit)."""
    seconds = _as_seconds(value)
    if seconds is None or not seconds > 0:
        raise ValueError(f"{name} must be a positive number of seconds (float('inf') to wait as long as the "
                         f"calls take), got {value!r}")
    return seconds


def _takes_timeout(tool: Any) -> bool:
    return getattr(tool, "takes_timeout", False) is True


# --------------------------------------------------------------------------- process path

def _process_worker_main(conn: multiprocessing.connection.Connection) -> None:
    """Entry point of a tool worker process: run pickled (tool, args) pairs until the pipe closes."""
    conn.send_bytes(b"ready")
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            tool, args, max_chars = pickle.loads(payload)
        except BaseException as e:  # noqa: BLE001
            result = ToolResult.failure(f"could not load the tool in its worker process: {type(e).__name__}: {e}")
        else:
            try:
                result = invoke_tool(tool, args, max_output_chars=max_chars)
            except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt, which a main thread re-raises
                name = getattr(tool, "name", type(tool).__name__)
                result = normalize_result(ToolResult.failure(f"tool {name!r} raised {_describe_exception(e)}"),
                                          tool_name=name, max_output_chars=max_chars)
        try:
            data = pickle.dumps(result)
        except Exception as e:  # noqa: BLE001 - e.g. an unpicklable ToolResult subclass.
            data = pickle.dumps(ToolResult.failure(f"tool result could not be sent back: {e}"))
        conn.send_bytes(data)


class _ProcessWorker:
    def __init__(self, ctx: Any, startup_timeout_s: float):
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_process_worker_main, args=(child_conn,), daemon=True,
                                name="jaxagent-tool-worker")
        self.proc.start()
        child_conn.close()
        self.stopped = False  # killed by the executor's shutdown during a call (`stop`)
        try:
            started = self.conn.poll(startup_timeout_s) and self.conn.recv_bytes() == b"ready"
        except (EOFError, OSError):  # it died before saying ready (an import failing in the fresh interpreter)
            self.proc.join(timeout=1.0)
            code = self.proc.exitcode
            self.kill()
            raise RuntimeError(f"tool worker process exited during its startup (exit code {code}); its "
                               "stderr says why") from None
        if not started:
            self.kill()
            raise RuntimeError(f"tool worker process did not start within {startup_timeout_s:g} s")

    def run(self, payload: bytes, timeout_s: float, name: str) -> tuple[ToolResult, bool]:
        """Returns (result, worker still usable)."""
        start = time.monotonic()
        deadline = start + timeout_s
        try:
            self.conn.send_bytes(payload)
            # In slices: a very long (or infinite) limit is more than one wait call accepts.
            while not self.conn.poll(min(max(deadline - time.monotonic(), 0.0), _MAX_WAIT_S)):
                if time.monotonic() < deadline:
                    continue
                self.kill()
                return ToolResult.failure(f"tool {name!r} timed out after {timeout_s:g} s (worker process killed)",
                                          timed_out=True, duration_s=time.monotonic() - start), False
            result = pickle.loads(self.conn.recv_bytes())
            return result, True
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            self.proc.join(timeout=1.0)  # reap it here, so its exit code is known
            code = self.proc.exitcode
            self.kill()
            if self.stopped:
                return ToolResult.failure(f"tool {name!r} was stopped: the tool executor was shut down during "
                                          "the call (worker process killed)",
                                          duration_s=time.monotonic() - start), False
            return ToolResult.failure(f"tool {name!r} crashed its worker process (exit code {code}): {e!r}",
                                      duration_s=time.monotonic() - start), False

    def died_while_idle(self) -> bool:
        """An idle worker sends nothing: anything to read (end of file) means it has ended."""
        try:
            return self.proc.exitcode is not None or self.conn.poll(0)
        except (OSError, ValueError):
            return True

    def stop(self) -> None:
        """SIGKILLs the worker and anything it started, from another thread than the one in
        `run`, touching no pipe: that thread sees the worker end and reports the call stopped."""
        self.stopped = True
        self._kill_tree()

    def kill(self) -> None:
        """SIGKILLs the worker and anything it started, then reaps the worker."""
        self._kill_tree()
        self.proc.join(timeout=5)
        self.conn.close()

    def _kill_tree(self) -> None:
        if self.proc.pid is not None and self.proc.exitcode is None:
            try:
                children = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.Error:
                children = []
            for child in children:
                try:
                    child.kill()
                except psutil.Error:
                    pass
            self.proc.kill()


class _Refused(RuntimeError):
    """A call the process pool no longer takes (see `_ProcessPool.refuse_waiting`)."""


class _ProcessPool:
    """Up to `size` reusable worker processes; a worker that times out or crashes is replaced."""

    def __init__(self, size: int, startup_timeout_s: float):
        self._ctx = multiprocessing.get_context("spawn")
        self._size = size
        self.startup_timeout_s = startup_timeout_s
        self._idle: list[_ProcessWorker] = []
        self._busy: set[_ProcessWorker] = set()
        self._count = 0
        self._closed = False
        self._refusal: str | None = None  # set by `refuse_waiting`: why calls without a worker are not run
        self._cv = threading.Condition()

    def call(self, tool: Tool, args: Any, timeout_s: float, max_output_chars: int | None,
             on_start: Callable[[], None] | None = None) -> ToolResult:
        """Runs one call on a worker; `on_start` is called once a worker is held (the call's clock starts)."""
        name = getattr(tool, "name", type(tool).__name__)
        try:
            payload = pickle.dumps((tool, args, max_output_chars))
        except Exception as e:  # noqa: BLE001
            return ToolResult.failure(f"tool {name!r} cannot run in a worker process because it cannot be "
                                      f"pickled (use a module-level function or class): {e}")
        try:
            worker = self._acquire()
        except _Refused as e:
            return ToolResult.failure(f"tool {name!r} was not run: {e}")
        except Exception as e:  # noqa: BLE001
            return ToolResult.failure(f"tool {name!r}: no worker process available: {e}")
        usable = False
        try:
            if on_start is not None:
                on_start()
            result, usable = worker.run(payload, timeout_s, name)
        finally:
            self._release(worker, usable)
        return result

    def _acquire(self) -> _ProcessWorker:
        with self._cv:
            while True:
                if self._closed:
                    raise RuntimeError("the executor is shut down")
                if self._refusal is not None:
                    raise _Refused(self._refusal)
                if self._idle:
                    worker = self._idle.pop()
                    if worker.died_while_idle():
                        # The OOM killer, a signal, a thread a tool left behind: replaced, instead
                        # of failing this call as a crash of its tool.
                        log.warning("tool worker process %s died while idle (exit code %s); starting another",
                                    worker.proc.pid, worker.proc.exitcode)
                        worker.conn.close()
                        self._count -= 1
                        continue
                    self._busy.add(worker)
                    return worker
                if self._count < self._size:
                    self._count += 1
                    break
                self._cv.wait()
        try:
            worker = _ProcessWorker(self._ctx, self.startup_timeout_s)
        except BaseException:
            with self._cv:
                self._count -= 1
                self._cv.notify()
            raise
        with self._cv:
            closed, refusal = self._closed, self._refusal
            if closed or refusal is None:
                self._busy.add(worker)
            else:  # refused while it started: the worker waits, idle, for the pool's close
                self._idle.append(worker)
                self._cv.notify()
        if closed:  # shut down while it started: the call is stopped like the others
            worker.stop()
        elif refusal is not None:
            raise _Refused(refusal)
        return worker

    def _release(self, worker: _ProcessWorker, usable: bool) -> None:
        with self._cv:
            self._busy.discard(worker)
            keep = usable and not self._closed
            if keep:
                self._idle.append(worker)
            else:
                self._count -= 1
            self._cv.notify()
        if not keep:
            worker.kill()

    def refuse_waiting(self, reason: str) -> None:
        """Calls that do not hold a worker yet fail with `reason` (now, and from now on); calls
        running on a worker go on."""
        with self._cv:
            self._refusal = reason
            self._cv.notify_all()

    def close(self) -> None:
        """Kills the idle workers, and the busy ones (their calls resolve as stopped)."""
        with self._cv:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            busy = list(self._busy)
            self._cv.notify_all()
        for worker in idle:
            worker.kill()
        for worker in busy:
            worker.stop()

    def worker_pids(self) -> list[int]:
        with self._cv:
            return [w.proc.pid for w in self._idle if w.proc.pid is not None]


# --------------------------------------------------------------------------- the executor

@dataclasses.dataclass(eq=False)
class _Job:
    tool: Tool
    name: str
    args: dict[str, Any]
    timeout_s: float
    execution: str
    future: concurrent.futures.Future
    grace_s: float = 0.0  # how long after `timeout_s` the watchdog backstops a thread call
    state: str = "queued"  # queued -> running -> done | timed_out


class ToolExecutor:
    """Thread pool with a timeout watchdog, plus a killable process pool, for tool calls.

    Args:
      registry: tools callable by name (a `ToolRegistry` or an iterable of tools); tools can also
        be passed to `submit` directly.
      max_workers: live threads running calls at once (abandoned threads do not count).
      max_stuck_threads: abandoned (timed-out, still running) threads tolerated beyond
        `max_workers`: live and abandoned threads together are at most `max_workers +
        max_stuck_threads` (so up to that many abandoned when none is live); calls that cannot
        get a thread then fail fast.
      default_timeout_s: per-call timeout when neither `submit` nor the tool's `timeout_s` sets one.
        The clock starts when the call starts running, not when it is queued.
      max_output_chars: tool output longer than this is truncated (`ToolResult.truncated`).
      process_workers: size of the process pool for `execution="process"` tools.
      idle_thread_exit_s: an idle thread exits after this long, so an idle executor holds no threads.
      shutdown_timeout_s: the longest `shutdown(wait=True)` waits for calls still running (see
        `shutdown`); a positive number of seconds, `float("inf")` to wait as long as they take.
    """

    def __init__(
        self,
        registry: ToolRegistry | Iterable[Tool] | None = None,
        *,
        max_workers: int = 32,
        max_stuck_threads: int = 64,
        default_timeout_s: float = 30.0,
        max_output_chars: int | None = 32_768,
        process_workers: int = 2,
        process_startup_timeout_s: float = 60.0,
        idle_thread_exit_s: float = 30.0,
        shutdown_timeout_s: float = 120.0,
    ):
        if max_workers < 1 or max_stuck_threads < 0 or process_workers < 1:
            raise ValueError("max_workers and process_workers must be >= 1 and max_stuck_threads >= 0, got "
                             f"{max_workers}, {process_workers}, {max_stuck_threads}")
        if not default_timeout_s > 0:
            raise ValueError(f"default_timeout_s must be positive, got {default_timeout_s}")
        if max_output_chars is not None and (not isinstance(max_output_chars, numbers.Integral)
                                             or isinstance(max_output_chars, bool) or max_output_chars < 1):
            raise ValueError(f"max_output_chars must be an int >= 1 or None, got {max_output_chars!r}")
        self.shutdown_timeout_s = _shutdown_limit(shutdown_timeout_s, "shutdown_timeout_s")
        if registry is None or isinstance(registry, ToolRegistry):
            self.registry = registry
        else:
            self.registry = ToolRegistry(registry)
        self.max_workers = max_workers
        self.max_stuck_threads = max_stuck_threads
        self.default_timeout_s = float(default_timeout_s)
        self.max_output_chars = max_output_chars
        idle_exit = _as_seconds(idle_thread_exit_s)
        if idle_exit is None or idle_exit < 0:
            # Read by each idle thread as it waits: a bad value killed the thread there, and the
            # dead thread, still counted idle, left later calls queued forever.
            raise ValueError(f"idle_thread_exit_s must be a number of seconds >= 0, got {idle_thread_exit_s!r}")
        self._idle_exit_s = idle_exit
        startup = _as_seconds(process_startup_timeout_s)
        if startup is None or not 0 < startup < float("inf"):
            # Read when a worker process starts: None made one that never starts block forever.
            raise ValueError("process_startup_timeout_s must be a positive finite number of seconds, "
                             f"got {process_startup_timeout_s!r}")
        self._processes = _ProcessPool(process_workers, startup)

        self._lock = threading.Lock()
        self._work_cv = threading.Condition(self._lock)   # idle workers wait here
        self._watch_cv = threading.Condition(self._lock)  # the watchdog waits here
        self._done_cv = threading.Condition(self._lock)   # shutdown waits for live threads here
        self._pending: collections.deque[_Job] = collections.deque()
        self._deadlines: list[tuple[float, int, _Job]] = []
        self._running: set[_Job] = set()  # jobs in state "running"
        self._seq = itertools.count()
        self._live = 0      # threads that count toward max_workers (idle or running a live call)
        self._idle = 0
        self._starting = 0  # threads started that have not yet looked for a job
        self._stuck = 0     # abandoned threads still inside a timed-out call
        self._shutdown = False
        self._queue_ended = False  # a call timed out during shutdown: queued calls are dropped
        self._resolving = 0        # watchdog batches being resolved outside the lock
        self._watchdog: threading.Thread | None = None
        self._counts = collections.Counter(submitted=0, ok=0, failed=0, timed_out=0)
        self._thread_role = threading.local()  # "worker" / "watchdog" on this executor's own threads

    # ----------------------------------------------------------------- public API

    def submit(self, tool: Tool | str, args: Any = None, *, timeout_s: float | None = None
               ) -> concurrent.futures.Future[ToolResult]:
        """Schedules `tool(args)`; the future always resolves to a `ToolResult`."""
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        future: concurrent.futures.Future[ToolResult] = concurrent.futures.Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("ToolExecutor.submit called after shutdown()")
            self._counts["submitted"] += 1
        resolved = self._resolve(tool, args)
        if isinstance(resolved, ToolResult):
            # The message may quote the policy's call (an unknown name, a value outside an enum):
            # capped like a tool's own output.
            resolved = normalize_result(resolved, tool_name="", max_output_chars=self.max_output_chars)
            self._count_result(resolved)
            future.set_result(resolved)
            return future
        tool_obj, checked = resolved
        timeout_attr = timeout_s or getattr(tool_obj, "timeout_s", None) or self.default_timeout_s
        grace_attr = getattr(tool_obj, "timeout_grace_s", None) if _takes_timeout(tool_obj) else 0.0
        if grace_attr is None:  # unset; a grace of 0 is a grace of 0
            grace_attr = 5.0
        # Read here, where a bad value fails this call: read by the worker thread, it killed the
        # thread and left the call's future pending forever (and a thread counted that was gone).
        timeout, grace = _as_seconds(timeout_attr), _as_seconds(grace_attr)
        if not (timeout is not None and timeout > 0 and grace is not None and grace >= 0):
            problem = (f"timeout_s {timeout_attr!r}" if not (timeout is not None and timeout > 0)
                       else f"timeout_grace_s {grace_attr!r}")
            result = ToolResult.failure(f"tool {tool_obj.name!r} has {problem}; it must be a positive number "
                                        "of seconds")
            self._count_result(result)
            future.set_result(result)
            return future
        job = _Job(tool_obj, tool_obj.name, checked, timeout, getattr(tool_obj, "execution", "thread"), future,
                   grace_s=grace)
        with self._lock:
            # A shutdown from another thread may have begun since the check above: the job would
            # then run after it, on a new thread, with no watchdog left to enforce its limit.
            closed = self._shutdown
            if not closed:
                self._pending.append(job)
                self._spawn_threads_locked()
                self._work_cv.notify()
            failed = self._fail_if_saturated_locked()
        if closed:
            self._resolve_not_run([job], "the tool executor was shut down while the call was being submitted")
        self._resolve_saturated(failed)
        return future

    def run(self, tool: Tool | str, args: Any = None, *, timeout_s: float | None = None) -> ToolResult:
        """Submits one call and waits for its result."""
        return self.submit(tool, args, timeout_s=timeout_s).result()

    def map(self, calls: Iterable[tuple[Tool | str, Any]], *, timeout_s: float | None = None) -> list[ToolResult]:
        """Runs `(tool, args)` calls concurrently; results in input order."""
        futures = [self.submit(tool, args, timeout_s=timeout_s) for tool, args in calls]
        return [f.result() for f in futures]

    def stats(self) -> dict[str, int]:
        """Counters (submitted, ok, failed, timed_out) and current thread/process numbers."""
        with self._lock:
            return {**self._counts, "live_threads": self._live, "idle_threads": self._idle,
                    "stuck_threads": self._stuck, "queued": len(self._pending)}

    def worker_process_pids(self) -> list[int]:
        """PIDs of idle process-pool workers (for monitoring and tests)."""
        return self._processes.worker_pids()

    def shutdown(self, wait: bool = True, *, timeout_s: float | None = None) -> None:
        """Stops accepting calls. With `wait`, queued calls still run and live threads are joined
        (each bounded by its timeout); abandoned threads are never waited for. Once a call runs
        out its time limit during the shutdown (a hung tool), the calls still queued, or waiting
        for a worker process, resolve at once as not run: hung calls cannot hold the shutdown
        for a time limit per queued call. So it returns within about two time limits (plus
        grace) of the calls it holds, unless they all finish earlier, and every call's future is
        resolved when it does. Then every worker process is killed: without `wait`, a process
        call still running resolves at once as stopped (a thread cannot be killed: a thread call
        still resolves at its timeout).

        The wait is bounded by `timeout_s` (default: the executor's `shutdown_timeout_s`), so a
        call under a very long or infinite time limit cannot hold the shutdown forever: past it,
        calls still running resolve as stopped (their threads are abandoned, their worker
        processes killed) and queued calls as not run, and shutdown returns.
        """
        limit = self.shutdown_timeout_s if timeout_s is None else _shutdown_limit(timeout_s, "timeout_s")
        with self._lock:
            self._shutdown = True
            self._work_cv.notify_all()
            self._watch_cv.notify_all()
            if not wait:
                dropped = list(self._pending)
                self._pending.clear()
            else:
                dropped = []
        for job in dropped:
            if job.future.set_running_or_notify_cancel():
                job.future.set_result(ToolResult.failure("the tool executor was shut down before the call ran"))
        if wait:
            self._wait_for_calls(limit)
        self._processes.close()

    def _wait_for_calls(self, limit: float) -> None:
        """`shutdown(wait=True)`'s wait: until no thread runs a call, or `limit` seconds; then the
        calls still running are abandoned and resolved as stopped, the queued ones as not run."""
        end = time.monotonic() + limit
        # Called from a done-callback, on one of this executor's threads: that thread cannot end
        # while it waits, so it is not waited for (it waited out the whole limit for itself).
        role = getattr(self._thread_role, "role", None)
        own_live, own_resolving = int(role == "worker"), int(role == "watchdog")
        with self._lock:
            while self._live > own_live or self._resolving > own_resolving:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    break
                self._done_cv.wait(min(remaining, _MAX_WAIT_S))
            overdue = [job for job in self._running if job.state == "running"]
            for job in overdue:  # as the watchdog abandons a timed-out call: its thread's result is dropped
                job.state = "timed_out"
                self._live -= 1
                self._stuck += 1
            self._running.difference_update(overdue)
            self._watch_cv.notify()  # the watchdog, waiting on their deadlines, can now exit
            dropped = list(self._pending)
            self._pending.clear()
            if overdue or dropped:
                self._processes.refuse_waiting(f"the tool executor was shut down and its calls had not "
                                               f"finished {limit:g} s later")
        if overdue or dropped:
            log.warning("tool executor shutdown: %d calls still running after %.3g s are stopped, %d queued "
                        "calls are not run", len(overdue), limit, len(dropped))
        for job in overdue:
            result = ToolResult.failure(f"tool {job.name!r} was stopped: the tool executor was shut down and the "
                                        f"call had not finished {limit:g} s later (the shutdown's time limit)")
            self._count_result(result)
            job.future.set_result(result)
        self._resolve_not_run(dropped, f"the tool executor was shut down and the calls before it had not "
                                       f"finished {limit:g} s later")

    def __enter__(self) -> ToolExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(wait=True)

    # ----------------------------------------------------------------- internals

    def _resolve(self, tool: Tool | str, args: Any) -> tuple[Tool, dict[str, Any]] | ToolResult:
        if isinstance(tool, str):
            if self.registry is None:
                return ToolResult.failure(f"unknown tool {tool!r}: this executor has no registry")
            try:
                tool = self.registry.get(tool)
            except UnknownToolError as e:
                return ToolResult.failure(str(e))
        name = getattr(tool, "name", None)
        if not isinstance(name, str) or not callable(tool):
            return ToolResult.failure(f"{tool!r} is not a tool (needs a name and to be callable)")
        if getattr(tool, "execution", "thread") not in ("thread", "process"):
            return ToolResult.failure(f"tool {name!r} has unknown execution mode {tool.execution!r}")
        try:
            checked = validate_arguments(getattr(tool, "parameters", {}) or {}, {} if args is None else args)
        except ToolArgumentError as e:
            return ToolResult.failure(f"bad arguments for tool {name!r}: {e}")
        return tool, checked

    def _spawn_threads_locked(self) -> None:
        limit = self.max_workers + self.max_stuck_threads
        # Threads already starting will take a queued job each, like idle ones.
        while (len(self._pending) > self._idle + self._starting and self._live < self.max_workers
               and self._live + self._stuck < limit):
            self._live += 1
            self._starting += 1
            threading.Thread(target=self._worker_loop, name="jaxagent-tool", daemon=True).start()
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watchdog_loop, name="jaxagent-tool-watchdog",
                                              daemon=True)
            self._watchdog.start()

    def _fail_if_saturated_locked(self) -> list[_Job]:
        """With no live thread and no room for one, queued calls would wait forever: fail them."""
        if self._live > 0 or not self._pending:
            return []
        failed = list(self._pending)
        self._pending.clear()
        return failed

    def _end_queue_locked(self) -> list[_Job] | None:
        """After a call ran out its limit during shutdown: the queued calls to drop (None when the
        executor is not shutting down, or the queue was already ended)."""
        if not self._shutdown or self._queue_ended:
            return None
        self._queue_ended = True
        dropped = list(self._pending)
        self._pending.clear()
        return dropped

    def _drop_queue(self, dropped: list[_Job] | None) -> None:
        if dropped is None:
            return
        if dropped:
            log.warning("dropping %d queued tool calls: %s", len(dropped), _QUEUE_ENDED)
        self._processes.refuse_waiting(_QUEUE_ENDED)
        self._resolve_not_run(dropped, _QUEUE_ENDED)

    def _resolve_saturated(self, jobs: list[_Job]) -> None:
        self._resolve_not_run(jobs, f"the executor is saturated ({self._stuck} calls are stuck past their "
                                    "timeouts and their threads cannot be killed)")

    def _resolve_not_run(self, jobs: list[_Job], reason: str) -> None:
        """Resolves each of `jobs` not cancelled by its caller as "tool X was not run: `reason`"."""
        for job in jobs:
            if job.future.set_running_or_notify_cancel():
                result = ToolResult.failure(f"tool {job.name!r} was not run: {reason}")
                self._count_result(result)
                job.future.set_result(result)

    def _next_job_locked(self) -> _Job | None:
        while True:
            while self._pending:
                job = self._pending.popleft()
                if not job.future.set_running_or_notify_cancel():
                    continue  # cancelled by the caller while queued
                job.state = "running"
                self._running.add(job)
                # Process calls enforce their own timeout by killing the worker; the watchdog
                # only backstops them, from when a worker is free to take the call (waiting for
                # a busy worker or starting a new one is not part of the call's budget).
                # Thread tools that take the limit themselves (`takes_timeout`) are backstopped
                # by their `timeout_grace_s` (default 5 s) in the same way.
                if job.execution == "thread":
                    self._arm_deadline_locked(job, job.grace_s)
                return job
            if self._shutdown:
                return None
            self._idle += 1
            woke = self._work_cv.wait(timeout=min(self._idle_exit_s, _MAX_WAIT_S))
            self._idle -= 1
            if not woke and not self._pending:
                return None

    def _arm_deadline_locked(self, job: _Job, grace: float) -> None:
        heapq.heappush(self._deadlines, (time.monotonic() + job.timeout_s + grace, next(self._seq), job))
        self._watch_cv.notify()

    def _arm_process_deadline(self, job: _Job) -> None:
        with self._lock:
            self._arm_deadline_locked(job, 5.0)

    def _worker_loop(self) -> None:
        self._thread_role.role = "worker"
        with self._lock:
            self._starting -= 1
        while True:
            with self._lock:
                job = self._next_job_locked()
                if job is None:
                    self._live -= 1
                    self._done_cv.notify_all()
                    self._watch_cv.notify()  # after a shutdown, the last thread out lets the watchdog exit
                    return
            try:
                if job.execution == "process":
                    result = self._processes.call(job.tool, job.args, job.timeout_s, self.max_output_chars,
                                                  on_start=lambda job=job: self._arm_process_deadline(job))
                else:
                    result = invoke_tool(job.tool, job.args, max_output_chars=self.max_output_chars,
                                         timeout_s=job.timeout_s)
            except BaseException as e:  # noqa: BLE001 - this thread must resolve its call and live on
                log.error("running tool %r failed inside the executor", job.name, exc_info=True)
                result = ToolResult.failure(f"tool {job.name!r} could not be run: {_describe_exception(e)}")
            dropped = None
            with self._lock:
                abandoned = job.state == "timed_out"
                if not abandoned:
                    job.state = "done"
                    self._running.discard(job)
                    if result.timed_out:
                        dropped = self._end_queue_locked()
            self._drop_queue(dropped)
            if not abandoned:
                self._count_result(result)
                job.future.set_result(result)
                continue
            with self._lock:  # back from a call the watchdog gave up on
                self._stuck -= 1
                if self._shutdown or self._live >= self.max_workers:
                    return
                self._live += 1

    def _watchdog_loop(self) -> None:
        self._thread_role.role = "watchdog"
        while True:
            expired: list[_Job] = []
            with self._lock:
                now = time.monotonic()
                while self._deadlines and (self._deadlines[0][2].state != "running" or self._deadlines[0][0] <= now):
                    _, _, job = heapq.heappop(self._deadlines)
                    if job.state == "running":
                        job.state = "timed_out"
                        self._running.discard(job)
                        self._live -= 1
                        self._stuck += 1
                        expired.append(job)
                dropped = None
                if expired:
                    dropped = self._end_queue_locked()
                    self._done_cv.notify_all()
                    self._spawn_threads_locked()
                failed = self._fail_if_saturated_locked()
                if not expired and not failed:
                    if self._shutdown and self._live == 0 and not self._deadlines:
                        return
                    wait = self._deadlines[0][0] - now if self._deadlines else _MAX_WAIT_S
                    self._watch_cv.wait(timeout=min(max(wait, 0.0), _MAX_WAIT_S))
                    continue
                self._resolving += 1  # shutdown(wait=True) returns once these futures are resolved
            try:
                self._drop_queue(dropped)
                for job in expired:
                    log.warning("tool %r timed out after %.3g s; abandoning its thread", job.name, job.timeout_s)
                    result = ToolResult.failure(f"tool {job.name!r} timed out after {job.timeout_s:g} s",
                                                timed_out=True, duration_s=job.timeout_s)
                    self._count_result(result)
                    job.future.set_result(result)
                self._resolve_saturated(failed)
            finally:
                with self._lock:
                    self._resolving -= 1
                    self._done_cv.notify_all()

    def _count_result(self, result: ToolResult) -> None:
        with self._lock:
            self._counts["ok" if result.ok else "failed"] += 1
            if result.timed_out:
                self._counts["timed_out"] += 1
