"""Tests for jaxagent/tools/executors.py: futures always resolve to ToolResults, timeouts do not
wait on stuck threads, 256 chaotic concurrent calls finish without deadlock, the process path kills."""

import concurrent.futures
import os
import random
import re
import threading
import time
from typing import Literal

import psutil
import pytest

from jaxagent.tools.base import ToolRegistry, ToolResult, function_tool
from jaxagent.tools.executors import ToolExecutor, invoke_tool

RELEASE = threading.Event()  # set at the end of a test to let hung thread-path tools return


@pytest.fixture(autouse=True)
def release_hung_tools():
    RELEASE.clear()
    yield
    RELEASE.set()


@function_tool
def nap(seconds: float) -> str:
    """Sleep, then say so."""
    time.sleep(seconds)
    return f"slept {seconds}"


@function_tool
def hang(seconds: float = 60.0) -> str:
    """Block until released (or `seconds`)."""
    RELEASE.wait(seconds)
    return "released"


@function_tool
def explode(message: str) -> str:
    """Raise."""
    raise RuntimeError(message)


@function_tool
def garbage() -> str:
    """Return something that is not a str."""
    return 42  # type: ignore[return-value]


@function_tool(execution="process")
def pid_in_process() -> str:
    """Report the worker's PID."""
    return str(os.getpid())


@function_tool(execution="process")
def spin_in_process() -> str:
    """Burn CPU forever while holding the worker's GIL."""
    while True:
        pass


@function_tool(execution="process")
def crash_in_process() -> str:
    """Kill the worker process."""
    os._exit(3)


@function_tool(execution="process")
def nap_in_process(seconds: float) -> str:
    """Sleep in the worker process."""
    time.sleep(seconds)
    return f"slept {seconds}"


@function_tool(execution="process")
def interrupt_in_process() -> str:
    """Raise KeyboardInterrupt in the worker process."""
    raise KeyboardInterrupt


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no message")


@function_tool
def raise_unprintable() -> str:
    """Raise an exception whose message cannot be formatted."""
    raise Unprintable()


@function_tool
def raise_long(n: int) -> str:
    """Raise with an n-character message."""
    raise ValueError("x" * n)


REGISTRY = ToolRegistry([nap, hang, explode, garbage, pid_in_process, spin_in_process, crash_in_process,
                         nap_in_process, raise_unprintable, raise_long, interrupt_in_process])


def test_invoke_tool_turns_everything_into_results():
    assert invoke_tool(nap, {"seconds": 0}).output == "slept 0"
    raised = invoke_tool(explode, {"message": "boom"})
    assert not raised.ok and raised.error == "tool 'explode' raised RuntimeError: boom"
    wrong = invoke_tool(garbage, {})
    assert not wrong.ok and "returned int" in wrong.error

    class Exits:
        name, description, parameters = "exits", "d", {"type": "object"}

        def __call__(self, args):
            raise SystemExit(1)

    assert "raised SystemExit" in invoke_tool(Exits(), {}).error


def test_256_chaotic_calls_all_resolve_without_deadlock():
    rng = random.Random(0)
    kinds = [rng.choice(["nap", "hang", "explode", "garbage", "bad_args", "unknown"]) for _ in range(256)]
    calls = {"nap": lambda: ("nap", {"seconds": rng.uniform(0, 0.2)}), "hang": lambda: ("hang", {}),
             "explode": lambda: ("explode", {"message": "x"}), "garbage": lambda: ("garbage", {}),
             "bad_args": lambda: ("nap", {"seconds": "soon"}), "unknown": lambda: ("nope", {})}
    start = time.monotonic()
    # A limit well above the naps' 0.2 s: on a loaded 2-core host a nap may wait for the GIL.
    with ToolExecutor(REGISTRY, max_workers=32, max_stuck_threads=256, default_timeout_s=1.0) as executor:
        futures = [executor.submit(*calls[kind]()) for kind in kinds]
        done, not_done = concurrent.futures.wait(futures, timeout=30)
        elapsed = time.monotonic() - start
        assert not not_done, f"{len(not_done)} futures never resolved"
        results = [f.result() for f in futures]
        stats = executor.stats()
        RELEASE.set()
    assert all(isinstance(r, ToolResult) for r in results)
    for kind, result in zip(kinds, results):
        if kind == "nap":
            assert result.ok and result.output.startswith("slept"), result
        elif kind == "hang":
            assert result.timed_out and not result.ok and "timed out after 1 s" in result.error
        elif kind == "explode":
            assert not result.ok and "raised RuntimeError" in result.error
        elif kind == "garbage":
            assert not result.ok and "returned int" in result.error
        elif kind == "bad_args":
            assert not result.ok and "'seconds' must be of type number" in result.error
        else:
            assert not result.ok and "unknown tool 'nope'" in result.error
    n_hang = kinds.count("hang")
    assert stats["timed_out"] == n_hang
    assert stats["ok"] == kinds.count("nap") and stats["submitted"] == 256
    # 32 live threads: about n_hang * 1 s + naps of thread time, spread over them.
    assert elapsed < 1.0 + 2 * (n_hang * 1.0 + kinds.count("nap") * 0.2) / 32, elapsed


def test_timeout_resolves_at_deadline_while_thread_stays_stuck():
    with ToolExecutor(REGISTRY, max_workers=2) as executor:
        start = time.monotonic()
        result = executor.run("hang", {}, timeout_s=0.3)
        waited = time.monotonic() - start
        # Upper bounds leave room for a loaded 2-core CI machine; the hang itself never ends.
        assert result.timed_out and 0.25 < waited < 2.0
        assert executor.stats()["stuck_threads"] == 1
        assert executor.run("nap", {"seconds": 0}).ok  # a replacement thread serves new calls
        RELEASE.set()
        deadline = time.monotonic() + 5
        while executor.stats()["stuck_threads"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert executor.stats()["stuck_threads"] == 0


def test_tool_timeout_attribute_and_default():
    slow = function_tool(hang.fn, name="slow", timeout_s=0.2)
    with ToolExecutor(default_timeout_s=5) as executor:
        start = time.monotonic()
        assert executor.run(slow, {}).timed_out
        assert time.monotonic() - start < 3.0  # the tool's 0.2 s, not the default 5 s
        RELEASE.set()
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        ToolExecutor().submit(nap, {"seconds": 0}, timeout_s=0)


def test_saturated_executor_fails_fast_instead_of_waiting_forever():
    executor = ToolExecutor(REGISTRY, max_workers=1, max_stuck_threads=0)
    try:
        assert executor.run("hang", {}, timeout_s=0.2).timed_out
        start = time.monotonic()
        result = executor.run("nap", {"seconds": 0})
        assert not result.ok and "saturated" in result.error
        assert time.monotonic() - start < 2.0
        RELEASE.set()
        deadline = time.monotonic() + 5
        while executor.stats()["stuck_threads"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert executor.run("nap", {"seconds": 0}).ok  # capacity is back once the stuck call returns
    finally:
        RELEASE.set()
        executor.shutdown()


def test_output_truncation_and_cancel_and_shutdown():
    @function_tool
    def shout(n: int) -> str:
        """Print n characters."""
        return "a" * n

    executor = ToolExecutor([shout, nap], max_workers=1, max_output_chars=50)
    long = executor.run("shout", {"n": 1000})
    assert long.ok and long.truncated and len(long.output) <= 50
    blocker = executor.submit("nap", {"seconds": 0.3})
    queued = executor.submit("nap", {"seconds": 0})
    assert queued.cancel()  # still waiting for the single worker
    assert blocker.result().ok
    executor.shutdown(wait=True)
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit("nap", {"seconds": 0})
    assert executor.stats()["live_threads"] == 0


def test_map_and_registry_free_executor():
    with ToolExecutor() as executor:
        results = executor.map([(nap, {"seconds": 0.01}), (explode, {"message": "m"}), ("nap", {})])
        assert [r.ok for r in results] == [True, False, False]
        assert "no registry" in results[2].error


def test_process_path_kills_cpu_bound_tool_on_timeout():
    with ToolExecutor(REGISTRY, process_workers=1) as executor:
        first = executor.run("pid_in_process", {}, timeout_s=30)
        assert first.ok and int(first.output) != os.getpid()
        worker = psutil.Process(int(first.output))
        start = time.monotonic()
        spinning = executor.submit("spin_in_process", {}, timeout_s=1.0)
        # The spinning worker holds its own GIL, not ours: thread-path calls keep flowing.
        assert executor.run("nap", {"seconds": 0.05}).ok
        result = spinning.result(timeout=20)
        assert result.timed_out and "worker process killed" in result.error
        assert time.monotonic() - start < 5
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
        crashed = executor.run("crash_in_process", {}, timeout_s=30)
        assert not crashed.ok and "crashed its worker process (exit code 3)" in crashed.error
        again = executor.run("pid_in_process", {}, timeout_s=30)
        assert again.ok and int(again.output) != worker.pid
        idle = executor.worker_process_pids()
    for pid in idle:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_process_tool_raising_keyboard_interrupt_is_reported_as_raised():
    # The worker runs the tool on its main thread, where invoke_tool lets KeyboardInterrupt through;
    # it was reported as the tool failing to load, and not as what the tool did.
    with ToolExecutor(REGISTRY, process_workers=1) as executor:
        result = executor.run("interrupt_in_process", {}, timeout_s=30)
        assert not result.ok and result.error == "tool 'interrupt_in_process' raised KeyboardInterrupt: "
        assert executor.run("pid_in_process", {}, timeout_s=30).ok  # the worker lives on


def test_process_path_reports_unpicklable_tools():
    local = function_tool(lambda: "x", name="local", description="A lambda.", execution="process")
    with ToolExecutor(process_workers=1) as executor:
        result = executor.run(local, {})
    assert not result.ok and "cannot be pickled" in result.error


def test_exception_whose_message_raises_is_a_result_not_a_dead_thread():
    direct = invoke_tool(raise_unprintable, {})
    assert not direct.ok and direct.error.startswith("tool 'raise_unprintable' raised Unprintable: <")
    executor = ToolExecutor(REGISTRY, max_workers=1, default_timeout_s=10)
    try:
        # It used to kill the worker thread: the call waited out its timeout, was reported as
        # timed out, and a "stuck" thread was counted forever.
        result = executor.submit("raise_unprintable", {}).result(timeout=5)
        assert not result.ok and not result.timed_out and "raised Unprintable" in result.error
        assert executor.run("nap", {"seconds": 0}).ok
        assert executor.stats()["stuck_threads"] == 0
    finally:
        executor.shutdown(wait=False)


def test_huge_error_messages_are_capped_like_output():
    with ToolExecutor(REGISTRY, max_output_chars=1000) as executor:
        result = executor.run("raise_long", {"n": 1_000_000})
    assert not result.ok and result.truncated
    assert len(result.error) <= 1000 and "truncated" in result.error
    with pytest.raises(ValueError, match="max_output_chars"):
        ToolExecutor(max_output_chars=0)


def test_infinite_timeout_does_not_kill_the_watchdog():
    executor = ToolExecutor(REGISTRY, process_workers=1)
    try:
        assert executor.submit("nap", {"seconds": 0.05}, timeout_s=float("inf")).result(timeout=5).ok
        assert executor.submit("pid_in_process", {}, timeout_s=float("inf")).result(timeout=60).ok
        # Timeouts of later calls are still enforced.
        assert executor.submit("hang", {}, timeout_s=0.3).result(timeout=5).timed_out
    finally:
        RELEASE.set()
        executor.shutdown(wait=False)


def test_one_call_starts_one_thread():
    with ToolExecutor(REGISTRY, max_workers=32) as executor:
        assert executor.run("nap", {"seconds": 0}).ok
        assert executor.stats()["live_threads"] == 1  # was max_workers for a single call


def test_process_calls_waiting_for_a_busy_worker_are_not_timed_out():
    # 16 calls of 0.5 s, each under a 1 s limit, share one worker process: the last ones wait
    # about 8 s for it. The limit counts from when the worker takes the call, not from the queue.
    with ToolExecutor(REGISTRY, process_workers=1, process_startup_timeout_s=1.0) as executor:
        futures = [executor.submit("nap_in_process", {"seconds": 0.5}, timeout_s=1.0) for _ in range(16)]
        results = [f.result(timeout=60) for f in futures]
        assert executor.stats()["stuck_threads"] == 0
    assert all(r.ok and r.output == "slept 0.5" for r in results), [r.error for r in results if not r.ok]


@function_tool
async def async_echo(text: str, delay: float = 0.0) -> str:
  """Echo text after an asynchronous sleep."""
  import asyncio
  await asyncio.sleep(delay)
  return f"echo {text}"


def test_async_tools_are_awaited_and_cancelled_at_their_timeout():
  """An `async def` tool (a user's HTTP client, say) returns its result, not an error about a
  coroutine; past its limit it is cancelled and answered as a timeout."""
  import asyncio

  class AsyncCallable:
    name, description = "acall", "an object with an async __call__"
    parameters = {"type": "object", "properties": {}}

    async def __call__(self, args):
      await asyncio.sleep(0)
      return ToolResult.success("done")

  direct = invoke_tool(async_echo, {"text": "hi"})
  assert (direct.ok, direct.output) == (True, "echo hi")
  with ToolExecutor(default_timeout_s=5.0) as ex:
    assert ex.run(async_echo, {"text": "a"}).output == "echo a"
    assert ex.run(AsyncCallable(), {}).output == "done"
    t0 = time.monotonic()
    slow = ex.run(async_echo, {"text": "b", "delay": 30.0}, timeout_s=0.3)
    assert time.monotonic() - t0 < 5.0
    assert not slow.ok and slow.timed_out and "timed out" in slow.error
    deadline = time.monotonic() + 2.0  # cancelled, not left running on its thread
    while ex.stats()["stuck_threads"] and time.monotonic() < deadline:
      time.sleep(0.01)
    assert ex.stats()["stuck_threads"] == 0


def test_shutdown_without_wait_stops_running_process_calls():
    """A process call still running at `shutdown(wait=False)` (the rollout driver's close) kept
    its worker alive, and its future pending, until the call's own timeout (30 s here)."""
    before = {p.pid for p in psutil.Process().children()}
    executor = ToolExecutor(REGISTRY, process_workers=2)
    assert executor.run("pid_in_process", {}, timeout_s=30).ok
    futures = [executor.submit("spin_in_process", {}, timeout_s=30) for _ in range(2)]
    time.sleep(1.0)  # both running (a second worker starts)
    start = time.monotonic()
    executor.shutdown(wait=False)
    results = [f.result(timeout=10) for f in futures]
    assert time.monotonic() - start < 5
    assert all(not r.ok and not r.timed_out and "shut down during the call" in r.error for r in results), results
    workers = [p for p in psutil.Process().children()
               if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline())]
    assert psutil.wait_procs(workers, timeout=5)[1] == []


class _LimitTakingTool:
    """A thread tool that stops itself at its limit (`takes_timeout`), with a given grace."""

    name = "limited"
    description = "Returns at once."
    parameters = {"type": "object"}
    takes_timeout = True

    def __init__(self, grace=None, timeout=None):
        self.timeout_grace_s = grace
        self.timeout_s = timeout

    def __call__(self, args, timeout_s=None):
        return f"limit {timeout_s:g}"


@pytest.mark.parametrize("grace,timeout,problem", [
    ("x", None, "timeout_grace_s 'x'"), (float("nan"), None, "timeout_grace_s nan"), (-1.0, None, "timeout_grace_s -1.0"),
    (None, "soon", "timeout_s 'soon'"), (None, -2.0, "timeout_s -2.0"),
])
def test_a_tool_with_a_malformed_time_limit_fails_its_call_and_the_executor_lives_on(grace, timeout, problem):
    """A `timeout_grace_s` that is not a number killed the worker thread that read it: the call's
    future never resolved, and the dead thread still counted toward max_workers."""
    executor = ToolExecutor(REGISTRY, max_workers=1)
    try:  # not a `with`: its shutdown(wait=True) would wait forever for the dead thread
        for _ in range(3):
            result = executor.submit(_LimitTakingTool(grace, timeout), {}).result(timeout=5)
            assert not result.ok and problem in result.error, result
        assert executor.submit(_LimitTakingTool(2.0), {}, timeout_s=1).result(timeout=5).output == "limit 1"
        assert executor.submit("nap", {"seconds": 0}).result(timeout=5).ok
    finally:
        executor.shutdown(wait=False)


def _shutdown_within(executor, seconds):
    """Runs `executor.shutdown(wait=True)` on a thread; how long it took, or None past `seconds`."""
    start = time.monotonic()
    thread = threading.Thread(target=executor.shutdown, kwargs={"wait": True}, daemon=True)
    thread.start()
    thread.join(seconds)
    return None if thread.is_alive() else time.monotonic() - start


def test_shutdown_with_wait_returns_with_every_timed_out_call_resolved():
    """The watchdog resolves timed-out calls after it has released their threads: shutdown(wait=True)
    returned while a call's future was still pending (here for the 0.3 s of the done-callback of
    the call resolved before it)."""
    executor = ToolExecutor(REGISTRY, max_workers=3)
    first = executor.submit("hang", {}, timeout_s=0.2)
    first.add_done_callback(lambda f: time.sleep(0.5))  # the watchdog is busy past the others' deadlines
    second, third = (executor.submit("hang", {}, timeout_s=0.3) for _ in range(2))
    second.add_done_callback(lambda f: time.sleep(0.3))  # `third` is resolved after it, in the same batch
    assert _shutdown_within(executor, 10) is not None
    assert third.done() and third.result().timed_out


def test_shutdown_with_wait_drops_calls_queued_behind_hung_calls():
    """Calls queued behind a hung call each waited out their own limit once a thread was free
    (8 calls of 0.3 s on one thread: shutdown(wait=True) took 2.4 s; 100 calls under a 30 s limit
    on 32 threads, 90 s). Once a call times out during the shutdown the queue is failed at once."""
    executor = ToolExecutor(REGISTRY, max_workers=1)
    futures = [executor.submit("hang", {}, timeout_s=0.3) for _ in range(8)]
    took = _shutdown_within(executor, 1.5)
    assert took is not None, "shutdown(wait=True) waited for each queued hung call in turn"
    assert all(f.done() for f in futures)
    results = [f.result() for f in futures]
    assert results[0].timed_out
    for r in results[1:]:
        assert not r.ok and not r.timed_out and r.error.startswith("tool 'hang' was not run: the tool executor "
                                                                   "was shut down and a call ran out its time limit")
    assert executor.stats()["failed"] == 8


def test_shutdown_with_wait_still_runs_queued_calls_that_do_not_hang():
    executor = ToolExecutor(REGISTRY, max_workers=1)
    futures = [executor.submit("nap", {"seconds": 0.05}) for _ in range(4)]
    assert _shutdown_within(executor, 10) is not None
    assert [f.result(timeout=0).output for f in futures] == ["slept 0.05"] * 4


def test_shutdown_with_wait_drops_process_calls_waiting_for_a_hung_worker():
    """Process calls wait on executor threads for a free worker process: each ran out its limit
    in turn behind the spinning one (4 calls of 0.5 s on one worker: 2 s plus a worker start
    per call)."""
    executor = ToolExecutor(REGISTRY, process_workers=1, process_startup_timeout_s=30)
    assert executor.run("pid_in_process", {}, timeout_s=30).ok  # the worker is up
    futures = [executor.submit("spin_in_process", {}, timeout_s=0.5) for _ in range(4)]
    time.sleep(0.2)
    took = _shutdown_within(executor, 2.5)
    assert took is not None, "shutdown(wait=True) waited for each process call in turn"
    results = [f.result(timeout=0) for f in futures]
    assert results[0].timed_out and "worker process killed" in results[0].error
    assert all("was not run: the tool executor was shut down" in r.error for r in results[1:]), results


@pytest.mark.parametrize("tool", ["hang", "spin_in_process"])
def test_shutdown_with_wait_is_bounded_for_calls_under_an_infinite_limit(tool):
    """A call under timeout_s=inf that hangs (a thread tool) or spins (a process tool) held
    shutdown(wait=True) forever; the calls queued behind it never resolved either."""
    executor = ToolExecutor(REGISTRY, max_workers=1, process_workers=1, shutdown_timeout_s=0.5)
    hung = executor.submit(tool, {}, timeout_s=float("inf"))
    queued = executor.submit("nap", {"seconds": 0})
    time.sleep(0.2)
    took = _shutdown_within(executor, 10)
    assert took is not None, "shutdown(wait=True) waited forever for a call under an infinite limit"
    assert took < 5, took
    stopped, not_run = hung.result(timeout=0), queued.result(timeout=0)
    assert not stopped.ok and stopped.error == (f"tool {tool!r} was stopped: the tool executor was shut down and "
                                                "the call had not finished 0.5 s later (the shutdown's time limit)")
    assert not not_run.ok and not_run.error.startswith("tool 'nap' was not run: the tool executor was shut down")
    stats = executor.stats()
    assert (stats["failed"], stats["live_threads"], stats["queued"]) == (2, 0, 0), stats


def test_shutdown_takes_its_own_time_limit_and_checks_it():
    executor = ToolExecutor(REGISTRY, max_workers=1)
    hung = executor.submit("hang", {}, timeout_s=1e9)
    start = time.monotonic()
    executor.shutdown(wait=True, timeout_s=0.3)  # instead of the executor's 120 s
    assert time.monotonic() - start < 5
    assert "had not finished 0.3 s later" in hung.result(timeout=0).error
    for bad in (0, -1.0, float("nan"), "soon", True):
        with pytest.raises(ValueError, match="must be a positive number of seconds"):
            ToolExecutor(shutdown_timeout_s=bad)
        with pytest.raises(ValueError, match=f"timeout_s must be a positive number of seconds.*got {bad!r}"):
            ToolExecutor().shutdown(timeout_s=bad)


def test_watchdog_exits_after_a_shutdown_that_stopped_a_call():
    """After shutdown's limit stopped a call under an infinite limit, the watchdog slept on that
    call's deadline for up to an hour: one leaked thread per executor."""
    executor = ToolExecutor(REGISTRY, max_workers=1)
    executor.submit("hang", {}, timeout_s=float("inf"))
    time.sleep(0.1)
    watchdog = executor._watchdog
    executor.shutdown(wait=True, timeout_s=0.2)
    watchdog.join(5)
    assert not watchdog.is_alive()


def test_watchdog_exits_after_a_shutdown_without_wait():
    """After shutdown(wait=False) (the rollout driver's close) the watchdog slept until the
    deadline of a call still running (here 60 s; up to an hour with an idle thread left): the
    threads' exit did not wake it. `rollout()` makes and closes an executor per call, so each
    call left a thread behind."""
    executor = ToolExecutor(REGISTRY, max_workers=2)
    running = executor.submit("nap", {"seconds": 0.3}, timeout_s=60)
    time.sleep(0.1)
    watchdog = executor._watchdog
    executor.shutdown(wait=False)
    assert running.result(timeout=5).ok  # a running thread call still finishes
    watchdog.join(5)
    assert not watchdog.is_alive()


def test_a_call_submitted_while_the_executor_shuts_down_is_not_run():
    """submit checked for shutdown, then checked the arguments, then queued the call: a shutdown
    from another thread in between let the call run after it, with no watchdog left to enforce
    its limit (a hung tool's future never resolved)."""
    executor = ToolExecutor(REGISTRY, max_workers=2)

    class ShutsDownWhileChecked:
        name, description = "racer", "Hangs."

        @property
        def parameters(self):  # read while submit checks the arguments: the shutdown lands there
            executor.shutdown(wait=False)
            time.sleep(0.1)  # the watchdog exits
            return {"type": "object"}

        def __call__(self, args):
            RELEASE.wait(60)
            return "late"

    assert executor.run("nap", {"seconds": 0}).ok  # starts the watchdog
    result = executor.submit(ShutsDownWhileChecked(), {}, timeout_s=0.2).result(timeout=5)
    assert not result.ok and result.error == ("tool 'racer' was not run: the tool executor was shut down while "
                                              "the call was being submitted")
    assert executor.stats()["queued"] == 0
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit("nap", {"seconds": 0})


@pytest.mark.parametrize("bad", [None, "soon", float("nan"), 0, -1.0, float("inf")])
def test_a_malformed_process_startup_timeout_is_refused_when_the_executor_is_built(bad):
    """process_startup_timeout_s is read when a worker process starts: None made a worker that
    never started block its call forever."""
    with pytest.raises(ValueError, match="process_startup_timeout_s must be a positive finite number "
                                         f"of seconds, got {re.escape(repr(bad))}"):
        ToolExecutor(REGISTRY, process_startup_timeout_s=bad)


@pytest.mark.parametrize("bad", [None, "soon", float("nan"), -1.0])
def test_a_malformed_idle_thread_exit_is_refused_when_the_executor_is_built(bad):
    """idle_thread_exit_s=None was taken, then killed the first thread to go idle (it is read as
    the thread waits): the dead thread still counted as idle, so the next call queued forever."""
    with pytest.raises(ValueError, match=f"idle_thread_exit_s must be a number of seconds >= 0, got {bad!r}"):
        ToolExecutor(REGISTRY, idle_thread_exit_s=bad)
    with ToolExecutor(REGISTRY, idle_thread_exit_s=0) as executor:  # idle threads leave at once
        assert [executor.run("nap", {"seconds": 0}).ok for _ in range(3)] == [True] * 3


@pytest.mark.parametrize("bad", [1e4, 100.5, True, "512"])
def test_a_max_output_chars_that_is_not_an_int_is_refused_when_the_executor_is_built(bad):
    """max_output_chars=1e4 (a config's float) was taken; every output longer than the limit then
    failed its call as "tool 'x' raised TypeError: slice indices must be integers", output lost."""
    with pytest.raises(ValueError, match=f"max_output_chars must be an int >= 1 or None, got {bad!r}"):
        ToolExecutor(REGISTRY, max_output_chars=bad)
    with pytest.raises(ValueError, match="max_output_chars must be an int"):
        invoke_tool(nap, {"seconds": 0}, max_output_chars=bad)


def test_errors_about_the_call_itself_are_capped_like_output():
    """A call refused before it runs (an unknown tool name, a value outside an enum) quoted the
    policy's text whole in its error: a 100000-character name gave a 100038-character
    observation, past max_output_chars."""

    @function_tool
    def pick(mode: Literal["a", "b"]) -> str:
        """Pick a mode."""
        return mode

    with ToolExecutor([pick], max_output_chars=100) as executor:
        for tool, args in [("p" * 100_000, {}), ("pick", {"mode": "z" * 100_000}), (pick, {"mode": "z" * 100_000})]:
            result = executor.run(tool, args)
            assert not result.ok and result.truncated and len(result.error) <= 100, len(result.error)
            assert "truncated" in result.error
        short = executor.run("pick", {"mode": "c"})
        assert not short.truncated and short.error == "bad arguments for tool 'pick': argument 'mode' must be one of " \
                                                      "['a', 'b'], got 'c'"


def _exit_at_startup(conn):
    os._exit(7)


class _DyingAtStartupContext:
    """A spawn context whose worker processes exit before they say they are ready."""

    def __init__(self, ctx):
        self._ctx = ctx
        self.Pipe = ctx.Pipe

    def Process(self, *, target, args, **kwargs):
        return self._ctx.Process(target=_exit_at_startup, args=args, **kwargs)


def test_a_worker_process_that_dies_at_startup_is_reported_with_its_exit_code():
    """A worker that died before saying it was ready (an import failing in the fresh interpreter)
    raised EOFError out of its startup, and the call's error ended in that exception's empty
    message: "tool 'pid_in_process': no worker process available: "."""
    executor = ToolExecutor(REGISTRY, process_workers=1, process_startup_timeout_s=30)
    executor._processes._ctx = _DyingAtStartupContext(executor._processes._ctx)
    try:
        result = executor.run("pid_in_process", {}, timeout_s=30)
        assert not result.ok and result.error == ("tool 'pid_in_process': no worker process available: tool worker "
                                                  "process exited during its startup (exit code 7); its stderr says "
                                                  "why")
        assert executor.run("nap", {"seconds": 0}).ok
    finally:
        executor.shutdown(wait=False)


def test_a_grace_of_zero_abandons_a_limit_taking_tool_at_its_limit():
    """timeout_grace_s = 0 was read as unset (`or 5.0`): a limit-taking tool that overran was
    abandoned 5 s past its limit instead of at it."""

    class Overruns(_LimitTakingTool):
        def __call__(self, args, timeout_s=None):
            RELEASE.wait(60)  # ignores the limit it was given
            return "late"

    with ToolExecutor(REGISTRY, max_workers=1) as executor:
        start = time.monotonic()
        result = executor.submit(Overruns(grace=0.0), {}, timeout_s=0.2).result(timeout=10)
        assert result.timed_out and time.monotonic() - start < 3.0
        RELEASE.set()


@pytest.mark.parametrize("tool, args, limit", [("nap", {"seconds": 0.1}, 5.0), ("hang", {}, 0.2)])
def test_shutdown_with_wait_from_a_done_callback_does_not_wait_for_its_own_thread(tool, args, limit):
    """A done-callback runs on the executor's thread (a worker's, or the watchdog's for a timeout);
    shutdown(wait=True) there waited for that thread to end, which it could not while waiting:
    the whole shutdown limit (120 s by default, 3 s here)."""
    executor = ToolExecutor(REGISTRY, max_workers=2, shutdown_timeout_s=3)
    took = []

    def close(future):
        start = time.monotonic()
        executor.shutdown(wait=True)
        took.append(time.monotonic() - start)

    future = executor.submit(tool, args, timeout_s=limit)
    future.add_done_callback(close)  # before the call ends: run by the thread that resolves it
    deadline = time.monotonic() + 10
    while not took and time.monotonic() < deadline:
        time.sleep(0.01)
    assert took and took[0] < 1.5, took
    assert future.result(timeout=0).ok == (tool == "nap")


def test_a_worker_process_that_died_while_idle_is_replaced_not_blamed_on_the_next_call():
    """An idle worker killed from outside (the OOM killer, say) was handed the next call, which
    failed as "tool 'pid_in_process' crashed its worker process (exit code -9)"."""
    with ToolExecutor(REGISTRY, process_workers=1) as executor:
        first = executor.run("pid_in_process", {}, timeout_s=30)
        assert first.ok
        pid = int(first.output)
        psutil.Process(pid).kill()
        # Dead and not reaped: waitable (WNOWAIT leaves it for the pool). A zombie status is not
        # enough: the leader thread shows it while the worker's other threads still exit, and
        # until they have, the worker is not waitable and its end of the pipe is still open.
        deadline = time.monotonic() + 5
        while (os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
               and time.monotonic() < deadline):
            time.sleep(0.01)
        second = executor.run("pid_in_process", {}, timeout_s=30)
        assert second.ok and second.output != first.output, second
