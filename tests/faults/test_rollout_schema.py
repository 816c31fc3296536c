"""Schemathesis against the rollout server's own OpenAPI schema: generated valid and invalid requests
to every operation get no 5xx, and the server stays up."""
from __future__ import annotations

import collections

import httpx
import pytest

pytestmark = pytest.mark.service

EXAMPLES_PER_MODE = 30  # bounded: each example is a real request to a vLLM replica on a 2-core CPU


def test_generated_requests_get_no_5xx(rollout_servers, fault_log):
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    base = rollout_servers.a.http_base
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    operations = sorted(f"{op.method.upper()} {op.path}" for op in (r.ok() for r in schema.get_all_operations()))
    for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
        statuses: collections.Counter = collections.Counter()
        server_errors: list[str] = []

        @settings(max_examples=EXAMPLES_PER_MODE, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=schema.as_strategy(generation_mode=mode))
        def call(case):
            response = case.call(base_url=base, timeout=60)
            statuses[response.status_code] += 1
            if response.status_code >= 500:
                server_errors.append(f"{case.method} {case.path} {case.body!r:.120} -> {response.status_code} {response.text[:200]}")

        call()
        fault_log.check("rollout HTTP input", f"schemathesis, {mode.value} mode, {sum(statuses.values())} requests over {', '.join(operations)}",
                        "no 5xx", f"statuses {dict(sorted(statuses.items()))}; 5xx: {server_errors[:2] or 'none'}", not server_errors)
    health = httpx.get(f"{base}/health", timeout=30)
    fault_log.check("rollout HTTP input", "GET /health after the generated requests", "200", str(health.status_code), health.status_code == 200)
