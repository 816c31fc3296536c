"""The launcher's process group and local Redis: real processes, real redis-server."""
import os
import signal
import sys
import time

import pytest
import redis

from services.launch.process_group import ProcessGroup, ProcessSpec
from services.launch.redis_local import start_local_redis

pytestmark = pytest.mark.service


def test_failure_is_reported_and_stop_leaves_no_orphans(tmp_path):
    # The sleeper forks a grandchild, as vLLM engine workers do; stop() must reach it too.
    sleeper = "import os, time\nif os.fork() == 0:\n    time.sleep(600)\ntime.sleep(600)"
    group = ProcessGroup(tmp_path)
    with group:
        a = group.start(ProcessSpec("sleeper", (sys.executable, "-c", sleeper)))
        group.start(ProcessSpec("failing", (sys.executable, "-c", "import sys; print('boom'); sys.exit(3)")))
        deadline = time.monotonic() + 10
        while group.first_exit() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        spec, code = group.first_exit()
        assert (spec.name, code) == ("failing", 3)
        assert "boom" in group.log_tail("failing")
        pgid = os.getpgid(a.pid)
    assert a.poll() is not None
    assert _group_gone(pgid), "a grandchild outlived stop()"


def _group_gone(pgid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if _pgid_state(pid, pgid)]
        if not alive:
            return True
        time.sleep(0.05)
    return False


def _pgid_state(pid: int, pgid: int) -> bool:
    """True when `pid` is a live (not zombie) member of process group `pgid`."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return int(fields[2]) == pgid and fields[0] != "Z"


def test_sigterm_ignoring_child_is_killed(tmp_path):
    stubborn = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(600)"
    group = ProcessGroup(tmp_path)
    p = group.start(ProcessSpec("stubborn", (sys.executable, "-c", stubborn)))
    time.sleep(0.5)
    t0 = time.monotonic()
    group.stop(grace_s=1.0)
    assert p.returncode == -signal.SIGKILL
    assert time.monotonic() - t0 < 5


def test_local_redis_starts_answers_and_stops(tmp_path):
    group = ProcessGroup(tmp_path / "logs")
    with group:
        url = start_local_redis(group, tmp_path / "data", durability=True)
        client = redis.Redis.from_url(url)
        assert client.ping()
        assert client.config_get("appendonly")["appendonly"] == "yes"
        assert client.config_get("bind")["bind"].startswith("127.0.0.1")
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()


def test_start_removes_a_previous_runs_ready_file(tmp_path):
    # A rerun in the same log directory must not read the last run's ports as this one's.
    ready = tmp_path / "ready" / "svc.json"
    ready.parent.mkdir()
    ready.write_text('{"grpc_port": 1, "pid": 1}')
    with ProcessGroup(tmp_path / "logs") as group:
        group.start(ProcessSpec("svc", (sys.executable, "-c", "import time; time.sleep(60)"), ready_file=str(ready)))
        assert not ready.exists()


def test_a_process_that_stops_last_outlives_the_others_stop(tmp_path):
    """Redis is `stops_last`: a service still finishing on SIGTERM (putting rows back, logging its last line)
    finds it running; it gets its own SIGTERM once the others have exited."""
    group = ProcessGroup(tmp_path)
    store = group.start(ProcessSpec("store", (sys.executable, "-c", "import time; time.sleep(600)"), stops_last=True))
    report = tmp_path / "seen.txt"
    client = (f"import os, signal, sys, time\n"
              f"def bye(*_):\n"
              f"    time.sleep(0.5)  # finishing its work\n"
              f"    try:\n        os.kill({store.pid}, 0); seen = 'alive'\n"
              f"    except ProcessLookupError:\n        seen = 'gone'\n"
              f"    open({str(report)!r}, 'w').write(seen); sys.exit(0)\n"
              f"signal.signal(signal.SIGTERM, bye)\n"
              f"time.sleep(600)\n")
    group.start(ProcessSpec("client", (sys.executable, "-c", client)))
    time.sleep(0.5)
    group.stop(grace_s=10.0)
    assert report.read_text() == "alive"
    assert store.returncode == -signal.SIGTERM
