"""Nothing a pytest run starts outlives it: a pytest that starts real servers (Redis, a process tree in a
session of its own, a rollout replica with its vLLM processes) and ends normally, by Ctrl-C, by SIGTERM or
by SIGKILL leaves no process behind (tests/reaper.py)."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests import reaper


pytestmark = pytest.mark.service

REPO = pathlib.Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    return reaper.process_table().get(pid, (0, 0, "Z"))[2] != "Z"


@pytest.mark.parametrize("ending", ["normal end", "SIGINT", "SIGTERM", "SIGKILL"])
def test_nothing_the_test_run_started_outlives_it(ending, tmp_path):
    record = tmp_path / "started.json"
    env = {**os.environ, "LEAKY_RECORD": str(record), "LEAKY_END": "return" if ending == "normal end" else "wait",
           "LEAKY_REPLICA": "1" if ending == "SIGKILL" else ""}
    # SIGINT as a terminal's Ctrl-C finds it: a pytest run in the background (CI's, say) inherits it ignored
    inner = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/service/leaky_session.py"],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while not record.exists():
            assert inner.poll() is None, f"the inner pytest ended early:\n{inner.stdout.read().decode()[-3000:]}"
            assert time.monotonic() < deadline, "the inner pytest did not start its servers"
            time.sleep(0.1)
        started = json.loads(record.read_text())
        assert started["pids"] and all(_alive(p) for p in started["pids"])
        if ending != "normal end":
            inner.send_signal(getattr(signal, ending))
        inner.wait(timeout=120)
        deadline = time.monotonic() + 20
        while (left := [p for p in started["pids"] + started["children"] if _alive(p)]):
            assert time.monotonic() < deadline, f"still running 20 s after the inner pytest's {ending}: {left}"
            time.sleep(0.1)
    finally:
        if inner.poll() is None:
            inner.kill()
            inner.wait()
