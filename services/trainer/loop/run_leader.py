"""Rank 0's part of a run: the dock, the prompt stream, the rollout and reward replicas, the run's records.

The other ranks have none of it: they join the collectives of an iteration (the batch's
broadcast, the update, the weight gather) and nothing else. Keeping rank 0's work here lets the
driver read as the algorithm.
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import redis

from services.common.config import Config
from services.common.log import log_event
from services.common.weight_wire import BucketSource
from services.common.prompt_file import OVER_MAX_PROMPT_LENGTH, PromptFile, read_prompt_file
from services.dock.client import Dock
from services.dock.registry import Replica
from services.dock.schema import DockLayout
from services.dock.timeline import Span
from services.trainer.loop.iteration_data import HeldBatch, RunAccounting, ScoredBatch, ack_batch, collection_rounds
from services.trainer.loop.prompt_stream import PromptStream
from services.trainer.weights.rollout_sync import ReplicaSync
from services.trainer.loop.run_log import RunLog

logger = logging.getLogger("dockrl.trainer")

EVAL_SETS = (("accuracy", "eval_data_path"), ("test_accuracy", "test_data_path"))
TRAIN_SET = "train"
TRAINER_STAGES = (("wait", "timing/rollout_and_reward_s"), ("train", "timing/train_s"), ("push", "timing/weight_sync_s"))


def read_run_data(cfg: Config) -> dict[str, PromptFile]:
    """The training prompts (TRAIN_SET) and each evaluation set, read before the model loads.

    The same checks for all (rl_config.max_prompt_length included: evaluation prompts go to the same
    replicas); each file's lines left out are logged, named by file and line.
    """
    keys = {TRAIN_SET: ("megatron_training.data_path", cfg.megatron_training.data_path)}
    keys |= {name: (f"trainer.{key}", getattr(cfg.trainer, key)) for name, key in EVAL_SETS if getattr(cfg.trainer, key)}
    files = {}
    for name, (key, prefix) in keys.items():
        files[name] = data = read_prompt_file(prefix, key, cfg.rl_config.max_prompt_length)
        if data.left_out:
            log_event(logger, "data lines left out", level=logging.WARNING, set=name, file=str(data.path),
                      kept=len(data.records), **data.counts())
            for line in data.named():
                logger.warning("  %s", line)
        else:
            log_event(logger, "data", set=name, file=str(data.path), kept=len(data.records))
    return files


@dataclass(frozen=True)
class CatchUp:
    """Rank 0's decision: these live replicas lack the model's version (joined late, or missed a push). Every rank
    streams the model's weights, which hold that version outside an update; rank 0 pushes them to the replicas."""

    replicas: tuple[Replica, ...]


@dataclass(frozen=True)
class BatchReady:
    """Rank 0's decision: the iteration's scored groups are in; every rank trains on `batch`."""

    batch: ScoredBatch
    metrics: dict[str, float]  # how the batch was gathered (dropped rows, dynamic sampling rounds)


class RunLeader:
    """What rank 0 does around the collectives: admit prompts and collect scored groups, push
    weights, evaluate, and record every step."""

    def __init__(self, cfg: Config, token: str, data: dict[str, PromptFile], prompt_cursor: int, resume: bool):
        self.cfg = cfg
        prompts = data[TRAIN_SET].records
        self.prompts = {"trained_from": len(prompts), "over_max_prompt_length": data[TRAIN_SET].counts().get(OVER_MAX_PROMPT_LENGTH, 0)}
        self.data_report = {name: file.report() for name, file in data.items()}
        self.token = token
        self.dock = Dock.from_config(cfg, token=token)
        if not resume or not self.dock.exists():
            self.dock.create(DockLayout.from_config(cfg))
        self.stream = PromptStream.from_config(prompts, cfg)
        self.stream.state.cursor = prompt_cursor
        self.eval_sets = {name: file.records for name, file in data.items() if name != TRAIN_SET}
        self.run_log = RunLog.from_config(cfg)
        self.sync = ReplicaSync(cfg, self.dock.registry(cfg.rollout.heartbeat_ttl_s), token)
        self.timeline = self.dock.timeline()
        self.accounting = RunAccounting()
        self.held: HeldBatch | None = None  # the iteration's batch, from collect to publish

    def wait_for_replicas(self) -> float:
        """Blocks until a rollout replica registers; returns the seconds waited."""
        waiting = time.perf_counter()
        self.sync.wait_for_replicas(timeout_s=600.0)
        return time.perf_counter() - waiting

    def lagging(self, version: int) -> CatchUp:
        """The live replicas that lack `version` (none, possibly) as a decision for every rank."""
        return CatchUp(tuple(self.sync.lagging(version)))

    def before(self, step: int, version: int) -> dict[str, float]:
        """The accuracies before training. A run resumed from the checkpoint of `step` (> 0) drops the records of
        the steps it trains again and takes the original run's step-0 evaluation when its records hold one."""
        if step > 0:
            dropped = self.run_log.keep_through(step)
            log_event(logger, "resumed", from_step=step, records_dropped=dropped)
            first = next((r for r in self.run_log.records() if r["step"] == 0 and any(k.startswith("eval/") for k in r)), None)
            if first is not None:
                return {key.removeprefix("eval/"): value for key, value in first.items() if key.startswith("eval/")}
        return self.evaluate(step, version)

    def collect(self, step: int, version: int) -> Iterator[CatchUp | BatchReady]:
        """This iteration's collection as rank 0's decisions for every rank: `CatchUp` for replicas that lag (checked
        before the first claim and at each wait round, about once a second while no scored group arrives), ending with
        `BatchReady`: GBS scored groups, prompts admitted up to the staleness bound, and how they were gathered."""
        mt = self.cfg.megatron_training
        books = self.accounting
        self.dock.set_policy_version(version)
        stale, failed = books.rows_stale, books.rows_failed
        rounds = collection_rounds(self.dock, self.stream, books, self.cfg, version,
                                   groups_left=(mt.train_iters - step + 1) * mt.global_batch_size)
        while True:
            if (catch_up := self.lagging(version)).replicas:
                yield catch_up
            try:
                next(rounds)  # to the next wait round
            except StopIteration as done:
                batch, metrics = done.value
                break
        metrics["policy_lag/stale_rows_dropped"] = books.rows_stale - stale
        metrics["rollout/failed_rows_dropped"] = books.rows_failed - failed
        self.held = HeldBatch(self.dock, batch, self.cfg.dock.lease_seconds)  # until publish acks it
        yield BatchReady(batch, metrics)

    def publish(self, weights: BucketSource, batch: ScoredBatch, version: int) -> dict[str, float]:
        """Pushes the updated policy (streamed: the other ranks take part) as `version` to every live replica and
        releases the trained rows."""
        push = self.sync.push_all(weights, version)
        self.held.release()
        ack_batch(self.dock, batch)
        return {"weight_sync/bytes": push.bytes_sent, "weight_sync/replicas": push.replicas_updated}

    def record(self, step: int, metrics: dict[str, float]) -> None:
        """One step's metrics to metrics.jsonl, TensorBoard and the log, and its stages to the run's timeline."""
        self.run_log.log(step, metrics)
        start = time.time() - metrics["timing/iteration_s"]  # the stages ran back to back, ending now
        rows = self.cfg.megatron_training.global_batch_size * self.cfg.rl_config.n_samples_per_prompt
        for stage, key in TRAINER_STAGES:
            self.timeline.record(Span("trainer", stage, start, start + metrics[key], rows))
            start += metrics[key]
        log_event(logger, "step", step=step, reward=f"{metrics['reward/mean']:.3f}", loss=f"{metrics['actor/loss']:.4f}",
                  seconds=f"{metrics['timing/iteration_s']:.1f}")

    def evaluate(self, step: int, version: int) -> dict[str, float]:
        """Greedy accuracy on each evaluation set, through the rollout and reward services."""
        from services.trainer.loop.evaluation import evaluate

        results = {}
        for name, records in self.eval_sets.items():
            result = evaluate(self.sync.any_address(), self.sync.reward_address(), records,
                              self.cfg.generate_config.sampling_config.max_tokens, token=self.token)
            results[name] = result.accuracy
            log_event(logger, "evaluation", step=step, set=name, accuracy=f"{result.accuracy:.3f}", prompts=result.count, version=version)
        if results:
            self.run_log.log(step, {f"eval/{k}": v for k, v in results.items()})
        return results

    def finish(self, step: int, version: int, first_step: int, before: dict[str, float]) -> None:
        """The last evaluation, the pictures and summary.json."""
        after = self.evaluate(step, version)
        try:
            spans = self.timeline.spans()
        except redis.RedisError as exc:  # the pictures still come, the timeline with the trainer's stages only
            log_event(logger, "run timeline unreadable", level=logging.WARNING, error=str(exc))
            spans = []
        self.run_log.plot(spans)
        summary = {"steps": step, "accuracy_before": before.get("accuracy"), "accuracy_after": after.get("accuracy"),
                   "test_accuracy_before": before.get("test_accuracy"), "test_accuracy_after": after.get("test_accuracy"),
                   "eval_prompts": {k: len(v) for k, v in self.eval_sets.items()}, "prompts": self.prompts,
                   "data": self.data_report,
                   # this process's count: a run resumed with --resume counts from its first step here
                   "accounting": {**self.accounting.__dict__, "from_step": first_step}, "dock": self.dock.stats().__dict__,
                   # spans in timeline.png, per stage and per worker
                   "timeline": {"stages": dict(Counter(s.stage for s in spans)), "workers": dict(Counter(s.worker for s in spans))}}
        (self.run_log.dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))

    def close(self) -> None:
        """Stops renewing a batch an iteration that failed still held; closes the run's records."""
        if self.held is not None:
            self.held.release()
        self.run_log.close()
