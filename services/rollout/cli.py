"""Rollout server commands: `serve` runs one replica (gRPC + HTTP on one engine)."""
from __future__ import annotations

import argparse

from services.common.config import DEFAULT_CONFIG


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the rollout sub-commands to `parser` (no heavy imports here)."""
    sub = parser.add_subparsers(dest="rollout_command", required=True)
    serve = sub.add_parser("serve", help="serve a model over gRPC and OpenAI-compatible HTTP", description="Serve a model over gRPC and OpenAI-compatible HTTP from one vLLM engine.")
    serve.add_argument("--model", required=True, help="Hugging Face model directory to serve (config.json, *.safetensors, tokenizer)")
    serve.add_argument("--config", default=str(DEFAULT_CONFIG), help="dockrl YAML config; generate_config, rollout and auth apply (default: %(default)s)")
    serve.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one config key; repeatable")
    serve.add_argument("--host", default=None, help="address to bind (default: rollout.host)")
    serve.add_argument("--grpc-port", type=int, default=None, help="gRPC port, 0 picks a free one (default: rollout.grpc_port)")
    serve.add_argument("--http-port", type=int, default=None, help="HTTP port, 0 picks a free one (default: rollout.http_port)")
    serve.add_argument("--served-model-name", default=None, help="model name clients must send (default: rollout.served_model_name, else the model directory's name)")
    serve.add_argument("--dock", default=None, metavar="REDIS_URL", help="also work for the dock at this Redis (redis://host:port/db), or at the one the config names (`config`: dock.redis_url, or the primary dock.redis_sentinels name): claim prompts, generate, put responses back; the run is dock.prefix / dock.run_id of the config")
    serve.add_argument("--ready-file", default=None, help="write {grpc_port, http_port, pid} as JSON here once both servers accept calls")


def run(args: argparse.Namespace) -> int:
    """Runs the chosen sub-command; returns the exit status."""
    import asyncio
    import logging
    import os
    import sys

    from services.common.config import load_config
    from services.common.log import setup_logging
    from services.rollout.server import ServeOptions, serve

    setup_logging("rollout")
    cfg = load_config(args.config, args.overrides)  # a ConfigError is reported by the entry point (exit_status)
    options = ServeOptions(
        model=args.model,
        host=args.host if args.host is not None else cfg.rollout.host,
        grpc_port=args.grpc_port if args.grpc_port is not None else cfg.rollout.grpc_port,
        http_port=args.http_port if args.http_port is not None else cfg.rollout.http_port,
        served_model_name=args.served_model_name or "",
        ready_file=args.ready_file,
        dock_url=args.dock or "",
    )
    code = asyncio.run(serve(cfg, options))
    # Everything is stopped (serve's last step stops the engine). What interpreter finalization would still
    # do is collect the heap and have nanobind report triton's extension objects as leaked (vLLM imports
    # triton on CPU too: dozens of lines on every exit), so the replica leaves here, its output flushed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
