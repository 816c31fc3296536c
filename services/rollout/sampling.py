"""Sampling parameters: the config's defaults plus per-request overrides, validated field by field.

Every API (gRPC, HTTP, the dock worker) turns its request into `SamplingOverrides`; `resolve`
fills the gaps from `generate_config.sampling_config` and checks each value against its limit,
so a bad request fails with the field's name and the accepted range before it reaches vLLM.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Sequence

from services.common.config import SamplingConfig
from services.common.errors import InvalidArgument

MAX_TEMPERATURE = 100.0
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_STOP_STRINGS = 16
NO_LOGPROBS = -1  # SamplingOverrides.logprobs: return none, whatever the default


@dataclass(frozen=True)
class SamplingOverrides:
    """What one request asks for; None takes the server's sampling_config value."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    logprobs: int | None = None  # top-k logprobs per token; 0 = only the sampled token's; NO_LOGPROBS = none
    n: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False


@dataclass(frozen=True)
class ResolvedSampling:
    """Validated sampling parameters of one request; `logprobs` None returns no logprobs."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_tokens: int
    logprobs: int | None
    n: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    seed: int | None
    ignore_eos: bool
    detokenize: bool

    def to_vllm(self, final_only: bool = False):
        """The vLLM SamplingParams streaming per-token deltas, or with `final_only` one output when the request ends."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=0 if self.top_k == -1 else self.top_k,
            min_p=self.min_p,
            max_tokens=self.max_tokens,
            logprobs=self.logprobs,
            stop=list(self.stop) or None,
            stop_token_ids=list(self.stop_token_ids) or None,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            detokenize=self.detokenize,
            output_kind=RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA,
        )


def sample_seed(base: int, prompt: Sequence[int], sample_index: int, version: int, done_tokens: int) -> int:
    """The vLLM seed of one dock row: a hash of (run seed, prompt tokens, index in its group, policy version, tokens already generated).

    The dock worker sends one n=1 request per row, so one seed for all would give a group n identical
    responses; a seed per row keeps them apart while a rerun of the same run draws the same ones. The
    version (and, under partial rollout, the tokens already generated) parts a prompt seen again in a
    later epoch, or resumed in a later claim, from its earlier draws.
    """
    digest = hashlib.blake2b(digest_size=8)
    for part in (base, sample_index, version, done_tokens, len(prompt)):
        digest.update(int(part).to_bytes(8, "little", signed=True))
    digest.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in prompt))
    return int.from_bytes(digest.digest(), "little") >> 1  # 63 bits: a non-negative int64 for torch.Generator


def _check_range(field: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    ok = (value > low if low_open else value >= low) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise InvalidArgument(field, f"must be in {bracket}{low}, {high}], got {value!r}")


def resolve(
    defaults: SamplingConfig,
    overrides: SamplingOverrides,
    *,
    prompt_tokens: int,
    max_model_len: int,
    max_n: int,
    detokenize: bool,
) -> ResolvedSampling:
    """Merges `overrides` over `defaults` and validates every value; raises InvalidArgument naming the field."""
    merged = {f.name: getattr(overrides, f.name) for f in dataclasses.fields(SamplingOverrides)}
    for name in ("temperature", "top_p", "top_k", "min_p", "max_tokens", "n", "stop", "seed"):
        if merged[name] is None:
            merged[name] = getattr(defaults, name)
    if merged["logprobs"] is None:
        merged["logprobs"] = 0 if defaults.logprobs else None
    elif merged["logprobs"] == NO_LOGPROBS:
        merged["logprobs"] = None
    _check_range("temperature", merged["temperature"], 0.0, MAX_TEMPERATURE)
    _check_range("top_p", merged["top_p"], 0.0, 1.0, low_open=True)
    _check_range("min_p", merged["min_p"], 0.0, 1.0)
    if merged["top_k"] == 0 or merged["top_k"] < -1:
        raise InvalidArgument("top_k", f"must be -1 (off) or >= 1, got {merged['top_k']!r}")
    _check_range("n", merged["n"], 1, max_n)
    if merged["n"] > 1 and merged["temperature"] == 0:
        raise InvalidArgument("n", f"must be 1 with temperature 0 (greedy gives n identical completions), got {merged['n']}")
    if merged["logprobs"] is not None:
        _check_range("logprobs", merged["logprobs"], 0, MAX_LOGPROBS)
    if len(merged["stop"]) > MAX_STOP_STRINGS:
        raise InvalidArgument("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(merged['stop'])}")
    if prompt_tokens < 1:
        raise InvalidArgument("prompt", "is empty; give at least one token")
    if prompt_tokens >= max_model_len:
        raise InvalidArgument(
            "prompt", f"has {prompt_tokens} tokens; max_model_len is {max_model_len}, so at most {max_model_len - 1} fit"
        )
    room = max_model_len - prompt_tokens
    if merged["max_tokens"] < 1 or merged["max_tokens"] > room:
        raise InvalidArgument(
            "max_tokens",
            f"must be in [1, {room}] (max_model_len {max_model_len} - {prompt_tokens} prompt tokens), got {merged['max_tokens']!r}",
        )
    return ResolvedSampling(
        temperature=float(merged["temperature"]),
        top_p=float(merged["top_p"]),
        top_k=int(merged["top_k"]),
        min_p=float(merged["min_p"]),
        max_tokens=int(merged["max_tokens"]),
        logprobs=merged["logprobs"],
        n=int(merged["n"]),
        stop=tuple(merged["stop"]),
        stop_token_ids=tuple(merged["stop_token_ids"]),
        seed=merged["seed"],
        ignore_eos=bool(merged["ignore_eos"]),
        detokenize=detokenize or bool(merged["stop"]),
    )
