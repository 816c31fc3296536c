"""Routing replay (slime's R3): the trainer's MoE routers pick the experts the rollout picked, token by token.

megatron-core 0.16.1's `RouterReplay` (one per router, built when `moe_enable_routing_replay` is set)
does the replay: with the REPLAY_FORWARD action its top-k takes the given expert ids and gathers their
scores, so the gate's probabilities (and their gradients) stay the trainer's own while the choice is the
rollout's. Here each forward pass hands every MoE layer its [tokens, top_k] ids in the order the router
flattens its input ([S, b] -> S-major) and clears them after. Backward needs no replay: no layer is
recomputed (no activation recompute), autograd keeps the forward's routing.
"""
from __future__ import annotations

import contextlib

import torch


def moe_replays(model) -> list[tuple[int, object]]:
    """(layer index in the whole model, `RouterReplay`) of each MoE layer of `model` (megatron, maybe DDP-wrapped; under
    pipeline parallel this stage's layers), in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [(m.layer_number - 1, m.router_replay) for m in model.modules()
            if isinstance(m, TopKRouter) and m.router_replay is not None]


@contextlib.contextmanager
def replaying(model, routing: torch.Tensor):
    """Within the block, every MoE layer l of `model` routes token t to the experts routing[t, l] ([tokens, layers, top_k])."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = moe_replays(model)
    if not replays:
        raise ValueError("rl_config.routing_replay: the model's routers were built without replay (build_model(routing_replay=True))")
    if replays[-1][0] >= routing.size(1):
        raise ValueError(f"rl_config.routing_replay: the routing has {routing.size(1)} MoE layers, the model at least {replays[-1][0] + 1}")
    try:
        for layer, replay in replays:
            replay.set_target_indices(routing[:, layer].long())
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        yield
    finally:
        for _, replay in replays:
            replay.clear_router_replay_action()
            replay.clear_indices()


def token_routing(routed: list[torch.Tensor], lengths: list[int], width: int | None) -> torch.Tensor:
    """Per-sample routing ([n_i <= length_i, layers, top_k]) laid out as the model's tokens.

    `width` given: padded rows of that width, [width * B] S-major (the router's flattening of [S, b]);
    None: samples packed end to end, [sum(lengths)]. Positions without a recorded routing (each sample's
    last token, which the rollout never fed to its model, and padding) take experts 0..top_k-1: no
    log-prob reads their output (causal attention: nothing after them does either).
    """
    layers, top_k = routed[0].shape[1:]
    filler = torch.arange(top_k, dtype=torch.long)
    rows = []
    for i, (sample, length) in enumerate(zip(routed, lengths)):
        if len(sample) > length or tuple(sample.shape[1:]) != (layers, top_k):
            raise ValueError(f"routed_experts: sample {i}'s routing {tuple(sample.shape)} does not fit its {length} tokens "
                             f"x {layers} MoE layers x top-{top_k}")
        row = filler.expand(width or length, layers, top_k).clone()
        row[: len(sample)] = sample.long()
        rows.append(row)
    if width is None:
        return torch.cat(rows)
    return torch.stack(rows, 1).reshape(-1, layers, top_k)
