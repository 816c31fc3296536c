"""The reward dock worker: claim complete response groups, decode, score, put `rm_scores` back.

Consumer `rule_reward` (MindSpeed-RL's name). A claim takes whole groups whose `responses` are
final (under partial rollout the dock shows a group only once all n samples are), so several
replicas share the work through the dock's atomic claims and none scores a row twice. Each put
carries the claim's lease: a worker that stalled past it and lost its rows to another replica
has its put refused and drops the batch. When the run's layout has an `rm_parts` column
(float32, one entry per verifier in rl_config.verifier_function order) the unweighted
per-verifier scores go there too. With `reward_model` among the verifiers the claim also takes
`prompts`, and the reward model scores prompt + response beside the rules.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np

from services.common.auth import resolve_token
from services.common.config import Config
from services.common.errors import FailedPrecondition, Unavailable
from services.common.log import log_event
from services.common.metrics import counter
from services.dock.client import Claim, Dock
from services.dock.registry import ReplicaRegistry
from services.dock.scripts import StaleLease
from services.reward.decoding import ResponseDecoder
from services.reward.model import RewardModelScorer
from services.reward.pool import VerifierRunner
from services.reward.scoring import ScoreInput, ScoringPlan, score_samples

logger = logging.getLogger("dockrl.reward.worker")

CONSUMER = "rule_reward"
PARTS_COLUMN = "rm_parts"
_CLAIM_WAIT_S = 1.0  # a claim waits this long for work, so a stop request is seen within it
_PROGRESS_EVERY_S = 10.0

ROWS_SCORED = counter("reward_dock_rows_scored_total", "dock rows scored and put back")
STALE_PUTS = counter("reward_dock_stale_puts_total", "batches dropped because their lease was taken over")


@dataclass(frozen=True)
class BatchReport:
    """What one claim-score-put step did: the rows put (none when the put was refused as stale)."""

    indexes: list[int]
    mean_score: float
    part_means: dict[str, float]
    timed_out: int


class RewardWorker:
    """Scores the dock's `rule_reward` work with `plan` through `runner` (the process pool) and,
    when the plan lists `reward_model`, `model`."""

    def __init__(self, dock: Dock, plan: ScoringPlan, runner: VerifierRunner, decoder: ResponseDecoder,
                 count: int | None = None, model: RewardModelScorer | None = None):
        self.dock = dock
        self.plan = plan
        self.runner = runner
        self.decoder = decoder
        self.model = model
        self.count = count  # rows per claim; None: rl_config.reward_dispatch_size (the layout's)
        self.replica_id = dock.holder or f"reward-{uuid.uuid4().hex[:8]}"

    @classmethod
    def from_config(cls, cfg: Config, runner: VerifierRunner, model: RewardModelScorer | None = None) -> "RewardWorker":
        """A worker on the run's dock, with the run's verifiers, tokenizer and reward model."""
        decoder = ResponseDecoder(cfg.megatron_training.tokenizer_name_or_path)
        if not decoder.available:
            raise FailedPrecondition("megatron_training.tokenizer_name_or_path is empty: the dock worker decodes responses with it")
        dock = Dock.from_config(cfg, token=resolve_token(cfg.auth), holder=f"reward-{uuid.uuid4().hex[:8]}")
        return cls(dock, ScoringPlan.from_rl_config(cfg.rl_config), runner, decoder, model=model)

    def step(self, wait_s: float = 0.0) -> BatchReport | None:
        """One claim (waiting up to `wait_s` for work), scored and put back; None when there was no work."""
        columns = ["responses", "labels", "prompts"] if self.plan.uses_model else ["responses", "labels"]
        claim = self.dock.claim(CONSUMER, columns, self.count, group=True,
                                partial_columns=["response_length"], timeout_s=wait_s)
        if claim is None:
            return None
        try:
            scored = score_samples(self._inputs(claim), self.plan, self.runner, self.model)
        except Exception:  # e.g. the tokenizer cannot load: give the rows back at once
            self.dock.release(claim.lease, claim.indexes)
            raise
        columns: dict[str, np.ndarray] = {"rm_scores": np.array([s.total for s in scored], dtype=np.float32)}
        if PARTS_COLUMN in {c.name for c in self.dock.layout.columns}:
            columns[PARTS_COLUMN] = np.array([[p.score for p in s.parts] for s in scored], dtype=np.float32)
        try:
            self.dock.put(claim.indexes, columns, lease=claim.lease)
        except StaleLease:
            STALE_PUTS.inc()
            log_event(logger, "lease taken over; batch dropped", logging.WARNING, rows=len(claim))
            return BatchReport([], 0.0, {}, 0)
        ROWS_SCORED.inc(len(claim))
        return BatchReport(
            indexes=list(claim.indexes),
            mean_score=float(columns["rm_scores"].mean()),
            part_means={name: float(np.mean([s.parts[i].score for s in scored])) for i, name in enumerate(self.plan.verifiers)},
            timed_out=sum(p.timed_out for s in scored for p in s.parts),
        )

    def _inputs(self, claim: Claim) -> list[ScoreInput]:
        lengths = claim.columns["response_length"]
        # The reward model reads the prompt as the policy saw it, chat template and its special tokens included.
        prompts = ([self.decoder.decode([int(t) for t in ids], skip_special_tokens=False) for ids in claim.columns["prompts"]]
                   if self.plan.uses_model else [""] * len(claim))
        inputs = []
        for ids, label, length, prompt in zip(claim.columns["responses"], claim.columns["labels"], lengths, prompts):
            tokens = [int(t) for t in ids]
            inputs.append(ScoreInput(self.decoder.decode(tokens), label, len(tokens) if length is None else int(length), prompt))
        return inputs

    def run_until(self, stop: threading.Event, address: str = "", heartbeat_ttl_s: float = 10.0) -> None:
        """Steps until `stop` is set, logging rows/s, the mean score and each part's mean
        (`{name}_rewards/mean`) over the rows of every 10 s, and of the rows since then when it stops;
        registered as a `reward` replica (with the gRPC `address` it serves, when given) while it runs."""
        registry = ReplicaRegistry(self.dock.client, self.dock.keys, heartbeat_ttl_s)
        replica_id = self.replica_id
        last_beat = -float("inf")  # register on the first pass
        window = _Window(time.monotonic())
        waiting_for = ""
        log_event(logger, "dock worker started", replica=replica_id, consumer=CONSUMER, run=self.dock.keys.base)
        try:
            while not stop.is_set():
                try:
                    # Heartbeat first: waiting for the dock to exist must not let the registration expire.
                    if time.monotonic() - last_beat > heartbeat_ttl_s / 3:
                        registry.register(replica_id, address or "dock-only", "reward")  # also revives an expired entry
                        last_beat = time.monotonic()
                    report = self.step(wait_s=_CLAIM_WAIT_S)
                except (FailedPrecondition, Unavailable) as exc:  # no dock yet, Redis away, no tokenizer: wait
                    if str(exc) != waiting_for:
                        log_event(logger, "cannot score yet; retrying every second", logging.WARNING, reason=str(exc))
                        waiting_for = str(exc)
                    stop.wait(_CLAIM_WAIT_S)
                    continue
                waiting_for = ""
                now = time.monotonic()
                if report is None:
                    continue
                window.add(report)
                if now - window.since >= _PROGRESS_EVERY_S:
                    window.log("scoring", now)
                    window = _Window(now)
        finally:
            if window.rows:
                window.log("scored before stopping", time.monotonic())
            try:
                registry.deregister(replica_id)
            except Unavailable:  # Redis away: the entry expires after its TTL instead
                pass
            log_event(logger, "dock worker stopped", replica=replica_id)


class _Window:
    """Rows scored since `since`, their score sum, per-part sums and timeouts, for the progress log."""

    def __init__(self, since: float):
        self.since = since
        self.rows = 0
        self.score_sum = 0.0
        self.part_sums: dict[str, float] = {}
        self.timed_out = 0

    def add(self, report: BatchReport) -> None:
        n = len(report.indexes)
        self.rows += n
        self.score_sum += report.mean_score * n
        for name, mean in report.part_means.items():
            self.part_sums[name] = self.part_sums.get(name, 0.0) + mean * n
        self.timed_out += report.timed_out

    def log(self, message: str, now: float) -> None:
        rows = max(self.rows, 1)
        log_event(logger, message, rows=self.rows, rows_per_s=round(self.rows / max(now - self.since, 1e-9), 1),
                  mean_score=round(self.score_sum / rows, 4), timed_out=self.timed_out,
                  **{f"{name}_rewards/mean": round(total / rows, 4) for name, total in self.part_sums.items()})
