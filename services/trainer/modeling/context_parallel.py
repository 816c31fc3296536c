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
(MindSpeed-RL's `ulysses_cp_algo`), "p2p" the ring (`megatron_cp_algo`), "a2a+p2p" both
(`hybrid_cp_algo`): Ulysses within each group of U consecutive CP ranks, the ring across the
R = CP / U ranks holding the same heads (megatron's hierarchical CP groups [U, R]). That needs no
other layout: the chunks of CP ranks g * U .. g * U + U - 1 together are chunks g and 2 * R - 1 - g
of the sequence cut into 2 * R chunks, the ring's layout for R ranks. The ring computes each
block with torch's flash-attention kernel for the CPU and with explicit scores on other devices;
on a GPU with TransformerEngine installed, TE's fused CP attention (`TEDotProductAttention`, same
`cp_comm_type`) is the path to take, which this layer spec does not wire up yet (TE is not
installed here).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# MindSpeed-RL's names -> megatron-core's TransformerConfig.cp_comm_type.
CP_ALGOS = {"ulysses_cp_algo": "a2a", "megatron_cp_algo": "p2p", "hybrid_cp_algo": "a2a+p2p"}


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
        dist.all_gather_single(gathered, local.contiguous(), group=group)
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


def _ring_pass(send: torch.Tensor, group):
    """Starts sending `send` to the next rank of the ring and receiving what the previous one sends; returns a
    function that waits for both and gives the received tensor (work can run between the two)."""
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send.contiguous(), _group_peer(group, 1), group),
           dist.P2POp(dist.irecv, recv, _group_peer(group, -1), group)]
    requests = dist.batch_isend_irecv(ops)

    def received() -> torch.Tensor:
        for request in requests:
            request.wait()
        del ops[:]  # the sent tensor is free once its send is done
        return recv

    return received


def _block_forward(q, k, v, causal: bool, scale: float, fused: bool):
    """(out, log-sum-exp) of q [B, H, m, D] attending to k/v [B, H, n, D], causal (m == n) or not.

    `fused`: torch's flash-attention kernel for the CPU, which returns the log-sum-exp the merge
    needs; elsewhere the scores are formed explicitly (TransformerEngine's CP replaces both on GPUs).
    """
    if fused:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    scores = _scores(q, k, causal, scale)
    lse = scores.logsumexp(-1)
    return torch.matmul((scores - lse.unsqueeze(-1)).exp(), v), lse


def _block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, fused: bool):
    """(dq, dk, dv) of one block, given the merged output and log-sum-exp of the queries' whole attention."""
    if fused:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    probs = (_scores(q, k, causal, scale) - lse.unsqueeze(-1)).exp()
    dscores = probs * (torch.matmul(dout, v.transpose(-1, -2)) - (dout * out).sum(-1, keepdim=True)) * scale
    return torch.matmul(dscores, k), torch.matmul(dscores.transpose(-1, -2), q), torch.matmul(probs.transpose(-1, -2), dout)


def _scores(q, k, causal: bool, scale: float):
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        hidden = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def _blocks(bounds: list[int], rank: int, src: int):
    """(query slice, key slice, causal) of each sequence between local `bounds` that rank `rank`'s queries attend in
    rank `src`'s keys. Each rank holds chunks (r, 2 * CP - 1 - r) of a sequence: its own block is causal; an earlier
    rank's first chunk is seen whole by both query chunks (its second chunk by neither); a later rank's two chunks are
    seen whole by the second query chunk only. Half of each other block is never computed.
    """
    for start, end in zip(bounds[:-1], bounds[1:]):
        middle = (start + end) // 2
        if src == rank:
            yield slice(start, end), slice(start, end), True
        elif src < rank:
            yield slice(start, end), slice(start, middle), False
        else:
            yield slice(middle, end), slice(start, end), False


class _RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries against every rank's keys/values, passed around the CP ring.

    q, k, v [B, H, n, D] in this rank's layout; `bounds` the local bounds of its sequences (each
    sequence's share is two chunks, see `_blocks`). Blocks merge by online softmax (running
    log-sum-exp); the backward pass recomputes each block with the merged output and log-sum-exp
    and passes the key/value gradients around the ring with the keys and values, so only q, k, v,
    the output and the log-sum-exp are kept.
    """

    @staticmethod
    def forward(ctx, q, k, v, bounds, scale, group):
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        fused = q.device.type == "cpu"
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(cp):
            src = (rank - step) % cp
            incoming = _ring_pass(kv, group) if step < cp - 1 else None
            for rows, cols, causal in _blocks(bounds, rank, src):
                block_out, block_lse = _block_forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal, scale, fused)
                merged = torch.logaddexp(lse[:, :, rows], block_lse)
                out[:, :, rows] = (out[:, :, rows] * (lse[:, :, rows] - merged).exp().unsqueeze(-1)
                                   + block_out * (block_lse - merged).exp().unsqueeze(-1))
                lse[:, :, rows] = merged
            if incoming is not None:  # the next block travelled while this one was computed
                kv = incoming()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.bounds, ctx.scale, ctx.group, ctx.fused = bounds, scale, group, fused
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)  # travels with the block it belongs to
        for step in range(cp):
            src = (rank - step) % cp
            for rows, cols, causal in _blocks(ctx.bounds, rank, src):
                dq_b, dk_b, dv_b = _block_backward(dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                                   out[:, :, rows], lse[:, :, rows], causal, ctx.scale, ctx.fused)
                dq[:, :, rows] += dq_b
                dkv[0][:, :, cols] += dk_b
                dkv[1][:, :, cols] += dv_b
            if step < cp - 1:
                kv, dkv = _ring_pass(torch.stack([kv, dkv]), group)().unbind(0)
        # The gradients last held are those of rank + 1's block: one more pass takes them home.
        dkv = _ring_pass(dkv, group)() if cp > 1 else dkv
        return dq, dkv[0], dkv[1], None, None, None


def ring_attention(q, k, v, bounds: list[int], scale: float, group) -> torch.Tensor:
    """Ring attention ("p2p", `megatron_cp_algo`) over `group`: q, k, v [B, H, n, D] of this rank's positions -> [B, H, n, D].

    `bounds`: where each sequence's share starts and ends in this rank's n positions ([0, n] for padded rows); rank
    i of `group` holds chunks i and 2 * size - 1 - i of each sequence (the CP group, or hybrid's ring group).
    """
    dtype = q.dtype
    out = _RingAttention.apply(q.float(), k.float(), v.float(), bounds, scale, group)
    return out.to(dtype)


def hybrid_groups():
    """(Ulysses group, ring group) of this rank under `hybrid_cp_algo`: megatron's hierarchical CP groups [U, R],
    U consecutive CP ranks and the R ranks one U apart; None when init_parallel made none."""
    from megatron.core import parallel_state

    return parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)


def sequence_to_heads(x: torch.Tensor, index: torch.Tensor, group) -> torch.Tensor:
    """Ulysses ("a2a"), the way in, over `group` of G ranks: [n, B, H, D] of this rank's positions -> [G * n, B, H / G, D],
    the group's positions in ascending order, this rank's group of H / G heads.

    `index` [G, n]: the positions rank i of `group` holds (the whole CP layout under `ulysses_cp_algo`, so every
    position in global order; the rows of this rank's Ulysses group under `hybrid_cp_algo`).
    """
    from megatron.core.tensor_parallel.mappings import all_to_all

    g = index.size(0)
    n, b, h, d = x.shape
    # Head group j goes to rank j; what arrives from rank i is its n positions.
    grouped = x.reshape(n, b, g, h // g, d).permute(2, 0, 1, 3, 4).reshape(g * n, b, h // g, d)
    received = all_to_all(group, grouped.contiguous())
    return received[index.reshape(-1).argsort().to(x.device)]


def heads_to_sequence(x: torch.Tensor, index: torch.Tensor, group) -> torch.Tensor:
    """Ulysses, the way back: [G * n, B, H / G, D] in sequence_to_heads' order -> [n, B, H, D] of this rank's positions,
    every head."""
    from megatron.core.tensor_parallel.mappings import all_to_all

    g = index.size(0)
    total, b, hg, d = x.shape
    # Where each held position sits in the ascending order: rank i's positions, in order, go back to rank i.
    by_rank = x[index.reshape(-1).argsort().argsort().to(x.device)]
    received = all_to_all(group, by_rank.contiguous())
    return received.reshape(g, total // g, b, hg, d).permute(1, 2, 0, 3, 4).reshape(total // g, b, g * hg, d)
