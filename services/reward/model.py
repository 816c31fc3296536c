"""The reward model as one more verifier: a scalar-head model on vLLM's pooling runner.

`reward_model` in `verifier_function` scores each sample with `reward_config.load`, a Hugging Face
`*ForSequenceClassification` checkpoint with one label (an outcome reward model). Its input is the
prompt text followed by the response text, encoded with the reward model's own tokenizer, so a
reward model need not share the policy's tokenizer; the score is the head's raw output on the
last token (`classify` without its sigmoid), which is what Hugging Face's
`AutoModelForSequenceClassification` returns as `logits[:, 0]`.

An input longer than `reward_config.seq_length` tokens keeps its last `seq_length` tokens: the
score is read off the last token, and the end of the response is where its answer is. An input of
no tokens at all (empty prompt and empty response) is InvalidArgument; an empty response after a
prompt is scored as it is (the model judges the prompt alone).

The engine is vLLM's AsyncLLM on an event loop of its own thread. `submit` hands a batch to it and
returns at once, so the rule verifiers of the same batch run in the process pool meanwhile, and
batches of concurrent callers (gRPC handlers, the dock worker) share the engine's steps.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import pathlib
import threading
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from services.common.config import Config
from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.log import log_event
from services.common.metrics import counter

logger = logging.getLogger("dockrl.reward.model")

MODEL_VERIFIER = "reward_model"  # its name in verifier_function, parts and logs

MODEL_SAMPLES = counter("reward_model_samples_total", "samples scored by the reward model")
MODEL_TRUNCATED = counter("reward_model_truncated_total", "reward-model inputs cut to reward_config.seq_length tokens")


class ModelScorer(Protocol):
    """What scores the `reward_model` part: this process's engine (RewardModelScorer) or, on a rule
    replica of a split run, a reward-model replica (client.RemoteRewardModel)."""

    def encode(self, prompt: str, response: str, field: str) -> Any:
        """One sample's input for `submit`; InvalidArgument naming `field` when it cannot be scored."""

    def submit(self, inputs: Sequence[Any]) -> concurrent.futures.Future:
        """Starts scoring; the future gives one float per input, in order."""


class RewardModelScorer:
    """One vLLM pooling engine on `reward_config.load`; thread-safe."""

    def __init__(self, llm, tokenizer, seq_length: int, loop: asyncio.AbstractEventLoop, thread: threading.Thread):
        self._llm = llm
        self._tokenizer = tokenizer
        self.seq_length = seq_length
        self._loop = loop
        self._thread = thread

    @classmethod
    def start(cls, cfg: Config) -> "RewardModelScorer":
        """Starts the engine (about as long as a rollout engine's start; call under `__main__`).

        Engine settings come from generate_config (dtype, max_num_seqs, max_num_batched_tokens,
        enforce_eager, trust_remote_code, seed, cpu_kvcache_space_gb), with one device and
        max_model_len = reward_config.seq_length.
        """
        from transformers import AutoConfig, AutoTokenizer

        rm, gen = cfg.reward_config, cfg.generate_config
        path = str(pathlib.Path(rm.load).resolve())
        try:
            model_config = AutoConfig.from_pretrained(path, trust_remote_code=gen.trust_remote_code)
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=gen.trust_remote_code)
        except (OSError, ValueError) as exc:
            raise FailedPrecondition(f"reward_config.load: cannot load {rm.load!r}: {exc}") from None
        if getattr(model_config, "num_labels", 1) != 1:
            raise FailedPrecondition(f"reward_config.load: {rm.load!r} has {model_config.num_labels} labels; a reward model has 1")
        positions = getattr(model_config, "max_position_embeddings", None)
        if positions is not None and rm.seq_length > positions:
            raise FailedPrecondition(
                f"reward_config.seq_length: {rm.seq_length} exceeds the model's max_position_embeddings {positions}"
            )
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(gen.cpu_kvcache_space_gb))
        # On CPU the replica shares cores with the rollout engine and the verifier pool: let the OS
        # place its threads unless the deployment binds them (VLLM_CPU_OMP_THREADS_BIND).
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="reward-model-engine", daemon=True)
        thread.start()
        try:
            llm = asyncio.run_coroutine_threadsafe(_create_engine(path, cfg), loop).result()
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            raise
        log_event(logger, "reward model loaded", model=path, seq_length=rm.seq_length, dtype=gen.dtype)
        return cls(llm, tokenizer, rm.seq_length, loop, thread)

    @property
    def vocab_size(self) -> int:
        """Token ids the reward model's tokenizer knows (specials included)."""
        return len(self._tokenizer)

    def encode(self, prompt: str, response: str, field: str) -> list[int]:
        """The model's input ids of one sample: its last `seq_length` tokens; InvalidArgument naming
        `field` when prompt and response give no token."""
        ids = self._tokenizer(prompt + response)["input_ids"]
        if not ids:
            raise InvalidArgument(field, "is empty and so is the prompt: the reward model needs at least one token to score")
        if len(ids) > self.seq_length:
            MODEL_TRUNCATED.inc()
            ids = ids[-self.seq_length:]
        return ids

    def submit(self, inputs: Sequence[list[int]]) -> concurrent.futures.Future:
        """Starts scoring `inputs` (ids from `encode`); the future gives one float per input, in order."""
        return asyncio.run_coroutine_threadsafe(self._score_all(list(inputs)), self._loop)

    def score(self, inputs: Sequence[list[int]]) -> list[float]:
        """`submit(inputs).result()`."""
        return self.submit(inputs).result()

    async def _score_all(self, inputs: list[list[int]]) -> list[float]:
        scores = await asyncio.gather(*(self._score_one(ids) for ids in inputs))
        MODEL_SAMPLES.inc(len(inputs))
        return list(scores)

    async def _score_one(self, ids: list[int]) -> float:
        from vllm.pooling_params import PoolingParams

        # use_activation=False: the raw head output, not classify's sigmoid of it
        params = PoolingParams(task="classify", use_activation=False)
        final = None
        async for output in self._llm.encode({"prompt_token_ids": ids}, params, request_id=f"rm-{uuid.uuid4().hex}"):
            final = output
        return float(final.outputs.data.reshape(-1)[0])

    def close(self) -> None:
        """Stops the engine, then its loop thread."""
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._llm = None  # collected now: AsyncLLM's __del__ shuts down again, and fails at interpreter exit

    async def _shutdown(self) -> None:
        self._llm.shutdown()
        # the engine's output tasks live on this loop: end them here, not when the loop is collected
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> "RewardModelScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _create_engine(path: str, cfg: Config):
    """vLLM's AsyncLLM with the pooling runner, created on the loop that will serve it."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    gen, seq_length = cfg.generate_config, cfg.reward_config.seq_length
    args = AsyncEngineArgs(
        model=path,
        runner="pooling",
        dtype=gen.dtype,
        max_model_len=seq_length,
        max_num_seqs=gen.max_num_seqs,
        max_num_batched_tokens=max(gen.max_num_batched_tokens, seq_length),
        gpu_memory_utilization=gen.gpu_memory_utilization,
        enforce_eager=gen.enforce_eager,
        trust_remote_code=gen.trust_remote_code,
        seed=gen.seed,
        disable_log_stats=True,
    )
    return AsyncLLM.from_engine_args(args)
