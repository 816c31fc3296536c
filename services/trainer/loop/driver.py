"""The iteration driver: the trainer's loop over the whole system.

Each iteration:
  1. collect: admit prompts (n rows each) into the dock's free group slots, up to (max_staleness + 1) * GBS
     untrained groups (GBS per iteration when synchronous, the next iterations' ahead with eta >= 1), and
     wait for GBS complete, scored groups (rollout and reward workers pull from the dock); drop groups
     with a token older than version - max_staleness
  2. bring lagging replicas up to date: before the first claim and at each wait round, replicas that
     joined late or missed a push get the model's weights (the version they should serve)
  3. train: the estimator's log-probs and advantages, the policy (and critic) update
  4. push the new weights to every live rollout replica; record the step's metrics

Rank 0 talks to the dock and the replicas (`RunLeader`) and decides, per wait round, what every rank
does next: `CatchUp` (replicas lag: every rank streams the weights, rank 0 pushes them) or `BatchReady`
(the batch, broadcast to every rank). Every rank then takes the same step: the weight gathers, the
update and the push's gather are collectives over TP / PP / DP; no push happens inside the collection.
"""
from __future__ import annotations

import logging
import time

import psutil
import torch
import torch.distributed as dist
from torch.profiler import record_function

from services.common.auth import resolve_token
from services.common.config import Config
from services.common.log import log_event, setup_logging
from services.dock.scripts import DockMissing
from services.trainer.modeling.checkpoint import latest_step
from services.trainer.modeling.cpu_shims import accelerator_present
from services.trainer.modeling.model import cpu_threads
from services.trainer.loop.profiling import StepProfiler
from services.trainer.loop.run_leader import TRAIN_SET, BatchReady, CatchUp, RunLeader, read_run_data
from services.trainer.loop.iteration_data import ScoredBatch
from services.trainer.loop.session import TrainerSession
from services.trainer.loop.step_metrics import batch_metrics, throughput_metrics
from services.trainer.weights.gather import take_part


def _report_lost_dock(logger, session: TrainerSession, exc: DockMissing) -> None:
    """Says which iteration failed because the dock's state is gone, and where --resume will continue."""
    saved = latest_step(session.cfg.megatron_training.save) if session.cfg.megatron_training.save else None
    resume = (f"`dockrl trainer train --resume` continues from the checkpoint of step {saved}" if saved is not None
              else "no checkpoint to resume from (megatron_training.save / save_interval)")
    log_event(logger, "iteration failed: the dock's state is gone", level=logging.ERROR, step=session.step + 1, error=str(exc),
              cause="Redis came back without the run's keys (restarted without AOF, or flushed)", resume=resume)


def train(cfg: Config, resume: bool = False, host: str | None = None, port: int | None = None) -> int:
    """Runs megatron_training.train_iters iterations against the dock; returns an exit code."""
    logger = setup_logging("trainer")
    started = time.perf_counter()
    imported = time.time() - psutil.Process().create_time()  # from the process's start: Python's imports
    if not accelerator_present():
        torch.set_num_threads(cpu_threads())
        log_event(logger, "cpu threads", threads=torch.get_num_threads())
    token = resolve_token(cfg.auth)
    mt = cfg.megatron_training
    try:
        data = read_run_data(cfg)
    except (FileNotFoundError, ValueError) as exc:  # a missing file, or one without a usable line: named, no traceback
        log_event(logger, "no usable data; not starting", level=logging.ERROR, error=str(exc))
        return 2
    session = TrainerSession.start(cfg, token, len(data[TRAIN_SET].records), resume=resume, host=host, port=port)
    model_ready = time.perf_counter()
    leader = RunLeader(cfg, token, data, session.prompt_cursor, resume) if session.is_leader else None
    profiler = StepProfiler.from_config(cfg, dist.get_rank() if dist.is_initialized() else 0)
    try:
        before: dict[str, float] = {}
        waiting_s = leader.wait_for_replicas() if leader else 0.0
        ready = time.perf_counter()
        # The start's catch-up: replicas that lack the model's version (every one, on a fresh run) get it.
        _catch_up(session, leader, session.broadcast(leader.lagging(session.version) if leader else None))
        if leader:
            push_s = time.perf_counter() - ready
            before = leader.before(session.step, session.version)
            # Where the trainer's start-up goes; rollout replicas start alongside, so waiting for one is vLLM's start left over.
            log_event(logger, "start-up", imports_s=f"{imported:.1f}", model_s=f"{model_ready - started:.1f}",
                      waiting_for_rollout_s=f"{waiting_s:.1f}", first_push_s=f"{push_s:.1f}",
                      total_s=f"{imported + time.perf_counter() - started:.1f}")
        session.broadcast(None)  # the other ranks wait for rank 0's evaluation before the first iteration
        first_step = session.step + 1
        for step in range(first_step, mt.train_iters + 1):
            session.control.wait_while_paused()
            with session.control.step_lock, profiler.step(step):
                metrics = _iteration(session, leader, step)
                session.control.record_step(step, metrics, session.version)
                if mt.save_interval and step % mt.save_interval == 0:
                    session.save_checkpoint()
                if leader and cfg.trainer.eval_interval and step % cfg.trainer.eval_interval == 0 and step < mt.train_iters:
                    leader.evaluate(step, session.version)
        session.save_checkpoint()
        if leader:
            leader.finish(session.step, session.version, first_step, before)
        session.control.set_state("done")
        return 0
    except DockMissing as exc:
        session.control.set_state("failed")
        _report_lost_dock(logger, session, exc)
        return 1
    except Exception:
        session.control.set_state("failed")
        logging.getLogger("dockrl.trainer").exception("training failed")
        return 1
    finally:
        if leader is not None:
            leader.close()
        session.close()


def _catch_up(session: TrainerSession, leader: RunLeader | None, decision: CatchUp) -> None:
    """Every rank: streams the model's weights (outside an update they hold session.version, so nothing is kept
    between pushes); rank 0 pushes them to the replicas `decision` names. No replica lags: nothing to do."""
    if not decision.replicas:
        return
    if leader:
        leader.sync.push_to(session.weight_stream(), decision.replicas, session.version)
    else:
        session.take_part_in_weight_gather()


def _collect(session: TrainerSession, leader: RunLeader | None, step: int) -> tuple[ScoredBatch, dict[str, float]]:
    """Every rank: rank 0's decisions (`RunLeader.collect`), one at a time, until the batch is ready; each `CatchUp`
    on the way brings lagging replicas up to date. Returns the batch and how it was gathered."""
    decisions = leader.collect(step, session.version) if leader else None
    while True:
        decision = session.broadcast(next(decisions) if leader else None)
        if isinstance(decision, BatchReady):
            return decision.batch, decision.metrics
        _catch_up(session, leader, decision)


def _iteration(session: TrainerSession, leader: RunLeader | None, step: int) -> dict[str, float]:
    """One iteration, as the algorithm: collect (bringing lagging replicas up to date while waiting), train, push.
    Rank 0 (`leader`) talks to the dock and the replicas; every rank takes each step and joins its collectives."""
    rl = session.cfg.rl_config
    t0 = time.perf_counter()
    session.control.set_state("rollout")
    with record_function("collect_scored_groups"):
        batch, metrics = _collect(session, leader, step)
    t_rollout = time.perf_counter()
    session.control.set_state("train")
    metrics.update(session.train_step(batch, step))  # log-probs, advantages, the policy (and critic) update
    t_train = time.perf_counter()
    session.control.set_state("push")
    with record_function("weight_gather"):  # plans the buckets; the gather itself streams into the push, bucket by bucket
        weights = session.weight_stream()
    with record_function("weight_push"):
        if leader:
            metrics.update(leader.publish(weights, batch, session.version + 1))
        else:
            take_part(weights)
    session.version += 1
    t_push = time.perf_counter()
    session.step = step
    if leader:
        session.prompt_cursor = leader.stream.state.cursor
    metrics.update(batch_metrics(batch, session.version - 1, rl.n_samples_per_prompt, rl.verifier_function))
    metrics.update({"timing/rollout_and_reward_s": t_rollout - t0, "timing/train_s": t_train - t_rollout,
                    "timing/weight_sync_s": t_push - t_train, "timing/iteration_s": t_push - t0})
    metrics.update(throughput_metrics(batch, t_rollout - t0, t_train - t_rollout, t_push - t0))
    if leader:
        leader.record(step, metrics)
    return metrics
