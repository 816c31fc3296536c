"""The whole loop under faults: Redis, two rollout replicas, two reward workers and the trainer run as
real processes; one run takes, in turn, a SIGKILL of a rollout replica and of a reward worker while
they hold rows, a Redis crash (SIGKILL) and restart on its AOF, a SIGKILL of the trainer and a restart with --resume,
and a Redis that comes back empty (no AOF). The run reaches its last step, and the dock accounts
for every sample: each row that entered the pool is live, or was trained once and retired.

One run carries every fault because starting the vLLM replicas dominates the test's time. It runs
synchronously with gRPC weight pushes, and at max_staleness 1 on the collective weight path
(trainer.weight_transport collective: a killed replica's group breaks, its restart joins a new one; the
resumed trainer builds every group afresh), so each mode meets every fault in two runs, not four.
"""
from __future__ import annotations

import json
import re
import signal
import time

import grpc
import pytest

from tests.faults.loop_harness import LoopSystem, wait_for

pytestmark = [pytest.mark.service, pytest.mark.slow]

# (max_staleness, trainer.weight_transport) -> the fault table's area
AREAS = {(0, "grpc"): "whole loop", (1, "collective"): "whole loop, max_staleness 1, collective weight path"}
GBS, N = 4, 4  # groups per iteration, samples per group
# Iterations per max_staleness, so the run outlasts the faults below: a synchronous iteration waits for a
# killed worker's rows (~1 s an iteration otherwise); an asynchronous one goes on without them, ~0.4 s each.
ITERS = {0: 48, 1: 120}
LEASE_S = 10  # short leases: a dead worker's rows come back within seconds
OUTAGE_S = 3.0  # how long Redis stays down, so every service sees the outage


def _overrides(tmp, eta: int, transport: str) -> list[str]:
    return [f"rl_config.max_staleness={eta}", f"trainer.weight_transport={transport}",
        f"megatron_training.load={tmp}/model", f"megatron_training.tokenizer_name_or_path={tmp}/model",
        f"megatron_training.data_path={tmp}/data/train", f"arithmetic.out_dir={tmp}/raw",
        "trainer.eval_data_path=", "trainer.test_data_path=", "init_model.warm_start_accuracy=0",
        f"trainer.log_dir={tmp}/logs", f"megatron_training.save={tmp}/ckpt", "megatron_training.save_interval=1",
        f"megatron_training.train_iters={ITERS[eta]}", f"megatron_training.global_batch_size={GBS}", f"rl_config.n_samples_per_prompt={N}",
        # One group per claim, so both replicas of each kind take part in every iteration.
        f"rl_config.actor_rollout_dispatch_size={N}", f"rl_config.reward_dispatch_size={N}",
        "rollout.replicas=2", "reward.replicas=2", f"dock.lease_seconds={LEASE_S}",
        "rollout.grpc_port=0", "rollout.http_port=0", "reward.grpc_port=0", "trainer.grpc_port=0",
    ]


@pytest.fixture(params=list(AREAS), ids=["sync-grpc", "max_staleness-1-collective"])
def loop(request, tmp_path):
    system = LoopSystem(tmp_path, _overrides(tmp_path, *request.param))
    system.area = AREAS[request.param]
    try:
        system.start()
        yield system
    finally:
        system.close()


def test_the_loop_survives_dead_workers_a_dead_trainer_and_redis_restarts(loop, fault_log):
    loop.wait_steps(1, timeout_s=900)  # start-up: two vLLM replicas and the trainer on a small CPU
    for name, consumer, what in (("rollout-1", "actor_rollout", "a rollout replica"), ("reward-1", "rule_reward", "a reward worker")):
        _worker_killed_mid_batch(loop, fault_log, name, consumer, what)
    _redis_restarted_on_its_aof(loop, fault_log)
    _trainer_killed_and_resumed(loop, fault_log)
    _every_sample_accounted_for(loop, fault_log, "after the kills, the Redis restart and the trainer resume", first_step=1, log_from=0)
    new_dock_from, log_from = _redis_back_empty_without_aof(loop, fault_log)
    _every_sample_accounted_for(loop, fault_log, "at the end of the run (the dock the resumed trainer made)", first_step=new_dock_from,
                                log_from=log_from)


def _worker_killed_mid_batch(loop: LoopSystem, fault_log, name: str, consumer: str, what: str) -> None:
    kill = loop.kill_while_holding(name, consumer)
    before = loop.steps()
    # The iteration it was killed in completes, and the next one too, with the remaining replica. Under
    # max_staleness 1 the pool holds groups enough for both before the lease ends, so the requeue is awaited too.
    after = loop.wait_steps(len(before) + 2)
    deadline = time.monotonic() + LEASE_S * 6
    while (requeued := loop.stats().requeued - kill.requeued_before) < len(kill.rows) and time.monotonic() < deadline:
        time.sleep(0.5)
    fault_log.check(
        loop.area, f"{what} ({name}) SIGKILLed while holding {len(kill.rows)} leased {consumer} rows, mid-iteration",
        f"its rows requeue when the {LEASE_S} s lease ends; the other replica finishes them; the iteration completes",
        f"{requeued} rows requeued; steps {before[-1] if before else 0} -> {after[-1]} completed",
        requeued >= len(kill.rows) and _each_step_once(after))


def _redis_restarted_on_its_aof(loop: LoopSystem, fault_log) -> None:
    before = loop.steps()
    # A crash at the moment the trainer holds this iteration's rows: with appendfsync everysec the
    # last second, its claim with it, could vanish and the same samples be handed out again.
    wait_for(lambda: loop.redis().hlen(loop.dock().keys.base + "owner:actor_train") > 0, 600,
             "the trainer to hold claimed rows", loop.procs["trainer"])
    held = loop.redis().hlen(loop.dock().keys.base + "owner:actor_train")
    before_stats = loop.stats()
    loop.stop_redis(signal.SIGKILL)  # no shutdown: only what was fsynced survives
    time.sleep(OUTAGE_S)
    loop.start_redis(aof=True)
    reloaded = loop.stats()
    after = loop.wait_steps(len(before) + 3)
    survivors = [name for name in ("rollout-0", "reward-0", "trainer") if loop.procs[name].poll() is None]
    fault_log.check(
        loop.area, f"Redis (AOF, appendfsync always) SIGKILLed while the trainer held {held} claimed rows, down {OUTAGE_S:.0f} s, "
              "restarted on its AOF",
        "every service reconnects with backoff; the run continues from the dock state of the crash, nothing a service "
        "was told succeeded is lost, no sample is handed out twice",
        f"dock reloaded with {reloaded.admitted_rows} admitted rows (had {before_stats.admitted_rows}), "
        f"{reloaded.retired_groups} retired groups (had {before_stats.retired_groups}); still running: {', '.join(survivors)}; "
        f"steps {before[-1]} -> {after[-1]}",
        len(survivors) == 3 and reloaded.admitted_rows >= before_stats.admitted_rows > 0
        and reloaded.retired_groups >= before_stats.retired_groups and _each_step_once(after))


def _each_step_once(steps: list[int]) -> bool:
    """The metrics log holds steps 1, 2, ... in order: none skipped, none trained twice."""
    return steps == list(range(1, len(steps) + 1))


def _at_a_checkpoint(loop: LoopSystem) -> int:
    """Waits until the last logged step has its checkpoint; returns that step."""
    wait_for(lambda: loop.steps() and loop.checkpoint_step() == loop.steps()[-1], 600, "a checkpoint of the last step",
             loop.procs["trainer"])
    return loop.steps()[-1]


def _trainer_killed_and_resumed(loop: LoopSystem, fault_log) -> None:
    saved = _at_a_checkpoint(loop)
    loop.kill("trainer")
    logged = len(loop.steps())
    served = loop.served_version("rollout-0")
    try:
        generated, refused = loop.generated_version("rollout-0", timeout_s=60), ""
    except grpc.RpcError as exc:
        # The kill broke a collective push mid-way (pushes overlap rollout under max_staleness 1): the model is a
        # mix of two versions, so the replica refuses to generate, at once, until the resumed trainer's push. A
        # request that arrived while the push had generation paused, before the transfer broke, is held with the
        # replica's other requests until that push instead (collective_receiver.py): it times out here while the
        # replica says why it holds generation (a loaded 2-core run put the probe in that window once).
        held = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and loop.weights_incomplete("rollout-0")
        if not held and (exc.code() != grpc.StatusCode.UNAVAILABLE or "weights incomplete" not in (exc.details() or "")):
            raise
        generated, refused = None, held or exc.details()
    log_before = len(loop.log("trainer"))
    loop.start_trainer(resume=True)
    # The resumed trainer drops the records of steps after its checkpoint (one an asynchronous trainer logged but did
    # not save), then records from saved + 1 on: the metrics log holds each step once.
    wait_for(lambda: "resumed from_step=" in loop.log("trainer")[log_before:], 600, "the trainer to resume", loop.procs["trainer"])
    resumed = re.search(r"resumed from_step=(\d+) records_dropped=(\d+)", loop.log("trainer")[log_before:])
    resumed_at, dropped = int(resumed.group(1)) + 1, int(resumed.group(2))
    after = loop.wait_steps(saved + 2)
    pushed = loop.served_version("rollout-0")
    # An asynchronous trainer needs no rollout wait to start step saved + 1, so it may have trained and pushed
    # it before the kill, unsaved: the resumed trainer then pushes its checkpoint's weights (version saved) first.
    orphan = served == saved + 1
    rolled_back = f"weights pushed version={saved} " in loop.log("trainer")[log_before:]
    fault_log.check(
        loop.area, f"the trainer SIGKILLed after the checkpoint of step {saved}, restarted with --resume",
        f"it continues at step {saved + 1}; the replica serves the last pushed version meanwhile ({saved}, or {saved + 1} "
        f"pushed but not saved, which the resumed trainer replaces with its checkpoint's {saved}) and takes the next push; "
        "on the collective path a push the kill broke mid-way leaves it refusing generation (UNAVAILABLE) until then",
        f"resumed at step {resumed_at} ({logged - saved} record(s) after the checkpoint, {dropped} dropped); "
        f"meanwhile the replica served version {served} "
        f"({f'Generate answered by {generated}' if refused == '' else f'Generate refused: {refused[:90]!r}'}); "
        f"{f'the resumed trainer pushed version {saved}: {rolled_back}; ' if orphan else ''}after the resume it serves {pushed}",
        resumed_at == saved + 1 and (served == generated or (refused and "collective" in loop.area))
        and (served == saved or (orphan and rolled_back))
        and pushed > saved and dropped == logged - saved and _each_step_once(after))


def _every_sample_accounted_for(loop: LoopSystem, fault_log, when: str, first_step: int, log_from: int) -> None:
    """Checks the dock's books against the steps trained since `first_step` (when this dock was made, the trainer's
    log at `log_from` characters)."""
    stats, steps = loop.stats(), loop.steps()
    trained_groups = (steps[-1] - first_step + 1) * GBS
    # Groups dropped unseen (a token older than version - max_staleness, or a row without a token) are retired too.
    # Counted from the trainer's log, not its records: an iteration the trainer kill cut short dropped some, unrecorded.
    dropped_groups = sum(int(rows) for rows in re.findall(r"(?:stale|failed) rows dropped rows=(\d+)",
                                                          loop.log("trainer")[log_from:])) // N
    # The last iteration's groups are acked, and retired when the next iteration begins.
    retired_ok = stats.retired_groups - dropped_groups in (trained_groups - GBS, trained_groups)
    fault_log.check(
        loop.area, f"accounting {when}",
        "every row that entered the dock is live or was trained once and retired; no row lost",
        f"{stats.admitted_rows} rows admitted = {stats.live_rows} live + {stats.retired_groups} retired groups x {N} "
        f"+ {stats.cleared_rows} cleared (unaccounted {stats.unaccounted_rows()}); {trained_groups} groups trained",
        stats.unaccounted_rows() == 0 and retired_ok)


def _redis_back_empty_without_aof(loop: LoopSystem, fault_log) -> tuple[int, int]:
    """Returns the first step trained on the new dock, and where the trainer's log stood when it was made."""
    saved = _at_a_checkpoint(loop)
    iters = loop.cfg.megatron_training.train_iters
    trainer = loop.procs["trainer"]
    loop.stop_redis(signal.SIGKILL)
    loop.start_redis(aof=False)  # comes back empty: the run's keys are gone
    wait_for(lambda: trainer.poll() is not None, 600, "the trainer to fail the iteration")
    log = loop.log("trainer")
    line = next((line for line in log.splitlines() if "the dock's state is gone" in line), "")
    message = line[line.find("iteration failed"):] if line else ""
    fault_log.check(
        loop.area, f"Redis SIGKILLed after step {saved} and restarted without AOF (empty)",
        f"the trainer fails iteration {saved + 1} with an error naming the lost dock and the checkpoint to resume from",
        f"exit {trainer.returncode}: {message}",
        trainer.returncode != 0 and f"step={saved + 1}" in message and f"checkpoint of step {saved}" in message)
    log_from = len(loop.log("trainer"))
    resumed = loop.start_trainer(resume=True)
    wait_for(lambda: resumed.poll() is not None, 900, "the resumed run to finish")
    after = loop.steps()
    counted = json.loads((loop.log_dir / "summary.json").read_text())["accounting"]
    fault_log.check(
        loop.area, "`dockrl trainer train --resume` after the empty Redis",
        f"continues from the checkpoint of step {saved} at step {saved + 1} and runs to step {iters}; its summary counts "
        "the samples of the steps it trained",
        f"exit {resumed.returncode}; steps after the resume: {after[saved:]}; summary: {counted['rows_trained']} rows trained "
        f"from step {counted['from_step']}",
        resumed.returncode == 0 and after[saved:] == list(range(saved + 1, iters + 1)) and _each_step_once(after)
        and counted["from_step"] == saved + 1 and counted["rows_trained"] == (iters - saved) * GBS * N)
    return saved + 1, log_from
