"""OpenAI-compatible HTTP API on FastAPI: completions, chat completions (SSE streaming), models,
health and Prometheus metrics. The official `openai` client works against it unchanged."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.common import metrics
from services.common.errors import DockrlError, InvalidArgument, http_status
from services.rollout.engine import GenerationStream, RolloutEngine
from services.rollout.openai_schema import ChatCompletionRequest, CompletionRequest
from services.rollout.sampling import SamplingOverrides

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error"}


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


class OpenAIFormatter:
    """Renders deltas and choices in the OpenAI response shapes for one engine."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine

    def token_text(self, token_id: int) -> str:
        """The text of one token (bytes of a split character show as U+FFFD)."""
        return self.engine.tokenizer.decode([token_id])

    def completion_logprobs(self, token_ids: list[int], logprobs: list[float], top: list[dict[int, float]]) -> dict | None:
        """The `logprobs` object of a /v1/completions choice (None when none were asked)."""
        if not logprobs:
            return None
        tokens = [self.token_text(t) for t in token_ids]
        offsets, pos = [], 0
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": [{self.token_text(t): lp for t, lp in alts.items()} for alts in top] if top else None,
            "text_offset": offsets,
        }

    def chat_logprobs(self, token_ids: list[int], logprobs: list[float], top: list[dict[int, float]]) -> dict | None:
        """The `logprobs` object of a /v1/chat/completions choice (None when none were asked)."""
        if not logprobs:
            return None

        def entry(token_id: int, lp: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        content = []
        for i, (tok, lp) in enumerate(zip(token_ids, logprobs)):
            alts = top[i] if top else {}
            content.append({**entry(tok, lp), "top_logprobs": [entry(t, a) for t, a in alts.items()]})
        return {"content": content}


def _open_all(engine: RolloutEngine, prompts: list[list[int]], overrides: SamplingOverrides) -> list[GenerationStream]:
    """Admits every prompt of a request, or none of them."""
    streams: list[GenerationStream] = []
    try:
        for ids in prompts:
            streams.append(engine.open(ids, overrides))
    except DockrlError:
        for s in streams:
            s.close()
        raise
    return streams


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def _completion_prompts(engine: RolloutEngine, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        return [engine.encode_text(prompt)]
    if not prompt:
        raise InvalidArgument("prompt", "is empty; give text or token ids")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [engine.encode_text(p) if isinstance(p, str) else list(p) for p in prompt]


def build_app(engine: RolloutEngine) -> FastAPI:
    """The FastAPI app serving `engine`."""
    app = FastAPI(title="dockrl rollout", docs_url=None, redoc_url=None)
    fmt = OpenAIFormatter(engine)

    @app.exception_handler(DockrlError)
    async def dockrl_error(request: Request, exc: DockrlError):
        return _error(http_status(exc), str(exc), getattr(exc, "field", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        problems = ["{}: {}".format(".".join(str(p) for p in e["loc"][1:]) or "body", e["msg"]) for e in exc.errors()]
        first = exc.errors()[0]["loc"] if exc.errors() else ()
        return _error(400, "; ".join(problems), ".".join(str(p) for p in first[1:]) or None)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        engine.check_model(req.model)
        overrides = req.overrides()
        prompts = _completion_prompts(engine, req.prompt)
        if req.stream and len(prompts) > 1:
            raise InvalidArgument("prompt", "streaming takes one prompt; send a list only with stream=false")
        streams = _open_all(engine, prompts, overrides)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        n = streams[0].sampling.n
        if req.stream:
            return StreamingResponse(_stream_completion(streams[0], rid, created, req, fmt), media_type="text/event-stream")
        results = await asyncio.gather(*(s.collect() for s in streams))
        choices, generated = [], 0
        for p, result in enumerate(results):
            for i, c in sorted(result.items()):
                choice = {
                    "index": p * n + i, "text": c.text, "finish_reason": c.finish_reason,
                    "logprobs": fmt.completion_logprobs(c.token_ids, c.logprobs, c.top_logprobs),
                }
                if req.return_token_ids:
                    choice["token_ids"] = c.token_ids
                choices.append(choice)
                generated += len(c.token_ids)
        return {
            "id": rid, "object": "text_completion", "created": created, "model": engine.model_name,
            "choices": choices, "usage": _usage(sum(len(s.prompt_ids) for s in streams), generated),
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        engine.check_model(req.model)
        overrides = req.overrides()
        stream = engine.open(engine.encode_chat(req.chat()), overrides)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return StreamingResponse(_stream_chat(stream, rid, created, req, fmt), media_type="text/event-stream")
        result = await stream.collect()
        choices = []
        for i, c in sorted(result.items()):
            choice = {
                "index": i, "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason, "logprobs": fmt.chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs),
            }
            if req.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": engine.model_name, "choices": choices,
            "usage": _usage(len(stream.prompt_ids), sum(len(c.token_ids) for c in result.values())),
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": engine.model_name, "object": "model", "created": 0, "owned_by": "dockrl",
            "max_model_len": engine.max_model_len, "policy_version": engine.version,
        }]}

    @app.get("/health")
    async def health():
        engine.ensure_running()
        return {"status": "ok", "model": engine.model_name, "version": engine.version, "queue_depth": engine.queue_depth}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return app


async def _stream_completion(stream: GenerationStream, rid: str, created: int, req: CompletionRequest, fmt: OpenAIFormatter) -> AsyncIterator[str]:
    generated = 0
    async for d in stream.deltas():
        generated += len(d.token_ids)
        choice = {"index": d.index, "text": d.text, "finish_reason": d.finish_reason,
                  "logprobs": fmt.completion_logprobs(d.token_ids, d.logprobs, d.top_logprobs)}
        if req.return_token_ids:
            choice["token_ids"] = d.token_ids
        yield _sse({"id": rid, "object": "text_completion", "created": created, "model": fmt.engine.model_name, "choices": [choice]})
    if req.include_usage:
        yield _sse({"id": rid, "object": "text_completion", "created": created, "model": fmt.engine.model_name,
                    "choices": [], "usage": _usage(len(stream.prompt_ids), generated)})
    yield _sse("[DONE]")


async def _stream_chat(stream: GenerationStream, rid: str, created: int, req: ChatCompletionRequest, fmt: OpenAIFormatter) -> AsyncIterator[str]:
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": fmt.engine.model_name}
    for i in range(stream.sampling.n):
        yield _sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    generated = 0
    async for d in stream.deltas():
        generated += len(d.token_ids)
        choice = {"index": d.index, "delta": {"content": d.text} if d.text else {}, "finish_reason": d.finish_reason,
                  "logprobs": fmt.chat_logprobs(d.token_ids, d.logprobs, d.top_logprobs)}
        if req.return_token_ids:
            choice["token_ids"] = d.token_ids
        yield _sse({**head, "choices": [choice]})
    if req.include_usage:
        yield _sse({**head, "choices": [], "usage": _usage(len(stream.prompt_ids), generated)})
    yield _sse("[DONE]")
