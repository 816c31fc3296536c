"""Agentic rollout: episodes of model turns and environment observations, run in the rollout replicas' dock workers.

The package's modules, one job each:
  environment       the environment interface (reset / step, Gymnasium's shape) and the registry of environments
  tools             a tool (OpenAI tool schema, async call with a timeout) and the calculator
  tool_calls        a model turn's text -> its tool calls (the tag format, or vLLM's hermes parser)
  tool_environment  the "tools" environment: each turn's tool calls answered with the tools' results
  episode           one episode run token-exact into a trajectory (ids, loss mask, log-probs, versions, turns)
"""
from __future__ import annotations

from services.rollout.agent import tool_environment  # noqa: F401  (registers the built-in "tools" environment)
