"""Context parallel: each sequence split over the CP ranks, the attention exchanges between them, and per-token results made whole.

Layout (megatron's): a sequence padded to a multiple of 2 * CP is cut into 2 * CP chunks and CP
rank r holds chunks r and 2 * CP - 1 - r, so every rank has as much causal attention work as any
other. It is the layout of megatron-core's `get_batch_on_this_cp_rank` (padded rows) and of the
THD split TransformerEngine's `thd_get_partitioned_indices` gives (each packed sequence on its own),
and it is what megatron's rotary embedding assumes when it slices the positions of a CP rank
(`get_pos_emb_on_this_cp_rank`, `_get_thd_freqs_on_this_cp_rank`), so every token gets the RoPE
of its true position.

The attention exchanges are written here by hand: megatron-core leaves them to TransformerEngine
(`TEDotProductAttention` with `cp_comm_type`), which is neither on the CPU nor in this project's
layer spec (see attention.py). They take the same `cp_comm_type` values: "a2a" is Ulysses
(MindSpeed-RL's `ulysses_cp_algo`), "p2p" the ring (`megatron_cp_algo`). On an accelerator with
TransformerEngine installed its fused CP attention would do the ring's work with flash kernels;
the ring below is the reference that runs everywhere (explicit per-block scores, recomputed in the
backward pass rather than kept).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# MindSpeed-RL's names -> megatron-core's TransformerConfig.cp_comm_type.
CP_ALGOS = {"ulysses_cp_algo": "a2a", "megatron_cp_algo": "p2p"}


def context_parallel_rank_size() -> tuple[int, int]:
    """(this rank's context-parallel rank, the CP size); (0, 1) before megatron's groups exist."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_world_size()


def padded_length(length: int, cp: int) -> int:
    """`length` rounded up to a multiple of 2 * CP (unchanged at CP 1)."""
    multiple = 2 * cp if cp > 1 else 1
    return -(-length // multiple) * multiple


def chunk_index(length: int, cp: int, rank: int) -> torch.Tensor:
    """Positions 0..length-1 (a multiple of 2 * CP) that CP rank `rank` holds: chunks rank and 2 * CP - 1 - rank."""
    chunk = length // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    return torch.cat([first, torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def layout_index(lengths: list[int], cp: int) -> torch.Tensor:
    """[CP, n]: row r is the flat positions CP rank r holds of sequences of `lengths` (each a multiple of 2 * CP) laid end to end."""
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0).tolist()
    return torch.stack([torch.cat([start + chunk_index(n, cp, r) for start, n in zip(starts, lengths)]) for r in range(cp)])


class _GatherSequence(torch.autograd.Function):
    """All-gathers [n, ...] over the CP group into [CP * n, ...] in global order; the backward pass keeps this rank's share.

    Every CP rank computes the same loss from the whole result, so the gradient of its own share
    is already complete on each rank: no communication is needed going back.
    """

    @staticmethod
    def forward(ctx, local, index, group):
        cp = index.size(0)
        gathered = local.new_empty((cp * local.size(0), *local.shape[1:]))
        dist.all_gather_into_tensor(gathered, local.contiguous(), group=group)
        whole = torch.empty_like(gathered)
        whole[index.reshape(-1).to(local.device)] = gathered
        ctx.mine = index[dist.get_rank(group)].to(local.device)
        return whole

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.mine], None, None


def gather_sequence(local: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """This rank's values [n, ...] of the positions `index[rank]` -> every position's [CP * n, ...], on every CP rank."""
    from megatron.core import parallel_state

    return _GatherSequence.apply(local, index, parallel_state.get_context_parallel_group())


def _group_peer(group, offset: int) -> int:
    return dist.get_global_rank(group, (dist.get_rank(group) + offset) % dist.get_world_size(group))


def _ring_pass(send: torch.Tensor, group) -> torch.Tensor:
    """Sends `send` to the next rank of the ring and returns what the previous one sent."""
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send.contiguous(), _group_peer(group, 1), group),
           dist.P2POp(dist.irecv, recv, _group_peer(group, -1), group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return recv


def _block_scores(q, k, scale, allowed):
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    return scores.masked_fill(~allowed, float("-inf"))


class _RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries against every rank's keys/values, passed around the CP ring.

    q, k, v [B, H, n, D]; positions [CP, n] (each rank's global positions) and segments [CP, n]
    (which packed sequence each position is in): a key is visible to a query in the same segment
    at or before it. Blocks merge by online softmax (running log-sum-exp); the backward pass
    recomputes each block's scores and passes the key/value gradients around the ring with the
    keys and values, so only q, k, v, the output and the log-sum-exp are kept.
    """

    @staticmethod
    def forward(ctx, q, k, v, positions, segments, scale, group):
        rank = dist.get_rank(group)
        cp = positions.size(0)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv = torch.stack([k, v])
        for step in range(cp):
            src = (rank - step) % cp
            incoming = _ring_pass(kv, group) if step < cp - 1 else None
            allowed = _visible(positions, segments, rank, src)
            scores = _block_scores(q, kv[0], scale, allowed)
            block_lse = scores.logsumexp(-1)
            # A query that sees no key of this block has lse -inf: its weights are 0, not NaN.
            safe_lse = block_lse.masked_fill(block_lse.isinf(), 0.0)
            block_out = torch.matmul((scores - safe_lse.unsqueeze(-1)).exp(), kv[1])
            merged = torch.logaddexp(lse, block_lse)
            out = out * (lse - merged).exp().unsqueeze(-1) + block_out * (block_lse - merged).exp().unsqueeze(-1)
            lse = merged
            if incoming is not None:
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse, positions, segments)
        ctx.scale, ctx.group = scale, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, positions, segments = ctx.saved_tensors
        scale, group = ctx.scale, ctx.group
        rank = dist.get_rank(group)
        cp = positions.size(0)
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)  # travels with the block it belongs to
        for step in range(cp):
            src = (rank - step) % cp
            allowed = _visible(positions, segments, rank, src)
            probs = (_block_scores(q, kv[0], scale, allowed) - lse.unsqueeze(-1)).exp()
            dprobs = torch.matmul(dout, kv[1].transpose(-1, -2))
            dscores = probs * (dprobs - delta) * scale
            dq += torch.matmul(dscores, kv[0])
            dkv[0] += torch.matmul(dscores.transpose(-1, -2), q)
            dkv[1] += torch.matmul(probs.transpose(-1, -2), dout)
            if step < cp - 1:
                kv, dkv = _ring_pass(torch.stack([kv, dkv]), group).unbind(0)
        # The gradients last held are those of rank + 1's block: one more pass takes them home.
        dkv = _ring_pass(dkv, group) if cp > 1 else dkv
        return dq, dkv[0], dkv[1], None, None, None, None


def _visible(positions, segments, rank: int, src: int) -> torch.Tensor:
    """[n_q, n_k]: which of rank `src`'s keys each of rank `rank`'s queries sees (causal within its segment)."""
    q_pos, k_pos = positions[rank].unsqueeze(1), positions[src].unsqueeze(0)
    return (k_pos <= q_pos) & (segments[rank].unsqueeze(1) == segments[src].unsqueeze(0))


def ring_attention(q, k, v, index: torch.Tensor, bounds: list[int] | None, scale: float) -> torch.Tensor:
    """Ring attention ("p2p", `megatron_cp_algo`): q, k, v [B, H, n, D] of this rank's positions -> [B, H, n, D].

    `index` [CP, n] is every rank's global positions; `bounds` the packed sequences' flat bounds (None for padded rows).
    """
    from megatron.core import parallel_state

    segments = torch.zeros_like(index) if bounds is None else torch.bucketize(index, torch.tensor(bounds[1:-1]), right=True)
    index, segments = index.to(q.device), segments.to(q.device)
    dtype = q.dtype
    out = _RingAttention.apply(q.float(), k.float(), v.float(), index, segments, scale,
                               parallel_state.get_context_parallel_group())
    return out.to(dtype)


def sequence_to_heads(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Ulysses ("a2a", `ulysses_cp_algo`), the way in: [n, B, H, D] of this rank's positions -> [CP * n, B, H / CP, D],
    every position in global order, this rank's group of H / CP heads."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import all_to_all

    cp = index.size(0)
    n, b, h, d = x.shape
    # Head group j goes to CP rank j; what arrives from rank i is its n positions.
    grouped = x.reshape(n, b, cp, h // cp, d).permute(2, 0, 1, 3, 4).reshape(cp * n, b, h // cp, d)
    received = all_to_all(parallel_state.get_context_parallel_group(), grouped.contiguous())
    return received[index.reshape(-1).argsort().to(x.device)]


def heads_to_sequence(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Ulysses, the way back: [CP * n, B, H / CP, D] in global order -> [n, B, H, D] of this rank's positions, every head."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import all_to_all

    cp = index.size(0)
    total, b, hg, d = x.shape
    by_rank = x[index.reshape(-1).to(x.device)]  # rank i's positions, in order, go back to rank i
    received = all_to_all(parallel_state.get_context_parallel_group(), by_rank.contiguous())
    return received.reshape(cp, total // cp, b, hg, d).permute(1, 2, 0, 3, 4).reshape(total // cp, b, cp * hg, d)
