"""Shared by the rollout service tests: one pair of real rollout servers per test session, and the
Hugging Face reference (greedy decode, teacher-forced logprobs) they are checked against.

vLLM on CPU takes ~20-40 s to start, so every rollout test module asks `shared_servers(request)`
for the same two server processes (`python -m services.rollout serve`): replica A serves every
test; replica B is only the second link of the chain-broadcast test. Both stop when the session ends.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import grpc

from services.common.pb import rollout_pb2, rollout_pb2_grpc

REPO = pathlib.Path(__file__).resolve().parents[2]
TOKEN = "rollout-test-token"
MAX_QUEUE = 4
MAX_MODEL_LEN = 128
START_TIMEOUT_S = 240


@dataclasses.dataclass
class RolloutServer:
    """One running `python -m services.rollout serve` process."""

    proc: subprocess.Popen
    grpc_port: int
    http_port: int
    log_path: pathlib.Path
    model_name: str

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def stub(self) -> rollout_pb2_grpc.RolloutStub:
        channel = grpc.insecure_channel(self.grpc_target, options=[("grpc.max_send_message_length", 64 << 20)])
        return rollout_pb2_grpc.RolloutStub(channel)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@dataclasses.dataclass
class Servers:
    model_dir: pathlib.Path
    a: RolloutServer
    b: RolloutServer


_SERVERS: Servers | None = None


def _spawn(model_dir: pathlib.Path, work: pathlib.Path, name: str, threads: str) -> tuple[subprocess.Popen, pathlib.Path, pathlib.Path]:
    ready = work / f"{name}.ready.json"
    log_path = work / f"{name}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DOCKRL_LOG_LEVEL": "INFO"}
    cmd = [
        sys.executable, "-m", "services.rollout", "serve", "--model", str(model_dir),
        "--grpc-port", "0", "--http-port", "0", "--host", "127.0.0.1", "--served-model-name", "tiny",
        "--ready-file", str(ready),
        "--set", f"rollout.max_queue={MAX_QUEUE}", "--set", f"auth.token={TOKEN}",
        "--set", f"rollout.omp_threads_bind={threads}", "--set", f"generate_config.max_model_len={MAX_MODEL_LEN}",
        "--set", "generate_config.dtype=float32",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, ready, log_path


def _wait_ready(proc: subprocess.Popen, ready: pathlib.Path, log_path: pathlib.Path) -> dict:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"rollout server did not start; log:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.5)
    return json.loads(ready.read_text())


def shared_servers(request) -> Servers:
    """The session's two rollout servers, started on first use and stopped at the session's end."""
    global _SERVERS
    if _SERVERS is None:
        from services.common.tiny_model import build_tiny_model

        work = pathlib.Path(tempfile.mkdtemp(prefix="rollout-test-"))
        model_dir = build_tiny_model(work / "model")
        spawned = {name: _spawn(model_dir, work, name, "nobind") for name in ("a", "b")}
        started = {}
        for name, (proc, ready, log_path) in spawned.items():
            ports = _wait_ready(proc, ready, log_path)
            started[name] = RolloutServer(proc, ports["grpc_port"], ports["http_port"], log_path, "tiny")
        _SERVERS = Servers(model_dir, started["a"], started["b"])

        def stop_all() -> None:
            global _SERVERS
            for server in started.values():
                server.stop()
            _SERVERS = None

        request.config.add_cleanup(stop_all)
    return _SERVERS


# ---------------------------------------------------------------- the Hugging Face reference


def load_hf_model(model_dir: pathlib.Path, state_dict: dict | None = None):
    """The HF model in float32 (optionally with other weights), for reference decoding."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.eval()


def hf_greedy(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation of `prompt_ids` (no stop at EOS), by argmax over the full-sequence logits."""
    import torch

    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt_ids):]


def hf_logprobs(model, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
    """log p(response token | prefix) for each response token, teacher-forced."""
    import torch

    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
    start = len(prompt_ids)
    return [float(logp[start - 1 + i, tok]) for i, tok in enumerate(response_ids)]


def greedy_request(prompt_ids: list[int], max_tokens: int) -> rollout_pb2.GenerateRequest:
    """A greedy gRPC request that returns the sampled tokens' logprobs and ignores EOS."""
    return rollout_pb2.GenerateRequest(
        token_ids=rollout_pb2.TokenIds(ids=prompt_ids),
        sampling=rollout_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True),
    )


def offline_vllm_generate(model_dir: pathlib.Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy token ids from vLLM's offline `LLM.generate`, run in a subprocess of the test."""
    out = pathlib.Path(tempfile.mkdtemp(prefix="rollout-offline-")) / "out.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, __file__, str(model_dir), str(out), json.dumps(prompts), str(max_tokens)],
        cwd=REPO, env=env, timeout=300, capture_output=True, text=True,
    )
    assert run.returncode == 0, f"offline vLLM failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return json.loads(out.read_text())


def _offline_main(model_dir: str, out: str, prompts_json: str, max_tokens: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True, seed=1234)
    params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in json.loads(prompts_json)], params)
    pathlib.Path(out).write_text(json.dumps([list(o.outputs[0].token_ids) for o in outputs]))


if __name__ == "__main__":
    _offline_main(*sys.argv[1:5])
