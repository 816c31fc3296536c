"""`dockrl reward serve` (gRPC server, optionally the dock worker) and `dockrl reward score` (try a rule)."""
from __future__ import annotations

import argparse
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
                            "acc_for_dapo, step, sandbox_fusion (reward.sandbox_address), "
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
    from services.reward.server import serve

    return serve(cfg, args.kind, args.dock, args.host, args.port, args.ready_file)


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
        from services.reward.code_tests import code_sandbox
        from services.reward.server import reward_model

        plan = ScoringPlan.create(verifiers, weights, ScoringPlan.from_rl_config(cfg.rl_config).overlong)
        with VerifierPool(1, cfg.rl_config.verifier_timeout, code_sandbox(cfg)) as pool, reward_model(cfg, plan.uses_model) as model:
            (result,) = score_samples([sample], plan, pool, model)
    print(f"extracted answer: {extract_answer(response)!r}   Minerva 'Answer:' line: {minerva_answer(response)!r}")
    for weight, part in zip(weights, result.parts):
        flag = "   (timed out: the verifier's timeout score)" if part.timed_out else ""
        print(f"{part.name:>14}: {part.score:+.4f} x {weight:g}{flag}")
    print(f"{'overlong':>14}: {result.overlong_penalty:+.4f}")
    print(f"{'total':>14}: {result.total:+.4f}")
    return 0
