"""Clients no one here wrote against the rollout server's HTTP API (vLLM's own OpenAI app on the
replica's engine): the official openai client, and vLLM's own routes and metrics."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from rollout_harness import greedy_request, hf_logprobs, load_hf_model, shared_servers, rollout_stub
from services.common.pb import rollout_pb2

pytestmark = pytest.mark.service

MAX_TOKENS = 8
GREEDY_NO_EOS = {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


@pytest.fixture(scope="module")
def servers(request):
    return shared_servers(request)


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=f"{servers.a.http_base}/v1", api_key="unused", max_retries=0)


def grpc_greedy(servers, prompt_ids):
    return rollout_stub(servers.a).Generate(greedy_request(prompt_ids, MAX_TOKENS)).completions[0]


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completions_stream_and_not_agree_with_grpc(client, servers):
    request = greedy_request([], MAX_TOKENS)
    request.text = "Hello"  # a text prompt: gRPC returns the text too
    expected = rollout_stub(servers.a).Generate(request).completions[0]
    assert expected.text
    full = client.completions.create(model="tiny", prompt="Hello", logprobs=2, **GREEDY_NO_EOS)
    choice = full.choices[0]
    assert choice.model_extra["token_ids"] == list(expected.token_ids)
    assert choice.text == expected.text
    assert choice.logprobs.token_logprobs == pytest.approx(list(expected.logprobs), abs=1e-5)
    assert all(len(alts) == 2 for alts in choice.logprobs.top_logprobs)
    assert full.usage.completion_tokens == MAX_TOKENS and full.usage.prompt_tokens == 5
    parts = list(client.completions.create(model="tiny", prompt="Hello", stream=True, **GREEDY_NO_EOS))
    assert "".join(p.choices[0].text for p in parts) == choice.text
    assert parts[-1].choices[0].finish_reason == "length"


def test_chat_stream_and_not_with_logprobs(client, servers):
    messages = [{"role": "user", "content": "1+2="}]
    tokenizer = AutoTokenizer.from_pretrained(str(servers.model_dir))
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    expected = grpc_greedy(servers, prompt_ids)
    chat = client.chat.completions.create(model="tiny", messages=messages, logprobs=True, top_logprobs=3, **GREEDY_NO_EOS)
    choice = chat.choices[0]
    assert choice.model_extra["token_ids"] == list(expected.token_ids)
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(list(expected.token_ids), skip_special_tokens=True)
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(
        hf_logprobs(load_hf_model(servers.model_dir), prompt_ids, list(expected.token_ids)), abs=1e-4
    )
    assert all(len(c.top_logprobs) == 3 for c in choice.logprobs.content)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, stream=True, **GREEDY_NO_EOS))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_samples_and_batched_prompts(client):
    sampled = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=3, temperature=1.0, max_tokens=6, seed=3,
    )
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2]
    batch = client.completions.create(model="tiny", prompt=["ab", "cd"], n=2, temperature=1.0, max_tokens=4)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]


def test_client_sees_vllms_errors(client):
    with pytest.raises(openai.BadRequestError, match=r"top_p must be in \(0, 1\], got 0.0"):
        client.completions.create(model="tiny", prompt="Hello", top_p=0.0)
    with pytest.raises(openai.NotFoundError, match=r"The model `gpt-4o` does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match=r"when using `top_logprobs`, `logprobs` must be set to true"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], top_logprobs=2)


def test_stop_string_gives_stop_reason(client):
    free = client.completions.create(model="tiny", prompt="Hello", **GREEDY_NO_EOS).choices[0].text
    stop = free[-1]  # a character greedy decoding is known to reach
    choice = client.completions.create(model="tiny", prompt="Hello", stop=[stop], temperature=0, max_tokens=MAX_TOKENS).choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    assert choice.text == free[:free.index(stop)]


def test_json_schema_response_format_holds_the_output_to_the_schema(client):
    """Guided decoding (vLLM's structured outputs) holds even a random tiny model to the schema (sampled: greedy
    loops on whitespace, which JSON allows between tokens, until max_tokens)."""
    schema = {"type": "object", "properties": {"op": {"type": "string", "enum": ["add", "sub"]}}, "required": ["op"],
              "additionalProperties": False}
    formatted = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+2="}], max_tokens=100, temperature=1, seed=1,
                                               response_format={"type": "json_schema", "json_schema": {"name": "op", "schema": schema}})
    assert json.loads(formatted.choices[0].message.content)["op"] in ("add", "sub")


def test_tools_named_and_auto_with_a_tool_call_parser_and_refused_without(client, servers):
    """`tools` through the openai client. Replica a sets generate_config.tool_call_parser (hermes): a named
    `tool_choice` comes back as a tool call of that function (what the random tiny model writes as its
    arguments is its own), and `auto` is served. Replica b sets none: vLLM refuses the tools request and
    names the missing flag."""
    tool = {"type": "function", "function": {"name": "calculate", "description": "Evaluates one operation",
                                             "parameters": {"type": "object", "properties": {"op": {"type": "string", "enum": ["add", "sub"]}},
                                                            "required": ["op"], "additionalProperties": False}}}
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "1+2="}], "tools": [tool]}
    answer = client.chat.completions.create(**ask, max_tokens=100, temperature=1, seed=1,
                                            tool_choice={"type": "function", "function": {"name": "calculate"}})
    call = answer.choices[0].message.tool_calls[0]
    assert call.type == "function" and call.function.name == "calculate" and isinstance(call.function.arguments, str)
    auto = client.chat.completions.create(**ask, max_tokens=8, tool_choice="auto")
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    without = openai.OpenAI(base_url=f"{servers.b.http_base}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="tool-call-parser"):
        without.chat.completions.create(**ask, max_tokens=8, tool_choice="auto")


def test_vllm_routes_tokenize_detokenize_version(servers):
    base = servers.a.http_base
    tokens = httpx.post(f"{base}/tokenize", json={"model": "tiny", "prompt": "Hello"}, timeout=30).json()
    assert tokens["tokens"] == [39, 68, 75, 75, 78] and tokens["max_model_len"] == 128
    assert httpx.post(f"{base}/detokenize", json={"model": "tiny", "tokens": tokens["tokens"]}, timeout=30).json()["prompt"] == "Hello"
    import vllm

    assert httpx.get(f"{base}/version", timeout=30).json() == {"version": vllm.__version__}


def test_policy_version_route_and_header(servers, client):
    base = servers.a.http_base
    version = rollout_stub(servers.a).GetInfo(rollout_pb2.GetInfoRequest()).version
    assert httpx.get(f"{base}/v1/policy_version", timeout=30).json() == {"policy_version": version, "model": "tiny"}
    raw = client.completions.with_raw_response.create(model="tiny", prompt="Hello", max_tokens=2)
    assert raw.headers["x-policy-version"] == str(version)


def test_metrics_has_vllms_series_beside_dockrls_counting_grpc_too(servers):
    def series(text: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    base = servers.a.http_base
    before = httpx.get(f"{base}/metrics", timeout=30).text
    grpc_greedy(servers, [72, 101, 108, 108, 111])  # MAX_TOKENS tokens through gRPC, not HTTP
    after = httpx.get(f"{base}/metrics", timeout=30).text
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket", "vllm:kv_cache_usage_perc",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:request_success_total"):
        assert f"\n{name}{{" in after, name
    assert "dockrl_rollout_queue_depth " in after and "dockrl_rollout_policy_version " in after
    assert series(after, "vllm:generation_tokens_total") - series(before, "vllm:generation_tokens_total") == MAX_TOKENS


def test_vllm_bench_serve_runs_against_the_replica(servers):
    """vLLM's own benchmark client, through the `vllm` command this project installs (services/rollout/vllm_cli.py)."""
    run = subprocess.run(
        [sys.executable, "-m", "services.rollout.vllm_cli", "bench", "serve", "--backend", "openai", "--base-url", servers.a.http_base,
         "--model", "tiny", "--tokenizer", str(servers.model_dir), "--dataset-name", "random", "--random-input-len", "8",
         "--random-output-len", "8", "--num-prompts", "8", "--max-concurrency", "2", "--ignore-eos"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"Successful requests:\s+8\b", run.stdout) and re.search(r"Failed requests:\s+0\b", run.stdout), run.stdout[-2000:]
    assert re.search(r"Total generated tokens:\s+64\b", run.stdout), run.stdout[-2000:]
