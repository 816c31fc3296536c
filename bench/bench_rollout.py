"""Tokens/s through the rollout server's gRPC and HTTP APIs vs. vLLM offline `LLM.generate` and `vllm serve`;
time to first token of our HTTP API vs. `vllm serve`.

Same model, engine settings, prompts and sampling params (greedy, EOS ignored, so every path
generates the same number of tokens; no logprobs), at each of --concurrency requests in flight (offline: one
`LLM.generate` call over that many prompts). The offline engine, `vllm serve` (vLLM's own server,
through services/rollout/vllm_cli.py) and our server each run in their own process; all stay
resident and the repetitions are interleaved (offline, gRPC, HTTP, vllm serve, offline, ...), so load
from other jobs hits every path alike. Prints the median tokens/s of each path and its ratio to
offline vLLM (goal >= 0.95), then the p50 / p99 time to first token of streamed /v1/completions
requests, ours and `vllm serve`'s, over every request of every repetition at each concurrency.

    python bench/bench_rollout.py --quick                 # tiny model, CI
    python bench/bench_rollout.py                         # tiny model, 128 tokens, 5 reps
    python bench/bench_rollout.py --hidden 512 --layers 4 # a wider model (head_dim 64)
    python bench/bench_rollout.py --device cuda           # Qwen2.5-0.5B-size model on a GPU
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

from common import REPO, QWEN25_05B, engine_env, engine_overrides, interleaved, median, model_size, paired, progress, ratio
from common import add_device_arg, build_model, machine_line, parser, start_replicas, stop_all, work_dir

GOAL = 0.95
WARMUPS = 2  # untimed repetitions per path first (CPU kernels are built on first use of a shape)


def engine_settings(device: str, max_seqs: int) -> dict:
    """vLLM engine arguments both sides use; on CUDA each of the two engines gets under half the GPU."""
    settings = {"dtype": "float32" if device == "cpu" else "bfloat16", "max_model_len": 512, "max_num_seqs": max_seqs, "seed": 1234}
    if device == "cuda":
        settings["gpu_memory_utilization"] = 0.4
    return settings


def prompts_for(count: int, length: int) -> list[list[int]]:
    """Deterministic distinct byte-token prompts."""
    return [[(97 + (i * 7 + j) % 26) for j in range(length)] for i in range(count)]


def offline_worker(model: str, prompts: list[list[int]], max_tokens: int, engine: dict) -> None:
    """Runs in a subprocess: per line `N` read from stdin, one timed LLM.generate over the first N prompts; prints `REP <seconds>`."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, enforce_eager=True, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    print("REP ready", flush=True)
    for line in sys.stdin:
        count = int(line)
        start = time.perf_counter()
        outputs = llm.generate(batch[:count], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
        print(f"REP {seconds}", flush=True)


class OfflineEngine:
    """The offline vLLM engine in its own process, timed one repetition at a time."""

    def __init__(self, spec: dict, env: dict[str, str], log_path):
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, __file__, "--offline-worker", json.dumps(spec)], env={**os.environ, **env},
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, cwd=REPO,
                                     start_new_session=True)

    def wait_ready(self) -> None:
        """Blocks until the engine has started (it starts while the server does)."""
        self._answer()

    def _answer(self) -> str:
        for line in self.proc.stdout:  # vLLM logs to stdout too
            if line.startswith("REP "):
                return line[4:].strip()
        raise RuntimeError(f"the offline engine exited; see {self._log.name}")

    def rep(self, count: int) -> float:
        """Seconds of one LLM.generate over the first `count` prompts."""
        self.proc.stdin.write(f"{count}\n")
        self.proc.stdin.flush()
        return float(self._answer())

    def close(self) -> None:
        """Ends the worker (stdin closed); its process group (the engine core too) is killed if it lingers."""
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()


class VllmServe:
    """`vllm serve` on the same model and engine settings, in its own process (its own process group)."""

    def __init__(self, model: str, engine: dict, env: dict[str, str], log_path):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        flags = [f"--{key.replace('_', '-')}={value}" for key, value in engine.items()]
        cmd = [sys.executable, "-m", "services.rollout.vllm_cli", "serve", model, "--host", "127.0.0.1", "--port", str(self.port),
               "--served-model-name", "bench", "--enforce-eager", "--no-enable-prefix-caching", "--disable-uvicorn-access-log", *flags]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
                                     start_new_session=True)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 600) -> None:
        """Blocks until GET /health answers 200."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not start; see {self._log.name}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    def close(self) -> None:
        """SIGTERM to its process group; SIGKILL if it lingers."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


async def ttft_rep(base: str, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """Seconds to the first streamed token of each of `prompts`, sent at once as streamed POST /v1/completions."""
    import httpx

    body = {"model": "bench", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> float:
        start = time.perf_counter()
        first = None
        async with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt}) as response:
            assert response.status_code == 200, response.status_code
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    first = time.perf_counter() - start
        return first if first is not None else float("nan")

    async with httpx.AsyncClient(base_url=base, timeout=600, limits=httpx.Limits(max_connections=len(prompts))) as client:
        return await asyncio.gather(*(one(client, p) for p in prompts))


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by the nearest-rank method."""
    ranked = sorted(values)
    return ranked[max(0, math.ceil(q / 100 * len(ranked)) - 1)]


async def grpc_rep(target: str, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds for every prompt as one concurrent unary Generate call each."""
    import grpc

    from services.common.pb import rollout_pb2, rollout_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        # logprobs=0 asks for none, as offline and HTTP (unset, the server's default of 1 would add them)
        sampling = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        start = time.perf_counter()
        out = await asyncio.gather(*(stub.Generate(rollout_pb2.GenerateRequest(token_ids=rollout_pb2.TokenIds(ids=p), sampling=sampling))
                                     for p in prompts))
        seconds = time.perf_counter() - start
    assert all(len(r.completions[0].token_ids) == max_tokens for r in out)
    return seconds


async def http_rep(base: str, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds for every prompt as one concurrent POST /v1/completions each."""
    import httpx

    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        body = {"model": "bench", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        start = time.perf_counter()
        out = await asyncio.gather(*(client.post("/v1/completions", json={**body, "prompt": p}) for p in prompts))
        seconds = time.perf_counter() - start
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens for r in out)
    return seconds


def main() -> int:
    p = parser(__doc__, "tiny model, 16 tokens per request, 3 repetitions (CI)")
    add_device_arg(p)
    p.add_argument("--hidden", type=int, default=128, help="CPU: hidden size of the built model (128: the tiny model; else head_dim 64)")
    p.add_argument("--layers", type=int, default=2, help="CPU: layers of the built model")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64], help="requests in flight, one measurement each (default 1 8 64)")
    p.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt (default 16)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens generated per request (default 128, or 16 with --quick)")
    p.add_argument("--offline-worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.offline_worker:
        offline_worker(**json.loads(args.offline_worker))
        return 0
    reps = args.reps or (3 if args.quick else 5)
    max_tokens = args.max_tokens or (16 if args.quick else 128)
    size = QWEN25_05B if args.device == "cuda" else model_size(args.hidden, args.layers)

    work = work_dir("rollout")
    model = build_model(work / "model", size)
    prompts = prompts_for(max(args.concurrency), args.prompt_len)
    engine = engine_settings(args.device, max(args.concurrency))
    progress(f"model {size.describe()} on {args.device}; concurrency {args.concurrency}, {args.prompt_len}-token prompts, "
             f"{max_tokens} tokens each, {reps} reps")

    # offline vLLM and our server, both resident, starting at the same time
    offline = OfflineEngine({"model": str(model), "prompts": prompts, "max_tokens": max_tokens, "engine": engine},
                            engine_env(args.device), work / "offline.log")
    vllm_serve = VllmServe(str(model), engine, engine_env(args.device), work / "vllm_serve.log")
    overrides = [f"generate_config.{k}={v}" for k, v in engine.items()] + ["rollout.max_queue=1024"]
    overrides += [o for o in engine_overrides(args.device, 2, engine["dtype"]) if "dtype" not in o and "gpu_memory" not in o]
    replicas = []
    results = {}
    ttft: dict[int, dict[str, list[float]]] = {}
    try:
        replicas = start_replicas(model, work, {"server": overrides}, engine_env(args.device))
        server = replicas[0]
        offline.wait_ready()
        vllm_serve.wait_ready()
        for c in args.concurrency:
            batch = prompts[:c]
            results[c] = interleaved({
                "offline": lambda: offline.rep(c),
                "gRPC": lambda: asyncio.run(grpc_rep(server.grpc_target, batch, max_tokens)),
                "HTTP": lambda: asyncio.run(http_rep(server.http_base, batch, max_tokens)),
                "vllm": lambda: asyncio.run(http_rep(vllm_serve.base, batch, max_tokens)),
            }, reps, WARMUPS, label=f"concurrency {c}: ")
            for rep in range(WARMUPS + reps):  # ours and vLLM's in turn; the warm-up rounds are not kept
                for name, base in (("HTTP", server.http_base), ("vllm", vllm_serve.base)):
                    seconds = asyncio.run(ttft_rep(base, batch, max_tokens))
                    if rep >= WARMUPS:
                        ttft.setdefault(c, {}).setdefault(name, []).extend(seconds)
    finally:
        stop_all(replicas)
        offline.close()
        vllm_serve.close()

    print(machine_line())
    print(f"{'concurrency':>11}{'path':>8}{'median tok/s':>14}{'vs offline':>12}   per-rep tok/s")
    for c, times in results.items():
        tokens = c * max_tokens
        base = tokens / median(times["offline"])
        for name, seconds in times.items():
            rate = tokens / median(seconds)
            print(f"{c:>11}{name:>8}{rate:>14.0f}{rate / base:>11.2f}x   {' '.join(f'{tokens / t:.0f}' for t in seconds)}")
    print(f"{'concurrency':>11}{'server':>13}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'requests':>10}")
    for c, by_server in ttft.items():
        for name, seconds in by_server.items():
            label = "ours (HTTP)" if name == "HTTP" else "vllm serve"
            print(f"{c:>11}{label:>13}{1000 * percentile(seconds, 50):>13.1f}{1000 * percentile(seconds, 99):>13.1f}{len(seconds):>10}")
    for c, times in results.items():
        for name in ("gRPC", "HTTP"):
            ratio(f"{name} / offline tokens/s at concurrency {c}", paired(times, "offline", name), at_least=GOAL)
        ratio(f"HTTP / vllm serve tokens/s at concurrency {c}", paired(times, "vllm", "HTTP"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
