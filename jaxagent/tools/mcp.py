"""Tools served by Model Context Protocol (MCP) servers, as jaxagent `Tool`s.

Where this sits: a task (`jaxagent.envs`) puts these tools in its `ToolRegistry` beside its own;
the rollout driver calls them through the same `ToolExecutor`, with the same argument checks
(the server's input JSON schema is the tool's `parameters`), time limits and failures-as-data
(DESIGN decision 7). Needs the `mcp` extra (`pip install "jaxagent[mcp]"`); importing
`jaxagent.tools` does not import this module or `mcp`.

    server = MCPServer({"command": "python", "args": ["my_server.py"], "prefix": "web_"})
    registry = ToolRegistry([Calculator(), *server.tools])
    ...
    server.close()

One `MCPServer` is one server process spoken to over stdio (or, with `url`, a running server's
streamable HTTP endpoint), with one MCP session shared by every thread: the session lives on an
asyncio loop in a background thread, and a call from any thread is a request on that loop, so
calls from many rollout threads run concurrently (up to `max_concurrent_calls`; MCP multiplexes
requests over the one connection, and the server decides whether it runs them at once). What a
call can end in, each a `ToolResult`:

* the server's result: its text content joined, non-text content (images, audio, binary
  resources, resource links) as a bracketed placeholder that names its type and size, a text
  resource as its text; `isError` results are `ok=False` with the server's message;
* its time limit (`MCPTool(args, timeout_s=...)`, the executor's limit, else the server's
  `timeout_s`): the request is cancelled, the result says it timed out, the session goes on
  (unless a ping sent then goes unanswered too: the session is then given up, as below);
* the server process ending (or the HTTP connection failing) during the call: a failure that
  says so; the next call starts the server again, or opens a new session with it (at most
  `max_restarts` times in a row without a call answered in between, each restart logged), so a
  crash costs the calls in flight, not the run. A process found ended before a call is
  restarted before it, costing nothing.

A server that cannot be started or reached, that does not answer `initialize`, or whose tool
list our argument checks cannot read, raises `MCPServerError` at construction, naming the
command (or URL) and quoting the last lines of the process's stderr.
`close()` (also at interpreter exit) ends the session and kills what is left of the process
and its children.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import dataclasses
import difflib
import json
import logging
import math
import numbers
import os
import shlex
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import psutil

from jaxagent.tools.base import (
    ToolArgumentError,
    ToolRegistry,
    ToolResult,
    check_tool,
    validate_arguments,
)

try:
    import mcp
    from mcp import ClientSession, StdioServerParameters, stdio_client
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("jaxagent.tools.mcp needs the MCP SDK: pip install 'jaxagent[mcp]' (or "
                      "pip install 'mcp>=1.30,<3')") from e

log = logging.getLogger(__name__)

# JSON-RPC error code the SDK gives pending requests when the connection ends (both majors).
_CONNECTION_CLOSED = getattr(mcp.types, "CONNECTION_CLOSED", -32000)
_MCP_ERRORS: tuple[type[BaseException], ...] = tuple(
    cls for cls in (getattr(mcp, "MCPError", None), getattr(mcp, "McpError", None)) if isinstance(cls, type))
_STDERR_LINES = 40     # lines of the server's stderr kept for error messages
_CLOSE_WAIT_S = 10.0   # the longest `close` waits for the session to end before killing the process
_PING_TIMEOUT_S = 5.0  # a ping after a timed-out call that takes longer marks the session dead
_MARK_VARIABLE = "JAXAGENT_MCP_SESSION"  # set in a server's environment to find its process


class MCPServerError(RuntimeError):
    """An MCP server could not be started or used (the message names its command)."""


# --------------------------------------------------------------------------- configuration

@dataclasses.dataclass(frozen=True)
class MCPServerConfig:
    """One MCP server started over stdio, and how its tools appear to the policy.

    Attributes:
      command, args, env, cwd: the process to start (`env` is added to a minimal default
        environment the SDK builds: PATH, HOME and the like, not this process's whole environment).
      url, headers: instead of a command, a server already running behind a streamable HTTP
        endpoint (`http://host:port/mcp`), with HTTP headers for its requests (an
        `Authorization`, say). A restart is then a new session with it.
      tools: the server's tools to offer (None: all of them); a name the server lacks is an error.
      prefix: put before each tool's name (`"web_"`: `search` becomes `web_search`), to keep two
        servers' tools, or a server's and ours, apart.
      rename: {server's tool name: our name} (before `prefix`), for a name our registry does not
        take (dots, more than 64 characters) or one the policy should see differently.
      timeout_s: a call's time limit when the caller gives none.
      startup_timeout_s: the longest starting the process and listing its tools may take.
      max_restarts: restarts in a row (without a call answered in between) after the process
        ended; past it, calls fail at once saying so.
      max_concurrent_calls: requests in flight at once; more wait (within their time limit).
      name: the server's name in logs and errors (default: the command line).
    """

    command: str = ""
    args: tuple[str, ...] = ()
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    url: str = ""
    headers: Mapping[str, str] | None = None
    tools: tuple[str, ...] | None = None
    prefix: str = ""
    rename: Mapping[str, str] = dataclasses.field(default_factory=dict)
    timeout_s: float = 30.0
    startup_timeout_s: float = 30.0
    max_restarts: int = 3
    max_concurrent_calls: int = 16
    name: str | None = None

    def __post_init__(self):
        where = f"MCPServerConfig({'url' if self.url else 'command'}={self.url or self.command!r})"
        if not isinstance(self.command, str) or not isinstance(self.url, str):
            raise TypeError(f"MCPServerConfig.command and url must be strings, got {self.command!r} and {self.url!r}")
        if bool(self.command.strip()) == bool(self.url.strip()):
            raise ValueError("an MCP server needs either a command (the program to run over stdio) or a url (a "
                             f"streamable HTTP endpoint), not {'both' if self.command else 'neither'}: got "
                             f"command={self.command!r}, url={self.url!r}")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"{where}: url must be an http:// or https:// endpoint, got {self.url!r}")
        if self.url and (self.args or self.env is not None or self.cwd is not None):
            raise ValueError(f"{where}: args, env and cwd are for a command; a url names a running server")
        if self.headers is not None:
            if not self.url:
                raise ValueError(f"{where}: headers are for a url")
            if not isinstance(self.headers, Mapping) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in self.headers.items()):
                raise TypeError(f"{where}.headers must map names to string values, got {self.headers!r}")
            object.__setattr__(self, "headers", dict(self.headers))
        object.__setattr__(self, "args", _strings(self.args, f"{where}.args"))
        if self.tools is not None:
            object.__setattr__(self, "tools", _strings(self.tools, f"{where}.tools"))
        if self.env is not None:
            if not isinstance(self.env, Mapping) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
                raise TypeError(f"{where}.env must map names to string values, got {self.env!r}")
            object.__setattr__(self, "env", dict(self.env))
        if self.cwd is not None:
            if not isinstance(self.cwd, (str, os.PathLike)) or not os.path.isdir(self.cwd):
                raise ValueError(f"{where}.cwd must be an existing directory, got {self.cwd!r}")
            object.__setattr__(self, "cwd", os.fspath(self.cwd))
        if not isinstance(self.prefix, str):
            raise TypeError(f"{where}.prefix must be a string, got {self.prefix!r}")
        if not isinstance(self.rename, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.rename.items()):
            raise TypeError(f"{where}.rename must map the server's tool names to ours, got {self.rename!r}")
        object.__setattr__(self, "rename", dict(self.rename))
        for field in ("timeout_s", "startup_timeout_s"):
            value = getattr(self, field)
            if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0
                    or not math.isfinite(value)):
                raise ValueError(f"{where}.{field} must be a positive number of seconds, got {value!r}")
        for field, low in (("max_restarts", 0), ("max_concurrent_calls", 1)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise ValueError(f"{where}.{field} must be an int >= {low}, got {value!r}")
        if self.name is not None and not isinstance(self.name, str):
            raise TypeError(f"{where}.name must be a string or None, got {self.name!r}")

    @classmethod
    def from_mapping(cls, spec: Mapping[str, Any]) -> MCPServerConfig:
        """A config from a dict (a run config's `mcp_servers` entry); unknown keys are an error."""
        if isinstance(spec, MCPServerConfig):
            return spec
        if hasattr(spec, "to_dict") and not isinstance(spec, Mapping):  # an ml_collections ConfigDict
            spec = spec.to_dict()
        if not isinstance(spec, Mapping):
            raise TypeError(f"an MCP server is a dict with a 'command' (and 'args', 'env', ...) or a 'url', "
                            f"got {spec!r}")
        fields = [f.name for f in dataclasses.fields(cls)]
        for key in spec:
            if key not in fields:
                close = difflib.get_close_matches(str(key), fields, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"MCP server {spec.get('command') or spec.get('url', '?')!r}: unknown setting {key!r}{hint}; "
                                 f"its settings are: {fields}")
        if "command" not in spec and "url" not in spec:
            raise ValueError(f"an MCP server needs a 'command' (the program to run) or a 'url', got {dict(spec)!r}")
        return cls(**dict(spec))

    @property
    def label(self) -> str:
        """How logs and errors name the server."""
        return self.name or self.url or shlex.join([self.command, *self.args])


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{where} must be a list of strings, got {value!r}")
    return tuple(value)


# --------------------------------------------------------------------------- results

def _nbytes(b64: str) -> int:
    """The size of base64 data without decoding it."""
    return len(b64) * 3 // 4 - b64[-2:].count("=") if b64 else 0


def content_text(blocks: Sequence[Mapping[str, Any]]) -> str:
    """The text a policy sees for MCP content blocks (wire form: `{"type": "text", "text": ...}`).

    Text is kept; a text resource is its URI line and its text; what a language model cannot
    read (images, audio, binary resources, resource links) is a placeholder naming its type,
    MIME type and size, so the policy knows something came back.
    """
    parts = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            parts.append(str(block.get("text", "")))
        elif kind in ("image", "audio"):
            parts.append(f"[{kind}: {block.get('mimeType', 'unknown type')}, {_nbytes(block.get('data', ''))} bytes]")
        elif kind == "resource":
            resource = block.get("resource") or {}
            uri, mime = resource.get("uri", "?"), resource.get("mimeType")
            if "text" in resource:
                parts.append(f"[resource: {uri}]\n{resource['text']}")
            else:
                parts.append(f"[resource: {uri}, {mime or 'binary'}, {_nbytes(resource.get('blob', ''))} bytes]")
        elif kind == "resource_link":
            name = block.get("name")
            parts.append(f"[resource link: {block.get('uri', '?')}{f' ({name})' if name else ''}]")
        else:
            parts.append(f"[{kind or 'unknown'} content]")
    return "\n".join(parts)


def _wire(model: Any) -> dict[str, Any]:
    """An SDK model as its JSON wire form (camelCase keys in both SDK majors)."""
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


def to_tool_result(result: Mapping[str, Any], tool_name: str) -> ToolResult:
    """A `CallToolResult` (wire form) as a `ToolResult`; `isError` makes it a failure."""
    text = content_text(result.get("content") or [])
    if not text and result.get("structuredContent") is not None:
        text = json.dumps(result["structuredContent"], ensure_ascii=False)
    if result.get("isError"):
        return ToolResult.failure(text or f"tool {tool_name!r} reported an error without a message")
    return ToolResult.success(text)


# --------------------------------------------------------------------------- the tool

@dataclasses.dataclass(frozen=True, eq=False)
class MCPTool:
    """One tool of an `MCPServer`, as a jaxagent `Tool`.

    Runs on an executor thread (`execution="thread"`) and keeps its own time limit
    (`takes_timeout`): the executor passes its limit and backstops it by `timeout_grace_s`.
    """

    server: MCPServer
    name: str
    remote_name: str  # the name the server knows it by
    description: str
    parameters: Mapping[str, Any]
    timeout_s: float | None = None
    execution: str = "thread"
    takes_timeout: bool = True
    timeout_grace_s: float = 5.0

    def __call__(self, args: dict[str, Any], timeout_s: float | None = None) -> ToolResult:
        try:
            checked = validate_arguments(self.parameters, args)
        except ToolArgumentError as e:
            return ToolResult.failure(f"bad arguments for tool {self.name!r}: {e}")
        return self.server.call(self.remote_name, checked, timeout_s=timeout_s, tool_name=self.name)

    def __repr__(self) -> str:
        return f"MCPTool({self.name!r} of {self.server.label!r})"


# --------------------------------------------------------------------------- the server

@dataclasses.dataclass(eq=False)
class _Connection:
    """One running server process and its session (a restart makes a new one)."""

    stop: asyncio.Event
    stderr: collections.deque
    session: Any = None
    task: asyncio.Task | None = None
    pid: int | None = None
    dead: str | None = None  # why the connection is no longer usable
    probing: bool = False    # a ping after a timed-out call is under way (`MCPServer._probe`)
    stderr_reader: threading.Thread | None = None

    def process_ended(self) -> bool:
        if self.pid is None:
            return False
        try:
            return _ended(psutil.Process(self.pid))
        except psutil.NoSuchProcess:
            return True


_LIVE: weakref.WeakSet[MCPServer] = weakref.WeakSet()
_SPAWN_LOCK = threading.Lock()  # one server spawned at a time, so its process can be told apart


class MCPServer:
    """A client of one MCP server process over stdio, shared by all threads; see the module docstring.

    Args:
      config: an `MCPServerConfig`, or a dict of its fields (`{"command": ..., "args": [...]}`);
        keyword arguments are the same fields (they override the config's).

    Raises `MCPServerError` when the server does not start, does not answer, or lists tools our
    argument checks cannot read.
    """

    def __init__(self, config: MCPServerConfig | Mapping[str, Any] | None = None, /, **fields: Any):
        if isinstance(config, MCPServerConfig):
            self.config = dataclasses.replace(config, **fields) if fields else config
        else:
            self.config = MCPServerConfig.from_mapping({**dict(config or {}), **fields})
        self.label = self.config.label
        self._owner = os.getpid()  # a forked child inherits this object, not its thread or session
        self._closed = False
        self._close_lock = threading.Lock()
        self._conn: _Connection | None = None
        self._restarts = 0   # in a row, without a call answered in between
        self._listed: list[dict[str, Any]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"jaxagent-mcp-{self.label[:40]}")
        self._thread.start()
        self._restart_lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(self.config.max_concurrent_calls)
        self._in_flight: set[asyncio.Task] = set()  # calls waiting on the server, cancelled by `close`
        try:
            self._conn, self._listed = self._submit(self._open()).result()
            self.tools: list[MCPTool] = self._make_tools(self._listed)
        except BaseException:
            self.close()
            raise
        _LIVE.add(self)

    # ----------------------------------------------------------------- public API

    def call(self, name: str, args: Mapping[str, Any] | None = None, *, timeout_s: float | None = None,
             tool_name: str | None = None) -> ToolResult:
        """Calls the server's tool `name` from any thread; always returns a `ToolResult`.

        `args` go to the server as given (an `MCPTool` checks them against the tool's schema
        first). `tool_name` is how errors name the tool (default `name`).
        """
        shown = tool_name or name
        limit = float(timeout_s) if timeout_s is not None else float(self.config.timeout_s)
        start = time.monotonic()
        if os.getpid() != self._owner:
            return ToolResult.failure(f"tool {shown!r} was not run: its MCP server {self.label!r} belongs to the "
                                      "process that started it, and this one is a fork of it")
        if self._closed:
            return ToolResult.failure(f"tool {shown!r} was not run: its MCP server {self.label!r} is closed")
        try:
            future = self._submit(self._call(name, dict(args or {}), limit, shown))
        except RuntimeError:  # the loop stopped: closed meanwhile
            return ToolResult.failure(f"tool {shown!r} was not run: its MCP server {self.label!r} is closed")
        try:
            # The loop answers at the limit itself; the margin covers a loop busy restarting.
            result = future.result(timeout=limit + 5.0)
        except concurrent.futures.TimeoutError:
            future.cancel()
            result = ToolResult.failure(f"tool {shown!r} timed out after {limit:g} s", timed_out=True)
        except concurrent.futures.CancelledError:
            result = ToolResult.failure(f"tool {shown!r} was stopped: its MCP server {self.label!r} was closed "
                                        "during the call")
        return dataclasses.replace(result, duration_s=time.monotonic() - start)

    @property
    def pid(self) -> int | None:
        """The process id of the running server (None when not known or not running)."""
        conn = self._conn
        return conn.pid if conn is not None and conn.dead is None else None

    @property
    def restarts(self) -> int:
        """Restarts since a call was last answered."""
        return self._restarts

    def close(self) -> None:
        """Ends the session and the server process (and its children); idempotent. In a process
        forked from the one that started the server, it does nothing: the server is the parent's."""
        if os.getpid() != self._owner:
            return
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        _LIVE.discard(self)
        pids: list[int] = []
        if self._loop.is_running():
            try:
                pids = self._submit(self._shutdown()).result(timeout=_CLOSE_WAIT_S + 5.0)
            except BaseException:  # noqa: BLE001 - the processes are killed below either way
                log.warning("MCP server %r did not shut down cleanly", self.label, exc_info=True)
                conn = self._conn
                pids = [conn.pid] if conn is not None and conn.pid is not None else []
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5.0)
        _kill_now(pids)
        if not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> MCPServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MCPServer({self.label!r}, tools={[t.name for t in getattr(self, 'tools', [])]})"

    @property
    def _lost(self) -> str:
        """What ended a session that stopped answering."""
        return "its process ended" if not self.config.url else "the connection to it was lost"

    # ----------------------------------------------------------------- on the loop

    def _submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _open(self) -> tuple[_Connection, list[dict[str, Any]]]:
        """Starts the process, initialises the session and lists the tools, within the startup limit."""
        conn = _Connection(stop=asyncio.Event(), stderr=collections.deque(maxlen=_STDERR_LINES))
        ready: asyncio.Future = self._loop.create_future()
        ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # read once, or not at all
        conn.task = asyncio.ensure_future(self._serve(conn, ready))
        limit = self.config.startup_timeout_s
        try:
            listed = await asyncio.wait_for(asyncio.shield(ready), limit)
        except BaseException as e:
            await self._end(conn)
            if conn.stderr_reader is not None:  # its last words, for the message below
                await self._loop.run_in_executor(None, conn.stderr_reader.join, 1.0)
            cause = _leaf(e)
            if isinstance(e, asyncio.TimeoutError):
                problem = f"did not start and list its tools within startup_timeout_s={limit:g} s"
            elif _connection_lost(cause) or conn.process_ended():
                problem = ("closed the connection during its startup" if self.config.url
                           else "exited during its startup")
            elif isinstance(cause, OSError):
                problem = f"could not be started: {type(cause).__name__}: {cause}"
            else:
                problem = f"failed during its startup: {type(cause).__name__}: {cause}"
            raise MCPServerError(f"MCP server {self.label!r} {problem}{_stderr_note(conn)}") from e
        return conn, listed

    async def _serve(self, conn: _Connection, ready: asyncio.Future) -> None:
        """Holds one session open until `conn.stop` (the SDK's contexts open and close in one task)."""
        try:
            async with contextlib.AsyncExitStack() as stack:
                if self.config.url:
                    read, write = await self._http_streams(stack)
                else:
                    read, write = await self._stdio_streams(stack, conn)
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                listed = await _list_tools(session)
                conn.session = session
                ready.set_result(listed)
                await conn.stop.wait()
        except BaseException as e:  # noqa: BLE001 - reported through `ready`, or the next call
            if not ready.done():
                if isinstance(e, asyncio.CancelledError):
                    ready.cancel()
                else:
                    ready.set_exception(e)
            elif not conn.stop.is_set():
                log.warning("MCP server %r: its session ended: %s", self.label, e)
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            conn.dead = conn.dead or "the session ended"

    async def _stdio_streams(self, stack: contextlib.AsyncExitStack, conn: _Connection) -> tuple[Any, Any]:
        """Starts the server process; its stderr goes to `conn.stderr` (and the DEBUG log)."""
        config = self.config
        # A mark in the child's environment tells its process apart from any other we start.
        mark = f"{os.getpid()}-{id(conn)}-{time.monotonic_ns()}"
        params = StdioServerParameters(command=config.command, args=list(config.args), cwd=config.cwd,
                                       env={**(config.env or {}), _MARK_VARIABLE: mark})
        read_fd, write_fd = os.pipe()
        errlog = os.fdopen(write_fd, "w")
        stack.callback(lambda: errlog.closed or errlog.close())
        conn.stderr_reader = threading.Thread(target=_read_stderr, args=(read_fd, conn.stderr, self.label),
                                              daemon=True, name="jaxagent-mcp-stderr")
        conn.stderr_reader.start()
        with _SPAWN_LOCK:
            before = _child_pids()
            streams = await stack.enter_async_context(stdio_client(params, errlog=errlog))
            conn.pid = await _find_child(before, config, mark)
        errlog.close()  # the child holds its own copy; the reader sees the end when it exits
        return streams[0], streams[1]

    async def _http_streams(self, stack: contextlib.AsyncExitStack) -> tuple[Any, Any]:
        """Connects to the streamable HTTP endpoint (the SDK's transport and HTTP client, both majors)."""
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client

        client = await stack.enter_async_context(create_mcp_http_client(headers=self.config.headers))
        streams = await stack.enter_async_context(streamable_http_client(self.config.url, http_client=client))
        return streams[0], streams[1]  # mcp 1.x adds a third: a session-id getter

    async def _end(self, conn: _Connection, *, graceful: bool = True) -> None:
        """Closes `conn`'s session and process (bounded), killing what is left.

        A session that is up ends as MCP asks (stdin closed, the process given time to exit,
        then signalled: the SDK's shutdown); one still starting, whose process may never answer,
        or one given up on (`graceful=False`: it stopped answering) is killed at once.
        """
        conn.dead = conn.dead or "closed"
        conn.stop.set()
        pids = _tree(conn.pid)
        if conn.task is not None and not conn.task.done():
            if conn.session is None or not graceful:
                await _kill(pids)
                conn.task.cancel()
            done, _ = await asyncio.wait({conn.task}, timeout=_CLOSE_WAIT_S)
            if not done:
                conn.task.cancel()
                await asyncio.wait({conn.task}, timeout=2.0)
        await _kill(pids)

    async def _shutdown(self) -> list[int]:
        for task in list(self._in_flight):
            task.cancel()
        conn = self._conn
        if conn is None:
            return []
        pids = _tree(conn.pid)
        await self._end(conn)
        return pids

    async def _connection(self) -> _Connection:
        """The live connection, started again when the process has ended (bounded, logged)."""
        conn = self._conn
        if conn is not None and conn.dead is None and not conn.process_ended():
            return conn
        async with self._restart_lock:
            if self._closed:
                raise MCPServerError(f"its MCP server {self.label!r} is closed")
            conn = self._conn
            if conn is not None and conn.dead is None and not conn.process_ended():
                return conn  # another call restarted it
            reason = conn.dead if conn is not None and conn.dead else self._lost
            if self._restarts >= self.config.max_restarts:
                raise MCPServerError(
                    f"its MCP server {self.label!r} is down ({reason}) and was restarted {self._restarts} "
                    f"times in a row without answering a call; not restarted again (max_restarts="
                    f"{self.config.max_restarts})")
            self._restarts += 1
            log.warning("MCP server %r is down (%s); starting a new session (restart %d of at most %d in a row)%s",
                        self.label, reason, self._restarts, self.config.max_restarts,
                        _stderr_note(conn) if conn is not None else "")
            if conn is not None:
                await self._end(conn, graceful=False)
            try:
                new, listed = await self._open()
            except MCPServerError as e:
                self._conn = _Connection(stop=asyncio.Event(), stderr=collections.deque(), dead=str(e))
                raise
            if [t.get("name") for t in listed] != [t.get("name") for t in self._listed]:
                log.warning("MCP server %r lists other tools since its restart: %s (was %s); the tools "
                            "made at its start are kept", self.label, [t.get("name") for t in listed],
                            [t.get("name") for t in self._listed])
            self._conn = new
            return new

    async def _call(self, name: str, args: dict[str, Any], limit: float, shown: str) -> ToolResult:
        deadline = self._loop.time() + limit

        def timed_out(waiting: str = "") -> ToolResult:
            return ToolResult.failure(f"tool {shown!r} timed out after {limit:g} s{waiting}", timed_out=True)

        # A restart goes on when the call that waits for it runs out of time (the next call finds
        # it done); its failure, if nobody waits any more, is the next call's to report.
        getting = asyncio.ensure_future(self._connection())
        getting.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            conn = await asyncio.wait_for(asyncio.shield(getting), limit)
        except asyncio.TimeoutError:
            return timed_out(f" (waiting for its MCP server {self.label!r} to restart)")
        except MCPServerError as e:
            return ToolResult.failure(f"tool {shown!r} was not run: {e}")

        async def attempt():
            async with self._slots:  # waiting for a slot counts toward the call's limit
                return await conn.session.call_tool(name, args)

        self._in_flight.add(asyncio.current_task())
        try:
            result = await asyncio.wait_for(attempt(), max(deadline - self._loop.time(), 0.0))
        except asyncio.TimeoutError:
            self._probe(conn)
            return timed_out()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed call is an observation
            if _connection_lost(_leaf(e)) or conn.process_ended():
                conn.dead = self._lost
                log.warning("MCP server %r ended during a call of %r: %s%s", self.label, name, conn.dead,
                            _stderr_note(conn))
                return ToolResult.failure(f"tool {shown!r} failed: its MCP server {self.label!r} stopped during "
                                          f"the call ({conn.dead}); the next call "
                                          f"{'connects again' if self.config.url else 'starts it again'}")
            return ToolResult.failure(f"tool {shown!r} failed: {_describe(e)}")
        finally:
            self._in_flight.discard(asyncio.current_task())
        self._restarts = 0
        return to_tool_result(_wire(result), shown)

    def _probe(self, conn: _Connection) -> None:
        """After a timed-out call: a ping, in the background, that marks the session dead when it goes
        unanswered too, so that the next call starts a new one. A server that is busy but alive
        answers it (requests run concurrently); one whose process or connection is gone without
        the SDK failing the request (mcp 1.x over HTTP leaves it pending) does not."""
        if conn.dead is not None or conn.probing:
            return
        conn.probing = True

        async def ping():
            try:
                await asyncio.wait_for(conn.session.send_ping(), _PING_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - any failure: the session is not usable
                if conn.dead is None:
                    leaf = _leaf(e)
                    why = f"{type(leaf).__name__}: {leaf}" if str(leaf) else type(leaf).__name__
                    conn.dead = f"it did not answer a ping after a timed-out call ({why})"
                    log.warning("MCP server %r: %s; the next call starts a new session", self.label, conn.dead)
            finally:
                conn.probing = False

        task = asyncio.ensure_future(ping())
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    # ----------------------------------------------------------------- tools

    def _make_tools(self, listed: list[dict[str, Any]]) -> list[MCPTool]:
        config = self.config
        by_name = {t.get("name"): t for t in listed}
        for key, what in ((config.tools or (), "tools"), (config.rename, "rename")):
            missing = [n for n in key if n not in by_name]
            if missing:
                raise MCPServerError(f"MCP server {self.label!r}: {what} names tools it does not have: {missing}; "
                                     f"it has: {sorted(map(str, by_name))}")
        wanted = config.tools if config.tools is not None else list(by_name)
        tools = []
        for remote in wanted:
            spec = by_name[remote]
            name = config.prefix + config.rename.get(remote, remote)
            schema = spec.get("inputSchema")
            tool = MCPTool(server=self, name=name, remote_name=remote, description=spec.get("description") or "",
                           parameters=schema if isinstance(schema, Mapping) else {}, timeout_s=config.timeout_s)
            try:
                if not isinstance(schema, Mapping):
                    raise TypeError(f"its inputSchema is {schema!r}, not a JSON schema object")
                check_tool(tool)
            except (TypeError, ValueError) as e:
                hint = ("; give it another name with rename={...} or leave it out with tools=[...]"
                        if "name" in str(e) else "; leave it out with tools=[...]")
                raise MCPServerError(f"MCP server {self.label!r} lists a tool {remote!r} that jaxagent cannot use: "
                                     f"{e}{hint}") from e
            if any(t.name == name for t in tools):
                raise MCPServerError(f"MCP server {self.label!r}: two of its tools would be named {name!r}; "
                                     "rename one (rename={...})")
            tools.append(tool)
        return tools


# --------------------------------------------------------------------------- helpers

async def _list_tools(session: Any) -> list[dict[str, Any]]:
    """Every page of the server's tool list, in wire form."""
    tools: list[dict[str, Any]] = []
    cursor = None
    for _ in range(1000):
        page = _wire(await (session.list_tools() if cursor is None else
                            session.list_tools(params=mcp.types.PaginatedRequestParams(cursor=cursor))))
        tools.extend(page.get("tools") or [])
        cursor = page.get("nextCursor")
        if not cursor:
            return tools
    raise MCPServerError("the server's tool list did not end after 1000 pages")


def _leaf(e: BaseException) -> BaseException:
    """The exception inside the SDK's task-group wrappers (an exception group of one)."""
    while len(getattr(e, "exceptions", ())) == 1:
        e = e.exceptions[0]
    return e


def _connection_lost(e: BaseException) -> bool:
    if isinstance(e, _MCP_ERRORS):
        return getattr(e, "code", getattr(getattr(e, "error", None), "code", None)) == _CONNECTION_CLOSED
    return isinstance(e, (ConnectionError, EOFError, BrokenPipeError)) or type(e).__name__ in (
        "ClosedResourceError", "BrokenResourceError", "EndOfStream")


def _describe(e: BaseException) -> str:
    if isinstance(e, _MCP_ERRORS):
        return f"the MCP server answered with an error: {e}"
    return f"{type(e).__name__}: {e}"


def _read_stderr(fd: int, tail: collections.deque, label: str) -> None:
    """Keeps the server's last stderr lines (for errors) and logs each at DEBUG."""
    with os.fdopen(fd, "r", errors="replace") as stream:
        for line in stream:
            line = line.rstrip("\n")
            tail.append(line)
            log.debug("[MCP server %s] %s", label, line)


def _stderr_note(conn: _Connection) -> str:
    lines = [line for line in list(conn.stderr) if line.strip()]
    if not lines:
        return ""
    return "; its last stderr lines:\n" + "\n".join(lines[-10:])


def _child_pids() -> set[int]:
    try:
        return {p.pid for p in psutil.Process().children()}
    except psutil.Error:
        return set()


async def _find_child(before: set[int], config: MCPServerConfig, mark: str) -> int | None:
    """The server process just spawned: the child of ours whose environment has `mark` (a wrapper's
    child has it too: the one nearest to us wins), or, where no environment can be read, the new
    child whose command line ends with the server's args. Looked for a few times over half a second."""
    me = os.getpid()
    for _ in range(20):
        marked, found = [], []
        for proc in psutil.Process().children(recursive=True):
            try:
                if proc.environ().get(_MARK_VARIABLE) == mark:
                    marked.append((proc.pid, proc.ppid()))
                elif proc.pid not in before and proc.ppid() == me:
                    cmdline = proc.cmdline()
                    if not config.args or cmdline[-len(config.args):] == list(config.args):
                        found.append(proc.pid)
            except psutil.Error:
                continue
        if marked:
            return next((pid for pid, parent in marked if parent == me), marked[0][0])
        if len(found) == 1:
            return found[0]
        await asyncio.sleep(0.025)
    log.warning("MCP server %r: cannot tell its process among %d new child processes; a crash is then "
                "noticed by the calls it fails, and close() relies on the SDK's shutdown", config.label,
                len(found))
    return None


def _tree(pid: int | None) -> list[int]:
    """`pid` and its descendants."""
    if pid is None:
        return []
    try:
        return [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return []


def _kill_now(pids: Iterable[int]) -> list[psutil.Process]:
    """SIGKILLs what is still running of `pids`; returns those processes. Nothing is reaped here:
    the SDK's transport waits for its process, and would log a child reaped under it."""
    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                proc.kill()
                procs.append(proc)
        except psutil.Error:
            pass
    return procs


def _ended(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def _kill(pids: Iterable[int]) -> None:
    """`_kill_now`, then waits (at most 2 s) for the processes to end."""
    procs = _kill_now(pids)
    deadline = time.monotonic() + 2.0
    while procs and not all(map(_ended, procs)) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


@atexit.register
def _close_all() -> None:
    for server in list(_LIVE):
        server.close()


# --------------------------------------------------------------------------- registries

def register_mcp_tools(registry: ToolRegistry, server: MCPServer) -> None:
    """Adds `server`'s tools to `registry`; a name already taken is an error naming both sides."""
    for tool in server.tools:
        if tool.name in registry:
            other = registry.get(tool.name)
            owner = (f"MCP server {other.server.label!r}" if isinstance(other, MCPTool)
                     else f"{type(other).__name__}")
            raise ValueError(f"MCP server {server.label!r}: its tool {tool.remote_name!r} would be named "
                             f"{tool.name!r}, which {owner} already uses; give the server a prefix "
                             "(\"prefix\": \"name_\") or rename the tool (\"rename\": {...})")
    for tool in server.tools:
        registry.register(tool)


def start_servers(specs: Iterable[MCPServerConfig | Mapping[str, Any]],
                  registry: ToolRegistry | None = None) -> tuple[list[MCPServer], ToolRegistry]:
    """Starts each server and adds its tools to `registry` (a new one when None).

    Returns (servers, registry). When one fails to start or clashes, those already started are
    closed before the error is raised.
    """
    registry = ToolRegistry() if registry is None else registry
    servers: list[MCPServer] = []
    try:
        for spec in specs:
            server = MCPServer(spec)
            servers.append(server)
            register_mcp_tools(registry, server)
    except BaseException:
        for server in servers:
            server.close()
        raise
    return servers, registry
