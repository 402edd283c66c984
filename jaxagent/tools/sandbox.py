"""A Python interpreter sandbox for model-written code: `run_python`, `PythonSession`, `PythonTool`.

Where this sits: math and code tasks (`jaxagent.envs`, ReTool-style) register a `PythonTool`; the
rollout driver runs it through `jaxagent.tools.executors.ToolExecutor` (thread path: the work
happens in the child process, the host thread only waits on pipes) and appends the printed
output, or the traceback, as an observation. Verifiers that execute model code (unit tests) use
`run_python` directly.

Each interpreter is a fresh `python -I` child started with `subprocess` (fork+exec, never a fork
of this process's Python state), in a new session, with a minimal environment (PATH, a temporary
HOME/TMPDIR, LANG, single-threaded BLAS; nothing else from the parent, so no secrets) and a fresh
temporary working directory that is deleted afterwards
(inside a directory the code may not list, so it cannot find the other sandboxes' directories:
`_make_workdir`). Code and results travel over pipes; the
printed output is read incrementally and capped. Like a REPL, a final expression statement has
its value printed. Before any user code runs, the child applies, in order:

1. Namespaces (`namespaces="auto"`, detected at run time; each layer is best effort and reported
   by `sandbox_isolation()`): as root, or inside a new user namespace otherwise, it unshares
   * a network namespace: no interfaces but a down loopback, so no connection leaves it,
     including to 127.0.0.1 on the host;
   * a mount namespace in which every mount is remounted read-only, nosuid, nodev, except the
     temporary directory and bind-mounted /dev/{null,zero,full,random,urandom}: writes anywhere
     else fail with EROFS at the kernel level; `deny_read_paths` are covered by an empty
     read-only tmpfs (a directory) or /dev/null (a file), so not even code that gets past the
     audit hook reads them;
   * a PID namespace, with the parent-death signal set: host PIDs cannot be named (so the
     parent cannot be signalled) and killing the sandbox kills every process it started, even
     ones that called setsid(). Its init only waits; the user code runs in its child, so that
     signals end it as they end any program (an init ignores those it has no handler for);
   then drops every capability (bounding set included) and sets no_new_privs, so none of this can
   be undone from inside.
2. Resource limits: RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_NPROC, RLIMIT_FSIZE, RLIMIT_NOFILE,
   RLIMIT_CORE=0. Linux exempts uid 0 from RLIMIT_NPROC, so when the host runs as root the
   process-count limit only binds inside a user namespace mapped to a non-root uid; the audit hook
   (3) is then what stops fork bombs.
3. An audit hook (`sys.addaudithook`) that refuses: process creation (os.fork/exec/system/spawn,
   posix_spawn, subprocess), signals to other processes (`signal.pidfd_send_signal`, which raises
   no audit event, is replaced), without a PID namespace changes to another process's CPU mask
   or priority (`os.sched_setaffinity`, `os.setpriority`, likewise), sockets other than AF_UNIX and all
   connect/bind/DNS calls, rlimit changes, loading or calling C functions through ctypes, GC
   introspection, opening files for writing outside the temporary directory (and /dev/null), and
   opening files for reading outside the temporary directory, the interpreter's prefixes and
   site-packages, /usr/share, /proc/self and the device files above (`os.open` is replaced so
   that a dir_fd-relative open is checked against its directory, which its audit event does not
   name), and listing directories (`os.listdir`, `os.scandir`) outside those same readable
   paths. So model code can neither read task data or answer keys kept elsewhere on the host
   nor find their names.

The parent enforces the wall-clock timeout, a per-call CPU-time limit (polling the process tree)
and the output cap; on any of them, or on a crash, it SIGKILLs the process group (and every
descendant it can see) and reaps it, so no process outlives the call; so it does when a call ends
normally. Without a PID namespace the interpreter is a child subreaper, so a process whose parent
exited (a daemon) stays among its descendants.

What this does not protect against: an audit hook is not a security boundary. Code that reaches
interpreter internals (ctypes addresses obtained without dlsym, frame and closure introspection,
`_posixsubprocess`, the original `os.open` in the closure of its replacement, a link swapped
between the check and the open) can get around it. Where the namespaces are available
the kernel still blocks the network, host file writes and signals to host processes; where they
are not (unprivileged host without user namespaces, or `namespaces="off"`), only the hook, the
rlimits and the process-group kill remain. Disk use is bounded per file by RLIMIT_FSIZE and in
total (`max_disk_mb`, `max_files`) by the host measuring the temporary directory during the
call: that check is not instant, so a program may write for ~0.1 s (longer with thousands of files)
past the limit before it is stopped (`os.posix_fallocate`, which reserves gigabytes in milliseconds, is refused by the
audit hook). Nothing here limits CPU or memory bandwidth, reads of
world-readable files through C extensions, or kernel exploits; and code can forge the result
of its own call (it can reach the control pipe), which is why rewards come from verifiers, not
from `ToolResult.ok`. Run untrusted code from the open internet in a VM or gVisor-style sandbox.
"""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import json
import math
import os
import queue
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any, Literal

import psutil

from jaxagent.tools.base import ToolResult, validate_arguments
from jaxagent.tools.sandbox_child import _child_main  # its source runs in the child

PROCESS_TAG = "jaxagent-sandbox"
_SOURCE_NAME = "<jaxagent-sandbox>"
_LOADER = ('import sys;r=sys.stdin.buffer;n=int.from_bytes(r.read(8),"big");'
           f'exec(compile(r.read(n),"{_SOURCE_NAME}","exec"),{{"__name__":"__jaxagent_sandbox__"}})')
_FRAME_LIMIT = 4 << 20
_RESTART_NOTE = " The Python session was restarted: variables and imports from earlier calls are lost."


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits and isolation for one sandboxed interpreter (per call, also in a `PythonSession`).

    Attributes:
      timeout_s: wall-clock limit per call.
      cpu_time_s: CPU-time limit per call (all threads and processes); None means `timeout_s`.
      memory_mb: address-space limit (RLIMIT_AS) of the interpreter; numpy+scipy+sympy need ~400.
      max_output_bytes: cap on each of stdout and stderr per call; past it the program is stopped.
      max_processes: RLIMIT_NPROC (see the module docstring for when the kernel applies it).
      max_file_mb: largest file the code may write (RLIMIT_FSIZE).
      max_disk_mb: most disk the interpreter's temporary directory may take (all its files,
        and files the code deleted but holds open); for a `PythonSession`, at any time of the
        session. Measured by the host during each call (every 0.1 s, less often for thousands of
        files, so the walk takes at most a tenth of a core) and at its end: past it the
        program is stopped and its files are deleted (see `_SandboxProcess._disk_problem`).
      max_files: most files and directories the temporary directory may hold; checked alike.
      max_open_files: RLIMIT_NOFILE.
      max_code_bytes: largest accepted program.
      session_cpu_s: kernel CPU-time budget (RLIMIT_CPU) for a `PythonSession` interpreter's lifetime.
      startup_timeout_s: time allowed for the interpreter to start (not part of `timeout_s`).
      namespaces: "auto" (plain namespaces as root, else a user namespace), "user" (always a user
        namespace first), or "off" (audit hook, rlimits and process-group kill only).
      audit_hook: install the Python-level guard; turn off only to test the kernel layers alone.
      display_last_expression: print the repr of a final expression statement, like a REPL.
      python: interpreter to run (its site-packages are importable by the code).
      extra_read_paths: further host paths the code may read.
      deny_read_paths: host paths the code may not read even where it could otherwise (e.g. a
        task's answer key inside an installed package); enforced by the audit hook, and hidden
        by the kernel where the mount namespace is available (`deny_read_hidden`).
      extra_env: further environment variables for the interpreter.
    """

    timeout_s: float = 10.0
    cpu_time_s: float | None = None
    memory_mb: int = 1024
    max_output_bytes: int = 65_536
    max_processes: int = 64
    max_file_mb: int = 64
    max_disk_mb: int = 256
    max_files: int = 10_000
    max_open_files: int = 256
    max_code_bytes: int = 1_000_000
    session_cpu_s: float = 600.0
    startup_timeout_s: float = 30.0
    namespaces: Literal["auto", "user", "off"] = "auto"
    audit_hook: bool = True
    display_last_expression: bool = True
    python: str = sys.executable
    extra_read_paths: tuple[str, ...] = ()
    deny_read_paths: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        # The limits travel to the interpreter as JSON and become rlimits there: a float (1e3 from
        # a config override) or an infinite time would fail every call at interpreter start.
        for name in ("memory_mb", "max_output_bytes", "max_processes", "max_file_mb", "max_disk_mb", "max_files",
                     "max_open_files", "max_code_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"SandboxConfig.{name} must be an int, got {value!r} ({type(value).__name__})")
        for name in ("timeout_s", "session_cpu_s", "startup_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"SandboxConfig.{name} must be a positive finite number of seconds, got {value!r}")
        if self.cpu_time_s is not None and (isinstance(self.cpu_time_s, bool)
                                            or not isinstance(self.cpu_time_s, (int, float))
                                            or not 0 < self.cpu_time_s < math.inf):
            raise ValueError(f"SandboxConfig.cpu_time_s must be a positive finite number of seconds or None, "
                             f"got {self.cpu_time_s!r}")
        if self.memory_mb < 128:
            raise ValueError(f"SandboxConfig.memory_mb must be >= 128 (the interpreter itself needs it), "
                             f"got {self.memory_mb}")
        for name in ("max_output_bytes", "max_processes", "max_file_mb", "max_disk_mb", "max_files", "max_open_files",
                     "max_code_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"SandboxConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_open_files < 16:
            raise ValueError(f"SandboxConfig.max_open_files must be >= 16, got {self.max_open_files}")
        if self.namespaces not in ("auto", "user", "off"):
            raise ValueError(f"SandboxConfig.namespaces must be 'auto', 'user' or 'off', got {self.namespaces!r}")
        for name in ("extra_read_paths", "deny_read_paths"):
            if isinstance(getattr(self, name), str):
                raise TypeError(f"SandboxConfig.{name} must be a tuple of paths, not a str")

    @classmethod
    def from_settings(cls, owner: str, settings: Mapping[str, tuple[str, Any]], **fixed: Any) -> "SandboxConfig":
        """A config built from another object's settings. `settings` maps each setting's name to
        (the field it sets, its value); a refused value is named as that setting
        (`CodeEnv.memory_mb=0 is refused: ...`), since the user never wrote `SandboxConfig.memory_mb`.
        `fixed` are fields the owner sets itself."""
        for name, (field, value) in settings.items():
            try:
                cls(**{field: value})
            except (ValueError, TypeError) as e:
                raise type(e)(f"{owner}.{name}={value!r} is refused: {e}") from e
        return cls(**{field: value for field, value in settings.values()}, **fixed)

    @property
    def call_cpu_s(self) -> float:
        return self.cpu_time_s if self.cpu_time_s is not None else self.timeout_s


class SandboxError(RuntimeError):
    """The sandbox interpreter could not be started."""


_CHILD_SOURCE = (inspect.getsource(_child_main) + "\n_child_main()\n").encode()


# --------------------------------------------------------------------------- parent side

def _minimal_env(tmpdir: str, extra: Mapping[str, str]) -> dict[str, str]:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": tmpdir, "TMPDIR": tmpdir, "LANG": "C.UTF-8",
           "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "MALLOC_ARENA_MAX": "2", "MPLBACKEND": "Agg"}
    env.update(extra)
    return env


def _frame(payload: Mapping[str, Any] | bytes) -> bytes:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return len(data).to_bytes(8, "big") + data


def _parse_reply(data: bytes) -> dict[str, Any] | None:
    """A control message from the child, or None when it is malformed (user code can write to
    the control pipe, so nothing in it is trusted)."""
    try:
        reply = json.loads(data)
    except ValueError:
        return None
    if not isinstance(reply, dict):
        return None
    if reply.get("type") == "ready" and isinstance(reply.get("isolation"), dict):
        return reply
    if (reply.get("type") == "result" and isinstance(reply.get("ok"), bool)
            and isinstance(reply.get("error"), (str, type(None))) and isinstance(reply.get("markers"), list)):
        return reply
    return None


def _describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (killed: memory, CPU or a limit)",
                "SIGSEGV": " (crashed)"}.get(name, "")
        return f"killed by {name}{hint}"
    return f"exit status {returncode}"


class _Stream:
    """One output pipe of the child during a call: bytes up to a cap, and the end-of-call marker."""

    def __init__(self, cap: int, marker: bytes):
        self.data = bytearray()
        self.cap = cap
        self.marker = marker
        self.marker_seen = False
        self.eof = False
        self.overflow = False

    def feed(self, chunk: bytes) -> None:
        if self.marker_seen:
            return
        start = max(0, len(self.data) - len(self.marker) + 1)
        self.data += chunk
        at = self.data.find(self.marker, start)
        if at >= 0:
            del self.data[at:]
            self.marker_seen = True
        if len(self.data) > self.cap:  # also when the marker came in the same read: same program, same result
            del self.data[self.cap:]
            self.overflow = True

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


_LIVE: weakref.WeakSet[_SandboxProcess] = weakref.WeakSet()


@atexit.register
def _kill_live_sandboxes() -> None:
    for proc in list(_LIVE):
        proc.close()
    _remove_workdir_parent()


# Whether this kernel lists each thread's children in /proc (CONFIG_PROC_CHILDREN).
_PROC_CHILDREN = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def _descendants(pid: int) -> list[psutil.Process]:
    """The live descendants of `pid`, parents before children.

    Walks `/proc/<pid>/task/<tid>/children`, touching only the tree itself. psutil's
    `children(recursive=True)` reads every process on the machine instead: ~70 ms with ~700
    processes, and a rollout polls hundreds of sandboxes once a second each, under the GIL.
    Falls back to psutil where the kernel lacks those files.
    """
    if not _PROC_CHILDREN:
        try:
            return psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            return []
    out: list[psutil.Process] = []
    queue = [pid]
    while queue:
        parent = queue.pop(0)
        try:
            tids = os.listdir(f"/proc/{parent}/task")
        except OSError:  # exited
            continue
        for tid in tids:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except (OSError, ValueError):  # the thread exited
                continue
            for k in kids:
                try:
                    out.append(psutil.Process(k))
                except psutil.Error:
                    continue
                queue.append(k)
    return out


def _remove_tree(path: str) -> None:
    """Deletes a sandbox's temporary directory, including directories the code made unreadable
    or read-only (chmod), which a plain rmtree leaves behind where the host lacks root's
    permission override. Called once every process of the sandbox is gone."""
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return
    def unlock(d: str) -> None:
        try:
            if not os.path.islink(d):
                os.chmod(d, 0o700)
        except OSError:
            pass

    unlock(path)
    for root, dirs, _ in os.walk(path):  # top-down: each directory is unlocked before it is entered
        for d in dirs:
            unlock(os.path.join(root, d))
    shutil.rmtree(path, ignore_errors=True)


# (pid of this process, the directory that holds its sandboxes' temporary directories)
_workdir_parent: tuple[int, str] | None = None
_workdir_lock = threading.Lock()


def _make_workdir() -> str:
    """A fresh temporary directory for one interpreter: a random name inside a directory that
    this process's sandboxes share and that may be traversed but not listed (mode 0o311).

    The code can list the host's temporary directory (the audit hook checks opens, not
    listings), where it sees that shared directory (and those of other processes); without
    read permission on it, and without the capabilities that override it (dropped where
    namespaces are used), it cannot learn the names inside, so it can neither list nor open the
    files of another trajectory's sandbox. As root without namespaces the override remains and
    only the audit hook refuses those reads. The shared directory is made once per process
    (a forked process makes its own) and removed at exit; each call costs one mkdir, as a
    directory of its own did.
    """
    global _workdir_parent
    stale = None
    for _ in range(2):
        with _workdir_lock:
            if _workdir_parent is None or _workdir_parent[0] != os.getpid() or _workdir_parent[1] == stale:
                parent = tempfile.mkdtemp(prefix="jaxagent-sandbox-")
                os.chmod(parent, 0o311)
                _workdir_parent = (os.getpid(), parent)
            parent = _workdir_parent[1]
        path = os.path.join(parent, f"jaxagent-sandbox-{secrets.token_hex(16)}")
        try:
            os.mkdir(path, 0o700)
            return path
        except FileNotFoundError:  # the shared directory was removed (a cleaner of old files): anew
            stale = parent
    raise FileNotFoundError(f"could not make a sandbox directory in {parent}")


def _remove_workdir_parent() -> None:
    """Removes this process's shared directory of `_make_workdir` once it is empty."""
    if _workdir_parent is not None and _workdir_parent[0] == os.getpid():
        try:
            os.rmdir(_workdir_parent[1])
        except OSError:  # a sandbox directory left behind, or already gone
            pass


def _live_descendants(pid: int) -> list[psutil.Process]:
    """`_descendants` less the zombies (killed, not yet reaped)."""
    out = []
    for p in _descendants(pid):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


_spawner: tuple[int, queue.SimpleQueue] | None = None  # (pid of this process, requests of its spawner thread)
_spawner_lock = threading.Lock()


def _spawner_loop(requests: queue.SimpleQueue) -> None:
    while True:
        args, kwargs, box, done = requests.get()
        try:
            box.append(subprocess.Popen(args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            box.append(e)
        done.set()


def _popen(args: list[str], **kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen`, run on one thread that lives as long as this process.

    The interpreter asks the kernel to SIGKILL it when the thread that started it ends
    (PR_SET_PDEATHSIG), so that a host killed outright (SIGKILL, the OOM killer) leaves no
    sandbox behind, not even a session stopped between calls. That signal follows the starting
    thread, not the process: an executor thread that exits when idle would take the sessions
    it started with it, so every interpreter is started from this one thread instead.
    """
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner[0] != os.getpid():  # none yet, or inherited by a fork
            requests: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_spawner_loop, args=(requests,), name="jaxagent-sandbox-spawner",
                             daemon=True).start()
            _spawner = (os.getpid(), requests)
        requests = _spawner[1]
    box: list[Any] = []
    done = threading.Event()
    requests.put((args, kwargs, box, done))
    done.wait()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


class _SandboxProcess:
    """One sandboxed interpreter: start, run cells, kill. Callers serialise calls."""

    def __init__(self, config: SandboxConfig, *, kernel_cpu_s: float):
        self.config = config
        self.isolation: dict[str, bool] = {}
        self.tmpdir = _make_workdir()
        self._closed = False
        self._paused = False
        self._ctrl_buf = bytearray()
        self._tree: list[psutil.Process] = []
        self._tree_refresh = 0.0
        self._disk_note: str | None = None  # what `_disk_problem` found over the limits
        ctrl_r, ctrl_w = os.pipe()
        try:
            self.proc = _popen(
                [config.python, "-I", "-c", _LOADER, f"{PROCESS_TAG}:{os.getpid()}"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(ctrl_w,),
                cwd=self.tmpdir, env=_minimal_env(self.tmpdir, config.extra_env), start_new_session=True)
        except OSError as e:
            os.close(ctrl_r)
            os.close(ctrl_w)
            _remove_tree(self.tmpdir)
            raise SandboxError(f"could not start the sandbox interpreter {config.python!r}: {e}") from e
        os.close(ctrl_w)
        self.ctrl = ctrl_r
        try:  # made now, while the PID is surely ours (see `kill`)
            self._leader: psutil.Process | None = psutil.Process(self.proc.pid)
        except psutil.Error:
            self._leader = None
        _LIVE.add(self)
        setup = {"ctrl_fd": ctrl_w, "host_pid": os.getpid(), "tmpdir": self.tmpdir, "namespaces": config.namespaces,
                 "audit_hook": config.audit_hook, "memory_mb": config.memory_mb, "kernel_cpu_s": kernel_cpu_s,
                 "max_processes": config.max_processes, "max_file_mb": config.max_file_mb,
                 "max_open_files": config.max_open_files, "display": config.display_last_expression,
                 "extra_read_paths": [os.path.realpath(p) for p in config.extra_read_paths],
                 "deny_read_paths": [os.path.realpath(p) for p in config.deny_read_paths]}
        deadline = time.monotonic() + config.startup_timeout_s
        try:
            if self._write(_frame(_CHILD_SOURCE) + _frame(setup), deadline):
                ready, streams, _ = self._collect(deadline, secrets.token_bytes(16), None)
            else:
                ready, streams = None, None
        except OSError:
            ready, streams = None, None
        if ready is None or ready["type"] != "ready":
            detail = streams[1].text()[-2000:] if streams else ""
            self.close()
            raise SandboxError(f"the sandbox interpreter failed to start: {detail or 'no message'}")
        self.isolation = ready["isolation"]

    @property
    def alive(self) -> bool:
        return not self._closed

    def pause(self) -> None:
        """Freezes the interpreter's processes (SIGSTOP) until the next `run` or `close`.

        A session sits idle while the policy writes its next turn; a thread or process the code
        left running would otherwise burn a core all that time, outside any call's limits.
        """
        if not self._closed and not self._paused:
            self._paused = self._signal_group(signal.SIGSTOP)

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            self._signal_group(signal.SIGCONT)

    def _signal_group(self, sig: int) -> bool:
        try:  # the leader is not reaped until `close`, so its group id cannot have been reused
            os.killpg(self.proc.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def run(self, code: str, timeout_s: float, cpu_s: float) -> ToolResult:
        """Runs one cell. If the result says the process was stopped, `alive` is now False."""
        self._resume()
        start = time.monotonic()
        marker = f"\0\x1e{secrets.token_hex(16)}\x1e\0"
        try:
            sent = self._write(_frame({"code": code, "marker": marker}), start + timeout_s)
        except OSError:
            self.close()
            return ToolResult.failure("the sandbox interpreter is not running")
        if sent:
            reply, (out, err), stop = self._collect(start + timeout_s, marker.encode(), cpu_s)
        else:  # it never read the program (user code left it stuck between calls)
            cap = self.config.max_output_bytes
            reply, (out, err), stop = None, (_Stream(cap, marker.encode()), _Stream(cap, marker.encode())), "timeout"
        duration = time.monotonic() - start
        output, stderr = out.text(), err.text()
        truncated = out.overflow or err.overflow
        if stop is None and self._disk_problem() is not None:  # written since the last check
            stop = "disk"
        if stop is None and reply is not None and reply["type"] == "result":
            if reply["ok"]:
                if stderr:
                    output = f"{output}{'' if not output or output.endswith(chr(10)) else chr(10)}{stderr}"
                return ToolResult(ok=True, output=output, duration_s=duration)
            error = reply["error"] or "the code failed"
            if stderr.strip():
                error = f"{stderr[-4000:].rstrip()}\n{error}"
            return ToolResult(ok=False, output=output, error=error.rstrip(), duration_s=duration)
        # Every pipe at EOF but the process still there: the code closed them itself.
        closed_pipes = stop == "exit" and not self._exited_within(0.2)
        returncode = self.close()
        if closed_pipes:
            error = "The program closed its output and control pipes, so the sandbox stopped it."
        elif stop == "timeout":
            error = f"Timed out after {timeout_s:g} s (wall clock); the program was stopped."
        elif stop == "cpu":
            error = f"CPU time limit of {cpu_s:g} s exceeded; the program was stopped."
        elif stop == "overflow":
            error = (f"Output limit of {self.config.max_output_bytes} bytes exceeded; the program was stopped "
                     f"and its output truncated.")
        elif stop == "disk":
            error = (f"Disk limit exceeded: {self._disk_note} (the limits are {self.config.max_disk_mb} MB and "
                     f"{self.config.max_files} files and directories); the program was stopped and its files "
                     f"deleted.")
        elif stop == "protocol":
            error = "The sandbox interpreter sent a malformed reply and was stopped."
        else:
            error = f"The Python process ended unexpectedly ({_describe_exit(returncode)})."
            if stderr.strip():
                error += f"\n{stderr[-4000:].rstrip()}"
        return ToolResult(ok=False, output=output, error=error, timed_out=stop in ("timeout", "cpu"),
                          truncated=truncated, duration_s=duration)

    def _write(self, data: bytes, deadline: float) -> bool:
        """Writes a request to the interpreter's stdin; False if it is not all taken by `deadline`.

        The interpreter reads requests only between cells, so code that leaves it stuck there
        (a signal handler that never returns) would block a plain write of a program larger than
        the pipe's buffer forever.
        """
        fd = self.proc.stdin.fileno()
        os.set_blocking(fd, False)
        view = memoryview(data)
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_WRITE)
            while view:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                if sel.select(timeout=remaining):
                    try:
                        view = view[os.write(fd, view):]
                    except BlockingIOError:
                        pass
        return True

    def _collect(self, deadline: float, marker: bytes, cpu_s: float | None
                 ) -> tuple[dict[str, Any] | None, tuple[_Stream, _Stream], str | None]:
        """Reads the pipes until a control reply and both end markers arrive, the child dies, or a
        limit trips. Returns (reply, (stdout, stderr), stop reason or None)."""
        cap = self.config.max_output_bytes
        streams = {self.proc.stdout.fileno(): _Stream(cap, marker), self.proc.stderr.fileno(): _Stream(cap, marker)}
        out, err = streams.values()
        reply: dict[str, Any] | None = None
        ctrl_eof = False
        cpu_start = self._tree_cpu() if cpu_s is not None else 0.0
        next_cpu_check = time.monotonic() + 0.2
        next_disk_check = time.monotonic() + 0.1
        with selectors.DefaultSelector() as sel:
            for fd in (*streams, self.ctrl):
                sel.register(fd, selectors.EVENT_READ)
            while True:
                if reply is not None:
                    if reply["type"] != "result":
                        return reply, (out, err), None
                    pending = [s for fd, s in ((1, out), (2, err)) if fd in reply["markers"]]
                    if all(s.marker_seen or s.eof for s in pending):
                        return reply, (out, err), None
                if ctrl_eof and out.eof and err.eof:
                    return reply, (out, err), "exit"
                now = time.monotonic()
                if now >= deadline:
                    return reply, (out, err), "timeout"
                if cpu_s is not None and now >= next_cpu_check:
                    next_cpu_check = now + 0.2
                    if self._tree_cpu() - cpu_start > cpu_s:
                        return reply, (out, err), "cpu"
                if cpu_s is not None and now >= next_disk_check:  # a call, not the start-up
                    if self._disk_problem() is not None:
                        return reply, (out, err), "disk"
                    # Every 0.1 s, or less often where a walk of many files costs more than a tenth of that.
                    next_disk_check = now + max(0.1, 10 * (time.monotonic() - now))
                for key, _ in sel.select(timeout=min(deadline - now, 0.1)):
                    chunk = os.read(key.fd, 65536)
                    if key.fd == self.ctrl:
                        if not chunk:
                            ctrl_eof = True
                            sel.unregister(key.fd)
                            continue
                        self._ctrl_buf += chunk
                        if len(self._ctrl_buf) >= 8:
                            size = int.from_bytes(self._ctrl_buf[:8], "big")
                            if size > _FRAME_LIMIT:
                                return None, (out, err), "protocol"
                            if len(self._ctrl_buf) >= 8 + size:
                                reply = _parse_reply(bytes(self._ctrl_buf[8:8 + size]))
                                del self._ctrl_buf[:8 + size]
                                if reply is None:
                                    return None, (out, err), "protocol"
                        continue
                    stream = streams[key.fd]
                    if not chunk:
                        stream.eof = True
                        sel.unregister(key.fd)
                        continue
                    stream.feed(chunk)
                    if stream.overflow:
                        return reply, (out, err), "overflow"

    def _processes(self) -> list[psutil.Process]:
        """The interpreter's live processes (the list is refreshed at most once a second)."""
        now = time.monotonic()
        if now >= self._tree_refresh:
            self._tree_refresh = now + 1.0
            try:
                self._tree = [psutil.Process(self.proc.pid), *_descendants(self.proc.pid)]
            except psutil.Error:
                self._tree = []
        return self._tree

    def _tree_cpu(self) -> float:
        """CPU seconds used by the interpreter's live processes (reading a process's times is cheap)."""
        total = 0.0
        for p in self._processes():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def _disk_problem(self) -> str | None:
        """What the temporary directory holds past `max_disk_mb` / `max_files`, or None.

        Counts the blocks of every file and directory in it (each inode once) and of files the
        code deleted but still holds open (found through /proc/<pid>/fd: unlinked, they are in no
        directory). A directory the code made unreadable is given its owner's permissions back
        to be measured (the host runs as the same user), as `_remove_tree` does to delete it.
        The walk stops at the limits, so its cost is bounded by `max_files`.
        """
        max_bytes, max_entries = self.config.max_disk_mb << 20, self.config.max_files
        seen: set[tuple[int, int]] = set()
        used = entries = 0

        def add(st: os.stat_result) -> None:
            nonlocal used
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                used += st.st_blocks * 512

        stack = [self.tmpdir]
        while stack and used <= max_bytes and entries <= max_entries:
            path = stack.pop()
            try:
                try:
                    listing = os.scandir(path)
                except PermissionError:
                    os.chmod(path, os.lstat(path).st_mode & 0o7777 | 0o700)
                    listing = os.scandir(path)
                with listing:
                    for entry in listing:
                        entries += 1
                        if entries > max_entries:
                            break
                        try:
                            add(entry.stat(follow_symlinks=False))
                        except FileNotFoundError:  # removed while being walked
                            continue
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
            except (FileNotFoundError, NotADirectoryError):  # removed (or replaced) while being walked
                continue
            except OSError as e:  # e.g. a path nested past PATH_MAX: what cannot be measured is refused
                self._disk_note = f"a directory in it could not be measured ({e.strerror or e})"
                return self._disk_note
        root = os.path.realpath(self.tmpdir) + "/"
        for p in self._processes() if used <= max_bytes else ():
            try:
                fds = os.listdir(f"/proc/{p.pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    target = os.readlink(f"/proc/{p.pid}/fd/{fd}")
                    if target.startswith(root) and target.endswith(" (deleted)"):
                        add(os.stat(f"/proc/{p.pid}/fd/{fd}"))
                except OSError:
                    continue
        if used > max_bytes:
            self._disk_note = f"its files take more than {self.config.max_disk_mb} MB"
        elif entries > max_entries:
            self._disk_note = f"it made more than {max_entries} files and directories"
        else:
            return None
        return self._disk_note

    def kill(self) -> None:
        """Sends SIGKILL to the interpreter and its processes, from any thread, touching no pipe.

        A `run` in progress on another thread then sees the interpreter end, closes it and
        returns; `close` reaps it otherwise. The leader's psutil handle was made at start, so
        psutil's identity check keeps a reused PID from being hit.
        """
        if self._closed or self._leader is None or not self._leader.is_running():
            return
        self._kill_descendants()
        try:
            self._leader.kill()
        except psutil.Error:
            pass

    def close(self, *, graceful: bool = False) -> int | None:
        """Ends the interpreter, reaps every process of it and removes the temporary directory.

        With `graceful`, the interpreter is first asked to exit (EOF on its request pipe). The
        processes are then killed from the inside out, so that each is reaped by its own parent
        rather than left as a zombie for init. Idempotent; returns the exit status.
        """
        if self._closed:
            return self.proc.returncode
        self._resume()  # a stopped interpreter could neither exit gracefully nor reap its init
        self._closed = True
        _LIVE.discard(self)
        pid = self.proc.pid
        pid_namespace = self.isolation.get("pid_namespace")
        if graceful and not pid_namespace:
            # Processes the code started would outlive a leader that exits on its own (only a PID
            # namespace ends with its init): kill them first, while the leader holds their orphans.
            self._kill_descendants()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        if not (graceful and self._exited_within(0.5)):
            if self._kill_descendants() and pid_namespace:
                self._exited_within(1.0)  # the bootstrap reaps the namespace's init and exits
        try:  # the leader is not reaped yet, so its group id cannot have been reused
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        returncode = self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            try:
                stream.close()
            except OSError:
                pass
        os.close(self.ctrl)
        _remove_tree(self.tmpdir)
        return returncode

    def _kill_descendants(self) -> bool:
        """SIGKILLs the leader's descendants, parents first; returns whether there were any.

        Without a PID namespace the leader is a child subreaper, so a process forked while its
        parent was being killed is reparented to the leader and found by the next pass. In a PID
        namespace the first descendant is its init, and killing it ends the rest.
        """
        descendants = _descendants(self.proc.pid)
        found = bool(descendants)
        for _ in range(5):
            for p in descendants:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            if self.isolation.get("pid_namespace") or not (descendants := _live_descendants(self.proc.pid)):
                break
        return found

    def _exited_within(self, seconds: float) -> bool:
        """Waits up to `seconds` for the leader to exit, without reaping it."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                if os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return True
            except ChildProcessError:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)


def _config(config: SandboxConfig | None, timeout_s: float | None, memory_mb: int | None) -> SandboxConfig:
    config = config or SandboxConfig()
    changes = {k: v for k, v in (("timeout_s", timeout_s), ("memory_mb", memory_mb)) if v is not None}
    return dataclasses.replace(config, **changes) if changes else config


def _check_code(code: Any, config: SandboxConfig) -> str | None:
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    size = len(code.encode("utf-8", errors="replace"))
    if size > config.max_code_bytes:
        return f"the program is {size} bytes; the limit is {config.max_code_bytes}"
    return None


def run_python(code: str, *, timeout_s: float | None = None, memory_mb: int | None = None,
               config: SandboxConfig | None = None) -> ToolResult:
    """Runs `code` in a fresh sandboxed interpreter and returns what it printed (never raises for
    anything the code does). `timeout_s`/`memory_mb` override the fields of `config`."""
    config = _config(config, timeout_s, memory_mb)
    problem = _check_code(code, config)
    if problem:
        return ToolResult.failure(problem)
    try:
        proc = _SandboxProcess(config, kernel_cpu_s=math.ceil(config.call_cpu_s))
    except SandboxError as e:
        return ToolResult.failure(str(e))
    try:
        return proc.run(code, config.timeout_s, config.call_cpu_s)
    finally:
        proc.close(graceful=True)


class PythonSession:
    """A persistent sandboxed interpreter: names defined by one `run` are visible to the next.

    Each call has the limits of `config`. A call that times out, overruns a limit or crashes the
    interpreter kills it; its error says that the state was lost, and the next call starts a fresh
    interpreter. Between calls the interpreter is stopped (SIGSTOP): threads the code left
    running resume with the next call. Thread-safe (calls are serialised). Use `close()` or a
    `with` block.
    """

    def __init__(self, config: SandboxConfig | None = None, *, timeout_s: float | None = None,
                 memory_mb: int | None = None):
        self.config = _config(config, timeout_s, memory_mb)
        self._proc: _SandboxProcess | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.restarts = 0

    def run(self, code: str, *, timeout_s: float | None = None) -> ToolResult:
        """Runs `code` in the session's interpreter; `timeout_s` overrides the config's wall-clock
        limit for this call (a positive finite number; None keeps the config's)."""
        limit = self.config.timeout_s if timeout_s is None else _config(self.config, timeout_s, None).timeout_s
        problem = _check_code(code, self.config)
        if problem:
            return ToolResult.failure(problem)
        with self._lock:
            if self._closed:
                return ToolResult.failure("the Python session is closed")
            if self._proc is None:
                try:
                    self._proc = _SandboxProcess(self.config, kernel_cpu_s=self.config.session_cpu_s)
                except SandboxError as e:
                    return ToolResult.failure(str(e))
            try:
                result = self._proc.run(code, limit, self.config.call_cpu_s)
            except BaseException:
                # Cut short in this process (KeyboardInterrupt): the interpreter is still in the cell
                # and its reply would answer the next call. End it; the next call starts afresh.
                self._proc.close()
                self._proc = None
                self.restarts += 1
                raise
            if self._closed:  # closed by another thread during the call (see `close`)
                self._proc.close()
                self._proc = None
                return ToolResult.failure("the Python session was closed during the call",
                                          duration_s=result.duration_s)
            if not self._proc.alive:
                self._proc = None
                self.restarts += 1
                result = dataclasses.replace(result, error=(result.error or "") + _RESTART_NOTE)
            else:  # threads the code left running wait for the next call
                self._proc.pause()
            return result

    @property
    def pids(self) -> list[int]:
        """PID of the live interpreter's process group leader, if any (for monitoring)."""
        proc = self._proc
        return [proc.proc.pid] if proc is not None and proc.alive else []

    @property
    def isolation(self) -> dict[str, bool]:
        """What the current interpreter achieved (see `sandbox_isolation`); empty before the first run."""
        proc = self._proc
        return dict(proc.isolation) if proc is not None else {}

    def close(self) -> None:
        """Ends the session without waiting for a call in progress.

        A call still running (for instance one its caller stopped waiting for) holds the lock:
        its interpreter is killed instead, and that call closes it as it returns. So a rollout
        that ends a trajectory never blocks on the trajectory's last program.
        """
        self._closed = True
        if not self._lock.acquire(blocking=False):
            proc = self._proc
            if proc is not None:
                proc.kill()
            return
        try:
            if self._proc is not None:
                self._proc.close(graceful=True)
                self._proc = None
        finally:
            self._lock.release()

    def __enter__(self) -> PythonSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self):
        proc = getattr(self, "_proc", None)
        if proc is not None:
            proc.close()


def sandbox_isolation(config: SandboxConfig | None = None) -> dict[str, bool]:
    """Starts an interpreter and reports which isolation layers it got on this host."""
    proc = _SandboxProcess(config or SandboxConfig(), kernel_cpu_s=10)
    try:
        return dict(proc.isolation)
    finally:
        proc.close()


class PythonTool:
    """The sandbox as a `Tool` taking `{"code": ...}`; `stateful=True` keeps one `PythonSession`
    (create one tool per trajectory and `close()` it when the trajectory ends)."""

    parameters = {"type": "object", "additionalProperties": False, "required": ["code"],
                  "properties": {"code": {"type": "string", "description": "Python source to execute."}}}
    execution = "thread"
    takes_timeout = True  # the executor passes each call's time limit; see `__call__`

    def __init__(self, config: SandboxConfig | None = None, *, stateful: bool = False, name: str = "python",
                 description: str | None = None):
        self.config = config or SandboxConfig()
        self.name = name
        self.description = description or (
            "Execute Python code in a sandbox and return what it prints; the value of a final expression "
            "is printed too. No network access." + (" Variables persist between calls." if stateful else ""))
        self._session = PythonSession(self.config) if stateful else None
        # The default per-call limit is the sandbox's own. The executor's watchdog only backstops
        # it, `timeout_grace_s` later: starting an interpreter is not part of a call's time.
        self.timeout_s = self.config.timeout_s
        self.timeout_grace_s = self.config.startup_timeout_s + 10.0

    def __call__(self, args: dict[str, Any], timeout_s: float | None = None) -> ToolResult:
        """Runs `args["code"]` with the sandbox's wall-clock limit, lowered to `timeout_s` if given.

        The sandbox itself enforces the limit and stops the program, so a caller with a shorter
        limit (a rollout's per-call or per-trajectory tool budget) gets the sandbox's timeout
        message, and a stateful session is restarted, rather than a call abandoned while it
        still runs and holds the session.
        """
        code = validate_arguments(self.parameters, args)["code"]
        limit = self.config.timeout_s if timeout_s is None else min(self.config.timeout_s, float(timeout_s))
        if self._session is not None:
            return self._session.run(code, timeout_s=limit)
        return run_python(code, config=self.config, timeout_s=limit)

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
