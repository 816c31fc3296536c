"""The HTTP API: vLLM's own OpenAI-compatible app on this replica's engine, plus dockrl's additions.

vLLM builds the app (`vllm.entrypoints.launchers`: `build_app` + `init_app_state`) from the same
serve arguments and the same `AsyncLLM` as the gRPC server, so every route, protocol model, error
and the `vllm:*` metrics are those of `vllm serve`. dockrl adds, in one ASGI middleware in front:

- the bearer token (`auth.token`) on every route that is not a read or a generation;
- `rollout.max_queue`, shared with gRPC and the dock worker: past it 429 with `Retry-After`;
- the policy version serving when a response starts, as the `x-policy-version` header;
- draining (SIGTERM): new generation requests and `/health` answer 503 with `Retry-After`;

and three routes: `GET /v1/policy_version`, `GET /v1/expert_load` (MoE token counts per expert, for `dockrl eplb`),
and `dockrl_*` series beside vLLM's on `/metrics`.
"""
from __future__ import annotations

import functools
import logging
import uuid
from http import HTTPStatus

import prometheus_client
from fastapi import APIRouter
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common import metrics
from services.common.auth import token_matches
from services.common.errors import ResourceExhausted, Unavailable
from services.rollout.engine import RolloutEngine

VERSION_HEADER = "x-policy-version"
RETRY_AFTER_S = 1  # a slot frees when one request ends: tokens of a decode step, not minutes
# Requests that run the engine: each holds one rollout.max_queue slot for its whole response.
GENERATION_ROUTES = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/v1/responses", "/v1/messages",
    "/inference/v1/generate", "/generative_scoring", "/invocations",
})
# POST routes that change nothing but the caller's own output (generation, tokenizing, rendering a prompt).
# Every other POST (aborting others' requests, cancelling a response, scaling, adapters, profiling, and any
# route a later vLLM adds) needs the token.
OPEN_POSTS = GENERATION_ROUTES | {
    "/tokenize", "/detokenize", "/ping", "/v1/messages/count_tokens",
    "/v1/completions/render", "/v1/chat/completions/render", "/v1/messages/render", "/v1/responses/render",
    "/v1/completions/derender", "/v1/chat/completions/derender",
}
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _error(status: HTTPStatus, err_type: str, message: str, retry_after: bool = False) -> JSONResponse:
    """An error in vLLM's OpenAI shape: {"error": {"message", "type", "param", "code"}}."""
    body = {"error": {"message": message, "type": err_type, "param": None, "code": int(status)}}
    return JSONResponse(body, status_code=int(status), headers={"Retry-After": str(RETRY_AFTER_S)} if retry_after else None)


class ReplicaMiddleware:
    """dockrl's rules around vLLM's app: token, queue bound, draining and the policy version header."""

    def __init__(self, app: ASGIApp, engine: RolloutEngine, token: str):
        self.app = app
        self.engine = engine
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if method not in READ_METHODS and path not in OPEN_POSTS and not token_matches(self.token, Headers(scope=scope).get("authorization")):
            response = _error(HTTPStatus.UNAUTHORIZED, "AuthenticationError",
                              f"{method} {path} changes state and needs 'Authorization: Bearer <token>'")
            await response(scope, receive, send)
            return
        generates = method == "POST" and path in GENERATION_ROUTES
        if generates or path == "/health":
            try:  # the engine's own checks, as the gRPC API applies them: draining, and (to generate) weights whole
                self.engine.ensure_generating() if generates else self.engine.ensure_accepting()
            except Unavailable as exc:
                await _error(HTTPStatus.SERVICE_UNAVAILABLE, "ServiceUnavailableError", str(exc), retry_after=True)(scope, receive, send)
                return

        async def send_with_version(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (VERSION_HEADER.encode(), str(self.engine.version).encode())]
            await send(message)

        if not generates:
            await self.app(scope, receive, send_with_version)
            return
        slot = f"http-{uuid.uuid4().hex}"
        try:
            self.engine.admit(slot)
        except ResourceExhausted as exc:
            await _error(HTTPStatus.TOO_MANY_REQUESTS, "RateLimitError", str(exc), retry_after=True)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send_with_version)  # returns once the (streamed) body is sent
        finally:
            self.engine.release(slot)


def _dockrl_router(engine: RolloutEngine) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/policy_version")
    async def policy_version() -> dict:
        """The policy version now serving (the trainer's weight version) and the served model."""
        return {"policy_version": engine.version, "model": engine.model_name}

    @router.get("/v1/expert_load")
    async def expert_load() -> JSONResponse:
        """Tokens routed to each expert of each MoE layer since the replica started (input of `dockrl eplb`), and the
        imbalance under generate_config.expert_map_path; 404 for a dense model, 409 for a compiled one (nothing counted)."""
        if engine.moe_shape == (0, 0):
            return _error(HTTPStatus.NOT_FOUND, "NotFoundError", f"{engine.model_name} has no MoE layers: no expert load")
        if engine.expert_counting_off:
            return _error(HTTPStatus.CONFLICT, "ConflictError", engine.expert_counting_off)
        return JSONResponse(await engine.expert_load())

    return router


@functools.cache  # once per process: a second registration would duplicate every series
def _serve_dockrl_metrics_with_vllms() -> None:
    """Adds the dockrl_* registry to the one vLLM's /metrics renders (prometheus_client's default)."""
    prometheus_client.REGISTRY.register(metrics.REGISTRY)


async def build_http_app(engine: RolloutEngine, token: str) -> ASGIApp:
    """vLLM's OpenAI app on `engine`'s AsyncLLM with dockrl's routes, behind dockrl's middleware."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    tasks = await engine.llm.get_supported_tasks()
    root = logging.getLogger()
    level = root.level
    app = build_app(engine.args, tasks, engine.llm.model_config)
    # Importing vLLM's SageMaker routes (model_hosting_container_standards) sets the root logger to
    # $SAGEMAKER_CONTAINER_LOG_LEVEL, ERROR by default, which silenced every dockrl log line; vLLM puts
    # back the handlers' levels but not the root's.
    root.setLevel(level)
    await init_app_state(engine.llm, app.state, engine.args, tasks)
    app.include_router(_dockrl_router(engine))
    _serve_dockrl_metrics_with_vllms()
    # A wrapper, not app.add_middleware: vLLM's build_app has already built the app's middleware stack.
    return ReplicaMiddleware(app, engine, token)
