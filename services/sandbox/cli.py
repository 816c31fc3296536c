"""`dockrl sandbox serve`: the code sandbox gRPC server (and its entry in the run's replica registry)."""
from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` sub-command and its flags."""
    sub = parser.add_subparsers(dest="sandbox_command", required=True, metavar="{serve}")
    serve = sub.add_parser("serve", help="run the sandbox gRPC server",
                           description="Serve Sandbox.Execute / ExecuteBatch and grpc.health.v1: each program runs under "
                                       "bubblewrap with the sandbox.* limits, sandbox.workers at once (docs/sandbox.md).")
    serve.add_argument("--config", help="run config YAML (default: configs/tiny_cpu.yaml)")
    serve.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one config key, e.g. --set sandbox.wall_s=5 (repeatable)")
    serve.add_argument("--host", help="address to listen on (default: sandbox.host)")
    serve.add_argument("--port", type=int, help="gRPC port; 0 picks a free one (default: sandbox.grpc_port + --replica-index)")
    serve.add_argument("--replica-index", type=int, default=0,
                       help="this replica's index below sandbox.replicas: its default port and its range of host uids "
                            "follow from it, so replicas on one machine share neither (default: 0)")
    serve.add_argument("--dock", action="store_true",
                       help="list this replica in the run's replica registry (kind sandbox) while it serves")
    serve.add_argument("--ready-file", default=None,
                       help="write {grpc_port, pid} as JSON here once the server accepts calls (how a launcher "
                            "learns the port that --port 0 bound)")


def run(args: argparse.Namespace) -> int:
    """Runs the chosen sub-command; 2 on a bad config or argument, 1 when the port cannot be bound."""
    from services.common.config import ConfigError, load_config
    from services.common.errors import DockrlError
    from services.sandbox.server import serve

    try:
        cfg = load_config(args.config, args.overrides)
        return serve(cfg, args.host, args.port, args.replica_index, args.dock, args.ready_file)
    except (ConfigError, DockrlError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the port is taken
        print(f"error: {exc}", file=sys.stderr)
        return 1
