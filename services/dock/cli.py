"""`dockrl dock stats|inspect|clear`: look at (or empty) a run's pool in Redis."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dockrl dock`: which Redis and run, then one of stats / inspect / clear."""
    parser.add_argument("--config", default=None, help="run config YAML; its dock section gives the defaults below")
    parser.add_argument("--redis-url", default=None, help="Redis URL (default: dock.redis_url of the config, else redis://127.0.0.1:6379/0)")
    parser.add_argument("--prefix", default=None, help="key prefix of the run (default: dock.prefix, 'dockrl')")
    parser.add_argument("--run-id", default=None, help="run id under the prefix (default: dock.run_id)")
    parser.add_argument("--token", default=None, help="the run's shared token for clear (default: auth.token or $DOCKRL_TOKEN)")
    commands = parser.add_subparsers(dest="dock_command", required=True, metavar="{stats,inspect,clear}")
    stats = commands.add_parser("stats", help="rows, ready columns, consumed / leased rows per consumer, requeued, ages, replicas")
    stats.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    inspect = commands.add_parser("inspect", help="print the stored values of some rows")
    inspect.add_argument("--rows", default="0:8", help="row range START:STOP or a comma list (default 0:8)")
    inspect.add_argument("--columns", default="", help="comma-separated columns (default: every column)")
    inspect.add_argument("--width", type=int, default=8, help="values shown per array before '...' (default 8)")
    clear = commands.add_parser("clear", help="empty the pool (changes data: needs the run's token when one is set)")
    clear.add_argument("--all", action="store_true", help="also delete the layout, so the trainer must create the dock again")
    clear.add_argument("--yes", action="store_true", help="required: confirms the run's samples may be deleted")


def _open(args: argparse.Namespace):
    from services.common.auth import resolve_token
    from services.common.config import Config, load_config
    from services.dock.client import Dock, redis_client

    cfg = load_config(args.config) if args.config else Config()
    # Behind sentinels (dock.redis_sentinels) the client asks them for the primary unless a URL is given.
    url = args.redis_url or cfg.dock.redis_url or ("" if cfg.dock.redis_sentinels else "redis://127.0.0.1:6379/0")
    dock_cfg = dataclasses.replace(cfg.dock, prefix=args.prefix or cfg.dock.prefix, run_id=args.run_id or cfg.dock.run_id)
    token = args.token if args.token is not None else resolve_token(cfg.auth)
    client = redis_client(dock_cfg, url)
    return Dock(client, dock_cfg.prefix, dock_cfg.run_id, token, dock_cfg.lease_seconds), cfg.rollout.heartbeat_ttl_s


def _parse_rows(text: str, capacity: int) -> list[int]:
    from services.common.errors import InvalidArgument

    try:
        if ":" in text:
            start, _, stop = text.partition(":")
            return list(range(int(start or 0), min(int(stop) if stop else capacity, capacity)))
        return [int(part) for part in text.split(",") if part]
    except ValueError:
        raise InvalidArgument("--rows", f"{text!r} is not START:STOP or a comma list of integers") from None


def _short(value, width: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:40] + "...")
    flat = value.reshape(-1)
    shown = ", ".join(f"{v:.4g}" if value.dtype.kind == "f" else str(v) for v in flat[:width])
    return f"{value.dtype}{list(value.shape)}[{shown}{', ...' if flat.size > width else ''}]"


def _print_stats(dock, ttl_s: float, as_json: bool) -> None:
    stats = dock.stats()
    replicas = dock.registry(ttl_s).live()
    if as_json:
        print(json.dumps({**dataclasses.asdict(stats), "replicas": [dataclasses.asdict(r) for r in replicas]}))
        return
    print(f"run {stats.run}: {stats.live_rows}/{stats.capacity_rows} rows live, n={stats.n_samples_per_prompt}, "
          f"complete groups {stats.complete_groups}/{stats.target_groups}, requeued {stats.requeued}, retired groups {stats.retired_groups}")
    print(f"rows:     admitted {stats.admitted_rows}, cleared {stats.cleared_rows}, unaccounted {stats.unaccounted_rows()}")
    print("ready:    " + "  ".join(f"{name}={count}" for name, count in stats.ready.items() if count))
    for consumer in stats.consumed:
        print(f"consumer {consumer}: consumed {stats.consumed[consumer]}, leased {stats.leased[consumer]}")
    print("ages:     " + ("  ".join(f"age {age}: {groups} groups" for age, groups in stats.groups_by_age.items()) or "-"))
    for replica in replicas:
        print(f"replica  {replica.replica_id} ({replica.kind}) at {replica.address}, version {replica.version}")


def run(args: argparse.Namespace) -> int:
    """Runs one dock command; prints a one-line error and returns 1 for a dock error."""
    from services.common.config import ConfigError
    from services.common.errors import DockrlError

    try:
        dock, ttl_s = _open(args)
        if args.dock_command == "stats":
            _print_stats(dock, ttl_s, args.json)
        elif args.dock_command == "inspect":
            columns = [c for c in args.columns.split(",") if c] or [c.name for c in dock.layout.columns]
            rows = _parse_rows(args.rows, dock.layout.capacity_rows)
            values = dock.read(rows, columns)
            for i, row in enumerate(rows):
                print(f"row {row}: " + "  ".join(f"{name}={_short(values[name][i], args.width)}" for name in columns))
        else:
            if not args.yes:
                print("dock clear deletes the run's samples; add --yes to confirm", file=sys.stderr)
                return 2
            dock.destroy() if args.all else dock.clear()
            print(f"cleared {dock.keys.base.rstrip(':')}" + (" (layout too)" if args.all else ""))
        return 0
    except (DockrlError, ConfigError) as exc:
        print(f"dockrl dock {args.dock_command}: {exc}", file=sys.stderr)
        return 1
