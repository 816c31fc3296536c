"""Request bodies of the OpenAI-compatible HTTP API (the fields this server honours).

Fields the OpenAI client may send but that do not change generation here (user, metadata, ...)
are ignored; `top_k`, `min_p`, `ignore_eos`, `stop_token_ids` and `return_token_ids` are
extensions, sent with the client's `extra_body`, as with vLLM's server.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from services.common.errors import InvalidArgument
from services.rollout.sampling import NO_LOGPROBS, SamplingOverrides


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False  # adds `token_ids` to every choice

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def _overrides(self, max_tokens: int | None, logprobs: int) -> SamplingOverrides:
        stop = (self.stop,) if isinstance(self.stop, str) else (tuple(self.stop) if self.stop is not None else None)
        return SamplingOverrides(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            max_tokens=max_tokens, logprobs=logprobs, n=self.n, stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()), seed=self.seed, ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # top-k logprobs per token (0 = the sampled token's only)
    echo: bool = False

    def overrides(self) -> SamplingOverrides:
        if self.echo:
            raise InvalidArgument("echo", "is not supported by this server; send echo=false")
        return self._overrides(self.max_tokens, NO_LOGPROBS if self.logprobs is None else self.logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The message's text; content parts must be of type 'text'."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise InvalidArgument("messages.content", f"only text parts are supported, got type {part.get('type')!r}")
            parts.append(part.get("text", ""))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def overrides(self) -> SamplingOverrides:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidArgument("top_logprobs", "needs logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else NO_LOGPROBS
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._overrides(max_tokens, logprobs)

    def chat(self) -> list[dict]:
        """The messages as the chat template takes them."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]
