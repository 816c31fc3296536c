"""Weight push of a whole model to 1, 2 and 4 rollout replicas, fan-out vs. chain vs. the collective
path, per bucket size, against a raw loopback TCP socket moving the same bytes.

The push is the trainer's own (`services.trainer.weights.weight_push.push_weights`: buckets of
`--buckets` MiB packed in a thread ahead of the wire, 4 MiB gRPC messages) into real rollout
servers, and its time runs until every replica serves the new version: receive, staging in the
vLLM worker, and the reload with generation paused. Fan-out sends one stream per replica; chain
sends one stream to the first replica, which forwards each chunk down the chain as it arrives.
Collective (`services.trainer.weights.collective_push.CollectiveSender`, trainer.weight_transport
collective) keeps gRPC for the control and broadcasts each bucket's tensors over a gloo group per
replica, with no packing copy, each loaded into the model as it arrives; its groups are built in
the warm-up and kept, as in a run. Its column "peak MB" is the median over pushes of the largest
extra resident memory a replica's worker reached while receiving.
The raw socket sends the model's bytes once, in the same message size, to a reader that discards
them: the floor any transport over loopback could reach. Every configuration and the raw socket
run once per repetition, interleaved; the figures are medians.

Goals: a push to 4 replicas takes at most 1.3x a push to 1; the collective push to 1 replica moves
at least 0.5 of the raw socket's bytes/s.

    python bench/bench_weight_sync.py --quick      # ~14 MB model, 1 and 2 replicas, 1 and 16 MiB buckets (CI)
    python bench/bench_weight_sync.py              # ~100 MB model, 1/2/4 replicas, 1/16/128 MiB buckets
    python bench/bench_weight_sync.py --device cuda  # Qwen2.5-0.5B-size model (bf16) on a GPU
"""
from __future__ import annotations

import itertools
import socket
import sys
import threading
import time

from common import QWEN25_05B, add_device_arg, build_model, engine_env, engine_overrides, interleaved, machine_line, median
from common import model_size, paired, parser, progress, ratio, start_replicas, stop_all, work_dir

GOAL = 1.3
COLLECTIVE_GOAL = 0.5  # raw socket time / collective push to 1 replica time
MODES = ("fanout", "chain", "collective")
MESSAGE_BYTES = 4 << 20  # the pusher's gRPC message size (services/trainer/weights/weight_push.py)


def raw_socket_seconds(total: int, message: bytes) -> float:
    """Seconds to move `total` bytes in `message`-sized sends through a loopback TCP connection to a discarding reader."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def drain():
        conn, _ = listener.accept()
        received = 0
        with conn:
            while received < total and (data := conn.recv(1 << 20)):
                received += len(data)
        done.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    with socket.create_connection(listener.getsockname()) as sender:
        start = time.perf_counter()
        for offset in range(0, total, len(message)):
            sender.sendall(message[:min(len(message), total - offset)])
        done.wait()
        seconds = time.perf_counter() - start
    listener.close()
    return seconds


def main() -> int:
    p = parser(__doc__, "~14 MB model, 1 and 2 replicas, 1 and 16 MiB buckets, 3 repetitions (CI)")
    add_device_arg(p)
    p.add_argument("--hidden", type=int, default=512, help="CPU: hidden size of the built model (128: the tiny model; else head_dim 64)")
    p.add_argument("--layers", type=int, default=8, help="CPU: layers of the built model")
    p.add_argument("--replicas", type=int, nargs="+", default=None, help="replica counts to push to (default 1 2 4; --quick 1 2)")
    p.add_argument("--buckets", type=float, nargs="+", default=None, help="bucket sizes in MiB (default 1 16 128; --quick 1 16)")
    args = p.parse_args()
    if args.quick:
        args.hidden, args.layers = 256, 4
    reps = args.reps or (3 if args.quick else 5)
    counts = args.replicas or ([1, 2] if args.quick else [1, 2, 4])
    buckets = args.buckets or ([1, 16] if args.quick else [1, 16, 128])
    size = QWEN25_05B if args.device == "cuda" else model_size(args.hidden, args.layers)
    dtype = "float32" if args.device == "cpu" else "bfloat16"

    import torch
    from safetensors.torch import load_file

    from services.trainer.weights.collective_push import CollectiveSender
    from services.trainer.weights.weight_push import push_weights

    work = work_dir("weights")
    model = build_model(work / "model", size)
    state = {name: t.to(getattr(torch, dtype)) if t.is_floating_point() else t
             for name, t in sorted(load_file(str(model / "model.safetensors")).items())}
    total = sum(t.numel() * t.element_size() for t in state.values())
    progress(f"model {size.describe()} on {args.device}: {len(state)} tensors, {total / 1e6:.1f} MB ({dtype}); "
             f"replicas {counts}, buckets {buckets} MiB, {reps} reps")

    names = [f"r{i}" for i in range(max(counts))]
    replicas = start_replicas(model, work, dict.fromkeys(names, engine_overrides(args.device, len(names), dtype)), engine_env(args.device))
    addresses = [r.grpc_target for r in replicas]
    version = itertools.count(1)
    # a bounded wait: a replica whose engine died mid-push (e.g. killed for memory) must fail the run, not hang it
    collective = CollectiveSender(token="", stall_s=300.0, host="127.0.0.1")
    peaks: dict[tuple, list[int]] = {}  # config -> per push, the largest replica's peak extra memory (collective)

    def push(k: int, mode: str, bucket_mb: float):
        """A path that pushes the model to the first `k` replicas and returns the push's seconds."""
        def run() -> float:
            if mode == "collective":
                result = collective.push(state, addresses[:k], next(version), bucket_mb=bucket_mb)
                peaks.setdefault((k, mode, bucket_mb), []).append(result.replica_peak_extra_bytes)
            else:
                result = push_weights(state, addresses[:k], next(version), bucket_mb=bucket_mb, mode=mode, timeout_s=300)
            assert not result.failed and result.replicas_updated == k, result
            return result.seconds
        return run

    # k = 1 is the same push in fan-out and chain: measured once, as fan-out
    configs = {(k, mode, b): push(k, mode, b) for b in buckets for k in counts for mode in MODES if k > 1 or mode != "chain"}
    message = bytes(MESSAGE_BYTES)
    paths = {"raw socket": lambda: raw_socket_seconds(total, message)}
    paths.update({f"{mode} x{k} {b:g} MiB": run for (k, mode, b), run in configs.items()})
    try:
        times = interleaved(paths, reps, warmups=1)
    finally:
        collective.close()
        stop_all(replicas)

    def one_replica(mode: str, b: float) -> str:
        """The push to 1 replica a `mode` push is compared with: its own for collective, fan-out's for gRPC (chain is fan-out at 1)."""
        return f"{'collective' if mode == 'collective' else 'fanout'} x1 {b:g} MiB"

    raw = median(times["raw socket"])
    print(machine_line())
    print(f"raw loopback socket: {raw:.3f} s for {total / 1e6:.1f} MB, {total / raw / 1e6:,.0f} MB/s")
    print(f"{'mode':<11}{'replicas':>9}{'bucket MiB':>11}{'median s':>10}{'MB/s delivered':>16}{'vs raw':>8}{'vs x1':>7}{'peak MB':>9}")
    for (k, mode, b) in configs:
        seconds = median(times[f"{mode} x{k} {b:g} MiB"])
        one = median(times[one_replica(mode, b)])
        peak = f"{median(peaks[(k, mode, b)]) / 1e6:>9.1f}" if mode == "collective" else f"{'-':>9}"
        print(f"{mode:<11}{k:>9}{b:>11g}{seconds:>10.3f}{k * total / seconds / 1e6:>16,.0f}{raw / seconds:>8.3f}{seconds / one:>7.2f}{peak}")
    for b in buckets:
        ratio(f"raw socket / push to 1 replica time, {b:g} MiB buckets", paired(times, "raw socket", f"fanout x1 {b:g} MiB"))
        ratio(f"raw socket / collective push to 1 replica time, {b:g} MiB buckets", paired(times, "raw socket", f"collective x1 {b:g} MiB"),
              at_least=COLLECTIVE_GOAL)
        ratio(f"replica peak extra memory / bucket size, collective, {b:g} MiB buckets",
              max(median(peaks[(k, "collective", b)]) for k in counts) / (b * 2**20))
        for k, mode in itertools.product(counts[1:], MODES):
            ratio(f"push to {k} / push to 1 replica time, {mode}, {b:g} MiB buckets",
                  paired(times, f"{mode} x{k} {b:g} MiB", one_replica(mode, b)),
                  at_most=GOAL if k == 4 else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
