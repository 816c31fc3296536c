"""Reward dock workers against the real Redis: two replicas score every row exactly once."""
import threading
import time

import numpy as np
import pytest
from transformers import AutoTokenizer

from services.common.errors import FailedPrecondition
from services.common.templates import load_templates
from services.common.tiny_model import build_tokenizer
from services.dock.registry import ReplicaRegistry
from services.dock.schema import DockLayout
from services.reward.decoding import ResponseDecoder
from services.reward.overlong import OverlongPenalty
from services.reward.pool import VerifierPool
from services.reward.scoring import ScoringPlan
from services.reward.worker import CONSUMER, RewardWorker

pytestmark = pytest.mark.service

N, GROUPS = 4, 12
LAYOUT = DockLayout(n_samples_per_prompt=N, capacity_groups=GROUPS)  # the default columns hold rm_parts
PLAN = ScoringPlan.create(["acc", "format"], [1.0, 0.5], OverlongPenalty(True, 4, 1.0, 200))
HANGS = r"\boxed{(x+1)^{10000}-1}"  # sympy simplifies this for minutes


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out, load_templates()["qwen"])
    return str(out), AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(parallel=2, timeout_s=1.5) as pool:
        yield pool


def response_of(row: int) -> str:
    """Row r answers r % 7 boxed; every third row is wrong by one, every fifth is well formatted."""
    answer = row % 7 + (1 if row % 3 == 0 else 0)
    text = rf"\boxed{{{answer}}}"
    return f"<think>adding</think> <answer>{text}</answer>" if row % 5 == 0 else f"so {text}"


def expected_score(row: int) -> float:
    acc = -0.5 if row % 3 == 0 else 1.0
    return acc + (0.5 if row % 5 == 0 else 0.0)


def put_responses(dock, tok, rows, text_of=response_of):
    ids = [np.array(tok.encode(text_of(r) + "<|im_end|>", add_special_tokens=False), np.int32) for r in rows]
    dock.put(rows, {"responses": ids, "response_length": [len(i) for i in ids]})


def worker_loop(worker, stop, taken):
    while not stop.is_set():
        report = worker.step(wait_s=0.2)
        if report is not None:
            taken.append(report)


def test_two_workers_score_every_complete_group_exactly_once(dock_factory, tokenizer, pool):
    path, tok = tokenizer
    owner = dock_factory(LAYOUT)
    rows = owner.rows_of(range(GROUPS))
    owner.put(rows, {"labels": [str(r % 7) for r in rows]})
    workers = [RewardWorker(dock_factory(), PLAN, pool, ResponseDecoder(path), count=2 * N) for _ in range(2)]
    reports = [[], []]
    stop = threading.Event()
    threads = [threading.Thread(target=worker_loop, args=(w, stop, r)) for w, r in zip(workers, reports)]
    for t in threads:
        t.start()
    try:
        # the rollout finishes groups in waves; group 0 stays one response short until the end
        put_responses(owner, tok, rows[1:N])
        for wave in range(1, GROUPS, 4):
            put_responses(owner, tok, owner.rows_of(range(wave, min(wave + 4, GROUPS))))
            time.sleep(0.3)
        deadline = time.monotonic() + 30
        while owner.stats().consumed.get(CONSUMER, 0) < (GROUPS - 1) * N and time.monotonic() < deadline:
            time.sleep(0.1)
        assert owner.stats().consumed[CONSUMER] == (GROUPS - 1) * N  # the incomplete group is not handed out
        put_responses(owner, tok, rows[:1])
        while not owner.all_consumed(CONSUMER) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    scored = [[i for r in worker_reports for i in r.indexes] for worker_reports in reports]
    assert all(scored), "both replicas took work"
    assert sorted(scored[0] + scored[1]) == rows  # every row exactly once
    stats = owner.stats()
    assert stats.consumed[CONSUMER] == len(rows) and stats.leased[CONSUMER] == 0 and stats.requeued == 0
    values = owner.read(rows, ["rm_scores", "rm_parts"])
    assert [float(s) for s in values["rm_scores"]] == [expected_score(r) for r in rows]
    assert [list(p) for p in values["rm_parts"][:2]] == [[-0.5, 1.0], [1.0, 0.0]]  # rows 0 and 1: acc, format


def test_a_stalled_worker_loses_its_rows_and_its_late_put_is_refused(dock_factory, tokenizer, pool):
    path, tok = tokenizer
    owner = dock_factory(LAYOUT)
    rows = owner.rows_of([0])
    owner.put(rows, {"labels": ["1"] * N})
    put_responses(owner, tok, rows, lambda r: HANGS if r == 0 else r"\boxed{1}")
    slow = RewardWorker(dock_factory(lease_seconds=0.5), PLAN, pool, ResponseDecoder(path), N)  # lease < verifier timeout
    patient = RewardWorker(dock_factory(lease_seconds=30), PLAN, pool, ResponseDecoder(path), N)
    slow_report = {}
    thread = threading.Thread(target=lambda: slow_report.setdefault("report", slow.step()))
    thread.start()
    time.sleep(0.8)  # the slow worker's lease has expired; its rows go back to the pool
    taken = patient.step(wait_s=5)
    thread.join(10)
    assert slow_report["report"].indexes == []  # refused: the lease was taken over
    assert taken.indexes == rows and taken.timed_out == 1  # acc on row 0
    assert [float(s) for s in owner.read(rows, ["rm_scores"])["rm_scores"]] == [-0.5, 1.0, 1.0, 1.0]
    assert owner.stats().requeued == N


def test_run_until_registers_the_replica_and_stops(dock_factory, tokenizer, pool):
    path, tok = tokenizer
    owner = dock_factory(LAYOUT)
    rows = owner.rows_of([0])
    owner.put(rows, {"labels": ["3"] * N})
    put_responses(owner, tok, rows, lambda r: r"\boxed{3}")
    worker = RewardWorker(dock_factory(), PLAN, pool, ResponseDecoder(path), N)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run_until, args=(stop, "127.0.0.1:1"))
    thread.start()
    registry = ReplicaRegistry(owner.client, owner.keys)
    deadline = time.monotonic() + 10
    while not owner.all_consumed(CONSUMER) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r.address for r in registry.live("reward")] == ["127.0.0.1:1"]
    stop.set()
    thread.join(10)
    assert not thread.is_alive() and registry.live("reward") == []
    assert [float(s) for s in owner.read(rows, ["rm_scores"])["rm_scores"]] == [1.0] * N


def test_a_worker_that_cannot_decode_gives_its_rows_back(dock_factory, tokenizer, pool, tmp_path):
    path, tok = tokenizer
    owner = dock_factory(LAYOUT)
    rows = owner.rows_of([0])
    owner.put(rows, {"labels": ["2"] * N})
    put_responses(owner, tok, rows, lambda r: r"\boxed{2}")
    broken = RewardWorker(dock_factory(), PLAN, pool, ResponseDecoder(str(tmp_path / "no-tokenizer")), N)
    with pytest.raises(FailedPrecondition, match="tokenizer_name_or_path: cannot load"):
        broken.step()
    assert owner.stats().leased[CONSUMER] == 0
    taken = RewardWorker(dock_factory(), PLAN, pool, ResponseDecoder(path), N).step()
    assert taken.indexes == rows and [float(s) for s in owner.read(rows, ["rm_scores"])["rm_scores"]] == [1.0] * N


def test_the_tokenizer_loads_before_the_first_batch_and_a_missing_one_fails_only_at_use(tokenizer, tmp_path):
    path, tok = tokenizer
    decoder = ResponseDecoder(path)
    decoder.preload()  # what the dock worker does at start, while the dock and the rollout replicas come up
    deadline = time.monotonic() + 60
    while decoder._tokenizer is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert decoder._tokenizer is not None and decoder.decode(tok.encode("7")) == "7"
    missing = ResponseDecoder(str(tmp_path / "not-yet"))
    missing.preload()  # the background load fails quietly; the first use says why
    with pytest.raises(FailedPrecondition, match="tokenizer_name_or_path: cannot load"):
        missing.decode([1])
