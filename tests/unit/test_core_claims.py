"""Rollout replicas on one host agree on their engines' cores through per-core file locks (services/rollout/core_claims.py)."""
import os
import subprocess
import sys
import textwrap

import pytest

from services.rollout.core_claims import BIND_ENV, CoreClaims, bind_engine_cores, choose_cores, parse_cores


def test_the_choice_leaves_one_free_core_for_the_scheduler_and_takes_none_when_none_is_free():
    assert choose_cores([0, 1, 2, 3]) == [0, 1, 2]
    assert choose_cores([1]) == [1]
    assert choose_cores([]) == []
    assert parse_cores("0,2-4") == [0, 2, 3, 4]
    assert parse_cores("auto") == parse_cores("nobind") == parse_cores("0-1|2-3") == []


@pytest.fixture
def holder(tmp_path):
    """Another process holding core 0's lock, as a running replica bound to core 0 does; killed at the end."""
    script = textwrap.dedent(f"""
        import sys, pathlib
        from services.rollout.core_claims import CoreClaims
        claims = CoreClaims(pathlib.Path({str(tmp_path)!r}))
        assert claims.try_claim(0)
        print("held", flush=True)
        sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_auto_takes_the_cores_no_other_replica_holds_and_they_come_back_when_it_dies(tmp_path, holder, monkeypatch):
    cores = sorted(os.sched_getaffinity(0))
    if 0 not in cores:
        pytest.skip("core 0 is not among this process's cores")
    monkeypatch.delenv(BIND_ENV, raising=False)
    claims = bind_engine_cores("auto", CoreClaims(tmp_path))
    free = [c for c in cores if c != 0]
    assert claims.cores == choose_cores(free)
    assert os.environ[BIND_ENV] == (",".join(map(str, choose_cores(free))) or "nobind")
    claims.keep_only([])

    holder.kill()  # the kernel drops a dead holder's lock
    holder.wait()
    monkeypatch.delenv(BIND_ENV)
    claims = bind_engine_cores("auto", CoreClaims(tmp_path))
    assert claims.cores == choose_cores(cores)


def test_every_core_held_means_no_binding(tmp_path, monkeypatch):
    others = CoreClaims(tmp_path)
    assert all(others.try_claim(c) for c in sorted(os.sched_getaffinity(0)))
    monkeypatch.delenv(BIND_ENV, raising=False)
    # flock locks belong to the open file, so a second CoreClaims in this process competes as another process would
    assert bind_engine_cores("auto", CoreClaims(tmp_path)).cores == []
    assert os.environ[BIND_ENV] == "nobind"


def test_a_launchers_binding_is_kept_and_claimed(tmp_path, monkeypatch):
    monkeypatch.setenv(BIND_ENV, "0")  # as `dockrl up` sets it for rollout-0
    claims = bind_engine_cores("auto", CoreClaims(tmp_path))
    assert os.environ[BIND_ENV] == "0" and claims.cores == [0]
    assert not CoreClaims(tmp_path).try_claim(0)  # a replica added later keeps off it
