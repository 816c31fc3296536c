"""Escapes tried against a real sandbox server on loopback: each is contained, reported with its own status and
reason, and the server then still runs a normal program correctly. The server holds the shared token (from its
environment), another secret in its environment and a token file on disk; the programs must see none of them."""
from __future__ import annotations

import os
import pathlib
import socket
import threading
import time

import pytest
from listening import all_loopback, listening_addresses
from sandbox_harness import LIMITS, sandbox_server

from services.common.config import SandboxConfig
from services.common.sandbox_client import ExecStatus, Program, SandboxClient

pytestmark = pytest.mark.service

AREA = "sandbox escapes"
TOKEN = "sandbox-escape-token-7f3a"
SECRET = "sandbox-escape-env-secret-91c2"
WORKERS = 2


class Listener:
    """A TCP server on the host's loopback that counts the connections it accepts."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    home = tmp_path_factory.mktemp("sandbox-escapes")
    token_file = home / "token"
    token_file.write_text(TOKEN)
    with sandbox_server(home, {"workers": WORKERS}, env={"DOCKRL_TOKEN": TOKEN, "SANDBOX_TEST_SECRET": SECRET}) as (proc, target):
        with SandboxClient(target, TOKEN) as client:
            yield proc, target, client, home


def still_serves(sandbox) -> tuple[bool, str]:
    """Whether the server lives and runs a normal program correctly after an escape; and what it saw."""
    proc, _, client, _ = sandbox
    if proc.poll() is not None:
        return False, f"server exited {proc.returncode}"
    result = client.execute(Program("import sys\nprint(sum(map(int, sys.stdin.read().split())))", b"20 22"))
    return result.status is ExecStatus.OK and result.stdout == b"42\n", f"then a normal program: {result.status.value} {result.stdout!r}"


def sandbox_uid_processes() -> list[int]:
    """Host processes left running as the sandbox's uids (a root server runs programs as uid_base + slot)."""
    base = SandboxConfig().uid_base
    left = []
    for status in pathlib.Path("/proc").glob("[0-9]*/status"):
        try:
            uid = int(next(line for line in status.read_text().splitlines() if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration):
            continue
        if base <= uid < base + WORKERS:
            left.append(int(status.parent.name))
    return left


def escape(sandbox, fault_log, tried: str, code: str, expected: str, contained, stdin: bytes = b""):
    """Runs `code`; the row holds when `contained(result)` and the server then serves a normal program."""
    started = time.monotonic()
    result = sandbox[2].execute(Program(code, stdin))
    took = time.monotonic() - started
    ok, after = still_serves(sandbox)
    last_lines = [stream.strip().splitlines()[-1][:100].decode(errors="replace") for stream in (result.stdout, result.stderr) if stream.strip()]
    observed = f"{result.status.value} ({result.reason}) in {took:.1f} s; last lines: {' / '.join(last_lines) or 'none'}; {after}"
    fault_log.check(AREA, tried, expected + "; then a normal program runs correctly", observed, bool(contained(result)) and ok)
    return result


def test_connect_to_loopback(sandbox, fault_log):
    listener = Listener()
    port = sandbox[1].rsplit(":", 1)[1]
    code = ("import socket\nfor port in (%d, %s):\n    try:\n        socket.create_connection(('127.0.0.1', port), timeout=1)\n"
            "        print('connected', port)\n    except OSError as exc:\n        print('refused', port, exc)\n"
            "socket.create_connection(('127.0.0.1', %d), timeout=1)") % (listener.port, port, listener.port)
    escape(sandbox, fault_log, "connect to the host's loopback: a listening test socket and the sandbox server's own port",
           code, "runtime_error, each connection refused (own network namespace), nothing accepted on the host",
           lambda r: r.status is ExecStatus.RUNTIME_ERROR and b"connected" not in r.stdout and listener.accepted == 0)


def test_connect_to_an_external_address(sandbox, fault_log):
    code = ("import socket\ntry:\n    print(socket.getaddrinfo('example.com', 80))\nexcept OSError as exc:\n    print('dns', exc)\n"
            "socket.create_connection(('1.1.1.1', 53), timeout=1)")
    escape(sandbox, fault_log, "resolve a name and connect to an external address (1.1.1.1:53)",
           code, "runtime_error: no name resolution, network unreachable",
           lambda r: r.status is ExecStatus.RUNTIME_ERROR and r.stdout.startswith(b"dns") and b"Network is unreachable" in r.stderr)


def test_write_outside_the_temporary_directory(sandbox, fault_log):
    host_file = sandbox[3] / "escaped"
    code = ("import sys\nfor path in ('/usr/escaped', '/escaped', '/code/main.py', '/proc/sys/kernel/hostname', %r):\n"
            "    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
            "    except OSError as exc:\n        print('refused', path, exc.strerror)\n"
            "open('/tmp/fine', 'w').write('ok')\nprint(open('/tmp/fine').read())") % str(host_file)
    escape(sandbox, fault_log, "write to /usr, /, its own source, /proc/sys and the server's directory on the host",
           code, "ok: every write outside /tmp refused (read-only binds, nothing else of the host mounted); /tmp writable",
           lambda r: r.status is ExecStatus.OK and b"wrote" not in r.stdout and r.stdout.endswith(b"ok\n")
           and not host_file.exists() and not pathlib.Path("/usr/escaped").exists())


def test_read_the_token_file_and_the_environment(sandbox, fault_log):
    code = ("import os, glob\nseen = [repr(dict(os.environ))]\n"
            "for path in [%r, '/proc/1/environ', '/proc/1/cmdline', *glob.glob('/proc/*/environ')]:\n"
            "    try:\n        seen.append(open(path, 'rb').read().decode(errors='replace'))\n"
            "    except OSError as exc:\n        seen.append(f'{path}: {exc.strerror}')\nprint('\\n'.join(seen))") % str(sandbox[3] / "token")
    escape(sandbox, fault_log, "read the server's token file, its own environment and every visible process's environ",
           code, "ok, and neither the token nor the server's environment secret in what it read",
           lambda r: r.status is ExecStatus.OK and TOKEN.encode() not in r.stdout and SECRET.encode() not in r.stdout
           and b"No such file" in r.stdout)


def test_fork_bomb(sandbox, fault_log):
    result = escape(sandbox, fault_log, "fork bomb (every process forks forever)", "import os\nwhile True:\n    os.fork()",
                    f"process_limit at sandbox.processes = {LIMITS['processes']}",
                    lambda r: r.status is ExecStatus.PROCESS_LIMIT and "process limit of 16" in r.reason)
    if os.geteuid() == 0:
        time.sleep(0.5)
        left = sandbox_uid_processes()
        fault_log.check(AREA, "fork bomb: processes left on the host after it", "none of the sandbox's uids", f"{len(left)} left", not left)
    assert result.exit_code != 0


def test_memory_bomb(sandbox, fault_log):
    escape(sandbox, fault_log, "memory bomb (32 MiB blocks, written, kept without end)", "x = []\nwhile True:\n    x.append(b'x' * (32 << 20))",
           f"memory at sandbox.memory_mb = {LIMITS['memory_mb']}", lambda r: r.status is ExecStatus.MEMORY and "256 MB" in r.reason)


def test_infinite_loop(sandbox, fault_log):
    escape(sandbox, fault_log, "busy infinite loop", "while True:\n    pass",
           "timeout at the 2 s limit", lambda r: r.status is ExecStatus.TIMEOUT and "2 s" in r.reason)


def test_sleep_past_the_wall_limit(sandbox, fault_log):
    escape(sandbox, fault_log, "sleep past the wall-clock limit (no CPU used)", "import time\ntime.sleep(3600)",
           "timeout at the 2 s wall-clock limit", lambda r: r.status is ExecStatus.TIMEOUT and "wall-clock limit of 2 s" in r.reason)


def test_gigabytes_of_output(sandbox, fault_log):
    escape(sandbox, fault_log, "write 4 GiB to stdout", "import sys\nblock = 'x' * (1 << 20)\nfor _ in range(4096):\n    sys.stdout.write(block)",
           f"output_limit after {LIMITS['output_bytes']} bytes kept, stopped at once",
           lambda r: r.status is ExecStatus.OUTPUT_LIMIT and len(r.stdout) == LIMITS["output_bytes"] and r.stdout_truncated
           and r.wall_ms < 1500)


def test_signals_to_the_parent(sandbox, fault_log):
    proc = sandbox[0]
    code = ("import os, signal, sys\nserver = int(sys.stdin.read())\n"
            "for name, pid in (('parent', os.getppid()), ('pid 1', 1), ('server', server), ('every process', -1)):\n"
            "    try:\n        os.kill(pid, signal.SIGKILL)\n        print('sent', name, pid)\n"
            "    except OSError as exc:\n        print('refused', name, pid, exc.strerror)\nprint('alive')")
    escape(sandbox, fault_log, "SIGKILL its parent, pid 1, the server's host pid and every process it can (kill -1)",
           code, "ok, alive: its parent is the namespace's init, which ignores signals from inside; the server's pid "
                 "is not in its pid namespace; the server untouched",
           lambda r: r.status is ExecStatus.OK and r.stdout.endswith(b"alive\n") and f"refused server {proc.pid}".encode() in r.stdout
           and proc.poll() is None,
           stdin=str(proc.pid).encode())


def test_a_program_that_closes_its_stdout_early(sandbox, fault_log):
    code = "import os, sys, time\nprint('before', flush=True)\nos.close(1)\ntime.sleep(0.3)\nsys.stderr.write('after')"
    escape(sandbox, fault_log, "close its stdout, then go on and exit 0",
           code, "ok with the output written before the close and stderr after it",
           lambda r: r.status is ExecStatus.OK and r.stdout == b"before\n" and r.stderr == b"after")


def test_sandbox_serve_listens_on_loopback_by_default(sandbox, fault_log):
    addresses = listening_addresses(sandbox[0].pid)
    fault_log.check("binding", "sandbox serve with no --host: its listening sockets", "127.0.0.1 only",
                    ", ".join(f"{ip}:{port}" for ip, port in sorted(addresses)), all_loopback(addresses))
