"""Draws profiler traces (Chrome trace JSON, as dockrl's profilers write them) as one picture: a row per
trace, its named ranges (torch.profiler.record_function: the trainer's stages, vLLM's model steps)
as bars at wall-clock time, nested ranges below their parents. docs/trainer.md's profiling picture
comes from it; Perfetto (ui.perfetto.dev) shows the same traces with every operator.

    python scripts/draw_trace.py --out docs/images/profiler_trace.png \
        trainer=RUN/traces/rank0/rank0_step2.*.pt.trace.json rollout=RUN/traces/rollout/*/step2_*.json \
        reward=RUN/traces/reward/*/reward_step2.*.pt.trace.json
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys


def named_ranges(trace: pathlib.Path, limit: int) -> list[tuple[str, float, float, int]]:
    """(name, start_us, duration_us, depth) of the trace's record_function ranges (its `user_annotation`
    events; top-level operators when it has none), longest first up to `limit`."""
    data = json.loads(trace.read_text())
    base = float(data.get("baseTimeNanoseconds", 0)) / 1e3  # kineto's ts count from it: traces of other processes line up
    events = [{**e, "ts": base + float(e["ts"])} for e in data["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    ranges = [e for e in events if e.get("cat") == "user_annotation"] or [e for e in events if e.get("cat") == "cpu_op"]
    ranges = sorted(ranges, key=lambda e: -float(e["dur"]))[:limit]
    ranges.sort(key=lambda e: float(e["ts"]))
    out, open_ends = [], []
    for e in ranges:
        start, dur = float(e["ts"]), float(e["dur"])
        open_ends = [end for end in open_ends if end > start]  # the ranges this one sits inside
        out.append((e["name"], start, dur, len(open_ends)))
        open_ends.append(start + dur)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", metavar="LABEL=TRACE", help="a row's label and its Chrome trace file")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--ranges", type=int, default=40, help="longest named ranges drawn per trace (default 40)")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for item in args.traces:
        label, _, path = item.partition("=")
        if not path or not pathlib.Path(path).is_file():
            p.error(f"{item!r}: expected LABEL=TRACE with an existing trace file")
        rows.append((label, named_ranges(pathlib.Path(path), args.ranges)))
    origin = min(start for _, ranges in rows for _, start, _, _ in ranges)
    span_ms = max((start + dur - origin) / 1e3 for _, ranges in rows for _, start, dur, _ in ranges)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 1.1 * len(rows)))
    colors = plt.get_cmap("tab20").colors
    names = sorted({name for _, ranges in rows for name, *_ in ranges})
    for row, (label, ranges) in enumerate(rows):
        for name, start, dur, depth in ranges:
            y = row + depth * 0.22
            ax.barh(y, dur / 1e3, left=(start - origin) / 1e3, height=0.2, color=colors[names.index(name) % len(colors)],
                    edgecolor="black", linewidth=0.3)
            if dur / 1e3 > 0.04 * span_ms:  # room for its name
                ax.text((start - origin) / 1e3, y, f" {name}", va="center", fontsize=7, clip_on=True)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first range")
    ax.set_title("profiled step: named ranges per trace (open the traces in ui.perfetto.dev for every operator)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
