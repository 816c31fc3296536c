"""Runs one untrusted program with its stdin under bubblewrap and rlimits, and says how it ended.

The isolation (docs/sandbox.md says why each part is there):
- bubblewrap: new user, pid, network, ipc, uts and cgroup namespaces (`--unshare-all`: no network at all,
  not even the host's loopback); a root made of read-only binds of /usr (and the /bin, /lib* links or
  directories beside it) plus `ro_paths`, a fresh /proc and a minimal /dev, and one writable place, a
  size-capped tmpfs at /tmp; the program's source bound read-only from a memfd; `--clearenv` with a minimal
  PATH, HOME and LANG; `--new-session` (no TIOCSTI into a terminal); `--die-with-parent`.
- bubblewrap itself starts with an empty environment, so no host variable is readable even in the
  namespace's init process (/proc/1/environ).
- A server running as root starts bubblewrap as an unused host uid (`uid_base` + the worker's slot):
  the kernel exempts root from RLIMIT_NPROC, and the program's processes are then nobody's but its own.
- rlimits set by prlimit (util-linux) before bubblewrap starts and inherited by everything inside: RLIMIT_AS (memory), RLIMIT_CPU,
  RLIMIT_NPROC (processes, per uid), RLIMIT_FSIZE (file size), RLIMIT_CORE 0 (no core files).
- This process enforces the wall-clock limit and the output cap: past either it SIGKILLs bubblewrap,
  whose namespace init then dies (`--die-with-parent`) and the kernel ends every process of the namespace.
"""
from __future__ import annotations

import ctypes
import enum
import json
import math
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

BWRAP = "bwrap"
PRLIMIT = "prlimit"  # util-linux
SETPRIV = "setpriv"  # util-linux
CODE_PATH = "/code/main.py"  # where the program's source appears inside the sandbox (read-only)
SANDBOX_UID = 65534  # the uid the program sees inside its user namespace (nobody)
BWRAP_PROCESSES = 2  # bubblewrap's monitor (prlimit execs it in place) and the namespace's init count against the uid's process limit
# Memory errors as Python and C programs report them when RLIMIT_AS refuses an allocation.
MEMORY_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc")
PROCESS_MARKERS = (b"BlockingIOError", b"Resource temporarily unavailable", b"can't start new thread")
READ_CHUNK = 65536
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


class Status(str, enum.Enum):
    """How one execution ended (proto/sandbox.proto's Status has the same names)."""

    OK = "ok"  # exit status 0
    RUNTIME_ERROR = "runtime_error"  # a non-zero exit status
    TIMEOUT = "timeout"  # past the wall-clock or the CPU-time limit
    MEMORY = "memory"  # an allocation refused by the memory limit
    PROCESS_LIMIT = "process_limit"  # a fork or thread refused by the process limit
    OUTPUT_LIMIT = "output_limit"  # more stdout or stderr than the cap: stopped
    KILLED = "killed"  # ended by a signal (other than the limits above)
    # The sandbox could not start the program: a server fault, told by bubblewrap's (or setpriv's, prlimit's) own
    # message and exit status 1. A program can print the same and exit 1, so a verifier scores this as a failure.
    SANDBOX_ERROR = "sandbox_error"


@dataclass(frozen=True)
class Limits:
    """What one execution may use."""

    wall_s: float  # wall-clock seconds, enforced here; also the CPU-time limit (rounded up)
    memory_mb: int  # RLIMIT_AS of each process
    output_bytes: int  # bytes kept of stdout and of stderr each; more stops the program
    processes: int  # processes and threads at once (RLIMIT_NPROC)
    file_size_mb: int  # largest file written (RLIMIT_FSIZE)
    tmpfs_mb: int  # size of /tmp


@dataclass(frozen=True)
class Execution:
    """The result of one program."""

    status: Status
    reason: str  # in words: which limit, which signal, or the exit status
    exit_code: int  # the program's exit status; 128 + N when signal N ended it; -1 when this process killed it
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    wall_ms: float


class SandboxRunner:
    """Builds the bubblewrap command line once and runs programs with it (thread-safe: nothing is shared per run)."""

    def __init__(self, interpreter: str, ro_paths: Sequence[str] = (), uid_base: int = 61000, bwrap: str = BWRAP):
        self.interpreter = interpreter
        self._bwrap = bwrap
        self._uid_base = uid_base
        self._as_root = os.geteuid() == 0
        self._mounts = _root_mounts() + [arg for path in ro_paths for arg in ("--ro-bind", path, path)]

    def run(self, code: str | bytes, stdin: bytes, limits: Limits, slot: int = 0) -> Execution:
        """Runs `code` with the interpreter, `stdin` on its standard input, under `limits`; `slot` picks the host uid
        (each concurrent execution needs its own, so that the process limit of one is not shared with another)."""
        source = code.encode() if isinstance(code, str) else code
        code_fd = os.memfd_create("sandbox-code", os.MFD_CLOEXEC)
        info_read, info_write = os.pipe()  # bubblewrap writes {"child-pid": N} here: the namespace's init on the host
        try:
            os.write(code_fd, source)
            os.lseek(code_fd, 0, os.SEEK_SET)
            argv = self._argv(code_fd, info_write, limits, slot)
            started = time.monotonic()
            try:
                proc = subprocess.Popen(
                    argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={},
                    pass_fds=(code_fd, info_write), start_new_session=True, close_fds=True,
                )
            except OSError as exc:
                return Execution(Status.SANDBOX_ERROR, f"cannot start {self._bwrap}: {exc}", -1, b"", b"", False, False, 0.0)
            finally:
                os.close(code_fd)
                os.close(info_write)
            result = _supervise(proc, stdin, limits, started)
            _reap_init(info_read)
            return result
        finally:
            os.close(info_read)

    def _argv(self, code_fd: int, info_fd: int, limits: Limits, slot: int) -> list[str]:
        # setpriv, not Popen's user=: CPython may vfork, and a setuid in a vfork child of a threaded server crashes it
        uid = str(self._uid_base + slot)
        become = [SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"] if self._as_root else []
        return [
            *become, *_rlimits(limits), self._bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--info-fd", str(info_fd),
            *self._mounts,
            "--proc", "/proc", "--dev", "/dev",
            "--size", str(limits.tmpfs_mb * 1024 * 1024), "--tmpfs", "/tmp",
            "--ro-bind-data", str(code_fd), CODE_PATH,
            "--remount-ro", "/",  # the root bubblewrap builds is a tmpfs: without this, writable
            "--chdir", "/tmp",
            # -I: no PYTHON* variables, no user site, no script directory on sys.path; -B: no .pyc writes
            self.interpreter, "-I", "-B", CODE_PATH,
        ]


def become_subreaper() -> None:
    """Makes this process the reaper of its orphaned descendants (PR_SET_CHILD_SUBREAPER), so that each run reaps its
    namespace's init. bubblewrap's monitor exits without waiting for it; orphaned, the init would stay a zombie of the
    host's pid 1 (never reaped where the server is a container's pid 1), and a zombie still counts against its uid's
    process limit. For a server process only: every orphan below it becomes its child."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _reap_init(info_fd: int) -> None:
    """Reaps the namespace's init, orphaned to this process (a subreaper) once bubblewrap's monitor exited (it dies
    with it); without `become_subreaper` it is not this process's child and the host's pid 1 reaps it."""
    try:
        info = json.loads(os.read(info_fd, 4096) or b"{}")
    except ValueError:
        return
    pid = info.get("child-pid")
    if pid:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:  # already reaped, or never ours
            pass


def _root_mounts() -> list[str]:
    """/usr read-only, and /bin, /sbin, /lib* as the host has them: links into /usr (merged /usr) or directories."""
    mounts = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{name}"
        if os.path.islink(path):
            mounts += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            mounts += ["--ro-bind", path, path]
    return mounts


def _rlimits(limits: Limits) -> list[str]:
    """prlimit's command line that sets the limits and then runs bubblewrap, which everything inside inherits. (util-linux's
    prlimit rather than a preexec function: a fork of the threaded gRPC server may not run Python before exec.)"""
    memory = limits.memory_mb * 1024 * 1024
    cpu = math.ceil(limits.wall_s)
    nproc = limits.processes + BWRAP_PROCESSES
    fsize = limits.file_size_mb * 1024 * 1024
    # CPU: SIGXCPU at the soft limit, SIGKILL one second later
    return [PRLIMIT, f"--as={memory}", f"--cpu={cpu}:{cpu + 1}", f"--nproc={nproc}", f"--fsize={fsize}", "--core=0", "--"]


def _supervise(proc: subprocess.Popen, stdin: bytes, limits: Limits, started: float) -> Execution:
    """Feeds stdin, reads stdout and stderr up to the cap, and kills the program past the wall limit or the cap."""
    deadline = started + limits.wall_s
    out = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    over = {fd: False for fd in out}
    pending = memoryview(stdin)
    stdin_fd = proc.stdin.fileno()
    stopped: Status | None = None
    with selectors.DefaultSelector() as sel:
        for fd in out:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        if pending:
            os.set_blocking(stdin_fd, False)
            sel.register(stdin_fd, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        while sel.get_map() and stopped is None:
            left = deadline - time.monotonic()
            if left <= 0:
                stopped = Status.TIMEOUT
                break
            for key, _ in sel.select(left):
                fd = key.fd
                if fd == stdin_fd:
                    pending = _feed(fd, pending)
                    if not pending:
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(fd, READ_CHUNK)
                if not chunk:
                    sel.unregister(fd)
                    continue
                buf = out[fd]
                room = limits.output_bytes - len(buf)
                buf += chunk[:room]
                if len(chunk) > room:
                    over[fd] = True
                    stopped = Status.OUTPUT_LIMIT
                    break
    if stopped is None:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stopped = Status.TIMEOUT
    if stopped is not None:
        _kill(proc)
    wall_ms = (time.monotonic() - started) * 1000
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        stream.close()
    return _classify(proc.returncode, stopped, out, over, limits, wall_ms)


def _feed(fd: int, pending: memoryview) -> memoryview:
    """Writes what the pipe takes now; a program that closed its stdin gets the rest dropped."""
    try:
        return pending[os.write(fd, pending[:READ_CHUNK]):]
    except BrokenPipeError:
        return pending[:0]


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILLs bubblewrap (the namespace follows it) and reaps it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _classify(returncode: int, stopped: Status | None, out: dict, over: dict, limits: Limits, wall_ms: float) -> Execution:
    fds = list(out)
    stdout, stderr = bytes(out[fds[0]]), bytes(out[fds[1]])
    truncated = (over[fds[0]], over[fds[1]])
    if stopped is Status.TIMEOUT:
        status, reason, code = stopped, f"past the wall-clock limit of {limits.wall_s:g} s", -1
    elif stopped is Status.OUTPUT_LIMIT:
        which = "stdout" if truncated[0] else "stderr"
        status, reason, code = stopped, f"{which} past the output limit of {limits.output_bytes} bytes", -1
    else:
        status, reason, code = _from_exit(returncode, stderr, limits)
    return Execution(status, reason, code, stdout, stderr, truncated[0], truncated[1], wall_ms)


def _from_exit(returncode: int, stderr: bytes, limits: Limits) -> tuple[Status, str, int]:
    """The status of a program that ended by itself: bubblewrap exits with the program's status, 128 + N for signal N."""
    if returncode == 0:
        return Status.OK, "exit status 0", 0
    if returncode < 0:  # the sandbox's own process died before it could report the program's status
        return Status.SANDBOX_ERROR, f"the sandbox process ended by {signal.Signals(-returncode).name}", returncode
    if returncode == 1 and stderr.startswith((b"bwrap:", b"setpriv:", b"prlimit:")):
        return Status.SANDBOX_ERROR, stderr.decode(errors="replace").strip(), returncode
    tail = stderr[-4096:]
    if returncode > 128:
        sig = returncode - 128
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
        if sig == signal.SIGXCPU:
            return Status.TIMEOUT, f"past the CPU-time limit of {math.ceil(limits.wall_s)} s ({name})", returncode
        if any(m in tail for m in MEMORY_MARKERS):
            return Status.MEMORY, f"memory limit of {limits.memory_mb} MB ({name})", returncode
        return Status.KILLED, f"ended by {name}", returncode
    if any(m in tail for m in MEMORY_MARKERS):
        return Status.MEMORY, f"an allocation past the memory limit of {limits.memory_mb} MB", returncode
    if any(m in tail for m in PROCESS_MARKERS):
        return Status.PROCESS_LIMIT, f"a fork or thread past the process limit of {limits.processes}", returncode
    return Status.RUNTIME_ERROR, f"exit status {returncode}", returncode
