"""The one interface a weight push goes through, whichever transport trainer.weight_transport names.

`ReplicaSync` decides which replicas get which version; a `WeightTransport` moves one version's
buckets to a list of addresses and says who missed it. Each transport is built once from the config,
with everything it needs (bucket size, serving dtype, token, stall limit), so a push is the same call
for both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from services.common.config import Config
from services.common.weight_wire import BucketSource, torch_dtype
from services.trainer.weights.collective_push import CollectiveSender
from services.trainer.weights.weight_push import PushResult, push_weights


class WeightTransport(Protocol):
    """Moves one version's weights to rollout replicas."""

    def push(self, weights: BucketSource, addresses: list[str], version: int) -> PushResult:
        """Pushes `weights` as `version` to `addresses` (host:port); those that fail or stall are listed in the result."""


@dataclass(frozen=True)
class GrpcStreams:
    """trainer.weight_transport grpc: buckets as UpdateWeights messages, one stream per replica (fanout) or relayed (chain)."""

    bucket_mb: float
    mode: str
    token: str
    dtype: torch.dtype
    stall_s: float

    def push(self, weights: BucketSource, addresses: list[str], version: int) -> PushResult:
        return push_weights(weights, addresses, version, bucket_mb=self.bucket_mb, mode=self.mode, token=self.token,
                            dtype=self.dtype, stall_s=self.stall_s)


@dataclass(frozen=True)
class CollectiveGroups:
    """trainer.weight_transport collective: gRPC control, the bytes broadcast over a gloo group per replica (kept from push to push)."""

    sender: CollectiveSender
    bucket_mb: float
    dtype: torch.dtype

    def push(self, weights: BucketSource, addresses: list[str], version: int) -> PushResult:
        return self.sender.push(weights, addresses, version, bucket_mb=self.bucket_mb, dtype=self.dtype)


def build_transport(cfg: Config, token: str) -> WeightTransport:
    """The transport trainer.weight_transport names; buckets travel in the replicas' serving dtype."""
    tcfg = cfg.trainer
    dtype = torch_dtype(cfg.generate_config.dtype)
    if tcfg.weight_transport == "collective":
        return CollectiveGroups(CollectiveSender(token, tcfg.push_stall_s, tcfg.weight_group_host or tcfg.host), tcfg.bucket_mb, dtype)
    return GrpcStreams(tcfg.bucket_mb, tcfg.push_mode, token, dtype, tcfg.push_stall_s)
