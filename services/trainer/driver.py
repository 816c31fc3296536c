"""The iteration driver: the trainer's loop over the whole system.

Each iteration:
  1. put GBS prompts (n rows each) into the dock's free group slots
  2. wait for GBS complete, scored groups (rollout and reward workers pull from the dock)
  3. log-probs (old: skipped when it equals the current policy; reference when KL is on)
  4. group_norm advantages, then the policy update
  5. push the new weights to every live rollout replica; record the step's metrics
"""
from __future__ import annotations

import json
import logging
import time

import torch

from services.common.auth import resolve_token
from services.common.config import Config
from services.common.log import log_event, setup_logging
from services.common.preprocess import load_prompts
from services.dock.client import Dock
from services.dock.registry import ReplicaRegistry
from services.dock.schema import DockLayout
from services.trainer.iteration_data import ack_batch, collect_scored_groups, put_prompts
from services.trainer.prompt_stream import PromptStream
from services.trainer.rollout_sync import ReplicaSync
from services.trainer.run_log import RunLog
from services.trainer.session import TrainerSession
from services.trainer.step_metrics import batch_metrics


def _evaluate(session: TrainerSession, sync: ReplicaSync, eval_records, step: int, run_log: RunLog, logger) -> float | None:
    """Held-out greedy accuracy through the rollout and reward services (None without eval data)."""
    from services.trainer.evaluation import evaluate

    if not eval_records:
        return None
    cfg = session.cfg
    result = evaluate(sync.any_address(), sync.reward_address(), eval_records,
                      cfg.generate_config.sampling_config.max_tokens, token=session.token)
    run_log.log(step, {"eval/accuracy": result.accuracy, "eval/response_length": result.mean_response_length})
    log_event(logger, "evaluation", step=step, accuracy=f"{result.accuracy:.3f}", prompts=result.count)
    return result.accuracy


def train(cfg: Config, resume: bool = False, host: str | None = None, port: int | None = None) -> int:
    """Runs megatron_training.train_iters iterations against the dock; returns an exit code."""
    logger = setup_logging("trainer")
    token = resolve_token(cfg.auth)
    mt, rl = cfg.megatron_training, cfg.rl_config
    session = TrainerSession.start(cfg, token, resume=resume, host=host, port=port)
    leader = session.is_leader
    dock = Dock.from_config(cfg, token=token) if leader else None
    if leader and (not resume or not dock.client.exists(dock.keys.meta)):
        dock.create(DockLayout.from_config(cfg))
    stream = PromptStream(load_prompts(mt.data_path), mt.seed, shuffle=not rl.guarantee_order)
    stream.state.cursor = session.prompt_cursor
    eval_records = load_prompts(cfg.trainer.eval_data_path) if cfg.trainer.eval_data_path else []
    run_log = RunLog(cfg.trainer.log_dir, rl.use_tensorboard) if leader else None
    sync = ReplicaSync(cfg, ReplicaRegistry(dock.client, dock.keys, cfg.rollout.heartbeat_ttl_s) if leader else None, token)
    gbs, n = mt.global_batch_size, rl.n_samples_per_prompt
    accuracy_before = accuracy_after = None
    try:
        weights = session.gather_weights()
        if leader:
            sync.wait_for_replicas(timeout_s=600.0)
            sync.push_to_stale(weights, session.version)
            accuracy_before = _evaluate(session, sync, eval_records, session.step, run_log, logger)
        for step in range(session.step + 1, mt.train_iters + 1):
            session.control.wait_while_paused()
            with session.control.step_lock:
                t0 = time.perf_counter()
                session.control.set_state("rollout")
                batch = None
                if leader:
                    groups = dock.begin_iteration(gbs)
                    put_prompts(dock, groups, stream.take(len(groups)))
                    batch = collect_scored_groups(dock, gbs * n, timeout_s=cfg.trainer.rollout_timeout_s,
                                                  on_wait=lambda s: sync.push_to_stale(weights, session.version))
                batch = session.broadcast(batch)
                t_rollout = time.perf_counter()
                session.control.set_state("train")
                metrics = session.train_step(batch, step)
                t_train = time.perf_counter()
                session.control.set_state("push")
                weights = session.gather_weights()
                if leader:
                    push = sync.push_all(weights, session.version + 1)
                    ack_batch(dock, batch)
                session.version += 1
                t_push = time.perf_counter()
                session.step = step
                session.prompt_cursor = stream.state.cursor
                metrics.update(batch_metrics(batch, session.version - 1, n))
                metrics.update({
                    "timing/rollout_and_reward_s": t_rollout - t0, "timing/train_s": t_train - t_rollout,
                    "timing/weight_sync_s": t_push - t_train, "timing/iteration_s": t_push - t0,
                    "throughput/tokens_per_s": sum(len(r) for r in batch.responses) / max(t_rollout - t0, 1e-9),
                })
                if leader:
                    metrics.update({"weight_sync/bytes": push.bytes_sent, "weight_sync/replicas": push.replicas_updated})
                    run_log.log(step, metrics)
                    log_event(logger, "step", step=step, reward=f"{metrics['reward/mean']:.3f}",
                              loss=f"{metrics['actor/loss']:.4f}", seconds=f"{metrics['timing/iteration_s']:.1f}")
                session.control.record_step(step, metrics, session.version)
                if mt.save_interval and step % mt.save_interval == 0:
                    session.save_checkpoint()
                if leader and cfg.trainer.eval_interval and step % cfg.trainer.eval_interval == 0 and step < mt.train_iters:
                    _evaluate(session, sync, eval_records, step, run_log, logger)
        session.save_checkpoint()
        if leader:
            accuracy_after = _evaluate(session, sync, eval_records, session.step, run_log, logger)
            run_log.plot()
            summary = {"accuracy_before": accuracy_before, "accuracy_after": accuracy_after, "steps": session.step,
                       "dock": dock.stats().__dict__}
            (run_log.dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
            if accuracy_before is not None:
                print(f"held-out accuracy: before {accuracy_before:.1%} -> after {accuracy_after:.1%} "
                      f"({(accuracy_after - accuracy_before) * 100:+.1f} points) over {len(eval_records)} prompts", flush=True)
        session.control.set_state("done")
        return 0
    except Exception:
        session.control.set_state("failed")
        logging.getLogger("dockrl.trainer").exception("training failed")
        return 1
    finally:
        if run_log is not None:
            run_log.close()
        session.close()
