"""The iteration driver: the trainer's loop over the whole system.

Each iteration:
  1. admit prompts (n rows each) into the dock's free group slots, up to (max_staleness + 1) * GBS
     untrained groups: GBS per iteration when synchronous, the next iterations' ahead with eta >= 1
  2. wait for GBS complete, scored groups (rollout and reward workers pull from the dock); drop
     groups with a token older than version - max_staleness
  3. log-probs (old: skipped when it equals the current policy; reference when KL is on)
  4. group_norm advantages, then the policy update
  5. push the new weights to every live rollout replica; record the step's metrics
"""
from __future__ import annotations

import json
import logging
import time

import psutil
import torch

from services.common.auth import resolve_token
from services.common.config import Config
from services.common.log import log_event, setup_logging
from services.common.preprocess import load_prompts
from services.dock.client import Dock
from services.dock.registry import ReplicaRegistry
from services.dock.schema import DockLayout
from services.dock.scripts import DockMissing
from services.trainer.checkpoint import latest_step
from services.trainer.cpu_shims import accelerator_present
from services.trainer.iteration_data import RunAccounting, ack_batch, collect_iteration
from services.trainer.model import cpu_threads
from services.trainer.prompt_stream import PromptStream
from services.trainer.rollout_sync import ReplicaSync
from services.trainer.run_log import RunLog
from services.trainer.session import TrainerSession
from services.trainer.step_metrics import batch_metrics, throughput_metrics


EVAL_SETS = (("accuracy", "eval_data_path"), ("test_accuracy", "test_data_path"))


def _evaluate(session: TrainerSession, sync: ReplicaSync, eval_sets: dict, step: int, run_log: RunLog, logger) -> dict[str, float]:
    """Greedy accuracy on each evaluation set, through the rollout and reward services."""
    from services.trainer.evaluation import evaluate

    results = {}
    for name, records in eval_sets.items():
        result = evaluate(sync.any_address(), sync.reward_address(), records,
                          session.cfg.generate_config.sampling_config.max_tokens, token=session.token)
        results[name] = result.accuracy
        log_event(logger, "evaluation", step=step, set=name, accuracy=f"{result.accuracy:.3f}", prompts=result.count)
    if results:
        run_log.log(step, {f"eval/{k}": v for k, v in results.items()})
    return results


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
    mt, rl = cfg.megatron_training, cfg.rl_config
    prompts = load_prompts(mt.data_path)
    session = TrainerSession.start(cfg, token, len(prompts), resume=resume, host=host, port=port)
    model_ready = time.perf_counter()
    leader = session.is_leader
    dock = Dock.from_config(cfg, token=token) if leader else None
    if leader and (not resume or not dock.client.exists(dock.keys.meta)):
        dock.create(DockLayout.from_config(cfg))
    stream = PromptStream(prompts, mt.seed, shuffle=not rl.guarantee_order)
    stream.state.cursor = session.prompt_cursor
    eval_sets = {name: load_prompts(getattr(cfg.trainer, key)) for name, key in EVAL_SETS if getattr(cfg.trainer, key)}
    run_log = RunLog(cfg.trainer.log_dir, rl.use_tensorboard) if leader else None
    sync = ReplicaSync(cfg, ReplicaRegistry(dock.client, dock.keys, cfg.rollout.heartbeat_ttl_s) if leader else None, token)
    n = rl.n_samples_per_prompt
    before: dict[str, float] = {}
    accounting = RunAccounting()
    try:
        weights = session.gather_weights()
        if leader:
            waiting = time.perf_counter()
            sync.wait_for_replicas(timeout_s=600.0)
            replica_ready = time.perf_counter()
            sync.push_to_stale(weights, session.version)
            pushed = time.perf_counter()
            before = _evaluate(session, sync, eval_sets, session.step, run_log, logger)
            # Where the trainer's start-up goes; rollout replicas start alongside, so waiting for one is vLLM's start left over.
            log_event(logger, "start-up", imports_s=f"{imported:.1f}", model_s=f"{model_ready - started:.1f}",
                      waiting_for_rollout_s=f"{replica_ready - waiting:.1f}", first_push_s=f"{pushed - replica_ready:.1f}",
                      evaluation_s=f"{time.perf_counter() - pushed:.1f}", total_s=f"{imported + time.perf_counter() - started:.1f}")
        first_step = session.step + 1
        for step in range(first_step, mt.train_iters + 1):
            session.control.wait_while_paused()
            with session.control.step_lock:
                t0 = time.perf_counter()
                session.control.set_state("rollout")
                batch, sampling_metrics = None, {}
                if leader:
                    dock.set_policy_version(session.version)
                    sync.push_to_stale(weights, session.version)  # replicas that joined since the last push
                    stale_before, failed_before = accounting.rows_stale, accounting.rows_failed
                    batch, sampling_metrics = collect_iteration(dock, stream, accounting, cfg, session.version,
                                                                groups_left=(mt.train_iters - step + 1) * mt.global_batch_size,
                                                                on_wait=lambda s: sync.push_to_stale(weights, session.version))
                    sampling_metrics["policy_lag/stale_rows_dropped"] = accounting.rows_stale - stale_before
                    sampling_metrics["rollout/failed_rows_dropped"] = accounting.rows_failed - failed_before
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
                metrics.update(batch_metrics(batch, session.version - 1, n, rl.verifier_function))
                metrics.update(sampling_metrics)
                metrics.update({
                    "timing/rollout_and_reward_s": t_rollout - t0, "timing/train_s": t_train - t_rollout,
                    "timing/weight_sync_s": t_push - t_train, "timing/iteration_s": t_push - t0,
                })
                metrics.update(throughput_metrics(batch, t_rollout - t0, t_train - t_rollout, t_push - t0))
                if leader:
                    metrics.update({"weight_sync/bytes": push.bytes_sent, "weight_sync/replicas": push.replicas_updated})
                    run_log.log(step, metrics)
                    log_event(logger, "step", step=step, reward=f"{metrics['reward/mean']:.3f}",
                              loss=f"{metrics['actor/loss']:.4f}", seconds=f"{metrics['timing/iteration_s']:.1f}")
                session.control.record_step(step, metrics, session.version)
                if mt.save_interval and step % mt.save_interval == 0:
                    session.save_checkpoint()
                if leader and cfg.trainer.eval_interval and step % cfg.trainer.eval_interval == 0 and step < mt.train_iters:
                    _evaluate(session, sync, eval_sets, step, run_log, logger)
        session.save_checkpoint()
        if leader:
            after = _evaluate(session, sync, eval_sets, session.step, run_log, logger)
            run_log.plot()
            summary = {"steps": session.step, "accuracy_before": before.get("accuracy"), "accuracy_after": after.get("accuracy"),
                       "test_accuracy_before": before.get("test_accuracy"), "test_accuracy_after": after.get("test_accuracy"),
                       "eval_prompts": {k: len(v) for k, v in eval_sets.items()},
                       # this process's count: a run resumed with --resume counts from its first step here
                       "accounting": {**accounting.__dict__, "from_step": first_step}, "dock": dock.stats().__dict__}
            (run_log.dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
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
        if run_log is not None:
            run_log.close()
        session.close()
