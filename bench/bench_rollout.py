"""Tokens/s through the rollout server's gRPC and HTTP APIs vs. vLLM offline `LLM.generate`.

Same model, engine settings, prompts and sampling params (greedy, EOS ignored, so every run
generates the same number of tokens); all prompts of a repetition are in flight at once.
Both engines stay resident and the repetitions are interleaved (offline, gRPC, HTTP, offline, ...),
so load from other jobs hits every path alike. Prints medians and the ratio to offline vLLM.

    python bench/bench_rollout.py --quick
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

ENGINE = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 64, "seed": 1234}
# PASSIVE: an idle engine's OpenMP threads sleep instead of spinning on the cores the other engine uses
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_WAIT_POLICY": "PASSIVE"}
WARMUPS = 2  # untimed repetitions per path first (CPU kernels are built on first use of a shape)


def prompts_for(count: int, length: int) -> list[list[int]]:
    """Deterministic distinct byte-token prompts."""
    return [[(97 + (i * 7 + j) % 26) for j in range(length)] for i in range(count)]


def offline_worker(model: str, prompts: list[list[int]], max_tokens: int) -> None:
    """Runs in a subprocess: one timed LLM.generate over all prompts per line read from stdin, printing `REP <seconds>`."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, enforce_eager=True, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    print("REP ready", flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
        print(f"REP {seconds}", flush=True)


class OfflineEngine:
    """The offline vLLM engine in its own process, timed one repetition at a time."""

    def __init__(self, spec: dict, log_path: pathlib.Path):
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, __file__, "--offline-worker", json.dumps(spec)], env={**os.environ, **ENV},
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, cwd=REPO)
        self._answer()

    def _answer(self) -> str:
        for line in self.proc.stdout:  # vLLM logs to stdout too
            if line.startswith("REP "):
                return line[4:].strip()
        raise RuntimeError(f"the offline engine exited; see {self._log.name}")

    def rep(self) -> float:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self._answer())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self._log.close()


async def grpc_rep(target: str, prompts: list[list[int]], max_tokens: int) -> float:
    import grpc

    from services.common.pb import rollout_pb2, rollout_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        sampling = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        out = await asyncio.gather(*(stub.Generate(rollout_pb2.GenerateRequest(token_ids=rollout_pb2.TokenIds(ids=p), sampling=sampling)) for p in prompts))
        seconds = time.perf_counter() - start
    assert all(len(r.completions[0].token_ids) == max_tokens for r in out)
    return seconds


async def http_rep(base: str, model: str, prompts: list[list[int]], max_tokens: int) -> float:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        start = time.perf_counter()
        out = await asyncio.gather(*(client.post("/v1/completions", json={**body, "prompt": p}) for p in prompts))
        seconds = time.perf_counter() - start
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens for r in out)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 prompts x 32 tokens, 5 repetitions")
    parser.add_argument("--model", default="", help="HF model directory (default: build one of --hidden x --layers)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size of the built model (128: the tiny model; else head_dim 64)")
    parser.add_argument("--layers", type=int, default=2, help="layers of the built model")
    parser.add_argument("--prompts", type=int, default=64, help="prompts in flight per repetition")
    parser.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per path (medians reported)")
    parser.add_argument("--offline-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.offline_worker:
        offline_worker(**json.loads(args.offline_worker))
        return 0
    if args.quick:
        args.prompts, args.max_tokens, args.reps = 16, 32, 5

    from services.rollout.launcher import spawn_replica

    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    model = args.model
    if not model:
        from rollout_bench_model import build_bench_model

        model = str(build_bench_model(work / "model", args.hidden, args.layers))
    prompts = prompts_for(args.prompts, args.prompt_len)
    print(f"model={model} prompts={args.prompts}x{args.prompt_len} max_tokens={args.max_tokens} reps={args.reps}", flush=True)

    # offline vLLM in its own process and our server, both resident; repetitions interleaved so load
    # from other jobs on the machine hits every path alike
    offline = OfflineEngine({"model": model, "prompts": prompts, "max_tokens": args.max_tokens}, work / "offline.log")
    overrides = [f"generate_config.{k}={v}" for k, v in ENGINE.items()] + ["rollout.omp_threads_bind=nobind", "rollout.max_queue=1024"]
    replica = spawn_replica(model, work, "bench", overrides, "bench", ENV).wait()
    times: dict[str, list[float]] = {"vLLM offline": [], "gRPC Generate": [], "HTTP completions": []}
    try:
        for rep in range(WARMUPS + args.reps):
            measured = {
                "vLLM offline": offline.rep(),
                "gRPC Generate": asyncio.run(grpc_rep(replica.grpc_target, prompts, args.max_tokens)),
                "HTTP completions": asyncio.run(http_rep(replica.http_base, "bench", prompts, args.max_tokens)),
            }
            if rep >= WARMUPS:
                for name, seconds in measured.items():
                    times[name].append(seconds)
    finally:
        replica.stop()
        offline.close()

    tokens = args.prompts * args.max_tokens
    base = tokens / statistics.median(times["vLLM offline"])
    print(f"{'path':<18}{'median tok/s':>14}{'vs offline':>12}   per-rep tok/s")
    for name, reps in times.items():
        rate = tokens / statistics.median(reps)
        print(f"{name:<18}{rate:>14.0f}{rate / base:>11.2f}x   {' '.join(f'{tokens / t:.0f}' for t in reps)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
