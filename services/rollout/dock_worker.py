"""Dock worker mode: this replica pulls prompts (or partial samples) from the dock and puts responses back.

Loop: claim `actor_rollout_dispatch_size` rows (at most this replica's share of the iteration:
`claim_share`) whose prompts are ready (oldest first; under
partial rollout also rows put back unfinished, with their partial responses) -> generate one
sample per row, continuing any partial response, for at most the partial-rollout token budget
-> put the finished rows (responses, logprobs, per-token versions, length, finish reason; with
rl_config.routing_replay on an MoE model, each position's routed experts) and
put the unfinished ones back as partial (age + 1). The replica is registered in the dock's
replica registry with a heartbeat, so the trainer's weight push finds it.

With rollout.multi_turn.environment set, each row runs as a multi-turn episode instead of one
generation (services/rollout/agent/): one engine request per model turn, from all the episode's ids
so far; the row's response is the whole trajectory, put with its loss mask. Partial rollout does not
carry episodes yet (the config refuses both together), so an episode cut short goes back whole.

Under partial rollout the claim is interruptible (MindSpeed-RL's async-engine scheme): each row
is put as soon as it finishes, so the iteration's target of complete groups can be reached while
rows are still running, on this replica or another; once it is (`Dock.rollout_done`), the rows
still running are aborted and go back as partial with what they generated (age + 1), and the
next iteration's claims resume them, oldest first. Without partial rollout a claim runs whole:
its groups are put together.

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
import uuid
from dataclasses import dataclass, field, replace

import numpy as np

from services.common.config import Config
from services.common.errors import DockrlError, InvalidArgument, ResourceExhausted, Unavailable
from services.common.log import log_event
from services.common.metrics import counter
from services.common.sample import FinishReason
from services.dock.rows import RolloutPart, claimed, episode_stats, names
from services.dock.schema import LABELS, PROMPTS
from services.dock.timeline import Span
from services.dock.worker_loop import RefusalLog, RegistryEntry
from services.rollout.agent.environment import Task, environment_factory
from services.rollout.agent.episode import EpisodeLimits, Trajectory, run_episode
from services.rollout.engine import Completion, GenerationStream, RolloutEngine
from services.rollout.profiling import EngineProfiler
from services.rollout.routing_recorder import RECORD_PREFIX
from services.rollout.sampling import SamplingOverrides, sample_seed

log = logging.getLogger("dockrl.rollout.dock")

CLAIM_WAIT_S = 1.0  # a claim waits this long for rows before the loop checks for stop
QUEUE_RETRY_S = 0.05
TARGET_POLL_S = 0.05  # how often a running partial-rollout claim asks whether the iteration's target is reached

INTERRUPTED_ROWS = counter("rollout_rows_interrupted", "Partial-rollout rows stopped in flight because the iteration's target was reached")
EPISODE_EVENTS = counter("rollout_episode_events_total", "Multi-turn episodes' events: turns, tool_calls, each tool-call "
                         "error kind, observations_cut, environment_failed", ("kind",))
ENVIRONMENT_SECONDS = counter("rollout_episode_environment_seconds_total", "Seconds multi-turn episodes spent in their environments")


@dataclass
class RowResult:
    """One claimed row after this claim's generation: the whole response so far."""

    index: int
    sample: Completion  # prior partial response + what this claim generated
    finished: bool = False  # False: budget spent before max_tokens (or aborted); goes back as partial
    generated: int = 0  # tokens this claim added
    # [P+L-1, MoE layers, top_k] uint8: the routing of this claim's request, which computed every position of prompt +
    # response (a resumed row's prompt holds its partial response); None unless routing is recorded
    routed_experts: np.ndarray | None = None
    loss_mask: list[int] | None = None  # [L] a multi-turn episode's: 1 on the model's tokens; None: a single generation
    episode_stats: np.ndarray | None = None  # [K] float32 a multi-turn episode's EPISODE_STATS; None: a single generation

    def part(self) -> RolloutPart:
        """The row's response so far as the dock stores it."""
        mask = None if self.loss_mask is None else np.asarray(self.loss_mask, np.uint8)
        return RolloutPart(np.asarray(self.sample.token_ids, np.int32), np.asarray(self.sample.logprobs, np.float32),
                           np.asarray(self.sample.versions, np.int32), self.sample.finish_reason, self.routed_experts, mask,
                           self.episode_stats)


@dataclass
class InFlight:
    """One claim's rows while they generate: their engine request ids, and whether the claim was interrupted."""

    requests: dict[int, str] = field(default_factory=dict)  # row index -> request id
    interrupted: bool = False  # the iteration's target was reached: running rows stop, waiting ones do not start


def claim_share(dispatch_size: int, iteration_rows: int, live_replicas: int, n: int) -> int:
    """Rows one claim asks for: the dispatch size, but no more than this replica's share of the iteration
    (GBS x n split over the live rollout replicas, in whole groups, at least one). With a dispatch size
    derived for one replica (the whole iteration), a replica added to the running system would otherwise
    find every row of an iteration in the first replica's claim."""
    share = -(-iteration_rows // max(live_replicas, 1))  # ceil
    return max(n, min(dispatch_size, -(-share // n) * n))


def token_budget(max_tokens: int, max_split: int, done: int) -> int:
    """Tokens to generate in this claim: max_tokens // max_split, never past max_tokens in all."""
    return min(max_tokens // max_split if max_split > 1 else max_tokens, max_tokens - done)


class DockWorker:
    """Runs the claim -> generate -> put loop of one replica against one run's dock."""

    def __init__(self, engine: RolloutEngine, dock, registry, cfg: Config, address: str):
        self.engine = engine
        self.dock = dock
        self.registry = registry
        self.entry = RegistryEntry(registry, engine.replica_id, address, "rollout")
        self.timeline = dock.timeline()
        self.cfg = cfg
        self.max_tokens = cfg.generate_config.sampling_config.max_tokens
        self.max_split = cfg.rl_config.partial_rollout_max_split
        # sampling_config.seed, when given, else the run's seed: the base of every row's own seed (`sample_seed`).
        smp_seed = cfg.generate_config.sampling_config.seed
        self.seed = cfg.megatron_training.seed if smp_seed is None else smp_seed
        self.profiler = EngineProfiler(engine.llm, cfg.profiler_config.rollout)
        mtc = cfg.rollout.multi_turn
        self.environment = environment_factory(mtc.environment) if mtc.environment else None
        if self.environment is not None:
            self.environment(mtc, engine.tokenizer)  # one built at start: an unknown tool stops the replica here, not in a claim
        self.episode_limits = EpisodeLimits(mtc.max_assistant_turns, self.max_tokens, engine.max_model_len,
                                            mtc.max_tokens_per_turn, mtc.max_observation_tokens)
        # The tag format's turn ends where its call closes (the model reads the response before going on); a chat
        # model's turn ends at its end-of-turn token, as any of its responses does.
        smp = cfg.generate_config.sampling_config
        self.turn_stop = (*smp.stop, mtc.tool_call_end) if mtc.format == "tag" else None

    async def register(self) -> None:
        """Lists this replica in the registry (before `run`, so it is listed once the server says it is ready)."""
        await asyncio.to_thread(self.entry.register, self.engine.version)
        log_event(log, "registered", replica=self.engine.replica_id, address=self.entry.address)

    async def run(self, stop: asyncio.Event) -> None:
        """Serves the dock until `stop` is set; then ends the claim it holds (see the module's docstring) and deregisters."""
        heartbeat = asyncio.create_task(self._heartbeat(stop))
        refusals = RefusalLog(log, "claim refused", "error")
        try:
            while not stop.is_set():
                try:
                    claim = await asyncio.to_thread(self._claim)
                except DockrlError as exc:  # Redis away, or no dock created yet: ask again later
                    refusals.refused(exc)
                    await asyncio.sleep(CLAIM_WAIT_S)
                    continue
                refusals.served()
                if claim is None:
                    continue
                await self.profiler.at_step(self.engine.version + 1)  # the trainer iteration these rows feed
                await self._serve_claim(claim, stop)
        finally:
            heartbeat.cancel()
            await self.profiler.stop()
            await asyncio.to_thread(self.entry.deregister)
            log_event(log, "deregistered", replica=self.engine.replica_id)

    async def _serve_claim(self, claim, stop: asyncio.Event) -> None:
        """Generates and puts one claim (to its end even when `stop` comes meanwhile: see `run`)."""
        if stop.is_set():  # came in while the replica began to drain: nothing generated, back at once
            await asyncio.to_thread(self.dock.release, claim.lease, claim.indexes)
            log_event(log, "returned claim on stop", rows=len(claim))
            return
        settled: set[int] = set()  # rows already put or released
        started = time.time()
        try:
            await self._process(claim, settled)
            await asyncio.to_thread(self.timeline.record, Span(self.engine.replica_id, "generate", started, time.time(), len(claim)))
        except DockrlError as exc:  # a lease that expired, or an engine that died
            log_event(log, "claim failed", level=logging.WARNING, rows=len(claim), error=str(exc))
            rest = [i for i in claim.indexes if i not in settled]
            try:  # back to the pool now rather than when the lease ends (refused when it already has)
                if rest:
                    await asyncio.to_thread(self.dock.release, claim.lease, rest)
            except DockrlError:
                pass

    def _claim(self):
        layout = self.dock.layout
        # Behind the trainer's version (joined late, or a push is on its way): samples would be
        # off-policy, so wait for the weights; the trainer pushes to replicas that lag. A model left a
        # mix of versions by a broken transfer generates nothing until a complete push.
        if self.engine.weights_incomplete or self.engine.version < self.dock.policy_version() - self.cfg.rl_config.max_staleness:
            time.sleep(CLAIM_WAIT_S)
            return None
        count = claim_share(layout.dispatch_sizes[layout.rollout_consumer], self.cfg.samples_per_iteration,
                            len(self.registry.live("rollout")), layout.n_samples_per_prompt)
        columns = [PROMPTS.name, LABELS.name] if self.environment is not None else [PROMPTS.name]  # an episode's task has its label
        return self.dock.claim(
            layout.rollout_consumer, columns, count, group=not layout.partial_rollout,
            partial_columns=names(RolloutPart.TOKEN_COLUMNS) if layout.partial_rollout else (), timeout_s=CLAIM_WAIT_S,
        )

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        # A task of its own: a claim generates for longer than the registry's TTL.
        while not stop.is_set():
            await asyncio.sleep(self.entry.period_s)
            try:
                await asyncio.to_thread(self.entry.renew, self.engine.version)
            except DockrlError as exc:
                log_event(log, "heartbeat failed", level=logging.WARNING, error=str(exc))

    async def _process(self, claim, settled: set[int]) -> None:
        running = InFlight()
        rows = []
        for index, prompt, label, prior in zip(claim.indexes, claimed(claim, PROMPTS), claimed(claim, LABELS),
                                               RolloutPart.from_claim(claim)):
            row = (self._generate(index, list(prompt), prior, running) if self.environment is None
                   else self._episode(index, list(prompt), label or "", running))
            rows.append(asyncio.create_task(row))
        if self.dock.layout.partial_rollout:
            await self._process_interruptible(claim, rows, running, settled)
            return
        try:
            results = await asyncio.gather(*rows)
        finally:
            for row in rows:
                row.cancel()
        # Claims take whole groups and never resume a response: a group with a row cut short (the drain,
        # an Abort) goes back whole, its finished rows too, or no group claim could take the rest of it.
        n = self.dock.layout.n_samples_per_prompt
        cut = {r.index // n for r in results if not r.finished}
        done = [r for r in results if r.index // n not in cut]
        await self._put_finished(claim, done, settled)
        unchanged = [r.index for r in results if r.index // n in cut]
        if unchanged:
            await asyncio.to_thread(self.dock.release, claim.lease, unchanged)
        log_event(log, "claim done", rows=len(results), finished=len(done), partial=0, released=len(unchanged),
                  version=self.engine.version)

    async def _process_interruptible(self, claim, rows: list[asyncio.Task], running: InFlight,
                                     settled: set[int]) -> None:
        """Puts each row as it finishes; once the iteration's target is reached, aborts the rows still running.

        Rows that got tokens go back with them (a later claim resumes them); rows stopped before a
        token (the target, or the drain's deadline) are released, back to the pool with what was
        stored before this claim. `settled` collects the rows put, for the caller to release the rest on an error.
        """
        pending = set(rows)
        finished = resumable = 0
        unchanged: list[int] = []
        interrupted = 0
        next_check = time.monotonic() + TARGET_POLL_S
        try:
            while pending:
                ended, pending = await asyncio.wait(pending, timeout=TARGET_POLL_S, return_when=asyncio.FIRST_COMPLETED)
                results = [task.result() for task in ended]
                done = [r for r in results if r.finished]
                back = [r for r in results if not r.finished and r.generated]
                await self._put_finished(claim, done, settled)
                if back:
                    columns = RolloutPart.to_partial_columns([r.part() for r in back])
                    await asyncio.to_thread(self.dock.put, [r.index for r in back], columns, lease=claim.lease,
                                            version=self.engine.version, partial=True)
                    settled.update(r.index for r in back)
                unchanged += [r.index for r in results if not r.finished and not r.generated]
                finished, resumable = finished + len(done), resumable + len(back)
                if pending and not running.interrupted and time.monotonic() >= next_check:
                    next_check = time.monotonic() + TARGET_POLL_S
                    if await asyncio.to_thread(self.dock.rollout_done):
                        running.interrupted = True
                        interrupted = len(running.requests)
                        for request_id in list(running.requests.values()):
                            await self.engine.abort(request_id)
                        INTERRUPTED_ROWS.inc(interrupted)
        finally:
            for row in pending:
                row.cancel()
        if unchanged:
            await asyncio.to_thread(self.dock.release, claim.lease, unchanged)
        log_event(log, "claim done", rows=len(rows), finished=finished, partial=resumable, released=len(unchanged),
                  interrupted=interrupted, version=self.engine.version)

    async def _put_finished(self, claim, done: list[RowResult], settled: set[int]) -> None:
        """Puts finished rows final: their whole responses, logprobs, versions, lengths and finish reasons."""
        if not done:
            return
        parts = [r.part() for r in done]
        if self.engine.routing_shape != (0, 0):
            empty = np.zeros((0, *self.engine.routing_shape), np.uint8)  # a row that failed before a token computed nothing
            parts = [p if p.routed_experts is not None else replace(p, routed_experts=empty) for p in parts]
        await asyncio.to_thread(self.dock.put, [r.index for r in done], RolloutPart.to_columns(parts), lease=claim.lease,
                                version=self.engine.version)
        settled.update(r.index for r in done)

    async def _open(self, index: int, ids: list[int], overrides: SamplingOverrides, running: InFlight,
                    **options) -> GenerationStream | str:
        """Opens row `index`'s engine request on `ids` (`options`: RolloutEngine.open's), waiting while the queue is
        full (HTTP users share it); or, when it cannot begin, why, as a FinishReason value: abort (the iteration's
        target was reached, or the drain's deadline stopped the engine) or failed (the row cannot be generated; logged)."""
        while True:
            if running.interrupted:
                return FinishReason.ABORT.value
            try:
                return self.engine.open(ids, overrides, **options)
            except ResourceExhausted:
                await asyncio.sleep(QUEUE_RETRY_S)
            except Unavailable:
                return FinishReason.ABORT.value
            except InvalidArgument as exc:
                log_event(log, "row failed", level=logging.WARNING, row=index, error=str(exc))
                return FinishReason.FAILED.value

    async def _generate(self, index: int, prompt: list[int], prior: RolloutPart | None, running: InFlight) -> RowResult:
        """Generates row `index` for this claim's budget, continuing `prior` (the partial response stored so far, if
        any); `running` holds its request id while it runs."""
        sample = Completion() if prior is None else Completion(
            token_ids=[int(t) for t in prior.response_ids], logprobs=[float(x) for x in prior.log_probs],
            versions=[int(v) for v in prior.versions])
        budget = token_budget(self.max_tokens, self.max_split, len(sample.token_ids))
        seed = sample_seed(self.seed, prompt, index % self.dock.layout.n_samples_per_prompt, self.engine.version,
                           len(sample.token_ids))
        overrides = SamplingOverrides(max_tokens=budget, n=1, logprobs=0, seed=seed)
        # Synchronous, whole responses: nothing reads a row before it ends, and the trainer pushes only between
        # iterations, so the row comes as one output instead of a delta per token (the replica's API process then
        # handles 128 outputs per claim, not 128 per engine step: the tiny run's rollout about 30 ms shorter,
        # docs/benchmarks.md). Each token's version is then the one at the end, which the check below guards.
        final_only = not self.dock.layout.partial_rollout and self.cfg.rl_config.max_staleness == 0
        record = self.engine.routing_shape != (0, 0)
        request_id = RECORD_PREFIX + uuid.uuid4().hex if record else ""  # the prefix asks the worker to record its routing
        stream = await self._open(index, prompt + sample.token_ids, overrides, running, request_id=request_id,
                                  detokenize=False, final_only=final_only)
        if isinstance(stream, str):  # abort: not begun, back as it was; failed: it cannot be generated, back as failed
            if stream == FinishReason.FAILED.value:
                sample.finish_reason = stream
            return RowResult(index, sample, finished=stream == FinishReason.FAILED.value)
        prior, version = len(sample.token_ids), self.engine.version
        running.requests[index] = stream.request_id
        try:
            async for delta in stream.deltas():
                sample.add(delta)
        finally:
            running.requests.pop(index, None)
            # taken whether the row finished or not, so the worker keeps no record of a request that has ended
            routed = await self.engine.take_routed_experts(stream.request_id) if record else None
        finished = sample.finish_reason == FinishReason.STOP.value or len(sample.token_ids) >= self.max_tokens
        if final_only and self.engine.version != version:  # weights changed mid-row (a late push): which token came
            finished = False                                # from which version is unknown, so the group goes back
        return RowResult(index, sample, finished, generated=len(sample.token_ids) - prior, routed_experts=routed)

    async def _episode(self, index: int, prompt: list[int], label: str, running: InFlight) -> RowResult:
        """Runs row `index` as a multi-turn episode (services/rollout/agent/episode.py); `running` holds the request id
        of its turn while one runs. An environment that raises fails the row (counted); nothing the model writes does."""
        env = self.environment(self.cfg.rollout.multi_turn, self.engine.tokenizer)
        sample_index = index % self.dock.layout.n_samples_per_prompt

        async def generate(ids: list[int], max_new: int) -> Completion:
            turn = Completion()
            # each turn its own seed (the tokens so far part it from the episode's other turns)
            seed = sample_seed(self.seed, prompt, sample_index, self.engine.version, len(ids) - len(prompt))
            overrides = SamplingOverrides(max_tokens=max_new, n=1, logprobs=0, seed=seed, stop=self.turn_stop)
            # stop strings need the engine's detokenizer
            stream = await self._open(index, ids, overrides, running, detokenize=self.turn_stop is not None)
            if isinstance(stream, str):  # abort: the episode goes back; failed: this turn cannot be generated, the row fails
                turn.finish_reason = stream
                return turn
            running.requests[index] = stream.request_id
            try:
                async for delta in stream.deltas():
                    turn.add(delta)
            finally:
                running.requests.pop(index, None)
            return turn

        task = Task(self.engine.tokenizer.decode(prompt, skip_special_tokens=False), label)
        try:
            trajectory = await run_episode(prompt, task, env, generate, self.engine.tokenizer, self.episode_limits)
        except DockrlError:  # the engine died or the dock is away: the claim's error path
            raise
        except Exception as exc:  # the environment's own fault: this row is dropped as failed, the run goes on
            log_event(log, "episode failed", level=logging.WARNING, row=index, error=f"{type(exc).__name__}: {exc}")
            EPISODE_EVENTS.labels("environment_failed").inc()
            trajectory = Trajectory([], [], [], [], [], FinishReason.FAILED.value, 0.0, {})
        for kind, value in trajectory.counters.items():
            if kind == "environment_s":
                ENVIRONMENT_SECONDS.inc(value)
            else:
                EPISODE_EVENTS.labels(kind).inc(value)
        sample = Completion(token_ids=trajectory.response_ids, logprobs=trajectory.log_probs,
                            versions=trajectory.versions, finish_reason=trajectory.finish_reason)
        return RowResult(index, sample, finished=trajectory.finish_reason != FinishReason.ABORT.value,
                         generated=len(trajectory.response_ids), loss_mask=trajectory.loss_mask,
                         episode_stats=episode_stats(trajectory.counters, trajectory.reward))
