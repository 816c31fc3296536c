"""The sandbox runner on the real bubblewrap: a program's output and status, each limit's own status, and the
sandbox config's refusals."""
import concurrent.futures
import os
import shutil
import time

import pytest

from services.common.config import ConfigError, load_config
from services.sandbox.runner import Limits, SandboxRunner, Status

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (scripts/setup.sh installs it)")

LIMITS = Limits(wall_s=2.0, memory_mb=256, output_bytes=4096, processes=8, file_size_mb=1, tmpfs_mb=4)


@pytest.fixture(scope="module")
def runner():
    return SandboxRunner("/usr/bin/python3")


def test_a_program_reads_stdin_and_writes_stdout(runner):
    run = runner.run("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", b"1 2 39\n", LIMITS)
    assert (run.status, run.exit_code, run.stdout, run.stderr) == (Status.OK, 0, b"42\n", b"")
    assert 0 < run.wall_ms < 2000


def test_a_large_stdin_reaches_a_program_that_reads_it_all(runner):
    run = runner.run("import sys\nprint(len(sys.stdin.buffer.read()))", b"x" * 1_000_000, LIMITS)
    assert run.stdout == b"1000000\n"


def test_an_exception_is_a_runtime_error_with_its_traceback(runner):
    run = runner.run("raise ValueError('bad input')", b"", LIMITS)
    assert run.status is Status.RUNTIME_ERROR and run.exit_code == 1 and b"ValueError: bad input" in run.stderr


def test_the_program_runs_as_nobody_with_a_minimal_environment(runner):
    run = runner.run("import os\nprint(os.getuid(), sorted(os.environ), os.getcwd())", b"", LIMITS)
    assert run.stdout == b"65534 ['HOME', 'LANG', 'PATH', 'PWD'] /tmp\n", run.stderr


@pytest.mark.parametrize("code, status, reason", [
    ("import time\ntime.sleep(30)", Status.TIMEOUT, "wall-clock limit of 2 s"),
    ("x = bytearray(512 * 1024 * 1024)", Status.MEMORY, "memory limit of 256 MB"),
    ("import os\nwhile True:\n    os.fork()", Status.PROCESS_LIMIT, "process limit of 8"),
    ("import sys\nwhile True:\n    sys.stdout.write('x' * 1000)", Status.OUTPUT_LIMIT, "stdout past the output limit of 4096 bytes"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", Status.KILLED, "SIGSEGV"),
    ("open('/tmp/big', 'wb').write(b'x' * 2 * 1024 * 1024)", Status.RUNTIME_ERROR, "exit status 1"),
])
def test_each_limit_ends_the_program_with_its_own_status(runner, code, status, reason):
    run = runner.run(code, b"", LIMITS)
    assert run.status is status and reason in run.reason, (run.status, run.reason, run.stderr[-300:])


def test_output_past_the_cap_is_kept_up_to_the_cap_and_flagged(runner):
    run = runner.run("import sys\nsys.stderr.write('e' * 10000)", b"", LIMITS)
    assert run.status is Status.OUTPUT_LIMIT and run.stderr == b"e" * 4096 and run.stderr_truncated and not run.stdout_truncated


def test_a_missing_interpreter_is_a_sandbox_error():
    run = SandboxRunner("/usr/bin/no-such-python").run("print(1)", b"", LIMITS)
    assert run.status is Status.SANDBOX_ERROR and "no-such-python" in run.reason


def test_sandbox_config_refuses_defaults_above_their_maxima_and_relative_paths():
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=["sandbox.wall_s=90", "sandbox.memory_mb=8192", "sandbox.interpreter=python3",
                               "sandbox.ro_paths=[lib, /]"])
    assert exc.value.errors == [
        "sandbox.wall_s: 90.0 is above sandbox.max_wall_s 60.0",
        "sandbox.memory_mb: 8192 is above sandbox.max_memory_mb 4096",
        "sandbox.interpreter: 'python3' must be an absolute path (the sandbox has no PATH search of the host)",
        "sandbox.ro_paths[0]: 'lib' must be an absolute path other than /, /proc, /dev and /tmp",
        "sandbox.ro_paths[1]: '/' must be an absolute path other than /, /proc, /dev and /tmp",
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="a root runner gives each slot its own host uid")
def test_each_slot_has_its_own_process_limit(runner):
    # Slot 2 holds 7 of its 10 processes (bubblewrap's 2, the program, 4 children) for a while; beside it a program
    # forking in slot 3 runs, one in slot 2 reaches the limit. (Slots 2 and 3: this module's other tests use slot 0,
    # whose namespaces this process, not a subreaper, does not wait to see torn down.)
    hold = "import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        time.sleep(1.5)\n        os._exit(0)\ntime.sleep(1.5)"
    fork = "import os\nfor _ in range(4):\n    if os.fork() == 0:\n        os._exit(0)\n    os.wait()\nprint('forked')"
    with concurrent.futures.ThreadPoolExecutor(1) as background:
        holding = background.submit(runner.run, hold, b"", LIMITS, 2)
        time.sleep(0.7)
        other_slot = runner.run(fork, b"", LIMITS, slot=3)
        same_slot = runner.run(fork, b"", LIMITS, slot=2)
        assert holding.result().status is Status.OK
    assert other_slot.status is Status.OK and other_slot.stdout == b"forked\n"
    assert same_slot.status is Status.PROCESS_LIMIT, (same_slot.reason, same_slot.stderr[-200:])
