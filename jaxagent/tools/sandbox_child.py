"""The code that runs inside the Python sandbox process (see `sandbox.py`).

Only this function's *source* crosses into the sandbox: `sandbox.py` sends
`inspect.getsource(_child_main)` to a fresh `python -I` interpreter, which runs it before any
user code. It therefore imports everything it needs itself and uses no module globals.
"""


def _child_main() -> None:  # pragma: no cover - executed in the sandbox process
    import ast, builtins, ctypes, errno, json, linecache, os, resource, signal, socket, sys, sysconfig, traceback, types  # noqa: E401,I001,E501

    def read_exact(stream, n):
        data = stream.read(n)
        if data is None or len(data) < n:
            raise EOFError
        return data

    def recv(stream):
        try:
            return json.loads(read_exact(stream, int.from_bytes(read_exact(stream, 8), "big")))
        except EOFError:
            return None

    cfg = recv(sys.stdin.buffer)
    ctrl, tmp = cfg["ctrl_fd"], os.path.realpath(cfg["tmpdir"])

    def send(msg):
        data = json.dumps(msg).encode()
        data = len(data).to_bytes(8, "big") + data
        while data:
            data = data[os.write(ctrl, data):]

    libc = ctypes.CDLL(None, use_errno=True)

    def die_with_host():
        # SIGKILL when the host's starting thread ends (see `_popen` in sandbox.py), so a host
        # killed outright leaves no interpreter behind; a host already gone: leave now.
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != cfg["host_pid"]:
            os._exit(1)

    die_with_host()

    def check(ret):
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    facts = {"user_namespace": False, "net_namespace": False, "mount_namespace": False,
             "pid_namespace": False, "readonly_host_fs": False, "capabilities_dropped": False,
             "no_new_privs": False, "audit_hook": bool(cfg["audit_hook"])}
    deny_paths = [p for p in cfg.get("deny_read_paths", ()) if p]
    facts["deny_read_hidden"] = not deny_paths  # set below once they are hidden from the kernel
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    in_ns = cfg["namespaces"] != "off" and (os.geteuid() == 0 or cfg["namespaces"] == "user")
    if cfg["namespaces"] == "user" or (cfg["namespaces"] == "auto" and os.geteuid() != 0):
        try:
            uid, gid = os.getuid(), os.getgid()
            check(libc.unshare(0x10000000))  # CLONE_NEWUSER
            for path, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{path}", "w") as f:
                    f.write(text)
            facts["user_namespace"] = in_ns = True
        except OSError:
            in_ns = False
    if in_ns:
        for name, flag in (("net", 0x40000000), ("mount", 0x20000), ("pid", 0x20000000)):
            try:
                check(libc.unshare(flag))
                facts[name + "_namespace"] = True
            except OSError:
                pass
    devices = [d for d in ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom") if os.path.exists(d)]
    if facts["mount_namespace"]:
        rdonly, nosuid, nodev, remount, bind, private = 1, 2, 4, 32, 4096, 1 << 18

        def mount(source, target, flags, fstype=None, data=None):
            check(libc.mount(source and source.encode(), target.encode(), fstype, flags, data))

        def kept_flags(path):  # flags a remount must keep (locked ones inside a user namespace)
            try:
                f = os.statvfs(path).f_flag
            except OSError:
                return 0
            pairs = ((2, 2), (4, 4), (8, 8), (1024, 1024), (2048, 2048), (4096, 1 << 21), (1, 1))
            return sum(ms for st, ms in pairs if f & st)

        try:
            mount(None, "/", private | 16384)  # MS_REC: nothing we do propagates to the host
            mount(tmp, tmp, bind)
            for dev in devices:
                mount(dev, dev, bind)
            with open("/proc/self/mountinfo") as f:
                points = [line.split()[4].encode().decode("unicode_escape") for line in f]
            failures = 0
            for point in dict.fromkeys(points):
                flags = kept_flags(point) | bind | remount | nosuid
                if point == tmp:
                    flags = (flags & ~rdonly) | nodev
                elif point in devices:
                    flags |= rdonly
                else:
                    flags |= rdonly | nodev
                try:
                    mount(None, point, flags)
                except OSError:
                    failures += 1
            facts["readonly_host_fs"] = failures == 0
            # Denied paths are hidden by the kernel too (an empty read-only tmpfs over a directory,
            # /dev/null over a file): the audit hook cannot see the directory of a dir_fd-relative
            # open, so it alone would let os.open(name, dir_fd=...) read them.
            hidden = 0
            for path in deny_paths:
                try:
                    if os.path.isdir(path):
                        mount("none", path, rdonly | nosuid | nodev | 8, b"tmpfs", b"size=4k,mode=0555")
                    elif os.path.lexists(path):
                        mount("/dev/null", path, bind)
                    hidden += 1
                except OSError:
                    pass
            facts["deny_read_hidden"] = hidden == len(deny_paths)
        except OSError:
            pass
    die_with_host()  # again: a change of credentials (entering a user namespace) may clear it
    if facts["pid_namespace"]:
        # The namespace's init passes on here the signal that killed the user code (an init
        # cannot die of a signal it sends itself, so it cannot mirror one by its own death).
        killed_r, killed_w = os.pipe()
        pid = os.fork()
        if pid:  # outside the namespace: wait for its init, mirror how it ended, never run user code
            os.close(killed_w)
            status = os.waitpid(pid, 0)[1]
            killed = os.read(killed_r, 1)
            if killed and not os.WIFSIGNALED(status):
                status = killed[0]  # a wait status of death by that signal
            if os.WIFSIGNALED(status):
                sig = os.WTERMSIG(status)
                if sig != signal.SIGKILL:  # its action cannot be set (EINVAL), and needs not be
                    signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)
                os._exit(128 + sig)
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    else:  # orphans of processes the code starts stay below this one, where the host finds them
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    if in_ns:
        for cap in range(64):
            libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP; EINVAL past the last capability
        libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
        header, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()
        facts["capabilities_dropped"] = libc.capset(header, data) == 0
    facts["no_new_privs"] = libc.prctl(38, 1, 0, 0, 0) == 0
    facts["nproc_limit_effective"] = os.getuid() != 0
    if facts["pid_namespace"]:
        # The user code must not be the namespace's init: the kernel drops every signal an init
        # has no handler for, so `os.kill(os.getpid(), SIGTERM)`, `signal.alarm` or `abort()`
        # did not end the program (it printed on, reported ok). This process stays as the init:
        # it reaps orphans, waits for the user code and reports how that ended.
        child = os.fork()
        if child:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # ignored, as an init without handlers
            for fd in (0, 1, 2, ctrl, killed_r):
                os.close(fd)
            while True:
                try:
                    pid, status = os.wait()
                except ChildProcessError:
                    os._exit(1)
                if pid == child:
                    break
            if os.WIFSIGNALED(status):
                os.write(killed_w, bytes([os.WTERMSIG(status)]))
                os._exit(1)
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG: ends with the init
        os.close(killed_r)
        os.close(killed_w)

    def limit(res, soft, hard=None):
        try:
            resource.setrlimit(res, (int(soft), int(soft if hard is None else hard)))
        except (ValueError, OSError):
            pass

    used = resource.getrusage(resource.RUSAGE_SELF)
    limit(resource.RLIMIT_CPU, used.ru_utime + used.ru_stime + cfg["kernel_cpu_s"] + 1)
    limit(resource.RLIMIT_NPROC, cfg["max_processes"])
    limit(resource.RLIMIT_FSIZE, cfg["max_file_mb"] << 20)
    limit(resource.RLIMIT_NOFILE, cfg["max_open_files"])

    # The protocol keeps its own copy of stdin; fd 0 becomes /dev/null so input() sees EOF.
    requests = os.fdopen(os.dup(0), "rb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.chdir(tmp)
    sys.dont_write_bytecode = True
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, errors="backslashreplace")
    # The output pipes, to tell whether fd 1 or 2 still is one: code that points them elsewhere
    # (os.dup2 of /dev/null or a file) gets no end marker there, which the host would wait for.
    pipes = {fd: (os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2)}

    read_roots = {tmp, os.path.realpath("/proc/self"), "/usr/share", *devices}
    read_roots |= {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    read_roots |= {p for p in sysconfig.get_paths().values() if p}
    read_roots = tuple(os.path.realpath(p) for p in read_roots | set(cfg["extra_read_paths"]))
    write_roots = (tmp, *devices)
    deny_roots = tuple(os.path.realpath(p) for p in cfg.get("deny_read_paths", ()))

    def inside(path, roots):
        path = os.path.realpath(path)
        return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)

    deny_set = frozenset(deny_roots)

    def is_denied(path):
        # The path and each directory above it looked up in a set: the cost of every checked
        # open is its depth, not the number of denied paths (a data set of hundreds of shards
        # denies each; a scan of 500 roots added 0.12 ms to every open, seconds to a big import).
        if not deny_set:
            return False
        path = os.path.realpath(path)
        while path not in deny_set:
            parent = os.path.dirname(path)
            if parent == path:
                return False
            path = parent
        return True

    def as_path(value, dir_fd=None):
        if isinstance(value, int):
            return None  # an already-open descriptor
        try:
            path = os.fsdecode(os.fspath(value))
        except TypeError:
            return None
        if dir_fd is not None and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        return path

    denied = frozenset({
        "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen",
        "os.killpg", "resource.setrlimit", "resource.prlimit", "ctypes.dlopen", "ctypes.dlsym",
        "ctypes.dlsym/handle", "ctypes.call_function", "ctypes.cdata", "gc.get_objects", "gc.get_referrers",
        "gc.get_referents", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
        "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex", "socket.gethostbyaddr",
        "socket.getnameinfo", "socket.sethostname"})
    # event -> (indexes of path arguments, index of a dir_fd argument or None)
    path_events = {"os.remove": ((0,), 1), "os.rmdir": ((0,), 1), "os.mkdir": ((0,), 2), "os.chmod": ((0,), 2),
                   "os.chown": ((0,), 3), "os.rename": ((0, 1), 2), "os.link": ((0, 1), 2),
                   "os.symlink": ((1,), 2), "os.truncate": ((0,), None), "os.utime": ((0,), 3),
                   "os.setxattr": ((0,), None), "os.removexattr": ((0,), None), "os.mkfifo": ((0,), 2),
                   "os.mknod": ((0,), 3), "shutil.rmtree": ((0,), 1), "os.chflags": ((0,), None)}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    my_pid = os.getpid()

    def refuse(what):
        raise PermissionError(errno.EACCES, f"{what} is not allowed in the sandbox")

    def check_open(path, writing):
        if not inside(path, write_roots if writing else read_roots) or is_denied(path):
            refuse(f"{'writing' if writing else 'reading'} {path!r}")

    def audit(event, args):
        if event in denied:
            refuse(event)
        if event == "open":
            path = as_path(args[0])
            if path is not None:
                check_open(path, any(c in (args[1] or "") for c in "wax+") or (args[2] or 0) & write_flags)
        elif event in path_events:
            indexes, fd_index = path_events[event]
            dir_fd = args[fd_index] if fd_index is not None and len(args) > fd_index else None
            for i in indexes:
                path = as_path(args[i], dir_fd if isinstance(dir_fd, int) and dir_fd >= 0 else None)
                if path is not None and not inside(path, write_roots):
                    refuse(f"{event} on {path!r}")
        elif event in ("os.listdir", "os.scandir"):  # names are read like contents: same roots
            path = as_path(args[0])
            if path is not None and (not inside(path, read_roots) or is_denied(path)):
                refuse(f"listing {path!r}")
        elif event == "sqlite3.connect":  # the library opens the file itself, with no "open" event
            path = as_path(args[0])
            if path is not None and path not in ("", ":memory:"):
                if path.startswith("file:"):  # a URI (uri=True): checked by its path
                    path = path[5:].split("?")[0]
                if not inside(path, write_roots) or is_denied(path):
                    refuse(f"sqlite3 opening {path!r}")
        elif event == "import" and args[0] in ("_signal", "posix"):  # imported above; again only to undo guards
            refuse(f"importing {args[0]} again")
        elif event == "os.kill" and args[0] != my_pid:
            refuse("signalling another process")
        elif event == "socket.__new__" and args[1] != socket.AF_UNIX:
            refuse("network access")

    def no_pidfd_signal(*args, **kwargs):
        refuse("signalling another process")

    def no_fallocate(*args, **kwargs):
        # Reserves gigabytes in milliseconds, faster than the host measures the disk the
        # temporary directory takes (SandboxConfig.max_disk_mb).
        refuse("os.posix_fallocate")

    def own_process(pid):  # this interpreter (0 or its PID) or one of its threads
        try:
            return pid in (0, my_pid) or os.path.isdir(f"/proc/self/task/{int(pid)}")
        except (TypeError, ValueError, OverflowError):
            return True  # the function itself raises the error

    def only_own_process(fn):
        def guarded(pid, *args, **kwargs):
            if not own_process(pid):
                refuse(f"{fn.__name__} on another process")
            return fn(pid, *args, **kwargs)
        return guarded

    def only_own_priority(fn):
        def guarded(which, who, *args, **kwargs):
            if which != os.PRIO_PROCESS or not own_process(who):
                refuse("setpriority on another process")
            return fn(which, who, *args, **kwargs)
        return guarded

    def dir_fd_checked(fn):
        # os.open(name, flags, dir_fd=fd) raises an "open" event with `name` alone, which the
        # hook reads against the working directory: a link named alike there and in fd's
        # directory opened any host file. The path is checked against fd's directory here.
        def guarded(path, flags, mode=0o777, *, dir_fd=None):
            if isinstance(dir_fd, int) and not isinstance(dir_fd, bool):
                full = as_path(path, dir_fd)
                if full is not None:
                    check_open(full, bool(flags & write_flags))
            return fn(path, flags, mode, dir_fd=dir_fd)
        return guarded

    limit(resource.RLIMIT_AS, cfg["memory_mb"] << 20)
    if cfg["audit_hook"]:
        guarded_open = dir_fd_checked(os.open)
        for module in (os, sys.modules.get("posix")):
            if module is not None:
                module.open = guarded_open
        # pidfd_send_signal raises no audit event: it is replaced, and a fresh import of its
        # module (after deleting it from sys.modules) is refused by the hook.
        for module in (signal, sys.modules.get("_signal")):
            if module is not None and hasattr(module, "pidfd_send_signal"):
                module.pidfd_send_signal = no_pidfd_signal
        for module in (os, sys.modules.get("posix")):
            if module is not None and hasattr(module, "posix_fallocate"):
                module.posix_fallocate = no_fallocate
        if not facts["pid_namespace"]:  # host PIDs are visible: a CPU mask or priority of the trainer
            for module in (os, sys.modules.get("posix")):
                for name in ("sched_setaffinity", "sched_setscheduler", "sched_setparam", "setpriority"):
                    if module is not None and hasattr(module, name):
                        wrap = only_own_priority if name == "setpriority" else only_own_process
                        setattr(module, name, wrap(getattr(module, name)))
        sys.addaudithook(audit)

    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    # As in an interactive interpreter: the loader's arguments (the host's tag and PID) would
    # be read as the program's own (argparse refused them; `int(sys.argv[1])` raised).
    sys.argv = [""]

    def shorten_tracebacks(error, keep=100, longest=5000):
        # Formatting costs ~10 us a frame: a runaway recursion under sys.setrecursionlimit(10**6)
        # would spend longer on its traceback than a call's time limit. Of a traceback longer
        # than `longest` frames (the default recursion limit is 1000), keeps the first and the
        # last `keep`, for each exception in the chain; returns how many frames were dropped.
        omitted, seen = 0, set()
        while error is not None and id(error) not in seen:
            seen.add(id(error))
            depth, tb = 0, error.__traceback__
            while tb is not None:
                depth, tb = depth + 1, tb.tb_next
            if depth > longest:
                tb, cut = error.__traceback__, None
                for i in range(depth - keep):
                    if i == keep - 1:
                        cut = tb
                    tb = tb.tb_next
                cut.tb_next = tb
                omitted += depth - 2 * keep
            error = error.__cause__ or error.__context__
        return omitted

    def run_cell(code, filename):
        reserve = bytearray(1 << 20)  # released on MemoryError so the traceback can be formatted
        try:
            tree = ast.parse(code, filename, "exec")
            last = None
            if cfg["display"] and tree.body and isinstance(tree.body[-1], ast.Expr):
                last = compile(ast.Expression(tree.body.pop().value), filename, "eval")
            body = compile(tree, filename, "exec")
        except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
            return False, "".join(traceback.format_exception_only(type(e), e))
        try:
            linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
            exec(body, main.__dict__)
            if last is not None:
                value = eval(last, main.__dict__)
                if value is not None:
                    print(repr(value))
            return True, None
        except SystemExit as e:
            if e.code is None or e.code == 0:
                return True, None
            return False, f"SystemExit: {e.code}"
        except BaseException as e:  # noqa: BLE001
            del reserve
            try:  # the traceback without this REPL's own frames (the cell runner, the audit hook)
                omitted = shorten_tracebacks(e)
                report = traceback.TracebackException(type(e), e, e.__traceback__)
                chain = [report]
                while chain:
                    item = chain.pop()
                    item.stack = traceback.StackSummary.from_list(
                        [f for f in item.stack if f.filename != "<jaxagent-sandbox>"])
                    chain += [c for c in (item.__cause__, item.__context__) if c is not None]
                text = "".join(report.format())
                if omitted:
                    text += f"({omitted} frames in the middle of the traceback are not shown)\n"
                if isinstance(e, MemoryError):
                    text += f"(the sandbox memory limit is {cfg['memory_mb']} MB)\n"
                elif isinstance(e, OSError) and e.errno == errno.EFBIG:
                    text += f"(the sandbox limits each file to {cfg['max_file_mb']} MB)\n"
            except BaseException:  # noqa: BLE001
                text = f"{type(e).__name__} (traceback unavailable)"
            return False, text[-16000:]

    send({"type": "ready", "isolation": facts})
    cell = 0
    while True:
        request = recv(requests)
        if request is None:  # the host closed the pipe: leave without running user finalizers
            os._exit(0)
        cell += 1
        ok, error = run_cell(request["code"], f"<cell-{cell}>")
        marker = request["marker"].encode()
        written = []
        for fd, stream in ((1, sys.__stdout__), (2, sys.__stderr__)):
            try:
                sys.stdout.flush() if fd == 1 else sys.stderr.flush()
            except BaseException:  # noqa: BLE001 - user code may have replaced the stream
                pass
            try:
                stream.flush()
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) == pipes[fd]:
                    os.write(fd, marker)
                    written.append(fd)
            except BaseException:  # noqa: BLE001
                pass
        send({"type": "result", "ok": ok, "error": error, "markers": written})
