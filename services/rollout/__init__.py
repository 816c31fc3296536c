"""Rollout server: a vLLM engine behind gRPC and an OpenAI-compatible HTTP API, with bucketed weight updates."""
