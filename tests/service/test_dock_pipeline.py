"""One iteration through the dock with a pipeline of consumers running at once: rollout, reward, an advantage
stage with its own column (the dock serves any chain of consumers), and training."""
import threading

import numpy as np
import pytest

from services.dock.client import Dock
from services.dock.schema import DEFAULT_COLUMNS, ColumnSpec, DockLayout

pytestmark = pytest.mark.service

GBS, N = 16, 4


def _worker(dock: Dock, consumer: str, columns: list[str], work, stop: threading.Event) -> None:
    """Claims until `stop`, puts what `work(claim)` returns under the claim's lease."""
    while not stop.is_set():
        claim = dock.claim(consumer, columns, 2 * N, timeout_s=0.2)
        if claim is not None:
            dock.put(claim.indexes, work(claim), lease=claim.lease, version=1)


def _rollout(claim):
    responses = [np.append(p, p.sum() % 10).astype(np.int32) for p in claim.columns["prompts"]]
    return {"responses": responses, "response_length": [len(r) for r in responses],
            "rollout_log_probs": [np.full(len(r), -0.5, np.float32) for r in responses]}


def _reward(claim):
    return {"rm_scores": [float(r[-1] == int(label)) for r, label in zip(claim.columns["responses"], claim.columns["labels"])]}


def test_an_iteration_passes_every_row_through_every_consumer_once(dock_factory):
    # A pipeline of consumers beyond dockrl's own: an advantage stage that writes a column of its own.
    columns = (*DEFAULT_COLUMNS, ColumnSpec("advantages", "float32", (None,)))
    dock = dock_factory(DockLayout(n_samples_per_prompt=N, capacity_groups=GBS, columns=columns))
    rows = dock.rows_of(range(GBS))
    prompts = [np.array([g, g + 1], np.int32) for g in range(GBS) for _ in range(N)]
    dock.put(rows, {"prompts": prompts, "labels": [str((2 * (i // N) + 1) % 10 if i % 2 else 0) for i in rows]})
    stop = threading.Event()
    workers = [threading.Thread(target=_worker, args=(dock, "actor_rollout", ["prompts"], _rollout, stop)) for _ in range(2)]
    workers.append(threading.Thread(target=_worker, args=(dock, "rule_reward", ["responses", "labels"], _reward, stop)))
    for w in workers:
        w.start()
    try:
        trained = []
        while not dock.all_consumed("compute_advantage"):  # the trainer: advantages per complete, scored group
            claim = dock.claim("compute_advantage", ["rm_scores"], N, timeout_s=5)
            assert claim is not None, dock.stats()
            scores = np.array([float(s) for s in claim.columns["rm_scores"]])
            adv = (scores - scores.mean()) / (scores.std() + 1e-6)
            lengths = [len(r) for r in dock.read(claim.indexes, ["responses"])["responses"]]
            dock.put(claim.indexes, {"advantages": [np.full(n, a, np.float32) for n, a in zip(lengths, adv)]}, lease=claim.lease)
        while (claim := dock.claim("actor_train", ["responses", "advantages"], GBS * N // 4, min_count=GBS * N // 4)) is not None:
            trained += claim.indexes
            dock.ack(claim.lease, claim.indexes)
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert sorted(trained) == rows
    stats = dock.stats()
    assert stats.consumed == {c: GBS * N for c in ("actor_rollout", "rule_reward", "compute_advantage", "actor_train")}
    assert stats.leased == dict.fromkeys(stats.consumed, 0) and stats.requeued == 0 and stats.complete_groups == GBS
    scores = [float(s) for s in dock.read(rows, ["rm_scores"])["rm_scores"]]
    assert scores == [float(i % 2 == 1) for i in rows]  # odd rows' labels match the rollout's answer
    assert dock.begin_iteration(GBS) == list(range(GBS)) and dock.stats().retired_groups == GBS
    # The books: every row that entered was trained and retired; none is live, none unaccounted.
    books = dock.stats()
    assert (books.admitted_rows, books.live_rows, books.unaccounted_rows()) == (GBS * N, 0, 0)
    dock.put([0, 1], {"prompts": [[1], [2]]})
    dock.put([0, 1], {"prompts": [[3], [4]]})  # the same slots again: not admitted twice
    dock.clear()
    books = dock.stats()
    assert (books.admitted_rows, books.cleared_rows, books.unaccounted_rows()) == (GBS * N + 2, 2, 0)


def test_trainer_puts_a_large_iteration_in_whole_groups_and_every_row_arrives(dock_factory):
    # More rows than one put carries: the prompts go in several puts, each of whole groups.
    from services.common.preprocess import PromptRecord
    from services.trainer.loop.iteration_data import PROMPT_PUT_ROWS, put_prompts

    n, groups = 8, PROMPT_PUT_ROWS // 8 * 2 + 3
    dock = dock_factory(DockLayout(n_samples_per_prompt=n, capacity_groups=groups))
    free = dock.begin_iteration(groups)
    records = [PromptRecord(index=g, prompt=f"p{g}", prompt_ids=[g % 250, 1, 2], label=str(g)) for g in range(groups)]
    rows = put_prompts(dock, free, records)
    assert rows == dock.rows_of(free) and len(rows) == groups * n > 2 * PROMPT_PUT_ROWS
    claim = dock.claim("actor_rollout", ["prompts", "labels"], len(rows))
    assert sorted(claim.indexes) == rows
    by_row = dict(zip(claim.indexes, claim.columns["labels"]))
    assert all(by_row[r] == str(free.index(r // n)) for r in rows)
    assert dock.stats().admitted_rows == len(rows)
