"""The official openai client against the rollout server's HTTP API, unchanged."""
from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from rollout_harness import greedy_request, hf_logprobs, load_hf_model, shared_servers, rollout_stub

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


def test_client_sees_clear_errors(client):
    with pytest.raises(openai.BadRequestError, match=r"top_p: must be in \(0.0, 1.0\], got 0.0"):
        client.completions.create(model="tiny", prompt="Hello", top_p=0.0)
    with pytest.raises(openai.BadRequestError, match=r"model: 'gpt-4o' is not served here; this server serves 'tiny'"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match=r"top_logprobs: needs logprobs=true"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], top_logprobs=2)
