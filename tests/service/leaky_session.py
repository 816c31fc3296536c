"""Not collected by the suite: tests/service/test_no_orphans.py runs it in a pytest of its own, which starts
servers, records them, and then ends as the outer test tells it (LEAKY_END), leaving them running."""
import json
import os
import pathlib
import subprocess
import sys
import time

import psutil

from tests.conftest import start_redis_server

# a server in a session of its own that starts a child of its own, as `dockrl up` and the replicas do
TREE = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(900)']); time.sleep(900)"


def test_start_servers_and_leave_them_running(tmp_path):
    redis, _ = start_redis_server(tmp_path)
    tree = subprocess.Popen([sys.executable, "-c", TREE], start_new_session=True)
    pids = [redis.pid, tree.pid]
    if os.environ.get("LEAKY_REPLICA"):  # a real rollout replica: its vLLM engine and worker processes too
        from replica_launcher import spawn_replica
        from services.common.tiny_model import build_tiny_model

        replica = spawn_replica(build_tiny_model(tmp_path / "model"), tmp_path, overrides=("rollout.omp_threads_bind=nobind",),
                                env={"OMP_NUM_THREADS": "1"}).wait()
        pids.append(replica.proc.pid)
    while not psutil.Process(tree.pid).children():  # the tree's child has started (a serving replica's engine has)
        time.sleep(0.05)
    children = [c.pid for p in pids for c in psutil.Process(p).children(recursive=True)]
    pathlib.Path(os.environ["LEAKY_RECORD"]).write_text(json.dumps({"pids": pids, "children": children}))
    if os.environ["LEAKY_END"] == "wait":
        time.sleep(900)  # until the outer test signals this pytest
