"""The text of a tool call and of the tools' responses, as the rollout's "tools" environment reads and writes it.

One place for both sides of an episode's text: the rollout's tools environment (services/rollout/agent) wraps its
responses with `observation_text`, and the tiny demo's warm start (services/common/warm_start.py) builds its
targets with `tag_call_text` and `observation_text`, so the warm start trains on the very tokens the rollout later
samples and appends.
"""
from __future__ import annotations

import json

# How a turn's tool responses are wrapped, per rollout.multi_turn.format. tag: on their own lines after the call
# (a model without chat tokens goes on writing in the same stream). hermes: a ChatML user turn, as the Qwen and
# Hermes chat templates render tool results, closing the model's turn line and opening the next assistant turn.
_WRAP = {"tag": ("\n", "\n"), "hermes": ("\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")}


def observation_text(responses: list[str], fmt: str) -> str:
    """The observation that answers one turn's calls: each response in `<tool_response>` tags, wrapped for `fmt`."""
    prefix, suffix = _WRAP[fmt]
    return prefix + "".join(f"<tool_response>{r}</tool_response>" for r in responses) + suffix


def tag_call_text(name: str, arguments: dict, start: str, end: str, body: str = "json") -> str:
    """One call in the tag format (rollout.multi_turn.tag_body `body`): `start`, compact JSON `{"name": ...,
    "arguments": {...}}` (json) or the one argument's value (argument), `end`."""
    if body == "argument":
        (value,) = arguments.values()
        return start + str(value) + end
    return start + json.dumps({"name": name, "arguments": arguments}, separators=(",", ":")) + end
