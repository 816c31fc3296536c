"""`dockrl up` (the whole system on one machine), `dockrl prepare` and `dockrl health`."""
from __future__ import annotations

import argparse
import sys


def add_up_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dockrl up`."""
    parser.add_argument("config", nargs="?", default=None, help="run config YAML (default: the embedded configs/tiny_cpu.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key, e.g. --set rollout.replicas=2 (repeatable)")
    parser.add_argument("--resume", action="store_true", help="continue the trainer from its last checkpoint")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for every service to answer health checks")


def add_prepare_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dockrl prepare`."""
    parser.add_argument("--config", default=None, help="run config YAML (default: the embedded configs/tiny_cpu.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key (repeatable)")


def add_health_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dockrl health`."""
    parser.add_argument("address", help="HOST:PORT of a dockrl gRPC server")
    parser.add_argument("--service", default="", help="service name to ask about ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds before the probe gives up")


def run_prepare(args: argparse.Namespace) -> int:
    """Builds the tiny model, data and warm start the config asks for, when missing."""
    from services.common.config import load_config
    from services.common.log import setup_logging
    from services.launch.prepare import prepare_run

    setup_logging("prepare")
    for line in prepare_run(load_config(args.config, args.overrides)) or ["nothing to prepare"]:
        print(line)
    return 0


def run_health(args: argparse.Namespace) -> int:
    """Exit 0 when the server answers SERVING."""
    import grpc

    from services.launch.health_probe import probe

    try:
        status = probe(args.address, args.service, args.timeout)
    except grpc.RpcError as exc:
        print(f"{args.address}: {exc.code().name}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


def run_up(args: argparse.Namespace) -> int:
    """Starts Redis (when the config names none), rollout, reward and trainer; waits for the trainer."""
    from services.launch.up import up

    return up(args.config, args.overrides, resume=args.resume, start_timeout_s=args.start_timeout)


COMMANDS = {
    "up": (add_up_arguments, run_up, "run the whole system on this machine: Redis, rollout, reward, trainer"),
    "prepare": (add_prepare_arguments, run_prepare, "build the tiny model, demo data and warm start a config needs"),
    "health": (add_health_arguments, run_health, "probe a dockrl gRPC server's grpc.health.v1 status"),
}

