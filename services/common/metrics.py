"""Prometheus helpers: one registry per process and a text rendering for /metrics."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_CONTENT_TYPE

REGISTRY = CollectorRegistry()


def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    """A counter named dockrl_<name> in the process registry."""
    return Counter(f"dockrl_{name}", doc, labels, registry=REGISTRY)


def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
    """A gauge named dockrl_<name> in the process registry."""
    return Gauge(f"dockrl_{name}", doc, labels, registry=REGISTRY)


def histogram(name: str, doc: str, labels: tuple[str, ...] = (), buckets: tuple[float, ...] = Histogram.DEFAULT_BUCKETS) -> Histogram:
    """A histogram named dockrl_<name> in the process registry."""
    return Histogram(f"dockrl_{name}", doc, labels, registry=REGISTRY, buckets=buckets)


def render() -> tuple[bytes, str]:
    """The registry in Prometheus text format and its content type."""
    return generate_latest(REGISTRY), PROMETHEUS_CONTENT_TYPE
