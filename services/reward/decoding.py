"""Token ids -> response text (and text -> token count) with the run's tokenizer, loaded on first use."""
from __future__ import annotations

import threading
from collections.abc import Sequence

from services.common.errors import FailedPrecondition


class ResponseDecoder:
    """transformers' AutoTokenizer from `megatron_training.tokenizer_name_or_path`; special tokens
    are dropped when decoding, as MindSpeed-RL's reward does (`skip_special_tokens=True`)."""

    def __init__(self, tokenizer_path: str):
        self.tokenizer_path = tokenizer_path
        self._tokenizer = None
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        """Whether a tokenizer is configured."""
        return bool(self.tokenizer_path)

    def _load(self):
        with self._lock:
            if self._tokenizer is None:
                if not self.tokenizer_path:
                    raise FailedPrecondition("megatron_training.tokenizer_name_or_path is empty: this server cannot decode token ids")
                from transformers import AutoTokenizer  # heavy: only when ids arrive

                try:
                    self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
                except (OSError, ValueError) as exc:
                    raise FailedPrecondition(f"megatron_training.tokenizer_name_or_path: cannot load {self.tokenizer_path!r}: {exc}") from None
            return self._tokenizer

    def preload(self) -> None:
        """Loads the tokenizer now, in a background thread, so the first scored batch does not wait
        for transformers' import and the tokenizer's load (seconds on CPU); a tokenizer that cannot
        load yet is loaded, or refused with its error, on first use as before."""
        def load() -> None:
            try:
                self._load()
            except FailedPrecondition:
                pass

        threading.Thread(target=load, name="tokenizer-preload", daemon=True).start()

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer knows (specials included)."""
        return len(self._load())

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `token_ids`, special tokens dropped unless `skip_special_tokens` is False."""
        return self._load().decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def count_tokens(self, text: str) -> int:
        """How many tokens `text` encodes to (no special tokens added)."""
        return len(self._load().encode(text, add_special_tokens=False))
