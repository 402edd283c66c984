"""Tests for jaxagent/tools/sandbox.py: normal runs, an adversarial suite (each attack must end in
ok=False within its timeout and leave the host untouched, no surviving processes), each kernel
layer on its own, and persistent sessions."""

import dataclasses
import os
import signal
import socket
import threading
import time

import psutil
import pytest

from jaxagent.tools.base import ToolRegistry
from jaxagent.tools.executors import ToolExecutor
from jaxagent.tools.sandbox import (
    PROCESS_TAG,
    PythonSession,
    PythonTool,
    SandboxConfig,
    _Stream,
    run_python,
    sandbox_isolation,
)

TIMEOUT = 2.0
FULL = SandboxConfig(timeout_s=TIMEOUT, memory_mb=512)
HOOK_ONLY = SandboxConfig(timeout_s=TIMEOUT, memory_mb=512, namespaces="off")
MODES = pytest.mark.parametrize("config", [FULL, HOOK_ONLY], ids=["namespaces", "hook-only"])


def sandbox_processes():
    """Live (non-zombie) processes started by this test process's sandboxes."""
    tag = f"{PROCESS_TAG}:{os.getpid()}"
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if tag in (proc.info["cmdline"] or []) and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


def live_children():
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}


@pytest.fixture(autouse=True)
def no_surviving_processes():
    before = live_children()  # e.g. multiprocessing's resource tracker, started by other tests
    yield
    assert sandbox_processes() == []
    assert live_children() - before == set()


@pytest.fixture(scope="module")
def isolation():
    return sandbox_isolation(FULL)


def run(code, config, **overrides):
    start = time.monotonic()
    result = run_python(code, config=config, **overrides)
    return result, time.monotonic() - start


# --------------------------------------------------------------------------- normal behaviour

def test_prints_and_last_expression_value():
    result, _ = run("print('hi')\nx = 6 * 7\nx", FULL)
    assert result.ok and result.output == "hi\n42\n" and result.error is None
    assert run("'abc'", FULL)[0].output == "'abc'\n"                  # repr, as a REPL shows it
    assert run("print('only')", FULL)[0].output == "only\n"            # None is not printed
    assert run("x = 1", FULL)[0].output == ""
    quiet = SandboxConfig(timeout_s=TIMEOUT, display_last_expression=False)
    assert run("1 + 1", quiet)[0].output == ""


def test_exception_gives_traceback_in_error_and_keeps_printed_output():
    result, _ = run("print('before')\ndef f(x):\n    return 1 / x\nf(0)", FULL)
    assert not result.ok and result.output == "before\n"
    assert result.error.startswith("Traceback (most recent call last):")
    assert 'File "<cell-1>", line 4, in <module>' in result.error
    assert "return 1 / x" in result.error and result.error.endswith("ZeroDivisionError: division by zero")
    assert "jaxagent-sandbox" not in result.error  # the sandbox's own frames are hidden
    syntax, _ = run("def (:", FULL)
    assert not syntax.ok and "SyntaxError: invalid syntax" in syntax.error and "ast.py" not in syntax.error


def test_stderr_exit_codes_and_stdin():
    mixed, _ = run("import sys\nprint('out')\nprint('warn', file=sys.stderr)", FULL)
    assert mixed.ok and mixed.output == "out\nwarn\n"
    assert run("import sys\nsys.exit(0)", FULL)[0].ok
    exit3, _ = run("import sys\nsys.exit(3)", FULL)
    assert not exit3.ok and exit3.error == "SystemExit: 3"
    hard, _ = run("import os\nprint('bye', flush=True)\nos._exit(7)", FULL)
    assert not hard.ok and hard.output == "bye\n" and "exit status 7" in hard.error
    assert "EOFError" in run("input()", FULL)[0].error


@MODES
@pytest.mark.parametrize("code,signal_name", [
    ("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)", "SIGTERM"),
    ("import signal\nsignal.raise_signal(signal.SIGUSR1)", "SIGUSR1"),
    ("import signal, time\nsignal.alarm(1)\ntime.sleep(3)", "SIGALRM"),
    ("import os\nos.abort()", "SIGABRT"),
])
def test_a_program_ended_by_its_own_signal_is_reported_so(config, code, signal_name):
    """In a PID namespace the code was the namespace's init, whose kernel drops signals it has no
    handler for: it printed on after them and reported ok (abort() as SIGSEGV)."""
    result, seconds = run(code + "\nprint('still running')", config, timeout_s=5.0)
    assert not result.ok and "still running" not in result.output, result
    assert f"killed by {signal_name}" in result.error, result.error
    assert seconds < 4


def test_environment_is_minimal_and_secrets_are_not_inherited(monkeypatch):
    monkeypatch.setenv("JAXAGENT_TEST_SECRET", "hunter2")
    result, _ = run("import os\nprint(sorted(os.environ))\nprint(os.environ['HOME'] == os.getcwd())", FULL)
    assert result.ok and "JAXAGENT_TEST_SECRET" not in result.output and "hunter2" not in result.output
    assert result.output.splitlines()[1] == "True"
    assert "'PATH'" in result.output and "'LANG'" in result.output


def test_the_program_gets_no_command_line_arguments():
    # The loader's arguments were the program's: a script's argparse refused them.
    code = ("import argparse, sys\nprint(sys.argv)\np = argparse.ArgumentParser()\n"
            "p.add_argument('--n', type=int, default=3)\nprint(p.parse_args().n)")
    result, _ = run(code, FULL)
    assert (result.ok, result.output) == (True, "['']\n3\n"), result.error


def test_fresh_temp_dir_is_writable_and_removed():
    result, _ = run("import os, tempfile\nopen('a.txt', 'w').write('x')\n"
                    "print(os.getcwd())\nprint(tempfile.mkstemp()[1].startswith(os.getcwd()))", FULL)
    assert result.ok, result.error
    workdir, mkstemp_inside = result.output.splitlines()
    assert mkstemp_inside == "True" and os.path.basename(workdir).startswith("jaxagent-sandbox-")
    assert not os.path.exists(workdir)
    assert run("import os\nprint(os.listdir('.'))", FULL)[0].output == "[]\n"


@pytest.mark.parametrize("hook", [True, False], ids=["hook", "kernel-only"])
def test_other_sandboxes_temp_dirs_cannot_be_listed(isolation, hook):
    """A program listed the host's temporary directory, in it the temporary directories of the
    other sandboxes (other trajectories), and in those their files; only the audit hook kept it
    from reading them. Each layer stops the listing on its own: the hook refuses to list a
    directory outside the readable roots, the kernel layer (work directories in a shared
    directory that can be traversed, not listed) hides the others' names."""
    if not isolation["capabilities_dropped"]:
        pytest.skip("needs the namespaces (without them root may list any directory)")
    config = FULL if hook else kernel_only(isolation)
    import tempfile
    search = (f"import os\nfound = []\ntop = {tempfile.gettempdir()!r}\n"
              "try:\n    names = os.listdir(top)\nexcept PermissionError as e:\n    names = []\n    print(e)\n"
              "for name in names:\n"
              "    if name.startswith('jaxagent-sandbox-'):\n"
              "        try:\n"
              "            for entry in os.scandir(os.path.join(top, name)):\n"
              "                found.append(entry.name)\n"
              "                if entry.is_dir() and entry.path != os.getcwd():\n"
              "                    found += os.listdir(entry.path)\n"
              "        except OSError:\n"
              "            pass\n"
              "print(sorted(set(found)))")
    with PythonSession(FULL) as other:
        assert other.run("open('the-other-trajectorys-file.txt', 'w').write('x')").ok
        assert os.listdir(other._proc.tmpdir) == ["the-other-trajectorys-file.txt"]
        result, _ = run(search, config)
    assert result.ok, result.error
    assert "the-other-trajectorys-file.txt" not in result.output, result.output
    assert ("listing" in result.output and "is not allowed in the sandbox" in result.output) == hook


def test_temp_dir_is_removed_after_the_code_chmods_it_shut():
    """Where the host lacks root's permission override (a non-root host, emulated for root by
    dropping CAP_DAC_OVERRIDE), directories the code made unreadable must still be deleted."""
    import json
    import shutil
    import subprocess
    import sys

    check = ("import glob, json, os, tempfile\nfrom jaxagent.tools.sandbox import run_python\n"
             "pattern = tempfile.gettempdir() + '/jaxagent-sandbox-*'\nbefore = set(glob.glob(pattern))\n"
             "r = run_python(\"import os\\nos.makedirs('d/e/f')\\nopen('d/e/x', 'w').write('x')\\n"
             "os.chmod('d/e/f', 0)\\nos.chmod('d/e', 0o500)\\nos.chmod('d', 0)\\nos.chmod('.', 0o500)\\n"
             "print(os.getcwd())\")\nassert r.ok, r\nfrom jaxagent.tools import sandbox\n"
             "shared = sandbox._workdir_parent[1]\nassert not os.path.lexists(r.output.strip()), r\n"
             "print(json.dumps([shared, sorted(set(glob.glob(pattern)) - before - {shared})]))")
    command = [sys.executable, "-c", check]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv to drop CAP_DAC_OVERRIDE as root")
        caps = "-dac_override,-dac_read_search"
        command = ["setpriv", "--bounding-set", caps, "--inh-caps", caps, "--", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    shared, leaked = json.loads(done.stdout)
    for path in leaked:  # as this (privileged) process
        subprocess.run(["rm", "-rf", path])
    assert leaked == []
    assert not os.path.exists(shared), "the shared directory is removed at exit"


def test_scientific_libraries_import():
    result, _ = run("import numpy as np, sympy\nprint(np.arange(4).sum(), sympy.factor('x**2 - 1'))", FULL,
                    timeout_s=20)
    assert result.ok and result.output == "6 (x - 1)*(x + 1)\n", result.error


@MODES
def test_listing_host_directories_outside_allowed_paths_is_refused(config, tmp_path):
    """Directory names were listed anywhere on the host (the file names of a task's answer key
    among them); the hook lists only what it lets the program read."""
    (tmp_path / "key").mkdir()
    (tmp_path / "key" / "answers_42.txt").write_text("42")
    (tmp_path / "notes.txt").write_text("x")
    for listing in ("os.listdir({!r})", "list(os.scandir({!r}))", "list(pathlib.Path({!r}).iterdir())"):
        code = f"import os, pathlib\nprint({listing.format(str(tmp_path))})"
        result, _ = run(code, config)
        assert "notes.txt" not in result.output and "listing" in (result.error or ""), (listing, result)
    for listing in ("glob.glob({!r} + '/*')", "list(os.walk({!r}))"):  # these swallow the error
        result, _ = run(f"import glob, os\nprint({listing.format(str(tmp_path))})", config)
        assert result.output == "[]\n", (listing, result)
    readable = dataclasses.replace(config, extra_read_paths=(str(tmp_path),),
                                   deny_read_paths=(str(tmp_path / "key"),))
    result, _ = run(f"import os\nprint(sorted(os.listdir({str(tmp_path)!r})))", readable)
    assert result.output == "['key', 'notes.txt']\n", result
    result, _ = run(f"import os\nprint(os.listdir({str(tmp_path / 'key')!r}))", readable)
    assert "answers_42" not in result.output and "is not allowed in the sandbox" in result.error
    result, _ = run("import os, sys\nos.makedirs('d/e')\nprint(sorted(os.listdir()), os.listdir('d'),"
                    " len(os.listdir(sys.prefix)) > 0)", config)
    assert result.output == "['d'] ['e'] True\n", result


def test_many_denied_paths_cost_every_open_little_and_stay_denied(tmp_path):
    """A sharded data set denies each of its files: with 20000 denied paths an open costs its
    path's depth in set lookups, not a scan of them all (1000 opens took seconds)."""
    (tmp_path / "shards").mkdir()
    for name in ("train-00001.parquet", "train-19999.parquet", "notes.txt"):
        (tmp_path / "shards" / name).write_text(name)
    shards = tuple(str(tmp_path / "shards" / f"train-{i:05d}.parquet") for i in range(20000))
    config = SandboxConfig(timeout_s=30, memory_mb=512, extra_read_paths=(str(tmp_path),),
                           deny_read_paths=shards)
    code = (f"import time\npath = {str(tmp_path / 'shards' / 'notes.txt')!r}\n"
            "t = time.perf_counter()\nfor _ in range(1000):\n    open(path).read()\n"
            "print(round(time.perf_counter() - t, 3))\n"
            f"for name in ('train-00001.parquet', 'train-19999.parquet'):\n"
            f"    try:\n        print(open({str(tmp_path / 'shards')!r} + '/' + name).read())\n"
            "    except PermissionError:\n        print('denied')\n")
    result, _ = run(code, config)
    seconds, *shown = result.output.split()
    assert shown == ["denied", "denied"], result
    assert float(seconds) < 0.5, result.output  # 0.04 s, as with one; a scan of every root: 3 s


def test_reading_host_files_outside_allowed_paths_is_refused(tmp_path):
    secret = tmp_path / "answers.txt"
    secret.write_text("42")
    result, _ = run(f"print(open({str(secret)!r}).read())", FULL)
    assert not result.ok and "not allowed in the sandbox" in result.error and "42" not in result.output
    allowed = SandboxConfig(timeout_s=TIMEOUT, extra_read_paths=(str(tmp_path),))
    assert run(f"print(open({str(secret)!r}).read())", allowed)[0].output == "42\n"
    # A denied path stays unreadable inside a readable one, by open() and by import.
    (tmp_path / "key").mkdir()
    (tmp_path / "key" / "answer_key.py").write_text("ANSWER = 42")
    denied = dataclasses.replace(allowed, deny_read_paths=(str(tmp_path / "key"),))
    assert run(f"print(open({str(secret)!r}).read())", denied)[0].output == "42\n"
    result, _ = run(f"print(open({str(tmp_path / 'key' / 'answer_key.py')!r}).read())", denied)
    assert not result.ok and "not allowed in the sandbox" in result.error and "42" not in result.output
    result, _ = run(f"import sys\nsys.path.insert(0, {str(tmp_path / 'key')!r})\nimport answer_key\n"
                    "print(answer_key.ANSWER)", denied)
    assert not result.ok and "42" not in result.output


def test_denied_paths_are_hidden_from_dir_fd_relative_opens(isolation, tmp_path):
    # The audit hook sees a dir_fd-relative open as a path relative to the working directory, so
    # only the kernel layer keeps the answer key out of reach.
    kernel_only(isolation, "mount_namespace")
    (tmp_path / "key").mkdir()
    (tmp_path / "key" / "answer_key.py").write_text("ANSWER = 42")
    (tmp_path / "single.txt").write_text("ANSWER = 43")
    config = dataclasses.replace(FULL, extra_read_paths=(str(tmp_path),),
                                 deny_read_paths=(str(tmp_path / "key"), str(tmp_path / "single.txt")))
    for name in ("key/answer_key.py", "single.txt"):
        code = (f"import os\nfd = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
                f"print(os.read(os.open({name!r}, os.O_RDONLY, dir_fd=fd), 100))")
        result, _ = run(code, config)
        assert "ANSWER" not in result.output, (name, result.output)
    assert sandbox_isolation(config)["deny_read_hidden"] is True


@MODES
def test_dir_fd_relative_opens_are_checked_against_their_directory(config, tmp_path):
    """os.open(name, dir_fd=fd) raises an audit event with `name` alone, which the hook read
    against the working directory: a link named alike in the working directory and in a folder
    of the temporary directory let the program read any file of the host (another copy of a
    task's answer key)."""
    secret = tmp_path / "answers.txt"
    secret.write_text("the answers")
    code = ("import os\nos.mkdir('sub')\nos.symlink('harmless', 's')\n"
            f"os.symlink({str(tmp_path)!r}, 'sub/s')\nopen('harmless', 'w').close()\n"
            "fd = os.open('sub', os.O_RDONLY)\n"
            "try:\n"
            "    f = os.open('s/answers.txt', os.O_RDONLY, dir_fd=fd)\n"
            "    print(os.read(f, 100))\n"
            "except PermissionError as e:\n"
            "    print('refused')\n"
            "f = os.open('harmless', os.O_RDONLY, dir_fd=os.open('.', os.O_RDONLY))\n"
            "print(os.read(f, 10))")
    result, _ = run(code, config)
    assert (result.ok, result.output) == (True, "refused\nb''\n"), (result.output, result.error)


def test_config_refuses_limits_the_interpreter_cannot_apply():
    # Each of these passed validation and then failed every call (or raised out of run_python).
    with pytest.raises(TypeError, match=r"SandboxConfig.memory_mb must be an int, got 512.0"):
        SandboxConfig(memory_mb=512.0)
    with pytest.raises(TypeError, match="SandboxConfig.max_file_mb must be an int"):
        SandboxConfig(max_file_mb=1.5)
    for field in ("timeout_s", "cpu_time_s", "session_cpu_s"):
        with pytest.raises(ValueError, match=f"SandboxConfig.{field} must be a positive finite number"):
            SandboxConfig(**{field: float("inf")})
    assert SandboxConfig(timeout_s=1, cpu_time_s=0.5, memory_mb=256).call_cpu_s == 0.5


def test_config_from_settings_names_the_setting_the_user_wrote():
    settings = {"code_memory_mb": ("memory_mb", 256), "code_timeout_s": ("timeout_s", 3)}
    config = SandboxConfig.from_settings("Env", settings, display_last_expression=False)
    assert (config.memory_mb, config.timeout_s, config.display_last_expression) == (256, 3, False)
    with pytest.raises(ValueError, match=r"^Env.code_memory_mb=64 is refused: SandboxConfig.memory_mb must "
                                         r"be >= 128"):
        SandboxConfig.from_settings("Env", {**settings, "code_memory_mb": ("memory_mb", 64)})
    with pytest.raises(TypeError, match=r"^Env.code_memory_mb='1024' is refused: .*must be an int"):
        SandboxConfig.from_settings("Env", {**settings, "code_memory_mb": ("memory_mb", "1024")})


def test_output_cap_holds_when_the_end_marker_arrives_in_the_same_read():
    # Whether output past the cap and the marker came in one read was a race: the same program
    # got ok=True with up to 64 KiB past the cap, or was stopped for its output.
    stream = _Stream(10, b"<end>")
    stream.feed(b"z" * 30 + b"<end>")
    assert stream.overflow and stream.text() == "z" * 10
    result, _ = run("import sys\nsys.stdout.write('z' * 50000)", FULL)
    assert run("import sys\nsys.stdout.write('z' * 50000)",
               dataclasses.replace(FULL, max_output_bytes=10_000))[0].truncated
    assert result.ok and result.output == "z" * 50000 + "50000\n"  # under the default cap


def test_code_size_limit_and_type():
    tiny = SandboxConfig(max_code_bytes=10)
    result = run_python("print('this is too long')", config=tiny)
    assert not result.ok and "limit is 10" in result.error
    with pytest.raises(TypeError, match="code must be a str"):
        run_python(b"print(1)")


# --------------------------------------------------------------------------- adversarial suite

@MODES
def test_infinite_loop_is_stopped_at_the_timeout(config):
    result, elapsed = run("while True:\n    pass", config, timeout_s=1.0)
    assert not result.ok and result.timed_out and "Timed out after 1 s" in result.error
    assert elapsed < 3.0


def test_cpu_time_limit_counts_all_threads():
    config = SandboxConfig(timeout_s=10, cpu_time_s=0.5)
    code = "import threading\ndef spin():\n    while True: pass\n" \
           "for _ in range(3): threading.Thread(target=spin, daemon=True).start()\nspin()"
    result, elapsed = run(code, config)
    assert not result.ok and result.timed_out and "CPU time limit of 0.5 s" in result.error
    assert elapsed < 4.0


@MODES
def test_fork_bomb(config):
    result, elapsed = run("import os\nwhile True:\n    os.fork()", config)
    assert not result.ok and "os.fork is not allowed" in result.error
    assert elapsed < TIMEOUT + 2
    multiprocessing_bomb, _ = run("import multiprocessing as mp\nwhile True:\n    mp.Process(target=print).start()",
                                  config)
    assert not multiprocessing_bomb.ok


@MODES
@pytest.mark.parametrize("code", ["x = bytearray(4 * 1024 ** 3)",
                                  "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 1024 ** 2))"])
def test_memory_bomb(config, code):
    # A longer wall-clock limit than the other attacks': on a loaded host, filling 512 MB in 50 MB
    # chunks took over 2 s and the program was stopped for time before the memory limit hit.
    config = dataclasses.replace(config, timeout_s=10.0)
    host_rss = psutil.Process().memory_info().rss
    result, elapsed = run(code, config)
    assert not result.ok and "MemoryError" in result.error and "memory limit is 512 MB" in result.error
    assert elapsed < 10.0 + 2
    assert psutil.Process().memory_info().rss - host_rss < 64 * 1024 ** 2


@MODES
@pytest.mark.parametrize("code", ["print('x' * 100_000_000)",
                                  "import sys\nfor _ in range(100):\n    sys.stdout.write('y' * 1_000_000)",
                                  "import os\nos.write(2, b'z' * 100_000_000)"])
def test_100mb_of_output_is_truncated(config, code):
    host_rss = psutil.Process().memory_info().rss
    result, elapsed = run(code, config, timeout_s=10)
    assert not result.ok and result.truncated and "Output limit of 65536 bytes exceeded" in result.error
    assert len(result.output) <= 65536
    assert elapsed < 5
    assert psutil.Process().memory_info().rss - host_rss < 64 * 1024 ** 2


@MODES
def test_writing_outside_the_temp_dir(config, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    attempts = [f"open({str(victim)!r}, 'w').write('pwned')",
                f"open({str(victim)!r}, 'a').write('pwned')",
                f"import os\nos.remove({str(victim)!r})",
                f"import os\nos.rename({str(victim)!r}, 'stolen')",
                f"import pathlib\npathlib.Path({str(tmp_path / 'new.txt')!r}).write_text('x')",
                f"import os\nos.symlink({str(victim)!r}, 'link')\nopen('link', 'w').write('pwned')",
                f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
                # sqlite opens files in C, past the "open" audit event
                f"import sqlite3\nsqlite3.connect({str(tmp_path / 'new.db')!r}).execute('create table t (x)')",
                f"import sqlite3\nsqlite3.connect('file:{tmp_path / 'new.db'}?mode=rwc', uri=True).execute('create table t (x)')"]
    for code in attempts:
        result, _ = run(code, config)
        assert not result.ok, code
        assert "not allowed in the sandbox" in result.error, (code, result.error)
    assert victim.read_text() == "original"
    assert sorted(os.listdir(tmp_path)) == ["victim.txt"]
    inside, _ = run("import sqlite3\nfor name in ('own.db', ':memory:', 'file:uri.db?mode=rwc'):\n"
                    "    sqlite3.connect(name, uri=True).execute('create table t (x)')\nprint('ok')", config)
    assert inside.ok and inside.output == "ok\n", inside.error


DISK_LIMITED = {"max_disk_mb": 4, "max_files": 200, "timeout_s": 10.0}


@MODES
@pytest.mark.parametrize("code", [
    "import time\nchunk = b'x' * (1 << 20)\ni = 0\nwhile True:\n    open(f'f{i}', 'wb').write(chunk)\n    i += 1\n"
    "    time.sleep(0.01)",  # (each case sleeps: the test writes megabytes, not what a disk takes in 0.1 s)
    "import time\nf = open('one', 'wb')\nwhile True:\n    f.write(b'x' * (1 << 20))\n    f.flush()\n"
    "    time.sleep(0.01)",
    "import os\nos.makedirs('d')\ni = 0\nwhile True:\n    open(f'd/e{i}', 'w').close()\n    i += 1",
    # deleted but held open: in no directory, still on the disk
    "import os, time\nheld = []\nwhile True:\n    f = open('h', 'wb')\n    os.unlink('h')\n"
    "    f.write(b'x' * (1 << 20))\n    f.flush()\n    held.append(f)\n    time.sleep(0.01)",
], ids=["many-files", "one-file-in-chunks", "many-empty-files", "deleted-open-files"])
def test_disk_use_of_a_run_is_capped(config, code):
    """Only each file's size was limited (RLIMIT_FSIZE): a program writing file after file, or one
    file in chunks under that size, or empty files by the million, filled the host's disk."""
    config = dataclasses.replace(config, **DISK_LIMITED)
    result, elapsed = run(code, config)
    assert not result.ok and not result.timed_out, result
    assert result.error.startswith("Disk limit exceeded: ") and result.error.endswith(
        "(the limits are 4 MB and 200 files and directories); the program was stopped and its files deleted."
    ), result.error
    assert elapsed < 5, elapsed


@MODES
def test_files_nested_past_path_max_are_not_a_way_around_the_disk_cap(config):
    """The host measures by path: directories nested past PATH_MAX (4096 bytes) could not be
    listed, were skipped, and their files went uncounted (8 MB past a 4 MB cap: ok=True)."""
    from jaxagent.tools import sandbox

    code = ("import os\nfor i in range(20):\n    os.mkdir('d' * 250)\n    os.chdir('d' * 250)\n"
            "for i in range(8):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))")
    result, _ = run(code, dataclasses.replace(config, **DISK_LIMITED, audit_hook=False))
    assert not result.ok and "Disk limit exceeded: a directory in it could not be measured (File name too long)" \
        in result.error, result
    assert os.listdir(sandbox._workdir_parent[1]) == []  # deleted, however deep


def test_disk_cap_counts_a_session_across_calls_and_a_program_that_ends_at_once():
    config = dataclasses.replace(FULL, **DISK_LIMITED)
    # Written faster than the host's checks: caught when the call ends.
    burst, _ = run("chunk = b'x' * (1 << 20)\nfor i in range(8):\n    open(f'f{i}', 'wb').write(chunk)\n"
                   "print('done')", config)
    assert not burst.ok and "its files take more than 4 MB" in burst.error and burst.output == "done\n"
    refused, _ = run("import os\nfd = os.open('x', os.O_CREAT | os.O_WRONLY)\nos.posix_fallocate(fd, 0, 1 << 30)",
                     config)
    assert not refused.ok and "os.posix_fallocate is not allowed in the sandbox" in refused.error
    too_big, _ = run("open('x', 'wb').write(b'x' * (2 << 20))", dataclasses.replace(config, max_file_mb=1))
    assert "File too large" in too_big.error and "limits each file to 1 MB" in too_big.error
    with PythonSession(config) as session:
        for i in range(3):
            assert session.run(f"open('s{i}', 'wb').write(b'q' * (1 << 20))").ok
        workdir = session._proc.tmpdir
        assert session.run("import os\nos.remove('s0')\nopen('s3', 'wb').write(b'q' * (1 << 20))").ok
        over = session.run("open('s4', 'wb').write(b'q' * (2 << 20))")
        assert not over.ok and "Disk limit exceeded" in over.error and "session was restarted" in over.error
        assert not os.path.exists(workdir) and session.restarts == 1
        assert session.run("import os\nos.listdir('.')").output == "[]\n"
    for field in ("max_disk_mb", "max_files"):
        with pytest.raises(TypeError, match=f"SandboxConfig.{field} must be an int"):
            SandboxConfig(**{field: 1.5})
        with pytest.raises(ValueError, match=f"SandboxConfig.{field} must be >= 1, got 0"):
            SandboxConfig(**{field: 0})


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.3)
    yield server
    server.close()


def assert_no_connection(server):
    with pytest.raises(socket.timeout):
        conn, _ = server.accept()
        conn.close()


@MODES
def test_network_connection_never_arrives(config, listener):
    port = listener.getsockname()[1]
    for code in [f"import socket\nsocket.socket().connect(('127.0.0.1', {port}))",
                 f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
                 f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=1)",
                 "import socket\nsocket.getaddrinfo('example.com', 80)"]:
        result, _ = run(code, config)
        assert not result.ok
        assert "network access is not allowed" in result.error or "getaddrinfo is not allowed" in result.error
    assert_no_connection(listener)


@MODES
def test_signals_through_a_pidfd_are_refused(config):
    # signal.pidfd_send_signal raises no audit event: without namespaces it killed host processes.
    import subprocess

    victim = subprocess.Popen(["sleep", "30"])
    try:
        for code in [f"import os, signal\nsignal.pidfd_send_signal(os.pidfd_open({victim.pid}), signal.SIGKILL)",
                     f"import os, sys\ndel sys.modules['_signal']\nimport _signal\n"
                     f"_signal.pidfd_send_signal(os.pidfd_open({victim.pid}), 9)"]:
            result, _ = run(code, config)
            assert not result.ok, code
        time.sleep(0.2)
        assert victim.poll() is None
        ok, _ = run("import signal, _signal\nprint(signal.SIGINT.value)", config)  # imports still work
        assert ok.ok and ok.output == "2\n", ok.error
    finally:
        victim.kill()
        victim.wait()


@MODES
def test_cpu_mask_and_priority_of_host_processes_cannot_be_changed(config):
    # Without a PID namespace host PIDs are visible: code pinned the trainer to one CPU and reniced it.
    import subprocess

    victim = subprocess.Popen(["sleep", "30"])
    try:
        before = (os.sched_getaffinity(victim.pid), os.getpriority(os.PRIO_PROCESS, victim.pid))
        for code in [f"import os\nos.sched_setaffinity({victim.pid}, {{0}})",
                     f"import os\nos.setpriority(os.PRIO_PROCESS, {victim.pid}, 19)",
                     f"import posix\nposix.sched_setaffinity({victim.pid}, {{0}})",
                     f"import sys\ndel sys.modules['posix']\nimport posix\nposix.sched_setaffinity({victim.pid}, {{0}})"]:
            result, _ = run(code, config)
            assert not result.ok, code
        # Every process of this user: in a PID namespace only the sandbox's own, so not refused there.
        result, _ = run("import os\nos.setpriority(os.PRIO_USER, 0, 19)", config)
        assert not result.ok or config.namespaces != "off"
        assert (os.sched_getaffinity(victim.pid), os.getpriority(os.PRIO_PROCESS, victim.pid)) == before
        own, _ = run("import os, threading\nos.sched_setaffinity(0, {0})\n"
                     "os.sched_setaffinity(threading.get_native_id(), {0})\n"
                     "os.setpriority(os.PRIO_PROCESS, 0, 5)\nos.nice(1)\nprint(os.sched_getaffinity(0))", config)
        assert own.ok and own.output == "{0}\n", own.error
    finally:
        victim.kill()
        victim.wait()


@MODES
def test_killing_the_parent_process(config):
    me = os.getpid()
    for code in ["import os\nos.kill(os.getppid(), 9)", f"import os\nos.kill({me}, 9)",
                 "import os, signal\nos.killpg(os.getpgid(os.getppid()), signal.SIGKILL)"]:
        result, _ = run(code, config)
        assert not result.ok and "not allowed in the sandbox" in result.error, result.error
    assert psutil.Process(me).is_running()


@MODES
@pytest.mark.parametrize("code", ["import os\nos.system('echo hacked')",
                                  "import subprocess\nprint(subprocess.run(['echo', 'hacked']))",
                                  "import os\nos.execv('/bin/echo', ['echo', 'hacked'])",
                                  "import os\nos.posix_spawn('/bin/echo', ['echo', 'hacked'], {})",
                                  "import os\nos.forkpty()",
                                  "import ctypes\nctypes.CDLL(None).fork()"])
def test_no_new_programs_or_c_calls(config, code):
    result, _ = run(code, config)
    assert not result.ok and "not allowed in the sandbox" in result.error, result.error
    assert "hacked" not in result.output


# --------------------------------------------------------------------------- kernel layers alone

def kernel_only(isolation, *needed):
    missing = [layer for layer in needed if not isolation.get(layer)]
    if missing:
        pytest.skip(f"this host does not allow: {', '.join(missing)}")
    return SandboxConfig(timeout_s=TIMEOUT, audit_hook=False)


def test_isolation_report(isolation):
    assert isolation["audit_hook"] is True
    assert set(isolation) >= {"net_namespace", "mount_namespace", "pid_namespace", "readonly_host_fs",
                              "capabilities_dropped", "nproc_limit_effective"}
    off = sandbox_isolation(HOOK_ONLY)
    assert not off["net_namespace"] and not off["mount_namespace"] and not off["pid_namespace"]


def test_network_namespace_alone_blocks_connections(isolation, listener):
    config = kernel_only(isolation, "net_namespace")
    port = listener.getsockname()[1]
    result, _ = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)", config)
    assert not result.ok and "Network is unreachable" in result.error
    assert_no_connection(listener)


def test_readonly_mounts_alone_block_host_writes(isolation, tmp_path):
    config = kernel_only(isolation, "mount_namespace", "readonly_host_fs")
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    result, _ = run(f"open({str(victim)!r}, 'w').write('pwned')", config)
    assert not result.ok and "Read-only file system" in result.error
    assert victim.read_text() == "original"
    assert run("open('inside.txt', 'w').write('fine')\nprint(open('/dev/null', 'w').write('x'))", config)[0].ok


def test_pid_namespace_alone_hides_host_processes(isolation):
    config = kernel_only(isolation, "pid_namespace", "capabilities_dropped")
    me = os.getpid()
    result, _ = run(f"import os\nprint(os.getpid(), os.getppid())\nos.kill({me}, 9)", config)
    assert not result.ok and "ProcessLookupError" in result.error
    assert result.output == "2 1\n"  # the namespace's init is its parent
    assert psutil.Process(me).is_running()
    # A process that leaves the session is still ended with the namespace.
    escaped, _ = run("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\ntime.sleep(60)",
                     config, timeout_s=1)
    assert escaped.timed_out


def test_processes_that_leave_the_session_are_killed_without_namespaces():
    bare = SandboxConfig(timeout_s=1.0, namespaces="off", audit_hook=False)
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent')\ntime.sleep(60)"
    result, _ = run(code, bare)
    assert result.timed_out and result.output == "parent\n"
    # no_surviving_processes then checks that the setsid() child was found and killed too
    daemon = code.replace("os.setsid()", "os.setsid()\n    if os.fork():\n        os._exit(0)")
    result, _ = run(daemon, bare)
    assert result.timed_out and result.output == "parent\n"
    assert psutil.wait_procs(sandbox_processes(), timeout=2.0)[1] == []


DAEMON = {"same-group": "pass", "setsid": "os.setsid()",
          # a daemon: its parent exits at once, so it is nobody's child but the subreaper's
          "double-fork": "os.setsid()\n    if os.fork():\n        os._exit(0)"}


@pytest.mark.parametrize("how", DAEMON)
def test_processes_left_by_a_finished_call_are_killed_without_namespaces(how):
    """The interpreter exits on its own when the call is done (or the session closed); a process
    the code started must not outlive it, though it is no longer the interpreter's child."""
    bare = SandboxConfig(timeout_s=5.0, namespaces="off", audit_hook=False)
    code = (f"import os, time\nif os.fork() == 0:\n    {DAEMON[how]}\n"
            "    time.sleep(60)\n    os._exit(0)\ntime.sleep(0.2)\nprint('parent')")
    result, _ = run(code, bare)
    assert result.ok and result.output == "parent\n"
    assert psutil.wait_procs(sandbox_processes(), timeout=2.0)[1] == []  # SIGKILLed ones die at once
    session = PythonSession(bare)
    assert session.run(code).ok
    session.close()
    assert psutil.wait_procs(sandbox_processes(), timeout=2.0)[1] == []


def test_code_that_closes_every_pipe_is_told_so():
    """Without a PID namespace nothing else holds the pipes: the host sees EOF on all of them
    while the program still runs, and says that, not that it was killed by a limit."""
    code = "import os, time\nfor fd in range(64):\n    try:\n        os.close(fd)\n    except OSError:\n" \
           "        pass\ntime.sleep(30)"
    result, elapsed = run(code, HOOK_ONLY)
    assert not result.ok and not result.timed_out and elapsed < TIMEOUT
    assert result.error == "The program closed its output and control pipes, so the sandbox stopped it."


@MODES
def test_code_that_points_stdout_elsewhere_is_not_timed_out(config):
    """os.dup2 of /dev/null (or a file) over fd 1 and 2 would swallow the end-of-call markers:
    the call returns when it ends, not at the timeout, and a session keeps its state."""
    with PythonSession(config) as session:
        start = time.monotonic()
        result = session.run("import os\nx = 7\nprint('before', flush=True)\n"
                             "null = os.open('/dev/null', os.O_WRONLY)\nos.dup2(null, 1)\nos.dup2(null, 2)\n"
                             "print('hidden')")
        assert result.ok and not result.timed_out, result.error
        assert result.output == "before\n" and time.monotonic() - start < TIMEOUT
        reopened = session.run("f = os.open('out.txt', os.O_WRONLY | os.O_CREAT)\nos.dup2(f, 1)\nx")
        assert reopened.ok and session.restarts == 0
        assert session.run("print(open('out.txt').read())").ok


# --------------------------------------------------------------------------- sessions and the tool

def test_session_keeps_state_across_calls():
    with PythonSession(FULL) as session:
        assert session.run("x = 40\nimport math").ok
        result = session.run("x + 2")
        assert result.output == "42\n"
        assert session.run("def f(y):\n    return y * x\nf(2)").output == "80\n"
        assert session.run("raise ValueError('nope')").error.endswith("ValueError: nope")
        assert session.run("math.sqrt(x + 9)").output == "7.0\n"  # an exception does not reset state
        assert len(session.pids) == 1 and session.restarts == 0


def test_session_restarts_after_crash_and_timeout():
    with PythonSession(FULL, timeout_s=1.0) as session:
        session.run("x = 1")
        first_pid = session.pids[0]
        crashed = session.run("import os\nos._exit(1)")
        assert not crashed.ok and "session was restarted" in crashed.error and "exit status 1" in crashed.error
        assert session.pids == [] and not psutil.pid_exists(first_pid)
        assert "NameError" in session.run("x").error
        assert session.run("x = 2").ok
        hung = session.run("while True:\n    pass")
        assert hung.timed_out and "session was restarted" in hung.error
        assert "NameError" in session.run("x").error
        memory = session.run("b = bytearray(4 * 1024 ** 3)")
        assert not memory.ok and "MemoryError" in memory.error  # a caught MemoryError keeps the session
        assert session.restarts == 2
    assert session.run("1").error == "the Python session is closed"


@pytest.mark.parametrize("stateful", [False, True], ids=["stateless", "session"])
@pytest.mark.parametrize("limit", [0, -1.0])
def test_a_bad_call_time_limit_is_refused_alike_with_and_without_a_session(stateful, limit):
    """A session read `timeout_s=0` as "the default" (`0 or default`) where a fresh interpreter
    refused it; both refuse it now, before starting anything."""
    tool = PythonTool(FULL, stateful=stateful)
    try:
        with pytest.raises(ValueError, match="timeout_s must be a positive finite number"):
            tool({"code": "print(1)"}, timeout_s=limit)
        assert tool({"code": "print(1)"}, timeout_s=1.5).output == "1\n"
        runner = tool._session.run if stateful else (lambda code, timeout_s: run_python(code, config=FULL,
                                                                                          timeout_s=timeout_s))
        with pytest.raises(ValueError, match="timeout_s must be a positive finite number"):
            runner("print(1)", timeout_s=float("nan"))
    finally:
        tool.close()


def test_threads_left_running_by_a_session_call_wait_for_the_next_call():
    """A session idles while the policy writes its next turn; a spinning thread the code left
    behind burned a core all that time (outside every call's limits)."""
    def tree_cpu(pid):
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        return sum(sum(p.cpu_times()[:2]) for p in procs)

    with PythonSession(FULL) as session:
        assert session.run("import threading, time\nn = 0\ndef spin():\n    global n\n    while True:\n"
                           "        n += 1\nthreading.Thread(target=spin, daemon=True).start()").ok
        pid = session.pids[0]
        before = tree_cpu(pid)
        time.sleep(0.5)
        assert tree_cpu(pid) - before < 0.1
        result = session.run("a = n\ntime.sleep(0.2)\nprint(n > a)")  # it runs again during a call
        assert result.output == "True\n" and session.restarts == 0
        start = time.monotonic()
    assert time.monotonic() - start < 0.5 and sandbox_processes() == []  # closes at once, paused or not


def test_session_close_leaves_no_process():
    session = PythonSession(FULL)
    session.run("import time")
    pid = session.pids[0]
    session.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_python_tool_through_the_executor():
    stateless = PythonTool(FULL)
    stateful = PythonTool(FULL, stateful=True, name="repl")
    try:
        with ToolExecutor(ToolRegistry([stateless, stateful])) as executor:
            assert executor.run("python", {"code": "print(2 + 2)"}).output == "4\n"
            assert executor.run("repl", {"code": "y = 5"}).ok
            assert executor.run("repl", {"code": "y * 2"}).output == "10\n"
            assert "NameError" in executor.run("python", {"code": "y"}).error
            assert "missing required argument(s): code" in executor.run("python", {}).error
            loop = executor.run("python", {"code": "while True:\n    pass"})
            # The sandbox's own timeout answers, well before the executor's backstop.
            assert loop.timed_out and "Timed out after 2 s (wall clock)" in loop.error
    finally:
        stateful.close()


def test_python_tool_keeps_a_shorter_executor_limit_itself():
    """A caller's limit below the sandbox's (a rollout's tool budget) is enforced by the sandbox:
    the program is stopped with the sandbox's message and a stateful session restarts, instead
    of the call being abandoned while its program still runs and holds the session."""
    stateful = PythonTool(dataclasses.replace(FULL, timeout_s=10.0), stateful=True, name="repl")
    try:
        with ToolExecutor(ToolRegistry([stateful])) as executor:
            assert executor.run("repl", {"code": "x = 41"}).ok
            t = time.monotonic()
            slow = executor.run("repl", {"code": "x = 0\nimport time\ntime.sleep(5)"}, timeout_s=1.0)
            assert slow.timed_out and "Timed out after 1 s (wall clock)" in slow.error, slow
            assert "session was restarted" in slow.error
            after = executor.run("repl", {"code": "print(x + 1)"}, timeout_s=1.0)
            assert time.monotonic() - t < 4.0
            assert "NameError" in after.error  # the policy was told the state is gone, and it is
            assert executor.stats()["timed_out"] == 1 and executor.stats()["stuck_threads"] == 0
    finally:
        stateful.close()


def test_session_close_does_not_wait_for_a_running_call():
    session = PythonSession(FULL, timeout_s=30.0)
    session.run("import time")
    pid = session.pids[0]
    results = []
    worker = threading.Thread(target=lambda: results.append(session.run("time.sleep(20)")))
    worker.start()
    time.sleep(0.5)
    t = time.monotonic()
    session.close()
    assert time.monotonic() - t < 1.0
    worker.join(timeout=5.0)
    assert not worker.is_alive()
    assert results[0].error == "the Python session was closed during the call"
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert session.run("1").error == "the Python session is closed"


def test_a_program_the_stuck_interpreter_does_not_read_times_out():
    """A signal handler that never returns leaves the interpreter stuck between calls; the next
    program, larger than the pipe's buffer, must still time out rather than block its caller."""
    session = PythonSession(FULL, timeout_s=1.0)
    armed = session.run("import signal, time\nsignal.signal(signal.SIGALRM, lambda *a: time.sleep(1000))\n"
                        "signal.setitimer(signal.ITIMER_REAL, 0.05)")
    assert armed.ok
    time.sleep(0.3)
    results = []
    worker = threading.Thread(target=lambda: results.append(session.run("x = 1\n#" + "#" * 500_000)), daemon=True)
    worker.start()
    worker.join(timeout=4.0)
    stuck = worker.is_alive()
    session.close()  # releases a stuck call on the old code
    worker.join(timeout=5.0)
    assert not stuck, "the call blocked writing its program"
    assert results[0].timed_out and "session was restarted" in results[0].error
    assert session.restarts == 1


def test_descendants_walks_only_the_tree_and_matches_psutil():
    import subprocess

    from jaxagent.tools.sandbox import _descendants
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & sh -c 'sleep 30 & sleep 30' & wait"])
    try:
        deadline = time.monotonic() + 5
        while len(psutil.Process(proc.pid).children(recursive=True)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        want = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        got = [p.pid for p in _descendants(proc.pid)]
        assert len(want) >= 4 and set(got) == want and len(got) == len(want)
    finally:
        for p in psutil.Process(proc.pid).children(recursive=True):
            p.kill()
        proc.kill()
        proc.wait()
    assert _descendants(proc.pid) == []  # gone: no error, nothing listed


_HOST_SCRIPT = """
import threading, time
from jaxagent.tools.sandbox import PythonSession, SandboxConfig, _descendants, run_python
config = SandboxConfig(timeout_s=60.0, memory_mb=512)
session = PythonSession(config)
# Started on a thread that then ends: the session must outlive that thread.
starter = threading.Thread(target=lambda: session.run("x = 41"))
starter.start()
starter.join()
time.sleep(0.3)
print(session.run("x + 1").output.strip(), flush=True)  # then stopped (SIGSTOP) until the next call
threading.Thread(target=run_python, args=("import time; time.sleep(60)",), kwargs={"config": config},
                 daemon=True).start()
time.sleep(1.0)
pids = [p.pid for p in _descendants(__import__("os").getpid())]
print(" ".join(map(str, pids)), flush=True)
time.sleep(60)
"""


def test_a_host_killed_outright_leaves_no_sandbox_process(tmp_path):
    # SIGKILL (the OOM killer, a preemption past its grace) runs no cleanup in the host; the
    # interpreters, a session stopped between calls among them, must end with it.
    import subprocess
    import sys

    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the dead host cannot remove its temporary directories
    host = subprocess.Popen([sys.executable, "-c", _HOST_SCRIPT], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert host.stdout.readline().strip() == "42"
        pids = [int(p) for p in host.stdout.readline().split()]
        assert len(pids) >= 2  # the session's interpreter and the running call's
    finally:
        host.kill()
        host.wait()

    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + 5.0
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [p for p in pids if alive(p)]
    for p in survivors:  # do not leave them to other tests
        psutil.Process(p).kill()
    assert survivors == []


@MODES
def test_session_cpu_budget_kill_is_reported_as_such(config):
    # The kernel's CPU-time limit (RLIMIT_CPU, `session_cpu_s`) ends the interpreter with SIGKILL;
    # the policy must read that, not a traceback of the sandbox's own start-up code.
    config = dataclasses.replace(config, timeout_s=30.0, cpu_time_s=60.0, session_cpu_s=1.0)
    with PythonSession(config) as session:
        result = session.run("while True: pass")
    assert not result.ok and "killed by SIGKILL" in result.error, result.error
    assert "Traceback" not in result.error and "restarted" in result.error


def test_runaway_recursion_under_a_raised_limit_reports_the_error_in_time():
    # Models raise the recursion limit for deep DP; a runaway recursion then dies at a million
    # frames, and formatting all of them took longer than the call's limit: the policy read a
    # timeout, and a session lost its state, instead of the RecursionError.
    code = "import sys\nsys.setrecursionlimit(10**6)\ndef f(n):\n    return f(n + 1)\nf(0)"
    result, elapsed = run(code, dataclasses.replace(FULL, timeout_s=10.0, memory_mb=1024))
    assert not result.ok and not result.timed_out, result.error
    assert result.error.rstrip().endswith("frames in the middle of the traceback are not shown)")
    assert "RecursionError: maximum recursion depth exceeded" in result.error and 'line 4, in f' in result.error
    assert elapsed < 10.0


def test_a_session_call_interrupted_in_the_host_does_not_shift_later_replies():
    # A KeyboardInterrupt in the host (a notebook's interrupt) left the interpreter in the cell:
    # the next call got its output and end marker, and every later call the previous call's result.
    import _thread

    with PythonSession(FULL) as session:
        session.run("x = 1")
        started = os.path.join(session._proc.tmpdir, "started")

        def interrupt_once_the_cell_runs():  # not on a clock: a loaded machine starts cells late
            deadline = time.monotonic() + 60
            while not os.path.exists(started) and time.monotonic() < deadline:
                time.sleep(0.02)
            _thread.interrupt_main()

        watcher = threading.Thread(target=interrupt_once_the_cell_runs)
        # interrupt_main runs the SIGINT handler, which code run earlier in this process may
        # have replaced (or set to ignore, when it does nothing): Python's own, for this test.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            watcher.start()
            with pytest.raises(KeyboardInterrupt):
                session.run("open('started', 'w').close()\nimport time\ntime.sleep(30)\nprint('slept')",
                            timeout_s=90)
            watcher.join()
        finally:
            signal.signal(signal.SIGINT, previous)
        first = session.run("print('a')")
        assert first.ok and first.output == "a\n", first
        failing = session.run("raise ValueError('c')")
        assert not failing.ok and "ValueError: c" in failing.error
        assert session.run("print('d')").output == "d\n"
        assert session.restarts == 1
