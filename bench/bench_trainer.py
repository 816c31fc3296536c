"""The trainer at data parallel 2 vs 1 on megatron-core's DDP and distributed optimizer: memory and throughput.

Each repetition starts the same worker under torchrun three ways, in turn, on the same weights
and the same GRPO batch (64 samples of up to 48 tokens, rewards 0/1, fp32, one mini-batch,
micro-batches of 8), 1 thread per rank:

- dp1: one rank; dp2: two ranks with the distributed optimizer (the default); dp2-replicated:
  two ranks with `use_distributed_optimizer: false`.

Each worker runs a warm-up update, then times `update_policy` (the forward, backward, gradient
reduce and optimizer step of its share of every mini-batch) and reports:

- Adam state bytes per rank (exp_avg and exp_avg_sq of the parameters it holds; in fp32 the main
  weights are the model's own, so nothing more): issue 25's goal, distributed / replicated at DP 2 <= 0.6;
- the weight gather for a push, streamed bucket by bucket (`stream_hf_weights`, buckets of 1/8 of the
  model so it spans several): the most tensor bytes alive at once while a consumer takes its buckets
  one by one (tests/unit/trainer_helpers.py's peak_extra_tensor_bytes: storages the garbage collector
  sees, less those alive before), against the model's size and the bucket size; beside it, the same
  measure of gathering the whole model first (`gather_hf_weights`, the push before streaming);
- trained tokens/s of the whole job: DP 2 / DP 1 on the same batch.

On this machine's 2 shared cores DP 2 runs one rank per core beside whatever else runs: the
tokens/s ratio says what splitting the work across two devices gives; the memory figures are
exact byte counts, not load-dependent.

    python bench/bench_trainer.py --quick
    python bench/bench_trainer.py
"""
from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

from common import REPO, build_model, machine_line, median, model_size, parser, progress, ratio, work_dir

OPTIMIZER_STATE_GOAL = 0.6
BUCKETS_PER_MODEL = 8  # the gather's bucket size is the model's / 8, so the model spans several buckets
# About one bucket: the bucket a push holds plus the HF tensors of the one megatron tensor being converted.
GATHER_PEAK_GOAL_BUCKETS = 2
SAMPLES, MAX_LEN, MICRO = 64, 48, 8


def _worker(hf_dir: str, out: str, distributed: bool, updates: int) -> None:
    """One rank (under torchrun): a warm-up update, `updates` timed ones, the memory figures; rank 0 writes `out`."""
    import time

    import torch

    sys.path.insert(0, str(REPO))
    from services.common.config import MegatronTrainingConfig
    from services.trainer.algorithm.advantages import group_norm_advantages
    from services.trainer.algorithm.update import TrainBatch, UpdateConfig, update_policy
    from services.trainer.modeling.checkpoint_convert import load_hf_into_model, load_hf_state
    from services.trainer.modeling.logprobs import ForwardConfig, ResponseBatch
    from services.trainer.modeling.model import ModelLayout, build_model as build_megatron, destroy_parallel, init_parallel
    from services.trainer.modeling.optimizer import build_optimizer
    from services.common.weight_wire import MIB, DictBuckets
    from services.trainer.weights.gather import stream_hf_weights

    sys.path.insert(0, str(REPO / "tests" / "unit"))
    from trainer_helpers import gather_hf_weights, peak_extra_tensor_bytes

    torch.set_num_threads(1)
    init_parallel(1, 1)
    layout = ModelLayout.from_hf_dir(hf_dir)
    model = build_megatron(layout)
    load_hf_into_model(model, load_hf_state(hf_dir), layout)
    optimizer = build_optimizer(model, MegatronTrainingConfig(lr=1e-5, use_distributed_optimizer=distributed), total_steps=updates + 1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, layout.vocab_size, (16,), generator=gen).tolist() for _ in range(SAMPLES)]
    responses = [torch.randint(0, layout.vocab_size, (int(n),), generator=gen).tolist()
                 for n in torch.randint(8, MAX_LEN - 16, (SAMPLES,), generator=gen)]
    samples = ResponseBatch.from_token_ids(prompts, responses)
    rewards = torch.randint(0, 2, (SAMPLES,), generator=gen).float()
    batch = TrainBatch(samples, group_norm_advantages(rewards, 8, samples.response_mask()))
    cfg = UpdateConfig(mini_batch_size=SAMPLES, forward=ForwardConfig(micro_batch_size=MICRO))
    update_policy(model, optimizer, batch, cfg)
    seconds = []
    for step in range(updates):
        torch.distributed.barrier()
        start = time.perf_counter()
        update_policy(model, optimizer, batch, cfg, step + 1)
        torch.distributed.barrier()
        seconds.append(time.perf_counter() - start)
    state_bytes = 0
    for chained in optimizer.optimizer.chained_optimizers:
        for group in chained.optimizer.param_groups:
            for param in group["params"]:
                state = chained.optimizer.state.get(param, {})  # the distributed optimizer's params are this rank's shards
                state_bytes += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim())
    per_rank = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(per_rank, state_bytes)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bucket_mb = model_bytes / BUCKETS_PER_MODEL / MIB
    stream_peak = peak_extra_tensor_bytes(lambda: stream_hf_weights(model, layout, bucket_mb))
    whole_peak = peak_extra_tensor_bytes(lambda: DictBuckets(gather_hf_weights(model, layout), bucket_mb))
    if torch.distributed.get_rank() == 0:
        pathlib.Path(out).write_text(json.dumps({
            "update_s": median(seconds), "tokens": int(samples.sequence_lengths.sum()), "state_bytes": per_rank,
            "stream_peak_bytes": stream_peak, "whole_peak_bytes": whole_peak, "bucket_bytes": int(bucket_mb * MIB),
            "model_bytes": model_bytes,
        }))
    destroy_parallel()


def run_worker(hf_dir: pathlib.Path, work: pathlib.Path, ranks: int, distributed: bool, updates: int) -> dict:
    """One torchrun launch of the worker; its figures."""
    out = work / f"result-{ranks}-{int(distributed)}.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
           "--master-port", str(port), __file__, "--worker", str(hf_dir), str(out), str(int(distributed)), str(updates)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"worker ({ranks} ranks) failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], sys.argv[4] == "1", int(sys.argv[5]))
        return
    p = parser(__doc__, "a smaller model, one repetition of 2 updates (seconds, to check it runs)")
    p.add_argument("--hidden", type=int, default=None, help="model hidden size (default 512; --quick 128)")
    p.add_argument("--layers", type=int, default=None, help="model layers (default 4; --quick 2)")
    args = p.parse_args()
    reps = args.reps or (1 if args.quick else 3)
    updates = 2 if args.quick else 5
    size = model_size(args.hidden or (128 if args.quick else 512), args.layers or (2 if args.quick else 4))
    print(machine_line())
    work = work_dir("trainer")
    hf_dir = build_model(work / "model", size)
    progress(f"model: {size.describe()}; {SAMPLES} samples, micro-batches of {MICRO}, {updates} timed updates per launch")
    paths = {"dp1": (1, True), "dp2": (2, True), "dp2-replicated": (2, False)}
    results: dict[str, list[dict]] = {name: [] for name in paths}
    for rep in range(reps):  # interleaved: each repetition launches every path once
        for name, (ranks, distributed) in paths.items():
            results[name].append(run_worker(hf_dir, work, ranks, distributed, updates))
        progress(f"rep {rep + 1}/{reps}: " + ", ".join(f"{n} {r[-1]['update_s']:.3f} s" for n, r in results.items()))
    last = {name: r[-1] for name, r in results.items()}
    distributed, replicated = max(last["dp2"]["state_bytes"]), max(last["dp2-replicated"]["state_bytes"])
    print(f"Adam state per rank at DP 2: distributed {distributed / 2**20:.2f} MiB, replicated {replicated / 2**20:.2f} MiB; "
          f"DP 1 {last['dp1']['state_bytes'][0] / 2**20:.2f} MiB")
    ratio("optimizer state per rank distributed / replicated at DP 2", distributed / replicated, at_most=OPTIMIZER_STATE_GOAL)
    gather = last["dp1"]
    print(f"weight gather holds at most {gather['stream_peak_bytes'] / 2**20:.2f} MiB streamed in {gather['bucket_bytes'] / 2**20:.2f} MiB "
          f"buckets, {gather['whole_peak_bytes'] / 2**20:.2f} MiB gathering the whole model first, of a {gather['model_bytes'] / 2**20:.2f} MiB model")
    ratio("weight gather peak / model size", gather["stream_peak_bytes"] / gather["model_bytes"],
          at_most=GATHER_PEAK_GOAL_BUCKETS / BUCKETS_PER_MODEL)
    ratio("weight gather peak / bucket size", gather["stream_peak_bytes"] / gather["bucket_bytes"], at_most=GATHER_PEAK_GOAL_BUCKETS)
    speedups = [(r2["tokens"] / r2["update_s"]) / (r1["tokens"] / r1["update_s"]) for r1, r2 in zip(results["dp1"], results["dp2"])]
    print("update s (median over repetitions): " + ", ".join(f"{n} {median([x['update_s'] for x in r]):.3f}" for n, r in results.items()))
    ratio("trained tokens/s DP 2 / DP 1", median(speedups))


if __name__ == "__main__":
    main()
