"""`dockrl reward serve` (gRPC server, optionally the dock worker) and `dockrl reward score` (try a rule)."""
from __future__ import annotations

import argparse
import contextlib
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` and `score` sub-commands and their flags."""
    sub = parser.add_subparsers(dest="reward_command", required=True, metavar="{serve,score}")
    serve = sub.add_parser("serve", help="run the reward gRPC server (and, with --dock, the dock worker)",
                           description="Serve Reward.Score / ListVerifiers and grpc.health.v1; verifications run in a "
                                       "process pool of rl_config.verifier_parallel workers, each bounded by "
                                       "rl_config.verifier_timeout. With reward_config.load set, the reward model "
                                       "(vLLM pooling runner) serves the reward_model verifier.")
    serve.add_argument("--config", help="run config YAML (default: configs/tiny_cpu.yaml)")
    serve.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one config key, e.g. --set rl_config.verifier_timeout=5 (repeatable)")
    serve.add_argument("--host", help="address to listen on (default: reward.host)")
    serve.add_argument("--port", type=int, help="gRPC port; 0 picks a free one (default: reward.grpc_port)")
    serve.add_argument("--dock", action="store_true",
                       help="also score the dock's completed response groups and put rm_scores back")
    serve.add_argument("--kind", choices=("rule", "model"), default="rule",
                       help="which part this replica scores in the dock when reward_config.model_replicas > 0: rule "
                            "(the rule verifiers, and the weighted sum once the model's part is in; it loads no reward "
                            "model) or model (the reward model alone; consumer model_reward). With model_replicas 0 only "
                            "rule is accepted, and it scores every part (default: rule)")
    serve.add_argument("--ready-file", default=None,
                       help="write {grpc_port, pid} as JSON here once the server accepts calls (how a launcher "
                            "learns the port that --port 0 bound)")

    score = sub.add_parser("score", help="score one response against a label and print each verifier's part",
                           description="Score one response the way training would: same verifiers, weights, "
                                       "timeout and overlong penalty as the config, or the ones given here.")
    score.add_argument("--label", required=True, help="the reference answer, e.g. 34 or '\\frac{1}{2}'")
    score.add_argument("--response", required=True, help="the response text; '-' reads it from stdin")
    score.add_argument("--prompt", default="", help="the prompt text before the response (read by reward_model only)")
    score.add_argument("--verifier", action="append", default=[], metavar="NAME",
                       help="a verifier to apply (repeatable; default: rl_config.verifier_function); "
                            "names: format, strict_format, base_acc, acc, math_17k_acc, acc_for_ppo, math_verify, math_verify_reward, "
                            "acc_for_dapo, step, "
                            "and reward_model (the config's reward_config.load)")
    score.add_argument("--weight", action="append", type=float, default=[], metavar="W",
                       help="weight of the matching --verifier (repeatable; default 1.0 each)")
    score.add_argument("--response-length", type=int, default=0,
                       help="response length in tokens, for the overlong penalty (default 0: no penalty)")
    score.add_argument("--config", help="run config YAML for the defaults (default: configs/tiny_cpu.yaml)")
    score.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one config key, e.g. --set rl_config.overlong_buffer_enable=true (repeatable)")
    score.add_argument("--server", metavar="HOST:PORT", help="score through a running reward server instead of locally")


def run(args: argparse.Namespace) -> int:
    """Runs the chosen sub-command; 2 on a bad config or argument."""
    from services.common.config import ConfigError, load_config
    from services.common.errors import DockrlError

    try:
        cfg = load_config(args.config, args.overrides)
        if args.reward_command == "serve":
            return _serve(cfg, args)
        return _score(cfg, args)
    except (ConfigError, DockrlError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the port is taken
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _serve(cfg, args: argparse.Namespace) -> int:
    import signal
    import threading

    from services.common.errors import FailedPrecondition
    from services.common.grpc_serving import advertised_address
    from services.common.log import log_event, setup_logging
    from services.common.ready_file import write_ready_file
    from services.reward.pool import VerifierPool
    from services.reward.server import start_server
    from services.reward.worker import RewardWorker

    split = cfg.reward_config.model_replicas > 0
    if args.kind == "model" and not split:
        raise FailedPrecondition("--kind model: reward_config.model_replicas is 0, so every reward replica serves the reward "
                                 "model itself; set it > 0 to run reward-model replicas apart")
    logger = setup_logging("reward-model" if args.kind == "model" else "reward")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # A rule replica of a split run loads no reward model: that is what the reward-model replicas are
    # for; its gRPC Score calls that list reward_model get that part from one of them.
    with (VerifierPool(cfg.rl_config.verifier_parallel, cfg.rl_config.verifier_timeout) as pool,
          _reward_model(cfg, args.kind == "model" or not split) as model, _remote_model(cfg, args.kind == "rule" and split) as remote):
        # a bad dock config fails before serving
        worker = RewardWorker.from_config(cfg, pool, model, args.kind) if args.dock else None
        host = args.host or cfg.reward.host
        server = start_server(cfg, pool, host, cfg.reward.grpc_port if args.port is None else args.port, model or remote)
        if cfg.reward.metrics_port:
            import prometheus_client

            from services.common.metrics import REGISTRY

            prometheus_client.start_http_server(cfg.reward.metrics_port, addr=host, registry=REGISTRY)
        # the file first: whoever reads the line may look for the file at once
        if args.ready_file:
            write_ready_file(args.ready_file, grpc_port=server.port)
        print(f"reward server listening on {host}:{server.port}", flush=True)
        worker_thread, worker_failed = None, threading.Event()

        def run_worker() -> None:
            # A worker that dies must take the process down: a server that only answers gRPC would
            # stall the run where a supervisor (`dockrl up`, compose, k8s) can restart a dead one.
            try:
                worker.run_until(stop, advertised_address(host, server.port))
            except Exception:
                logger.exception("reward dock worker failed; stopping the server")
                worker_failed.set()
                stop.set()

        if worker is not None:
            worker_thread = threading.Thread(target=run_worker, name="reward-dock-worker", daemon=True)
            worker_thread.start()
        stop.wait()
        log_event(logger, "reward server stopping")
        server.stop()
        if worker_thread is not None:
            worker_thread.join(30)
    return 1 if worker_failed.is_set() else 0


@contextlib.contextmanager
def _reward_model(cfg, wanted: bool = True):
    """The reward model's engine when `wanted` and reward_config.load is set (else None), stopped on exit."""
    if not (wanted and cfg.reward_config.load):
        yield None
        return
    from services.reward.model import RewardModelScorer

    with RewardModelScorer.start(cfg) as model:
        yield model


@contextlib.contextmanager
def _remote_model(cfg, wanted: bool):
    """A rule replica's way to a split run's reward-model replicas (through the run's registry), or None."""
    if not wanted:
        yield None
        return
    from services.common.auth import resolve_token
    from services.dock.client import Dock
    from services.reward.client import RemoteRewardModel

    dock = Dock.from_config(cfg, token=resolve_token(cfg.auth))
    with RemoteRewardModel(dock.registry(cfg.rollout.heartbeat_ttl_s)) as remote:
        yield remote


def _score(cfg, args: argparse.Namespace) -> int:
    from services.reward.math_answer import extract_answer, minerva_answer
    from services.reward.pool import VerifierPool
    from services.reward.scoring import ScoreInput, ScoringPlan, score_samples

    response = sys.stdin.read() if args.response == "-" else args.response
    verifiers = args.verifier or list(cfg.rl_config.verifier_function)
    weights = args.weight or ([1.0] * len(verifiers) if args.verifier else list(cfg.rl_config.verifier_weight))
    sample = ScoreInput(response, args.label, args.response_length, args.prompt)
    if args.server:
        import grpc

        from services.reward.client import RewardClient

        with RewardClient(args.server) as client:
            try:
                (result,) = client.score([sample], verifiers, weights)
            except grpc.RpcError as exc:
                print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 2 if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    else:
        plan = ScoringPlan.create(verifiers, weights, ScoringPlan.from_rl_config(cfg.rl_config).overlong)
        with VerifierPool(1, cfg.rl_config.verifier_timeout) as pool, _reward_model(cfg, plan.uses_model) as model:
            (result,) = score_samples([sample], plan, pool, model)
    print(f"extracted answer: {extract_answer(response)!r}   Minerva 'Answer:' line: {minerva_answer(response)!r}")
    for weight, part in zip(weights, result.parts):
        flag = "   (timed out: the verifier's timeout score)" if part.timed_out else ""
        print(f"{part.name:>14}: {part.score:+.4f} x {weight:g}{flag}")
    print(f"{'overlong':>14}: {result.overlong_penalty:+.4f}")
    print(f"{'total':>14}: {result.total:+.4f}")
    return 0
