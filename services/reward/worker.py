"""The reward dock worker: claim complete response groups, decode, score, put `rm_scores` back.

Consumer `rule_reward` (MindSpeed-RL's name). A claim takes whole groups whose `responses` are
final (under partial rollout the dock shows a group only once all n samples are), so several
replicas share the work through the dock's atomic claims and none scores a row twice. Each put
carries the claim's lease: a worker that stalled past it and lost its rows to another replica
has its put refused and drops the batch. When the run's layout has an `rm_parts` column
(float32, one entry per verifier in rl_config.verifier_function order) the unweighted
per-verifier scores go there too. With `reward_model` among the verifiers the claim also takes
`prompts`, and the reward model scores prompt + response beside the rules.

With reward_config.model_replicas > 0 the two kinds of replica run apart, each scaled on its own:
a `model` replica claims as consumer `model_reward` and puts only the model's unweighted score
(`rm_model`); a `rule` replica claims `rule_reward` on rows whose `rm_model` is already final, runs
the rules and puts the weighted sum. So a row is scored (rm_scores final) only once both parts are
there, each part is computed by one claim (a lease), and a replica that dies loses nothing: its
lease expires and another replica of the same kind takes the rows.
"""
from __future__ import annotations

import logging
import pathlib
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np

from services.common.auth import resolve_token
from services.common.config import Config, ProfilerConfig
from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.common.log import log_event
from services.common.metrics import counter
from services.dock.client import Claim, Dock
from services.dock.rows import ModelScore, RewardPart, ScoringRow, names
from services.dock.schema import LABELS, PROMPTS, RESPONSES, RM_MODEL, RM_PARTS
from services.dock.timeline import Span
from services.dock.scripts import StaleLease
from services.dock.worker_loop import RefusalLog, RegistryEntry
from services.reward.decoding import ResponseDecoder
from services.reward.model import MODEL_VERIFIER, RewardModelScorer
from services.reward.pool import VerifierRunner
from services.reward.profiling import ScoringProfiler
from services.reward.scoring import PartScore, SampleScore, ScoreInput, ScoringPlan, score_samples

logger = logging.getLogger("dockrl.reward.worker")

CONSUMER = "rule_reward"
MODEL_CONSUMER = "model_reward"  # reward-model replicas, when they run apart from the rule ones
KINDS = ("rule", "model")
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
    when the plan lists `reward_model`, `model`; or, as a `model` replica (`kind`), the
    `model_reward` work with `model` alone. `split`: the model runs on replicas of its own, so a
    `rule` replica takes its part from the `rm_model` column."""

    def __init__(self, dock: Dock, plan: ScoringPlan, runner: VerifierRunner, decoder: ResponseDecoder,
                 count: int | None = None, model: RewardModelScorer | None = None, kind: str = "rule", split: bool = False):
        if kind not in KINDS:
            raise InvalidArgument("kind", f"{kind!r} is not one of {', '.join(KINDS)}")
        if kind == "model" and not (split and model is not None and plan.uses_model):
            raise FailedPrecondition("a reward-model replica needs reward_model in rl_config.verifier_function, "
                                     "reward_config.load and reward_config.model_replicas > 0")
        self.dock = dock
        self.plan = plan
        self.runner = runner
        self.decoder = decoder
        self.model = model
        self.count = count  # rows per claim; None: rl_config.reward_dispatch_size (the layout's)
        self.kind = kind
        self.split = split and plan.uses_model
        self.consumer = MODEL_CONSUMER if kind == "model" else CONSUMER
        self.replica_id = dock.holder or f"reward-{uuid.uuid4().hex[:8]}"
        self.timeline = dock.timeline()
        self.profiler = ScoringProfiler(ProfilerConfig(), pathlib.Path())  # off; from_config gives the run's

    @classmethod
    def from_config(cls, cfg: Config, runner: VerifierRunner, model: RewardModelScorer | None = None,
                    kind: str = "rule") -> "RewardWorker":
        """A `kind` worker on the run's dock, with the run's verifiers, tokenizer and reward model."""
        decoder = ResponseDecoder(cfg.megatron_training.tokenizer_name_or_path)
        if not decoder.available:
            raise FailedPrecondition("megatron_training.tokenizer_name_or_path is empty: the dock worker decodes responses with it")
        holder = f"reward-{'model-' if kind == 'model' else ''}{uuid.uuid4().hex[:8]}"
        dock = Dock.from_config(cfg, token=resolve_token(cfg.auth), holder=holder)
        worker = cls(dock, ScoringPlan.from_config(cfg), runner, decoder, model=model, kind=kind,
                     split=cfg.reward_config.model_replicas > 0)
        worker.profiler = ScoringProfiler.from_config(cfg)
        return worker

    @property
    def registry_kind(self) -> str:
        """What it registers as: `reward` (serves Score for the whole plan over gRPC) or `reward_model`."""
        return "reward_model" if self.kind == "model" else "reward"

    def step(self, wait_s: float = 0.0) -> BatchReport | None:
        """One claim (waiting up to `wait_s` for work), scored and put back; None when there was no work."""
        if self.kind == "model":
            return self._model_step(wait_s)
        columns = [RESPONSES, LABELS]
        if self.split:
            columns.append(RM_MODEL)  # claimed only once a reward-model replica put the model's part
        elif self.plan.uses_model:
            columns.append(PROMPTS)
        with self.profiler.range("dock_claim"):
            claim = self.dock.claim(CONSUMER, names(columns), self.count, group=True,
                                    partial_columns=self._optional_columns(), timeout_s=wait_s)
        if claim is None:
            return None
        if self.profiler.enabled:  # decided on the rows claimed: a claim waits, and the iteration may move meanwhile
            self.profiler.at_step(self.dock.policy_version() + 1)
        started = time.time()
        try:
            with self.profiler.range("score_samples"):
                scored = score_samples(self._inputs(claim), self.plan, self.runner, self.model)
        except Exception:  # e.g. the tokenizer cannot load: give the rows back at once
            self.dock.release(claim.lease, claim.indexes)
            raise
        with_parts = self.dock.layout.has(RM_PARTS)
        parts = [RewardPart(s.total, np.array([p.score for p in s.parts], np.float32) if with_parts else None) for s in scored]
        with self.profiler.range("dock_put"):
            return self._put(claim, RewardPart.to_columns(parts), scored, started)

    def _model_step(self, wait_s: float) -> BatchReport | None:
        claim = self.dock.claim(MODEL_CONSUMER, names([RESPONSES, PROMPTS]), self.count, group=True,
                                partial_columns=self._optional_columns(), timeout_s=wait_s)
        if claim is None:
            return None
        started = time.time()
        try:
            samples = self._inputs(claim)
            ids = [self.model.encode(s.prompt, s.response, f"rows[{row}].{RESPONSES.name}") for row, s in zip(claim.indexes, samples)]
            values = self.model.score(ids)
        except Exception:  # give the rows back at once rather than after the lease
            self.dock.release(claim.lease, claim.indexes)
            raise
        scored = [SampleScore(v, (PartScore(MODEL_VERIFIER, v),), 0.0) for v in values]
        return self._put(claim, ModelScore.to_columns([ModelScore(v) for v in values]), scored, started)

    def _put(self, claim: Claim, columns: dict[str, np.ndarray], scored: list[SampleScore], started: float) -> BatchReport:
        try:
            self.dock.put(claim.indexes, columns, lease=claim.lease)
            self.timeline.record(Span(self.replica_id, "score", started, time.time(), len(claim)))
        except StaleLease:
            STALE_PUTS.inc()
            log_event(logger, "lease taken over; batch dropped", logging.WARNING, rows=len(claim))
            return BatchReport([], 0.0, {}, 0)
        ROWS_SCORED.inc(len(claim))
        names = [p.name for p in scored[0].parts]
        return BatchReport(
            indexes=list(claim.indexes),
            mean_score=float(np.mean([s.total for s in scored])),
            part_means={name: float(np.mean([s.parts[i].score for s in scored])) for i, name in enumerate(names)},
            timed_out=sum(p.timed_out for s in scored for p in s.parts),
        )

    def _optional_columns(self) -> list[str]:
        """ScoringRow's optional columns this run's layout holds (a claim may name only columns the layout has)."""
        return names([c for c in ScoringRow.OPTIONAL_COLUMNS if self.dock.layout.has(c)])

    def _inputs(self, claim: Claim) -> list[ScoreInput]:
        inputs = []
        for row in ScoringRow.from_claim(claim):
            tokens = [int(t) for t in row.response_ids]
            # The reward model reads the prompt as the policy saw it, chat template and its special tokens included.
            prompt = "" if row.prompt_ids is None else self.decoder.decode([int(t) for t in row.prompt_ids], skip_special_tokens=False)
            length = len(tokens) if row.response_length is None else row.response_length
            # a multi-turn episode's rules read its last model turn only: never a tool response as the answer
            answer = None if row.loss_mask is None else self.decoder.decode([int(t) for t in row.final_turn_ids])
            inputs.append(ScoreInput(self.decoder.decode(tokens), row.label, length, prompt, row.model_score, answer,
                                     row.environment_reward))
        return inputs

    def run_until(self, stop: threading.Event, address: str = "", heartbeat_ttl_s: float = 10.0) -> None:
        """Steps until `stop` is set, logging rows/s, the mean score and each part's mean
        (`{name}_rewards/mean`) over the rows of every 10 s, and of the rows since then when it stops;
        registered as a `reward` replica (with the gRPC `address` it serves, when given) while it runs."""
        entry = RegistryEntry(self.dock.registry(heartbeat_ttl_s), self.replica_id, address, self.registry_kind)
        replica_id = self.replica_id
        window = _Window(time.monotonic())
        refusals = RefusalLog(logger, "cannot score yet; retrying every second", "reason")
        log_event(logger, "dock worker started", replica=replica_id, consumer=self.consumer, run=self.dock.name)
        if self.decoder.available:  # meanwhile the dock is made and the rollout replicas start
            self.decoder.preload()
        try:
            while not stop.is_set():
                try:
                    # Renewed first (registered on the first pass): waiting for the dock to exist must not let it expire.
                    entry.renew_if_due()
                    report = self.step(wait_s=_CLAIM_WAIT_S)
                except (FailedPrecondition, Unavailable) as exc:  # no dock yet, Redis away, no tokenizer: wait
                    refusals.refused(exc)
                    stop.wait(_CLAIM_WAIT_S)
                    continue
                refusals.served()
                now = time.monotonic()
                if report is None:
                    continue
                window.add(report)
                if now - window.since >= _PROGRESS_EVERY_S:
                    window.log("scoring", now)
                    window = _Window(now)
        finally:
            self.profiler.stop()
            if window.rows:
                window.log("scored before stopping", time.monotonic())
            try:
                entry.deregister()
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
