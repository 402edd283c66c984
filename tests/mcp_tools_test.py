"""Tests for jaxagent/tools/mcp.py against a real MCP server over stdio (tests/data/mcp/server.py,
written with the SDK's server API): listing, calls, argument checks before the call, concurrency,
tool errors, timeouts, a crash and its restart, startup failures, name clashes and shutdown."""

import json
import logging
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

pytest.importorskip("mcp")

from jaxagent.tools import Calculator, ToolExecutor, ToolRegistry, function_tool  # noqa: E402
from jaxagent.tools.mcp import (  # noqa: E402
    MCPServer,
    MCPServerConfig,
    MCPServerError,
    MCPTool,
    content_text,
    register_mcp_tools,
    start_servers,
    to_tool_result,
)

DATA = pathlib.Path(__file__).parent / "data" / "mcp"
SERVER = {"command": sys.executable, "args": [str(DATA / "server.py")]}


@pytest.fixture(scope="module")
def server():
    with MCPServer(SERVER, name="test") as s:
        yield s


@pytest.fixture
def own_server():
    """A server of the test's own (for crashes and shutdown)."""
    servers = []

    def start(**settings):
        servers.append(MCPServer({**SERVER, **settings}))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def lambda_add(a: int, b: int) -> int:
    """Adds."""
    return a + b


def tool(server, name):
    return next(t for t in server.tools if t.name == name)


def alive(pid):
    assert pid is not None, "the server's process was not found"
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone(pid, within_s=5.0):
    """Whether `pid` has ended (or ends within `within_s`: a process that exits takes a moment)."""
    deadline = time.monotonic() + within_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def no_new_servers(before, within_s=5.0):
    """Whether every test server started since `before` has ended (or does within `within_s`)."""
    deadline = time.monotonic() + within_s
    while server_processes(before):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def server_processes(before=()):
    """Our descendants running a test server (other than the pids in `before`)."""
    return [p.pid for p in psutil.Process().children(recursive=True)
            if p.pid not in before and alive(p.pid) and any("server.py" in part for part in p.cmdline())]


# --------------------------------------------------------------------------- listing

def test_lists_the_servers_tools_with_their_schemas(server):
    names = [t.name for t in server.tools]
    assert names == ["add", "echo", "sleep", "fail", "crash", "pid", "env_value", "media"]
    add = tool(server, "add")
    assert isinstance(add, MCPTool) and add.description == "Adds two integers."
    assert add.parameters["required"] == ["a", "b"]
    assert add.parameters["properties"]["a"]["type"] == "integer"
    registry = ToolRegistry([Calculator(), *server.tools])
    schema = next(s for s in registry.schemas() if s["function"]["name"] == "echo")
    assert schema["function"]["parameters"]["properties"]["times"]["default"] == 1
    assert "- add(a: integer, b: integer): Adds two integers." in registry.describe()
    assert "- echo(text: string, times?: integer): Repeats a text." in registry.describe()


@pytest.mark.slow  # a server of its own (~1-2 s); the default run keeps the core cases
def test_tools_filter_prefix_and_rename(own_server):
    s = own_server(tools=["add", "echo"], prefix="m_", rename={"echo": "say"})
    assert [t.name for t in s.tools] == ["m_add", "m_say"]
    assert tool(s, "m_say")({"text": "ab", "times": 2}).output == "abab"
    assert tool(s, "m_add").remote_name == "add"


def test_a_tool_the_server_lacks_is_an_error_naming_it():
    before = server_processes()
    with pytest.raises(MCPServerError, match=r"tools names tools it does not have: \['nope'\].*'add'"):
        MCPServer({**SERVER, "tools": ["add", "nope"]})
    assert no_new_servers(before)  # the server it started is gone


# --------------------------------------------------------------------------- calls

def test_valid_call_through_the_executor(server):
    with ToolExecutor(ToolRegistry(server.tools)) as executor:
        result = executor.run("add", {"a": 2, "b": 3})
        assert result.ok and result.output == "5"
        assert executor.run("add", {"a": 2.0, "b": 3}).output == "5"  # integral float coerced


def test_invalid_arguments_are_rejected_before_the_call(server):
    add = tool(server, "add")
    # Our checks answer (the server's own would say "validation error for addArguments").
    result = add({"a": "x", "b": 1})
    assert not result.ok and result.error == "bad arguments for tool 'add': argument 'a' must be of type " \
                                             "integer, got str"
    assert add({"a": 1}).error == "bad arguments for tool 'add': missing required argument(s): b"
    with ToolExecutor(ToolRegistry(server.tools)) as executor:
        result = executor.run("add", {"b": 1})
        assert not result.ok and "missing required argument(s): a" in result.error


def test_tool_error_result_is_a_failure_the_policy_sees(server):
    result = tool(server, "fail")({"message": "boom"})
    assert not result.ok and "boom" in result.error and not result.timed_out
    assert result.to_observation().startswith("Error: ") and "boom" in result.to_observation()


def test_non_text_content_becomes_placeholders(server):
    result = tool(server, "media")({})
    assert result.ok
    assert result.output.splitlines() == [
        "here is a picture", "[image: image/png, 100 bytes]", "[resource: file:///notes.txt]", "resource text",
        "[resource: file:///data.bin, application/octet-stream, 10 bytes]"]


def test_content_text_of_every_block_kind():
    blocks = [{"type": "audio", "data": "AAAA", "mimeType": "audio/wav"},
              {"type": "resource_link", "uri": "file:///a", "name": "a"},
              {"type": "hologram"}]
    assert content_text(blocks) == "[audio: audio/wav, 3 bytes]\n[resource link: file:///a (a)]\n[hologram content]"
    assert to_tool_result({"content": [], "structuredContent": {"x": 1}}, "t").output == '{"x": 1}'
    assert to_tool_result({"content": [], "isError": True}, "t").error == \
        "tool 't' reported an error without a message"


@pytest.mark.slow  # a server of its own (~1-2 s); the default run keeps the core cases
def test_env_and_cwd_reach_the_server_process(own_server, tmp_path):
    s = own_server(env={"JAXAGENT_MCP_TEST": "hello"}, cwd=str(tmp_path))
    assert tool(s, "env_value")({"key": "JAXAGENT_MCP_TEST"}).output == f"hello in {tmp_path}"


def test_sixteen_calls_from_eight_threads_run_concurrently(server):
    sleep = tool(server, "sleep")
    results = {}
    with ToolExecutor(ToolRegistry(server.tools), max_workers=16) as executor:
        def worker(k):
            futures = [executor.submit("sleep", {"seconds": 0.5 + (2 * k + j) / 1000}) for j in range(2)]
            for j, f in enumerate(futures):
                results[2 * k + j] = f.result()

        start = time.monotonic()
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - start
    assert len(results) == 16
    for i, result in results.items():  # each answer went to its own call
        assert result.ok and result.output == f"slept {0.5 + i / 1000}", result
    assert elapsed < 4.0, f"16 calls of 0.5 s took {elapsed:.2f} s (8 s one after another): they did not overlap"
    assert sleep.server is server


# --------------------------------------------------------------------------- failures

def test_timeout_is_an_error_and_the_session_stays_usable(server):
    pid = server.pid
    start = time.monotonic()
    result = tool(server, "sleep")({"seconds": 10}, timeout_s=0.3)
    assert not result.ok and result.timed_out and "timed out after 0.3 s" in result.error
    assert time.monotonic() - start < 5.0  # not the 10 s of the call
    assert tool(server, "add")({"a": 1, "b": 1}).output == "2"
    assert server.pid == pid  # the same process and session
    # Through the executor, whose limit the tool keeps itself (its watchdog stays a backstop).
    with ToolExecutor(ToolRegistry(server.tools)) as executor:
        result = executor.run("sleep", {"seconds": 10}, timeout_s=0.3)
        assert result.timed_out and result.error == "tool 'sleep' timed out after 0.3 s"
        assert executor.run("echo", {"text": "ok"}).output == "ok"


def test_a_crash_mid_call_fails_the_call_and_the_next_call_restarts_the_server(own_server, caplog):
    s = own_server()
    first = s.pid
    with caplog.at_level(logging.WARNING, logger="jaxagent.tools.mcp"):
        result = tool(s, "crash")({})
        assert not result.ok and "stopped during the call" in result.error
        assert "the next call starts it again" in result.error
        assert tool(s, "add")({"a": 2, "b": 2}).output == "4"
    assert s.pid != first and gone(first)
    assert tool(s, "pid")({}).output == str(s.pid)
    assert any("starting a new session (restart 1 of at most 3" in r.getMessage() for r in caplog.records)
    assert s.restarts == 0  # a call was answered since


@pytest.mark.slow  # ~2 s: two starts
def test_a_server_killed_while_idle_is_restarted_before_the_next_call(own_server):
    s = own_server()
    first = s.pid
    psutil.Process(first).kill()
    psutil.Process(first).wait(timeout=5)
    assert tool(s, "add")({"a": 1, "b": 2}).output == "3"  # no call is lost
    assert s.pid != first


@pytest.mark.slow  # a server of its own (~1-2 s); the default run keeps the core cases
def test_a_server_that_stops_answering_is_replaced_after_a_timed_out_call(own_server, monkeypatch):
    import jaxagent.tools.mcp as mcp_module
    monkeypatch.setattr(mcp_module, "_PING_TIMEOUT_S", 0.5)
    s = own_server()
    first = s.pid
    psutil.Process(first).suspend()  # alive, but answers nothing (not even a ping)
    assert tool(s, "add")({"a": 1, "b": 2}, timeout_s=0.3).timed_out
    deadline = time.monotonic() + 5
    while s.pid is not None and time.monotonic() < deadline:  # the ping's verdict
        time.sleep(0.05)
    assert tool(s, "add")({"a": 1, "b": 2}).output == "3"
    assert s.pid != first and gone(first)


def test_a_busy_server_that_answers_pings_keeps_its_session(server, monkeypatch):
    import jaxagent.tools.mcp as mcp_module
    monkeypatch.setattr(mcp_module, "_PING_TIMEOUT_S", 0.5)
    pid = server.pid
    assert tool(server, "sleep")({"seconds": 2}, timeout_s=0.2).timed_out
    time.sleep(0.7)  # the ping has been answered
    assert server.pid == pid and tool(server, "echo")({"text": "x"}).output == "x"


def test_restarts_are_bounded(own_server):
    s = own_server(max_restarts=0)
    first = s.pid
    assert not tool(s, "crash")({}).ok
    result = tool(s, "add")({"a": 1, "b": 2})
    assert not result.ok and "not restarted again (max_restarts=0)" in result.error
    assert gone(first)


def test_a_server_that_fails_to_start_is_an_error_naming_its_command():
    with pytest.raises(MCPServerError) as info:
        MCPServer({**SERVER, "args": [*SERVER["args"], "--fail-start"]})
    message = str(info.value)
    assert "server.py --fail-start" in message and "exited during its startup" in message
    assert "refusing to start (--fail-start)" in message  # its stderr
    with pytest.raises(MCPServerError, match="'no-such-program-jaxagent' could not be started"):
        MCPServer(command="no-such-program-jaxagent")


@pytest.mark.slow  # a server of its own (~1-2 s); the default run keeps the core cases
def test_a_server_that_never_answers_times_out_at_startup():
    start = time.monotonic()
    silent = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(MCPServerError, match=r"did not start and list its tools within startup_timeout_s=1 s"):
        MCPServer(command=silent[0], args=silent[1:], startup_timeout_s=1)
    assert time.monotonic() - start < 8.0
    assert not [p for p in psutil.Process().children(recursive=True)
                if alive(p.pid) and "time.sleep(60)" in " ".join(p.cmdline())]


def test_a_malformed_tool_list_is_an_error_naming_the_command_and_the_tool():
    with pytest.raises(MCPServerError) as info:
        MCPServer(command=sys.executable, args=[str(DATA / "malformed_server.py")])
    message = str(info.value)
    assert "malformed_server.py" in message and "'scale'" in message and "'float'" in message


def test_name_clashes_are_errors_naming_both_sides(server):
    registry = ToolRegistry([function_tool(lambda_add, name="add")])
    with pytest.raises(ValueError, match=r"its tool 'add' would be named 'add', which FunctionTool already uses; "
                                         r"give the server a prefix"):
        register_mcp_tools(registry, server)
    assert registry.names() == ["add"]  # nothing of the server's was added
    registry = ToolRegistry(server.tools)
    with pytest.raises(ValueError, match="which MCP server 'test' already uses"):
        register_mcp_tools(registry, server)


@pytest.mark.slow  # a server of its own (~1-2 s); the default run keeps the core cases
def test_start_servers_registers_all_or_closes_what_it_started():
    before = server_processes()
    with pytest.raises(ValueError, match="unknown setting 'comand'"):
        start_servers([{**SERVER, "prefix": "a_"}, {"comand": "x"}])
    assert no_new_servers(before)
    servers, registry = start_servers([{**SERVER, "prefix": "a_", "tools": ["add"]}], ToolRegistry([Calculator()]))
    try:
        assert registry.names() == ["calculator", "a_add"]
        assert registry.get("a_add")({"a": 1, "b": 2}).output == "3"
    finally:
        for s in servers:
            s.close()


def test_config_errors_name_the_setting():
    with pytest.raises(ValueError, match=r"unknown setting 'arg' \(did you mean 'args'\?\)"):
        MCPServerConfig.from_mapping({"command": "x", "arg": ["a"]})
    with pytest.raises(ValueError, match="needs a 'command'"):
        MCPServerConfig.from_mapping({"args": ["a"]})
    with pytest.raises(TypeError, match="args must be a list of strings"):
        MCPServerConfig(command="x", args="server.py")
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        MCPServerConfig(command="x", timeout_s=0)


# --------------------------------------------------------------------------- shutdown

def test_close_ends_the_process_and_later_calls_fail_cleanly(own_server):
    s = own_server()
    pid = s.pid
    assert alive(pid)
    s.close()
    assert gone(pid) and pid not in server_processes()
    result = tool(s, "add")({"a": 1, "b": 2})
    assert not result.ok and "is closed" in result.error
    s.close()  # idempotent


@pytest.mark.slow  # a server of its own (~1-2 s); the default run keeps the core cases
def test_close_during_a_call_resolves_it_at_once(own_server):
    s = own_server()
    out = {}
    caller = threading.Thread(target=lambda: out.setdefault("r", tool(s, "sleep")({"seconds": 30})))
    caller.start()
    time.sleep(0.3)
    start = time.monotonic()
    s.close()
    caller.join(timeout=10)
    assert not caller.is_alive() and time.monotonic() - start < 10
    assert not out["r"].ok and "closed" in out["r"].error


def _in_fork(server):
    import jaxagent.tools.mcp as mcp_module
    result = tool(server, "add")({"a": 1, "b": 2})
    mcp_module._close_all()  # as a forked child's interpreter exit would
    os._exit(0 if not result.ok and "fork" in result.error else 1)


def test_a_forked_child_neither_calls_nor_closes_the_parents_server(server):
    import multiprocessing
    pid = server.pid
    child = multiprocessing.get_context("fork").Process(target=_in_fork, args=(server,))
    child.start()
    child.join(timeout=30)
    assert child.exitcode == 0
    assert server.pid == pid and alive(pid) and tool(server, "add")({"a": 2, "b": 2}).output == "4"


@pytest.mark.slow  # ~2 s: a Python process of its own
def test_no_orphan_when_the_interpreter_exits_without_close(tmp_path):
    script = ("import json, sys; from jaxagent.tools.mcp import MCPServer; "
              f"s = MCPServer({json.dumps(SERVER)}); print(s.pid, flush=True)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=pathlib.Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 5
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_importing_jaxagent_tools_does_not_import_mcp():
    code = ("import sys, jaxagent.tools; assert 'mcp' not in sys.modules and 'jaxagent.tools.mcp' not in sys.modules; "
            "import jaxagent.tools.mcp as m; assert jaxagent.tools.MCPServer is m.MCPServer")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   env={**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parent.parent)})


# --------------------------------------------------------------------------- streamable HTTP

def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve_http(port):
    """The test server behind http://127.0.0.1:port/mcp, once it accepts connections."""
    proc = subprocess.Popen([sys.executable, str(DATA / "server.py"), "--http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the HTTP test server did not start")


@pytest.mark.slow  # ~3 s: two HTTP servers
def test_streamable_http_calls_timeouts_and_reconnect_after_the_server_is_back():
    port = _free_port()
    proc = _serve_http(port)
    try:
        with MCPServer(url=f"http://127.0.0.1:{port}/mcp", headers={"X-Test": "1"}) as s:
            assert s.pid is None and "add" in [t.name for t in s.tools]
            assert tool(s, "add")({"a": 2, "b": 3}).output == "5"
            assert tool(s, "add")({"a": "x", "b": 3}).error.startswith("bad arguments for tool 'add'")
            assert tool(s, "sleep")({"seconds": 10}, timeout_s=0.3).timed_out
            start = time.monotonic()
            with ToolExecutor(ToolRegistry(s.tools), max_workers=16) as executor:
                results = executor.map([("sleep", {"seconds": 0.5})] * 16)
            assert all(r.ok for r in results) and time.monotonic() - start < 4.0
            result = tool(s, "crash")({}, timeout_s=2)
            # mcp 2 fails the request when the connection drops; mcp 1.x leaves it pending, so the
            # call times out and a ping that goes unanswered too marks the session dead.
            assert result.timed_out or ("the connection to it was lost" in result.error
                                        and "the next call connects again" in result.error), result
            proc.wait(timeout=10)
            if not result.timed_out:
                down = tool(s, "add")({"a": 1, "b": 1})
                assert not down.ok and "All connection attempts failed" in down.error
            proc = _serve_http(port)
            deadline = time.monotonic() + 20
            while not (result := tool(s, "add")({"a": 1, "b": 1}, timeout_s=2)).ok and time.monotonic() < deadline:
                time.sleep(0.2)
            assert result.output == "2"  # a new session
    finally:
        proc.kill()
        proc.wait()


def test_a_url_that_answers_nothing_is_an_error_naming_it():
    url = f"http://127.0.0.1:{_free_port()}/mcp"
    with pytest.raises(MCPServerError, match=f"MCP server '{url}' failed during its startup: ConnectError"):
        MCPServer(url=url, startup_timeout_s=5)
    with pytest.raises(ValueError, match="either a command .* or a url .*not both"):
        MCPServerConfig(command="x", url=url)
    with pytest.raises(ValueError, match="headers are for a url"):
        MCPServerConfig(command="x", headers={"A": "b"})


# --------------------------------------------------------------------------- the env (run-config wiring)

class ChatCharTokenizer:
    """The rollout tests' character tokenizer, with a chat template that shows its `tools=`."""

    eos_ids = frozenset({3})

    def __init__(self):
        self.tools_given = []

    def encode(self, text):
        return [ord(c) if ord(c) < 512 else ord("?") for c in text]

    def decode(self, ids):
        return "".join(chr(int(i)) for i in ids)

    def encode_chat(self, messages, add_generation_prompt=True, tools=None):
        self.tools_given.append(tools)
        text = "".join(f"[{m['role']}] {m['content']}\n" for m in messages)
        if tools:
            text = "[tools] " + ",".join(t["function"]["name"] for t in tools) + "\n" + text
        return self.encode(text + "[assistant] ")


@pytest.fixture
def questions(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "What is 2+3?", "answer": "5"}) + "\n")
    return str(path)


def test_make_env_mcp_tools_lists_the_servers_tools_in_the_system_prompt(questions):
    from jaxagent.envs import make_env
    with pytest.raises(ValueError, match="unknown setting 'mcp_server' \\(did you mean 'mcp_servers'\\?\\)"):
        make_env("mcp_tools", mcp_server=[SERVER])
    before = server_processes()
    with pytest.raises(ValueError, match="TextMatchReward.metric must be one of"):
        make_env("mcp_tools", mcp_servers=[SERVER], match="exact")
    with pytest.raises(ValueError, match="system_prompt must be text whose only field is"):
        make_env("mcp_tools", mcp_servers=[SERVER], system_prompt="Use {tool}.")
    with pytest.raises(ValueError, match="mcp_servers must be a non-empty list"):
        make_env("mcp_tools", mcp_servers=SERVER)
    assert no_new_servers(before)  # refused before any server started
    env = make_env("mcp_tools", mcp_servers=[{**SERVER, "tools": ["add", "echo"]}], train_file=questions)
    pid = env.servers[0].pid
    try:
        assert env.tools.names() == ["add", "echo"]
        (ex,) = env.examples("train")
        system = ex.prompt[0]["content"]
        assert "- add(a: integer, b: integer): Adds two integers." in system
        assert '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>' in system
        assert env.examples("eval") == []
        tok = ChatCharTokenizer()
        assert tok.decode(env.render_prompt(ex, tok)).startswith("[system] You are a helpful assistant")
        assert tok.tools_given == [None]
    finally:
        env.close()
    assert pid is not None and gone(pid)


@pytest.mark.slow  # a server of its own (~1-2 s); the default run keeps the core cases
def test_tools_in_template_gives_the_schemas_to_the_chat_template(questions):
    from jaxagent.envs.mcp_tools import MCPToolEnv
    env = MCPToolEnv(mcp_servers=[{**SERVER, "tools": ["add"], "prefix": "m_"}], train_file=questions,
                     tools_in_template=True)
    try:
        (ex,) = env.examples("train")
        tok = ChatCharTokenizer()
        assert tok.decode(env.render_prompt(ex, tok)).startswith("[tools] m_add\n[system] ")
        assert tok.tools_given[0][0]["function"]["parameters"]["required"] == ["a", "b"]
        assert "- m_add" not in ex.prompt[0]["content"]  # the template lists them
    finally:
        env.close()


def test_a_rollout_calls_the_servers_tools_and_is_rewarded(questions):
    from tests.agent.rollout_test import FakeEngine

    from jaxagent.agent import RolloutConfig, rollout
    from jaxagent.envs.mcp_tools import MCPToolEnv

    tok = ChatCharTokenizer()
    turns = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
             '<tool_call>{"name": "add", "arguments": {"a": "two", "b": 3}}</tool_call>',
             '<tool_call>{"name": "fail", "arguments": {"message": "no such thing"}}</tool_call>',
             "<answer>5</answer>"]
    encoded = [tok.encode(t) for t in turns]
    fake = FakeEngine(lambda rid, turn: encoded[turn] if turn < len(encoded) else [], slots=1, max_len=2048)
    env = MCPToolEnv(mcp_servers=[SERVER], train_file=questions)
    try:
        (traj,) = rollout(fake, None, env, env.examples("train"), tokenizer=tok,
                          cfg=RolloutConfig(max_turns=6, max_tokens_per_turn=96, decode_steps=8))
        assert traj.stop_reason == "answer"
        observations = [t.observation_text for t in traj.turns[:3]]
        assert observations[0] == "\n<tool_response>\n5\n</tool_response>\n"
        assert "bad arguments for tool 'add': argument 'a' must be of type integer" in observations[1]
        assert "Error: " in observations[2] and "no such thing" in observations[2]
        reward = env.reward(traj, env.examples("train")[0], tok, step=0)
        assert reward.components["correct"] == 1.0
    finally:
        env.close()


@pytest.mark.slow  # one RL step of the tiny quickstart model
def test_a_training_step_with_mcp_servers_in_the_run_config(tmp_path):
    from tests.trainer_test import _tiny

    from jaxagent.trainer import Trainer

    for split, n in (("train", 16), ("eval", 4)):
        with (tmp_path / f"{split}.jsonl").open("w") as f:
            for i in range(n):
                f.write(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n")
    kwargs = {"mcp_servers": [{**SERVER, "tools": ["add"]}], "train_file": str(tmp_path / "train.jsonl"),
              "eval_file": str(tmp_path / "eval.jsonl")}
    trainer = Trainer(_tiny(tmp_path, **{"env.name": "mcp_tools", "env.kwargs": kwargs}))
    try:
        assert trainer.env.tools.names() == ["add"]
        trainer.run()
    finally:
        trainer.close()
        trainer.env.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("step") == 1 and "reward/mean" in r for r in rows)


@pytest.mark.slow  # a server of its own
def test_the_readme_mcp_example_runs():
    import re
    root = pathlib.Path(__file__).parent.parent
    text = (root / "README.md").read_text()
    section = text[text.index("### MCP tool servers"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-3:] == [
        "5", "bad arguments for tool 'demo_add': argument 'a' must be of type integer, got str",
        "tool 'demo_sleep' timed out after 0.5 s"]
