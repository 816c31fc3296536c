"""Dock worker mode: this replica pulls prompts (or partial samples) from the dock and puts responses back.

Loop: claim `actor_rollout_dispatch_size` rows whose prompts are ready (oldest first; under
partial rollout also rows put back unfinished, with their partial responses) -> generate one
sample per row, continuing any partial response, for at most the partial-rollout token budget
-> put the finished rows (responses, logprobs, per-token versions, length, finish reason) and
put the unfinished ones back as partial (age + 1). The replica is registered in the dock's
replica registry with a heartbeat, so the trainer's weight push finds it.

On stop (the replica drains) it claims nothing more; the claim it holds runs on until it ends or
the server aborts the engine's requests at the drain's deadline. Then rows that finished are put,
and the others go back to the dock: under partial rollout with the tokens, logprobs and versions
generated so far (a partial put); otherwise released to start over, each with its whole group
(claims then take whole groups). Then the replica deregisters.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np

from services.common.config import Config
from services.common.errors import DockrlError, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from services.common.log import log_event
from services.rollout.engine import Completion, RolloutEngine
from services.rollout.sampling import SamplingOverrides, sample_seed

log = logging.getLogger("dockrl.rollout.dock")

PARTIAL_COLUMNS = ("responses", "rollout_log_probs", "versions")
CLAIM_WAIT_S = 1.0  # a claim waits this long for rows before the loop checks for stop
QUEUE_RETRY_S = 0.05


@dataclass
class RowResult:
    """One claimed row after this claim's generation: the whole response so far."""

    index: int
    sample: Completion  # prior partial response + what this claim generated
    finished: bool = False  # False: budget spent before max_tokens (or aborted); goes back as partial
    generated: int = 0  # tokens this claim added


def _token_columns(results: list[RowResult]) -> dict[str, list[np.ndarray]]:
    """The per-token dock columns of `results` (whole responses so far)."""
    return {
        "responses": [np.asarray(r.sample.token_ids, np.int32) for r in results],
        "rollout_log_probs": [np.asarray(r.sample.logprobs, np.float32) for r in results],
        "versions": [np.asarray(r.sample.versions, np.int32) for r in results],
    }


def token_budget(max_tokens: int, max_split: int, done: int) -> int:
    """Tokens to generate in this claim: max_tokens // max_split, never past max_tokens in all."""
    return min(max_tokens // max_split if max_split > 1 else max_tokens, max_tokens - done)


class DockWorker:
    """Runs the claim -> generate -> put loop of one replica against one run's dock."""

    def __init__(self, engine: RolloutEngine, dock, registry, cfg: Config, address: str):
        self.engine = engine
        self.dock = dock
        self.registry = registry
        self.cfg = cfg
        self.address = address
        self.max_tokens = cfg.generate_config.sampling_config.max_tokens
        self.max_split = cfg.rl_config.partial_rollout_max_split
        # sampling_config.seed, when given, else the run's seed: the base of every row's own seed (`sample_seed`).
        smp_seed = cfg.generate_config.sampling_config.seed
        self.seed = cfg.megatron_training.seed if smp_seed is None else smp_seed

    async def register(self) -> None:
        """Lists this replica in the registry (before `run`, so it is listed once the server says it is ready)."""
        await asyncio.to_thread(self.registry.register, self.engine.replica_id, self.address, "rollout", self.engine.version)
        log_event(log, "registered", replica=self.engine.replica_id, address=self.address)

    async def run(self, stop: asyncio.Event) -> None:
        """Serves the dock until `stop` is set; then ends the claim it holds (see the module's docstring) and deregisters."""
        heartbeat = asyncio.create_task(self._heartbeat(stop))
        refused = ""
        try:
            while not stop.is_set():
                try:
                    claim = await asyncio.to_thread(self._claim)
                except DockrlError as exc:  # Redis away, or no dock created yet: ask again later
                    if str(exc) != refused:  # once per distinct reason, not once a second
                        log_event(log, "claim refused", level=logging.WARNING, error=str(exc))
                    refused = str(exc)
                    await asyncio.sleep(CLAIM_WAIT_S)
                    continue
                refused = ""
                if claim is None:
                    continue
                await self._serve_claim(claim, stop)
        finally:
            heartbeat.cancel()
            await asyncio.to_thread(self.registry.deregister, self.engine.replica_id)
            log_event(log, "deregistered", replica=self.engine.replica_id)

    async def _serve_claim(self, claim, stop: asyncio.Event) -> None:
        """Generates and puts one claim (to its end even when `stop` comes meanwhile: see `run`)."""
        if stop.is_set():  # came in while the replica began to drain: nothing generated, back at once
            await asyncio.to_thread(self.dock.release, claim.lease, claim.indexes)
            log_event(log, "returned claim on stop", rows=len(claim))
            return
        try:
            await self._process(claim)
        except DockrlError as exc:  # a lease that expired, or an engine that died
            log_event(log, "claim failed", level=logging.WARNING, rows=len(claim), error=str(exc))
            try:  # back to the pool now rather than when the lease ends (refused when it already has)
                await asyncio.to_thread(self.dock.release, claim.lease, claim.indexes)
            except DockrlError:
                pass

    def _claim(self):
        layout = self.dock.layout
        # Behind the trainer's version (joined late, or a push is on its way): samples would be
        # off-policy, so wait for the weights; the trainer pushes to replicas that lag.
        if self.engine.version < self.dock.policy_version() - self.cfg.rl_config.max_staleness:
            time.sleep(CLAIM_WAIT_S)
            return None
        return self.dock.claim(
            layout.rollout_consumer, ["prompts"], group=not layout.partial_rollout,
            partial_columns=PARTIAL_COLUMNS if layout.partial_rollout else (), timeout_s=CLAIM_WAIT_S,
        )

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        period = self.cfg.rollout.heartbeat_ttl_s / 3
        while not stop.is_set():
            await asyncio.sleep(period)
            try:
                await asyncio.to_thread(self.registry.heartbeat, self.engine.replica_id, self.engine.version)
            except NotFound:  # expired (e.g. Redis was away longer than the TTL): register again
                await asyncio.to_thread(self.registry.register, self.engine.replica_id, self.address, "rollout", self.engine.version)
            except DockrlError as exc:
                log_event(log, "heartbeat failed", level=logging.WARNING, error=str(exc))

    async def _process(self, claim) -> None:
        rows = []
        for i, index in enumerate(claim.indexes):
            prior = [claim.columns.get(c, [None] * len(claim))[i] for c in PARTIAL_COLUMNS]
            rows.append(self._generate(index, list(claim.columns["prompts"][i]), *prior))
        results = await asyncio.gather(*rows)
        layout = self.dock.layout
        if layout.partial_rollout:
            # Rows that got tokens go back with them (a later claim resumes them); rows cut at the drain's
            # deadline before a token are released, back to the pool with what was stored before this claim.
            done = [r for r in results if r.finished]
            resumable = [r for r in results if not r.finished and r.generated]
            unchanged = [r.index for r in results if not r.finished and not r.generated]
        else:
            # Claims take whole groups and never resume a response: a group with a row cut short (the drain,
            # an Abort) goes back whole, its finished rows too, or no group claim could take the rest of it.
            n = layout.n_samples_per_prompt
            cut = {r.index // n for r in results if not r.finished}
            done = [r for r in results if r.index // n not in cut]
            resumable = []
            unchanged = [r.index for r in results if r.index // n in cut]
        version = self.engine.version
        if done:
            columns = {**_token_columns(done), "response_length": [len(r.sample.token_ids) for r in done],
                       "finish_reason": [r.sample.finish_reason for r in done]}
            await asyncio.to_thread(self.dock.put, [r.index for r in done], columns, lease=claim.lease, version=version)
        if resumable:
            await asyncio.to_thread(self.dock.put, [r.index for r in resumable], _token_columns(resumable),
                                    lease=claim.lease, version=version, partial=True)
        if unchanged:
            await asyncio.to_thread(self.dock.release, claim.lease, unchanged)
        log_event(log, "claim done", rows=len(results), finished=len(done), partial=len(resumable), released=len(unchanged),
                  version=version)

    async def _generate(self, index: int, prompt: list[int], response, logprobs, versions) -> RowResult:
        sample = Completion(
            token_ids=[int(t) for t in (response if response is not None else [])],
            logprobs=[float(x) for x in (logprobs if logprobs is not None else [])],
            versions=[int(v) for v in (versions if versions is not None else [])],
        )
        budget = token_budget(self.max_tokens, self.max_split, len(sample.token_ids))
        seed = sample_seed(self.seed, prompt, index % self.dock.layout.n_samples_per_prompt, self.engine.version,
                           len(sample.token_ids))
        overrides = SamplingOverrides(max_tokens=budget, n=1, logprobs=0, seed=seed)
        while True:
            try:
                stream = self.engine.open(prompt + sample.token_ids, overrides, detokenize=False)
                break
            except ResourceExhausted:  # the queue is full (HTTP users share it): wait for room
                await asyncio.sleep(QUEUE_RETRY_S)
            except Unavailable:  # the drain's deadline stopped the engine before this row began: back as it was
                return RowResult(index, sample, finished=False)
            except InvalidArgument as exc:  # this row cannot be generated; it goes back as failed
                log_event(log, "row failed", level=logging.WARNING, row=index, error=str(exc))
                sample.finish_reason = "failed"
                return RowResult(index, sample, finished=True)
        prior = len(sample.token_ids)
        async for delta in stream.deltas():
            sample.add(delta)
        finished = sample.finish_reason == "stop" or len(sample.token_ids) >= self.max_tokens
        return RowResult(index, sample, finished, generated=len(sample.token_ids) - prior)
