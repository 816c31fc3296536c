"""The trainer's side of asynchronous RL on a real dock: admission up to (max_staleness + 1) * GBS
untrained groups, and groups with a token older than version - max_staleness, or with a row the
rollout could not generate, dropped, counted and replaced, never trained. A rollout + reward thread stands in for the workers and tags every token
with the policy version it is told to serve."""
import threading
import time

import numpy as np
import pytest

from services.common.config import config_from_dict
from services.common.sample import FinishReason
from services.common.preprocess import PromptRecord
from services.dock.schema import DockLayout
from services.dock.scripts import StaleLease
from services.trainer.loop.iteration_data import HeldBatch, RunAccounting, ack_batch, collection_rounds
from services.trainer.loop.prompt_stream import PromptStream

pytestmark = pytest.mark.service

GBS, N = 2, 2


class Workers:
    """Rollout and reward in one thread: each response is the prompt's first token, every token of
    it tagged with `self.version`."""

    def __init__(self, dock, fail_rows: set[int] = frozenset(), uniform_even_prompts: bool = False):
        self.dock, self.version, self.stop = dock, 0, threading.Event()
        # The groups of even prompts all score 1 (no signal: dynamic sampling drops them); the others' scores differ.
        self.uniform_even_prompts = uniform_even_prompts
        # These rows end "failed", as the rollout worker stores a row the engine refused; they keep a token
        # (one an earlier partial-rollout split gave them), so only the finish reason marks them.
        self.fail_rows = set(fail_rows)
        self.failed_prompts: list[list[int]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def _run(self):
        while not self.stop.is_set():
            claim = self.dock.claim("actor_rollout", ["prompts"], N, timeout_s=0.05)
            if claim is not None:
                responses = [np.array([p[0]] if i in self.fail_rows else [p[0], 7], np.int32)
                             for i, p in zip(claim.indexes, claim.columns["prompts"])]
                reasons = [FinishReason.FAILED.value if i in self.fail_rows else FinishReason.STOP.value for i in claim.indexes]
                self.failed_prompts += [list(p) for i, p in zip(claim.indexes, claim.columns["prompts"]) if i in self.fail_rows]
                self.fail_rows -= set(claim.indexes)  # once: the slot's next prompt generates
                self.dock.put(claim.indexes, {
                    "responses": responses, "response_length": [len(r) for r in responses],
                    "rollout_log_probs": [np.full(len(r), -0.5, np.float32) for r in responses],
                    "versions": [np.full(len(r), self.version, np.int32) for r in responses], "finish_reason": reasons},
                    lease=claim.lease)
            claim = self.dock.claim("rule_reward", ["responses"], N, timeout_s=0.05)
            if claim is not None:
                scores = [1.0 if self.uniform_even_prompts and r[0] % 2 == 0 else float(i % 2)
                          for i, r in zip(claim.indexes, claim.columns["responses"])]
                parts = [np.array([score, 0.5], np.float32) for score in scores]  # two verifiers: the score, and 0.5 for all
                self.dock.put(claim.indexes, {"rm_scores": scores, "rm_parts": parts}, lease=claim.lease)


def collect_iteration(dock, stream, books: RunAccounting, cfg, version: int, groups_left: int | None = None):
    """The trainer's collection of one iteration run to its end (nothing done between its wait rounds): (batch, metrics)."""
    rounds = collection_rounds(dock, stream, books, cfg, version, groups_left)
    while True:
        try:
            next(rounds)
        except StopIteration as done:
            return done.value


def _in_flight(books: RunAccounting) -> int:
    """Rows put but neither trained nor dropped yet (still in the dock: rollout, reward or carried over)."""
    return books.rows_put - books.rows_trained - books.rows_dropped - books.rows_stale - books.rows_failed


def _setup(dock_factory, max_staleness: int, lease_s: float = 30.0):
    cfg = config_from_dict({"megatron_training": {"global_batch_size": GBS},
                            "rl_config": {"n_samples_per_prompt": N, "max_staleness": max_staleness},
                            "trainer": {"rollout_timeout_s": 20}})
    dock = dock_factory(DockLayout.from_config(cfg), lease_seconds=lease_s)
    stream = PromptStream([PromptRecord(i, str(i), [i + 1], str(i)) for i in range(50)], seed=1)
    return cfg, dock, stream, RunAccounting()


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_the_trainer_admits_eta_plus_one_batches_of_groups(dock_factory, eta):
    """eta = 0: GBS prompts an iteration, as the synchronous loop; eta >= 1: (eta + 1) * GBS untrained
    groups in the dock, so rollout for the next iterations runs while the trainer trains."""
    cfg, dock, stream, books = _setup(dock_factory, eta)
    with Workers(dock) as workers:
        admitted = []
        for version in range(4):
            workers.version = version  # the push of the last iteration's weights has landed
            batch, _ = collect_iteration(dock, stream, books, cfg, version)
            admitted.append(books.prompts_put)
            assert len(batch) == GBS * N
            ack_batch(dock, batch)
    assert admitted == [(eta + 1 + v) * GBS for v in range(4)]
    assert books.rows_stale == 0 and books.rows_trained == 4 * GBS * N


def test_no_prompt_is_admitted_past_the_runs_last_iteration(dock_factory):
    cfg, dock, stream, books = _setup(dock_factory, 2)
    with Workers(dock):
        batch, _ = collect_iteration(dock, stream, books, cfg, 0, groups_left=GBS)
    assert books.prompts_put == GBS and len(batch) == GBS * N


def test_groups_older_than_version_minus_eta_are_dropped_counted_and_replaced(dock_factory):
    cfg, dock, stream, books = _setup(dock_factory, 1)
    with Workers(dock) as workers:
        batch, _ = collect_iteration(dock, stream, books, cfg, 0)
        ack_batch(dock, batch)
        deadline = time.monotonic() + 30
        while dock.stats().ready["rm_scores"] < cfg.admitted_groups * N and time.monotonic() < deadline:
            time.sleep(0.05)  # the groups admitted ahead are generated (at version 0) and scored too
        # Every group in the dock now holds version-0 tokens; the trainer is at version 2 (eta 1:
        # oldest allowed 1), so they are all stale. Fresh ones come from a replica serving 2.
        workers.version = 2
        batch, _ = collect_iteration(dock, stream, books, cfg, 2)
        ack_batch(dock, batch)
    assert len(batch) == GBS * N and all(min(s.versions) >= 1 for s in batch.samples)
    assert books.rows_stale >= GBS * N  # the version-0 groups admitted ahead, at least
    # The books balance: the rows neither trained nor dropped are the dock's live rows, beside the
    # last batch (acked, retired at the next admission); the dock lost none.
    stats = dock.stats()
    assert stats.live_rows == _in_flight(books) + len(batch) and stats.unaccounted_rows() == 0


@pytest.mark.parametrize("eta", [0, 1])
def test_a_group_with_a_failed_row_is_dropped_counted_and_replaced_not_the_end_of_the_run(dock_factory, eta):
    """A row the rollout could not generate (e.g. a prompt past the engine's context) comes back marked failed:
    its group is never trained, it is counted, and a fresh prompt takes its slot."""
    cfg, dock, stream, books = _setup(dock_factory, eta)
    with Workers(dock, fail_rows={1}) as workers:
        batch, _ = collect_iteration(dock, stream, books, cfg, 0)
    assert len(batch) == GBS * N and all(length == 2 for length in batch.response_lengths)
    assert books.rows_failed == N and workers.failed_prompts and workers.failed_prompts[0] not in [s.prompt_ids.tolist() for s in batch.samples]
    assert books.prompts_put == (eta + 1) * GBS + 1  # the failed group's slot took one more prompt


def test_each_verifiers_part_reaches_the_trainers_metrics(dock_factory):
    """The reward worker stores each verifier's score in rm_parts; the trainer reads them with the batch and logs
    `{verifier}_rewards/mean` (MindSpeed-RL's names) beside reward/mean."""
    from services.trainer.loop.step_metrics import batch_metrics

    cfg, dock, stream, books = _setup(dock_factory, 0)
    with Workers(dock):
        batch, _ = collect_iteration(dock, stream, books, cfg, 0)
    assert [float(s.parts[0]) for s in batch.samples] == batch.scores
    metrics = batch_metrics(batch, 0, N, ("math_17k_acc", "format"))
    assert metrics["math_17k_acc_rewards/mean"] == pytest.approx(metrics["reward/mean"])
    assert metrics["format_rewards/mean"] == pytest.approx(0.5)


def test_a_batch_held_through_an_update_longer_than_the_lease_is_renewed_and_acked_once(dock_factory):
    """An update and push outlasting dock.lease_seconds (a large model's step; a push waiting out a dead replica):
    the trainer's leases on the batch are renewed meanwhile, so its rows neither go back to the pool nor fail the ack."""
    lease_s = 1.0
    cfg, dock, stream, books = _setup(dock_factory, 0, lease_s)
    with Workers(dock):
        batch, _ = collect_iteration(dock, stream, books, cfg, 0)
        held = HeldBatch(dock, batch, lease_s)
        time.sleep(3 * lease_s)  # the update and the push
        held.release()
        ack_batch(dock, batch)
        assert dock.stats().requeued == 0
        # Without the renewal the same wait loses the lease: the rows went back to the pool and the ack fails.
        batch, _ = collect_iteration(dock, stream, books, cfg, 1)
        time.sleep(3 * lease_s)
        with pytest.raises(StaleLease):
            ack_batch(dock, batch)


def test_dynamic_sampling_draws_rounds_of_gbs_prompts_until_the_train_batch_of_groups_is_kept(dock_factory):
    """DAPO as MindSpeed-RL configures it: filter_groups_train_batch_size groups per update, generated GBS prompts a
    round; here the groups of even prompts score the same and are dropped, so 3 groups take more than one round of 2."""
    cfg = config_from_dict({"megatron_training": {"global_batch_size": GBS},
                            "rl_config": {"n_samples_per_prompt": N, "filter_groups_enable": True, "filter_groups_train_batch_size": 3,
                                          "filter_groups_max_batches": -1},
                            "trainer": {"rollout_timeout_s": 20}})
    assert cfg.rl_config.mini_batch_size == 3 * N  # one update over the kept groups
    dock = dock_factory(DockLayout.from_config(cfg))
    stream = PromptStream([PromptRecord(i, str(i), [i + 1], str(i)) for i in range(50)], seed=1)
    books = RunAccounting()
    with Workers(dock, uniform_even_prompts=True):
        batch, metrics = collect_iteration(dock, stream, books, cfg, 0)
    assert len(batch) == 3 * N
    groups = [batch.samples[g * N:(g + 1) * N] for g in range(3)]
    assert all(len({s.score for s in group}) == N for group in groups)  # only groups whose scores differ train
    assert metrics["dynamic_sampling/kept_groups"] == 3 and metrics["dynamic_sampling/rounds"] >= 2
    assert metrics["dynamic_sampling/dropped_groups"] == metrics["dynamic_sampling/rounds"] * GBS - 3 >= 1
    assert books.rows_trained == 3 * N and books.rows_dropped == metrics["dynamic_sampling/dropped_groups"] * N
