"""The driver's side of the dock: an iteration's prompts in, its scored groups out.

The trainer keeps (max_staleness + 1) * GBS untrained groups in the dock (AReaL's admission
rule: accepted + running < (eta + version + 1) * GBS; with eta = 0, GBS prompts per iteration),
then claims complete, scored groups as the `actor_train` consumer until it holds GBS of them.
Rollout and reward workers do everything in between, pulling from the dock, so with eta >= 1 the
next iterations' rollout runs while the trainer updates and pushes. A group whose oldest token is
older than version - eta, or with a row the rollout could not generate (no token), is never
trained: it is dropped, counted, and its slot takes a fresh prompt.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field

import numpy as np

from services.common.errors import DockrlError, Unavailable
from services.common.log import log_event
from services.common.preprocess import PromptRecord
from services.common.sample import FinishReason
from services.dock.client import Claim, Dock
from services.dock.rows import PromptRow, ScoredSample, names
from services.dock.scripts import StaleLease

log = logging.getLogger("dockrl.trainer")

TRAIN_CONSUMER = "actor_train"
# One put is one Lua script, and Redis serves nobody else while it runs: 32768 prompt rows held it
# ~1 s on a quiet 2-core machine (several under load), so prompts go in puts of at most this many rows.
PROMPT_PUT_ROWS = 4096


@dataclass
class ScoredBatch:
    """GBS complete groups as the trainer trains them: the claimed ScoredSamples (services/dock/rows.py) in group
    order, their dock rows, and the claims whose leases hold them until the ack. The views the step and the metrics
    read across samples are the properties below; the tensors are built from the samples in session.py."""

    samples: list[ScoredSample] = field(default_factory=list)  # [B], B = groups * n
    indexes: list[int] = field(default_factory=list)  # [B] each sample's dock row
    claims: list[Claim] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def scores(self) -> list[float]:
        """[B] each sample's reward."""
        return [sample.score for sample in self.samples]

    @property
    def prompt_lengths(self) -> list[int]:
        """[B] each sample's prompt tokens."""
        return [len(sample.prompt_ids) for sample in self.samples]

    @property
    def response_lengths(self) -> list[int]:
        """[B] each sample's response tokens."""
        return [len(sample.response_ids) for sample in self.samples]

    def extend(self, claim: Claim) -> None:
        """Adds a claim's rows, sorted by index so groups stay contiguous."""
        samples = ScoredSample.from_claim(claim)
        for i in sorted(range(len(claim.indexes)), key=claim.indexes.__getitem__):
            self.samples.append(samples[i])
            self.indexes.append(claim.indexes[i])
        self.claims.append(claim)

    def add_groups(self, other: "ScoredBatch", groups: list[int], n: int) -> None:
        """Appends groups (positions of n-row blocks in `other`) of another batch, claims excluded."""
        for g in groups:
            self.samples += other.samples[g * n:(g + 1) * n]
            self.indexes += other.indexes[g * n:(g + 1) * n]


@dataclass
class RunAccounting:
    """Every sample of the run, counted where it enters and where it is trained: none lost, none twice."""

    prompts_put: int = 0
    rows_put: int = 0
    groups_trained: int = 0
    rows_trained: int = 0
    rows_resumed: int = 0  # trained rows whose group went through more than one rollout round (partial rollout)
    rows_dropped: int = 0  # rows of groups dynamic sampling dropped (every sample scored the same)
    rows_stale: int = 0  # rows of groups dropped unseen: a token older than version - max_staleness
    rows_failed: int = 0  # rows of groups dropped unseen: a row the rollout could not generate

    def record_put(self, prompts: int, n: int) -> None:
        self.prompts_put += prompts
        self.rows_put += prompts * n

    def record_collected(self, batch: "ScoredBatch", n: int) -> None:
        """Checks a collected batch: no row twice, only whole groups; counts resumed rows."""
        if len(set(batch.indexes)) != len(batch.indexes):
            raise AssertionError(f"a scored batch holds a row twice: {sorted(batch.indexes)}")
        groups = {i // n for i in batch.indexes}
        if len(groups) * n != len(batch.indexes):
            raise AssertionError(f"a scored batch holds an incomplete group: rows {sorted(batch.indexes)}")
        self.rows_resumed += sum(1 for claim in batch.claims for age in claim.ages if age > 0)

    def record_trained(self, rows: int, dropped_rows: int, n: int) -> None:
        self.rows_trained += rows
        self.groups_trained += rows // n
        self.rows_dropped += dropped_rows


def put_prompts(dock: Dock, groups: list[int], prompts: list[PromptRecord]) -> list[int]:
    """Writes each prompt into the n rows of its group slot, whole groups per put; returns the rows written.

    Each put is all or nothing; when one fails (Redis gone past dock.reconnect_timeout_s) the
    groups of the earlier ones stay in the dock, as after a trainer that died right after its put:
    `--resume` keeps them and trains them.
    """
    n = dock.layout.n_samples_per_prompt
    per_put = max(1, PROMPT_PUT_ROWS // n)
    rows = []
    for first in range(0, len(groups), per_put):
        chunk_rows = dock.rows_of(groups[first:first + per_put])
        chunk_prompts = [PromptRow(np.asarray(p.prompt_ids, dtype=np.int32), p.label) for p in prompts[first:first + per_put]]
        dock.put(chunk_rows, PromptRow.to_columns([row for row in chunk_prompts for _ in range(n)]))
        rows += chunk_rows
    return rows


def unusable_groups(claim: Claim, n: int, min_version: int | None) -> dict[str, set[int]]:
    """The claim's groups that must not be trained, by reason: `failed` (a row the rollout could not
    generate, e.g. a prompt past the engine's context: finish_reason FAILED, or no response token) and
    `stale` (a token older than `min_version`; None: no bound)."""
    failed, stale = set(), set()
    for index, sample in zip(claim.indexes, ScoredSample.from_claim(claim)):
        if len(sample.response_ids) == 0 or sample.finish_reason == FinishReason.FAILED.value:
            failed.add(index // n)
        elif min_version is not None and len(sample.versions) and int(np.min(sample.versions)) < min_version:
            stale.add(index // n)
    return {"failed": failed, "stale": stale - failed}


def drop_groups(dock: Dock, claim: Claim, n: int, groups: set[int]) -> Claim | None:
    """Acks (so the dock retires them) the claimed rows of `groups`; returns the claim of the other
    rows, None when none is left."""
    if not groups:
        return claim
    dock.ack(claim.lease, [index for index in claim.indexes if index // n in groups])
    kept = [i for i, index in enumerate(claim.indexes) if index // n not in groups]
    if not kept:
        return None
    return Claim(claim.lease, [claim.indexes[i] for i in kept], [claim.ages[i] for i in kept],
                 {name: [values[i] for i in kept] for name, values in claim.columns.items()})


def scored_group_rounds(dock: Dock, rows_wanted: int, timeout_s: float, min_version: int | None = None,
                        on_drop=None) -> Generator[float, None, ScoredBatch]:
    """Claims complete, scored groups until `rows_wanted` rows are held, and returns them; raises Unavailable on timeout.

    A generator: it yields the seconds waited about once a second while nothing new arrives (a wait
    round), so its caller can act between rounds, and returns the batch. The groups already held are
    renewed while waiting: the wait for the rest (e.g. rows of a dead worker coming back after their
    lease) may outlast the lease on the first ones. Groups with a failed row, and with `min_version`
    groups holding an older token, are dropped (never trained); `on_drop(reason, rows)` is told how
    many rows, for each reason.
    """
    batch = ScoredBatch()
    n = dock.layout.n_samples_per_prompt
    optional = names([c for c in ScoredSample.OPTIONAL_COLUMNS if dock.layout.has(c)])
    start = last_note = time.monotonic()
    while len(batch) < rows_wanted:
        claim = dock.claim(TRAIN_CONSUMER, names(ScoredSample.COLUMNS), count=rows_wanted - len(batch), group=True, min_count=n, timeout_s=1.0,
                           partial_columns=optional)
        if claim is not None:
            for reason, groups in unusable_groups(claim, n, min_version).items():
                if groups and claim is not None:
                    claim = drop_groups(dock, claim, n, groups)
                    if on_drop is not None:
                        on_drop(reason, len(groups) * n)
        if claim is not None:
            batch.extend(claim)
            continue
        for held in batch.claims:
            dock.renew(held.lease, held.indexes)
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise Unavailable(
                f"no scored groups for {waited:.0f} s ({len(batch)} of {rows_wanted} rows): are rollout and reward workers "
                f"running against this dock? ({dock.stats()})"
            )
        if time.monotonic() - last_note >= 1.0:
            yield waited
            last_note = time.monotonic()
    return batch


def collection_rounds(dock: Dock, stream, accounting: RunAccounting, cfg, version: int,
                      groups_left: int | None = None) -> Generator[float, None, tuple[ScoredBatch, dict[str, float]]]:
    """One iteration's training batch: prompts admitted up to the staleness bound, GBS scored groups out.

    A generator, like `scored_group_rounds`: it yields at each wait round and returns (batch, metrics).
    `version` is the policy version this iteration trains; `groups_left` the groups the run's
    remaining iterations train (no prompt is admitted past them). With DAPO's dynamic sampling
    (rl_config.filter_groups_enable), groups whose samples all scored the same are dropped and rounds of GBS
    prompts are drawn until filter_groups_train_batch_size groups (0: GBS) are kept, up to filter_groups_max_batches
    rounds.
    """
    from services.trainer.algorithm.dynamic_sampling import DynamicSampler

    rl, gbs = cfg.rl_config, cfg.megatron_training.global_batch_size
    n, eta = rl.n_samples_per_prompt, rl.max_staleness
    bound = cfg.admitted_groups
    if eta and groups_left is not None:  # (eta = 0 stays the synchronous loop as it was, carry-over room included)
        bound = max(gbs, min(bound, groups_left))
    # Under partial rollout, rollout stops at the target of complete groups; with eta >= 1 every admitted group may complete.
    target = gbs if eta == 0 else min(bound, (eta + 1) * gbs)
    min_version = version - eta if eta else None  # synchronous: every token is the current version's (replicas wait for it)

    def admit() -> None:
        """Retires what was trained or dropped and fills free slots up to the bound."""
        free = dock.begin_iteration(target)
        live = dock.layout.capacity_groups - len(free)
        groups = free[: max(0, bound - live)]
        if groups:  # none: the pool is full of groups carried over (e.g. from before a trainer restart) or admitted ahead
            put_prompts(dock, groups, stream.take(len(groups)))
            accounting.record_put(len(groups), n)

    def dropped(reason: str, rows: int) -> None:
        if reason == "stale":
            accounting.rows_stale += rows
            log_event(log, "stale rows dropped", rows=rows, oldest_allowed=min_version)
        else:
            accounting.rows_failed += rows
            log_event(log, "failed rows dropped", level=logging.WARNING, rows=rows,
                      cause="the rollout gave them no token (see the rollout replica's 'row failed' lines)")
        admit()  # their slots take fresh prompts, or the wait for GBS usable groups could never end

    def one_round() -> Generator[float, None, ScoredBatch]:
        admit()
        batch = yield from scored_group_rounds(dock, gbs * n, timeout_s=cfg.trainer.rollout_timeout_s,
                                               min_version=min_version, on_drop=dropped)
        accounting.record_collected(batch, n)
        return batch

    if not rl.filter_groups_enable:
        batch = yield from one_round()
        accounting.record_trained(len(batch), 0, n)
        return batch, {}
    import torch

    sampler = DynamicSampler(rl.filter_groups_train_batch_size or gbs, n, rl.filter_groups_max_batches)
    generated = 0
    kept = ScoredBatch()
    while not sampler.done:
        batch = yield from one_round()
        ack_batch(dock, batch)
        generated += len(batch) // n
        picked = sampler.add(torch.tensor(batch.scores))
        kept.add_groups(batch, picked, n)
        accounting.record_trained(len(picked) * n, len(batch) - len(picked) * n, n)
    if not kept.indexes:
        raise RuntimeError(f"rl_config.filter_groups_max_batches: {sampler.batches_seen} batches gave no group whose scores differ")
    return kept, {"dynamic_sampling/rounds": sampler.batches_seen, "dynamic_sampling/kept_groups": len(kept) // n,
                  "dynamic_sampling/dropped_groups": generated - len(kept) // n}


class HeldBatch:
    """Keeps the trainer's leases on a collected batch alive while it trains and pushes.

    A thread renews them every third of dock.lease_seconds until `release`: an update and a push can
    outlast the lease (a large model's step; a push that waits out a replica that just died), and rows
    whose lease ends go back to the pool, to be trained again, while this ack would then fail.
    """

    def __init__(self, dock: Dock, batch: ScoredBatch, lease_s: float):
        self._dock, self._batch = dock, batch
        self._released = threading.Event()
        self._thread = threading.Thread(target=self._renew, args=(lease_s / 3,), name="batch-lease-renewal", daemon=True)
        self._thread.start()

    def _renew(self, period_s: float) -> None:
        while not self._released.wait(period_s):
            try:
                for claim in self._batch.claims:
                    self._dock.renew(claim.lease, claim.indexes)
            except StaleLease as exc:  # gone already (Redis was down longer than the lease): the ack will say so
                log_event(log, "batch lease lost", level=logging.WARNING, error=str(exc))
                return
            except DockrlError as exc:  # Redis away for a moment: the next period tries again
                log_event(log, "batch lease renewal failed", level=logging.WARNING, error=str(exc))

    def release(self) -> None:
        """Stops renewing (before the ack, or when the iteration failed)."""
        self._released.set()
        self._thread.join()


def ack_batch(dock: Dock, batch: ScoredBatch) -> None:
    """Tells the dock the trainer is done with every row of `batch` (they leave at the next begin_iteration)."""
    for claim in batch.claims:
        dock.ack(claim.lease, claim.indexes)
