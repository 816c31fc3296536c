"""UpdateWeights bytes/s into a running rollout server vs. a raw loopback TCP socket moving the same bytes.

The push is the full model (every tensor, bucketed and chunked as the trainer sends it) and its
time includes validation, staging in the vLLM worker and the in-place reload with generation
paused. The raw socket sends the same bytes in the same chunk size to a reader that discards them:
the floor any transport over loopback could reach. Prints medians and the ratio.

    python bench/bench_weight_sync.py --quick
"""
from __future__ import annotations

import argparse
import pathlib
import socket
import statistics
import sys
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def raw_socket_seconds(payloads: list[bytes]) -> float:
    """Seconds to move `payloads` through a loopback TCP connection to a discarding reader."""
    total = sum(len(p) for p in payloads)
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def drain():
        conn, _ = listener.accept()
        received = 0
        with conn:
            while received < total:
                data = conn.recv(1 << 20)
                if not data:
                    break
                received += len(data)
        done.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    with socket.create_connection(listener.getsockname()) as sender:
        start = time.perf_counter()
        for payload in payloads:
            sender.sendall(payload)
        done.wait()
        seconds = time.perf_counter() - start
    listener.close()
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a ~14 MB model, 3 repetitions")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of the generated model (128: the tiny model; else head_dim 64)")
    parser.add_argument("--layers", type=int, default=8, help="layers of the generated model")
    parser.add_argument("--bucket-mb", type=float, default=16, help="bucket size")
    parser.add_argument("--chunk-mb", type=float, default=4, help="chunk (message) size")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (medians reported)")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.reps = 256, 4, 3

    import grpc
    from safetensors.torch import load_file

    from rollout_bench_model import build_bench_model
    from services.common.pb import rollout_pb2_grpc
    from services.rollout.launcher import spawn_replica
    from services.rollout.weight_chunks import weight_chunks

    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-weights-"))
    model = build_bench_model(work / "model", args.hidden, args.layers)
    state = sorted(load_file(str(model / "model.safetensors")).items())
    bucket, chunk = int(args.bucket_mb * 2**20), int(args.chunk_mb * 2**20)
    chunks = list(weight_chunks(state, 1, bucket, chunk))
    total = sum(len(c.data) for c in chunks)
    print(f"model: hidden={args.hidden} layers={args.layers} tensors={len(state)} bytes={total / 1e6:.1f} MB "
          f"buckets={chunks[0].num_buckets} chunks={len(chunks)} reps={args.reps}", flush=True)

    replica = spawn_replica(model, work, "bench", ["generate_config.dtype=float32", "rollout.omp_threads_bind=nobind"], "bench", ENV).wait()
    push_times, server_times, apply_times, raw_times = [], [], [], []
    try:
        channel = grpc.insecure_channel(replica.grpc_target, options=[("grpc.max_send_message_length", 64 << 20)])
        stub = rollout_pb2_grpc.RolloutStub(channel)
        for version in range(args.reps + 1):  # the first push is a warm-up
            for c in chunks:
                c.version = version + 1
            start = time.perf_counter()
            response = stub.UpdateWeights(iter(chunks))
            seconds = time.perf_counter() - start
            assert response.bytes_received == total and response.version == version + 1
            raw = raw_socket_seconds([c.data for c in chunks])
            if version:
                push_times.append(seconds)
                server_times.append(response.seconds)
                apply_times.append(response.apply_seconds)
                raw_times.append(raw)
    finally:
        replica.stop()

    def mbps(times):
        return total / statistics.median(times) / 1e6

    print(f"{'path':<34}{'median MB/s':>12}{'vs raw':>9}")
    for name, times in (("raw loopback socket", raw_times), ("UpdateWeights (client wall time)", push_times),
                        ("UpdateWeights (server-side time)", server_times),
                        ("  of which receive + stage", [s - a for s, a in zip(server_times, apply_times)]),
                        ("  of which apply (paused)", apply_times)):
        print(f"{name:<34}{mbps(times):>12.1f}{mbps(times) / mbps(raw_times):>8.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
