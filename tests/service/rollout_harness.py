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
import subprocess
import sys
import tempfile
import uuid

import grpc

from services.common.pb import rollout_pb2, rollout_pb2_grpc
from replica_launcher import LocalReplica, spawn_replica

REPO = pathlib.Path(__file__).resolve().parents[2]
TOKEN = "rollout-test-token"
MAX_QUEUE = 4
MAX_MODEL_LEN = 128


@dataclasses.dataclass
class Servers:
    model_dir: pathlib.Path
    a: LocalReplica  # every test
    b: LocalReplica  # the chain's second link, and a dock worker for DOCK_PREFIX / DOCK_RUN


_SERVERS: Servers | None = None
OVERRIDES = (
    f"rollout.max_queue={MAX_QUEUE}", f"auth.token={TOKEN}", "rollout.omp_threads_bind=nobind",
    f"generate_config.max_model_len={MAX_MODEL_LEN}", "generate_config.dtype=float32",
)
REDIS_URL = "redis://127.0.0.1:6379/0"
DOCK_PREFIX = f"rollout-test-{uuid.uuid4().hex[:12]}"
DOCK_RUN = "worker"
DOCK_OVERRIDES = (  # greedy, 2 samples per prompt, each sample generated over 2 claims of 4 tokens
    f"dock.prefix={DOCK_PREFIX}", f"dock.run_id={DOCK_RUN}", "rl_config.n_samples_per_prompt=2",
    "rl_config.partial_rollout_max_split=2", "generate_config.sampling_config.temperature=0.0",
    "rollout.heartbeat_ttl_s=3",
)


def rollout_stub(replica: LocalReplica) -> rollout_pb2_grpc.RolloutStub:
    """A blocking Rollout client of `replica`."""
    channel = grpc.insecure_channel(replica.grpc_target, options=[("grpc.max_send_message_length", 64 << 20)])
    return rollout_pb2_grpc.RolloutStub(channel)


def shared_servers(request) -> Servers:
    """The session's two rollout servers, started on first use and stopped at the session's end."""
    global _SERVERS
    if _SERVERS is None:
        from services.common.tiny_model import build_tiny_model

        work = pathlib.Path(tempfile.mkdtemp(prefix="rollout-test-"))
        model_dir = build_tiny_model(work / "model")
        env = {"OMP_NUM_THREADS": "1"}  # two replicas and the test share two cores
        pending = [
            # a: tool calling on (vLLM's hermes parser: the tiny tokenizer has what it needs); b: off
            spawn_replica(model_dir, work, "a", OVERRIDES + ("generate_config.tool_call_parser=hermes",), "tiny", env),
            spawn_replica(model_dir, work, "b", OVERRIDES + DOCK_OVERRIDES, "tiny", env, extra_args=("--dock", REDIS_URL)),
        ]
        started = [p.wait() for p in pending]
        _SERVERS = Servers(model_dir, *started)

        def stop_all() -> None:
            global _SERVERS
            for replica in started:
                replica.stop()
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
