"""Log-probabilities and entropy of response tokens given their prompts, on the megatron model.

Each sample is its prompt followed by its response, contiguous. Two equivalent forward paths:
padded (rows right-padded to the micro-batch's longest, causal attention) and packed
(`use_remove_padding`: samples concatenated into one row in megatron's THD format, attention
causal within each sample). `use_dynamic_bsz` forms micro-batches by a token budget
(`max_packing_token_size`) instead of a fixed `micro_batch_size`. Under context parallel each CP
rank runs the model on its share of every sequence (context_parallel.py) and the per-token
log-probs and entropy are gathered whole before the responses' are picked out.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from services.trainer.modeling import context_parallel
from services.trainer.modeling.data_parallel import my_rows, sum_over_data_parallel
from services.trainer.modeling.model import compute_device
from services.trainer.modeling.model_inputs import ModelInputs, packed_params, padded_inputs
from services.trainer.modeling.pipeline import pipelined_micro_batches
from services.trainer.modeling.routing_replay import token_routing


@dataclass(frozen=True)
class ResponseBatch:
    """B samples: token ids of prompt + response and where the response sits."""

    tokens: torch.Tensor  # [B, S] prompt then response, right-padded with 0
    prompt_lengths: torch.Tensor  # [B]
    response_lengths: torch.Tensor  # [B]
    # routing replay: per sample [n <= P+L, MoE layers, top_k] the experts each position was routed to in rollout
    # (rl_config.routing_replay); None: the routers choose
    routed_experts: list[torch.Tensor] | None = None
    # [B, L] 1 on the model's response tokens, 0 on those an environment added (multi-turn episodes) and past each
    # response; None: every response token is the model's
    loss_mask: torch.Tensor | None = None

    @classmethod
    def from_token_ids(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                       routed_experts: list[torch.Tensor] | None = None,
                       loss_masks: Sequence[Sequence[int]] | None = None) -> "ResponseBatch":
        """Builds the padded tensor from per-sample prompt and response token ids, lists or int arrays (a
        ScoredSample's, as the dock gave them), their rollout routing, and their loss masks (multi-turn episodes)."""
        if len(prompts) != len(responses):
            raise ValueError(f"responses: {len(responses)} responses for {len(prompts)} prompts")
        if any(len(r) == 0 for r in responses):
            raise ValueError("responses: every sample needs at least one response token")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: every sample needs at least one prompt token (the first response token is predicted from it)")
        width = max(len(p) + len(r) for p, r in zip(prompts, responses))
        tokens = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            tokens[i, : len(p) + len(r)] = torch.from_numpy(np.concatenate([p, r]).astype(np.int64))
        if routed_experts is not None and len(routed_experts) != len(prompts):
            raise ValueError(f"routed_experts: {len(routed_experts)} routings for {len(prompts)} samples")
        mask = None
        if loss_masks is not None:
            if [len(m) for m in loss_masks] != [len(r) for r in responses]:
                raise ValueError("loss_masks: each sample needs one mask value per response token")
            mask = torch.zeros(len(responses), max(len(r) for r in responses))
            for i, m in enumerate(loss_masks):
                mask[i, : len(m)] = torch.as_tensor(np.asarray(m, np.float32))
        return cls(tokens, torch.tensor([len(p) for p in prompts]), torch.tensor([len(r) for r in responses]), routed_experts,
                   mask)

    @property
    def size(self) -> int:
        return self.tokens.size(0)

    @property
    def max_response_length(self) -> int:
        return int(self.response_lengths.max())

    @property
    def sequence_lengths(self) -> torch.Tensor:
        return self.prompt_lengths + self.response_lengths

    def response_mask(self) -> torch.Tensor:
        """[B, L]: 1 on the response tokens the loss trains (the model's), L the longest response."""
        mask = (torch.arange(self.max_response_length).unsqueeze(0) < self.response_lengths.unsqueeze(1)).float()
        return mask if self.loss_mask is None else mask * self.loss_mask[:, : self.max_response_length]

    def select(self, index: torch.Tensor) -> "ResponseBatch":
        """The samples at `index` (a 1-D long tensor), trimmed to their longest sequence."""
        lengths = self.sequence_lengths[index]
        routed = None if self.routed_experts is None else [self.routed_experts[i] for i in index.tolist()]
        mask = None if self.loss_mask is None else self.loss_mask[index, : int(self.response_lengths[index].max())]
        return ResponseBatch(self.tokens[index, : int(lengths.max())], self.prompt_lengths[index], self.response_lengths[index],
                             routed, mask)


@dataclass(frozen=True)
class ForwardConfig:
    """How samples are grouped into forward passes (rl_config / megatron_training names)."""

    micro_batch_size: int = 1
    use_remove_padding: bool = False
    use_dynamic_bsz: bool = False
    max_packing_token_size: int = 4096
    # Token-budget micro-batches come in a multiple of this many: megatron's interleaved schedule needs a multiple of PP.
    count_multiple_of: int = 1

    @classmethod
    def from_config(cls, cfg, role: str = "update") -> "ForwardConfig":
        """The micro-batching of one pass: "update" (the policy's and the critic's training passes), "actor" or "ref"
        (the forward-only log-prob passes, which may take larger micro-batches: rl_config.*_forward_micro_batch_size)."""
        rl, mt = cfg.rl_config, cfg.megatron_training
        multiple = mt.pipeline_model_parallel_size if mt.virtual_pipeline_model_parallel_size else 1
        size = {"actor": rl.actor_forward_micro_batch_size, "ref": rl.ref_forward_micro_batch_size, "update": 0}[role]
        budget = {"actor": rl.actor_max_packing_token_size, "ref": rl.ref_max_packing_token_size,
                  "update": rl.update_max_packing_token_size}[role]
        return cls(size or mt.micro_batch_size, rl.use_remove_padding, rl.use_dynamic_bsz, budget or rl.max_packing_token_size,
                   multiple)


def micro_batches(batch: ResponseBatch, cfg: ForwardConfig) -> list[torch.Tensor]:
    """Sample indexes of each forward pass, in order.

    Fixed size: chunks of micro_batch_size. Dynamic: greedy in order, each micro-batch's tokens
    (packed: the sum of lengths; padded: rows x longest) within max_packing_token_size, then the costliest
    micro-batches cut in two until their count is a multiple of count_multiple_of (verl's num_batches_divided_by).
    """
    n = batch.size
    if not cfg.use_dynamic_bsz:
        return list(torch.arange(n).split(cfg.micro_batch_size))
    lengths = batch.sequence_lengths.tolist()
    groups: list[list[int]] = []
    current: list[int] = []
    for i, length in enumerate(lengths):
        if length > cfg.max_packing_token_size:
            raise ValueError(f"rl_config.max_packing_token_size: {cfg.max_packing_token_size} is below sample {i}'s {length} tokens")
        candidate = current + [i]
        if current and _budget_tokens(candidate, lengths, cfg.use_remove_padding) > cfg.max_packing_token_size:
            groups.append(current)
            candidate = [i]
        current = candidate
    groups.append(current)
    groups = _split_to_multiple(groups, lengths, cfg)
    return [torch.tensor(g, dtype=torch.long) for g in groups]


def _budget_tokens(group: list[int], lengths: list[int], packed: bool) -> int:
    """What a micro-batch of these samples costs against max_packing_token_size: packed, the sum of their lengths;
    padded, rows x the longest."""
    return sum(lengths[j] for j in group) if packed else len(group) * max(lengths[j] for j in group)


def _split_to_multiple(groups: list[list[int]], lengths: list[int], cfg: ForwardConfig) -> list[list[int]]:
    """`groups` with the costliest ones of several samples cut in two, in order, until their count is a multiple of
    cfg.count_multiple_of; a cut only lowers a micro-batch's tokens, so each stays within the budget."""
    groups = list(groups)
    while len(groups) % cfg.count_multiple_of:
        splittable = [i for i, g in enumerate(groups) if len(g) > 1]
        if not splittable:
            raise ValueError(f"rl_config.use_dynamic_bsz: {len(lengths)} samples make {len(groups)} micro-batches, and the "
                             f"interleaved schedule needs a multiple of pipeline_model_parallel_size {cfg.count_multiple_of}")
        i = max(splittable, key=lambda k: _budget_tokens(groups[k], lengths, cfg.use_remove_padding))
        half = len(groups[i]) // 2
        groups[i:i + 1] = [groups[i][:half], groups[i][half:]]
    return groups


def _response_stats(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This tensor-parallel rank's vocabulary slice of the logits [N, V / TP] predicting labels [N] ->
    (log p(label) [N], entropy [N]), in fp32.

    The full vocabulary is never on one rank: the max and three sums per position (sum of exp,
    sum of exp * logit, the label's logit where this rank holds it) are all-reduced over TP, the
    sums through megatron's autograd-aware reduction, so gradients reach each rank's slice. With
    s = logit - max: log p(label) = s_label - log sum exp(s), entropy = log sum exp(s) - sum(exp(s) s) / sum exp(s).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    logits = logits.float()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    peak = logits.max(-1).values.detach()  # a constant shift: no gradient goes through it
    if tp > 1:
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = logits - peak.unsqueeze(-1)
    exp = shifted.exp()
    width = logits.size(-1)
    local = labels - parallel_state.get_tensor_model_parallel_rank() * width
    held = (local >= 0) & (local < width)
    label_logit = shifted.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1) * held
    sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1), label_logit])
    if tp > 1:
        sums = reduce_from_tensor_model_parallel_region(sums, group=group)
    sum_exp, sum_exp_shifted, label_shifted = sums
    log_z = sum_exp.log()
    return label_shifted - log_z, log_z - sum_exp_shifted / sum_exp


def positions_predicting_responses(batch: ResponseBatch, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """For each sample (flat start offsets `starts`), the flat positions whose logits predict its response tokens."""
    rows, cols = [], []
    for i, (start, p, r) in enumerate(zip(starts, batch.prompt_lengths.tolist(), batch.response_lengths.tolist())):
        rows.append(torch.full((r,), i))
        cols.append(torch.arange(start + p - 1, start + p - 1 + r))
    return torch.cat(rows), torch.cat(cols)


def model_inputs(batch: ResponseBatch, packed: bool) -> ModelInputs:
    """The padded (causal mask) or packed (THD, per-sample causal) inputs of a micro-batch; under context
    parallel this CP rank's share of them, each sequence (packed) or row (padded) padded to a multiple of 2 * CP."""
    device = compute_device()
    cp_rank, cp = context_parallel.context_parallel_rank_size()
    lengths = batch.sequence_lengths.tolist()
    if packed:
        padded = [context_parallel.padded_length(n, cp) for n in lengths]
        tokens = torch.cat([F.pad(batch.tokens[i, :n], (0, p - n)) for i, (n, p) in enumerate(zip(lengths, padded))])
        tokens = tokens.unsqueeze(0).to(device)
        positions = torch.cat([torch.arange(p) for p in padded]).unsqueeze(0).to(device)
        bounds = torch.tensor([0] + padded).cumsum(0).to(torch.int32).to(device)
        inputs = ModelInputs(tokens, positions, None, packed_params(bounds, max(padded)), bounds[:-1].tolist(),
                             (tokens.size(1), 1), routing=_routing(batch, padded, None))
    else:
        width = context_parallel.padded_length(max(lengths), cp)
        padded = [width]
        tokens = F.pad(batch.tokens[:, : max(lengths)], (0, width - max(lengths))).to(device)
        inputs = padded_inputs(tokens, batch.size, _routing(batch, lengths, width))
    return inputs if cp == 1 else _context_parallel_share(inputs, padded, cp_rank, cp)


def _routing(batch: ResponseBatch, lengths: list[int], width: int | None) -> torch.Tensor | None:
    """The batch's rollout routing in the model's token order (routing replay), None when it has none."""
    return None if batch.routed_experts is None else token_routing(batch.routed_experts, lengths, width)


def _context_parallel_share(inputs: ModelInputs, lengths: list[int], cp_rank: int, cp: int) -> ModelInputs:
    """This CP rank's positions of `inputs` (rows of sequences of `lengths` laid end to end), with the labels they predict."""
    index = context_parallel.layout_index(lengths, cp)
    mine = index[cp_rank].to(inputs.tokens.device)
    mask = None if inputs.attention_mask is None else inputs.attention_mask[:, :, mine]
    routing = inputs.routing
    if routing is not None:  # the router flattens this rank's [S share, b] S-major: the replayed experts follow its tokens
        routing = routing.view(*inputs.hidden_shape, *routing.shape[1:])[mine.to(routing.device)].flatten(0, 1)
    return ModelInputs(inputs.tokens[:, mine], inputs.positions[:, mine], mask, inputs.packed_seq_params, inputs.starts,
                       (mine.numel(), inputs.hidden_shape[1]), inputs.tokens.roll(-1, dims=1)[:, mine], index, routing)


def response_stats(logits: torch.Tensor, batch: ResponseBatch, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """From the last stage's logits: (log-probs [b, L], entropy [b, L]) of the responses, 0 past each."""
    device = logits.device
    flat_logits = logits.reshape(-1, logits.size(-1))
    rows, cols = positions_predicting_responses(batch, inputs.starts)
    rows, cols = rows.to(device), cols.to(device)
    if inputs.cp_index is None:
        token_logp, entropy = _response_stats(flat_logits[cols], inputs.tokens.reshape(-1)[cols + 1])
    else:  # every position of this CP rank's share, then all of them gathered in order: [S, b, 2]
        every = torch.stack(_response_stats(flat_logits, inputs.labels.reshape(-1)), -1)
        whole = context_parallel.gather_sequence(every.view(logits.size(0), -1, 2).transpose(0, 1), inputs.cp_index)
        token_logp, entropy = whole.transpose(0, 1).reshape(-1, 2)[cols].unbind(-1)
    offsets = torch.cat([torch.arange(r) for r in batch.response_lengths.tolist()]).to(device)
    shape = (batch.size, batch.max_response_length)
    out_logp = torch.zeros(shape, device=device).index_put((rows, offsets), token_logp)
    out_entropy = torch.zeros(shape, device=device).index_put((rows, offsets), entropy)
    return out_logp, out_entropy


def forward_micro_batch(model, batch: ResponseBatch, packed: bool,
                        after_forward: Callable[[torch.Tensor], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass over all of `batch` on a single pipeline stage: (log-probs [b, L], entropy [b, L]).

    Gradients flow when called outside torch.no_grad(); `after_forward` sees the model's output first.
    """
    inputs = model_inputs(batch, packed)
    output = inputs.run(model)
    if after_forward is not None:
        after_forward(output)
    return response_stats(output, batch, inputs)


# The loss of micro-batch i from its log-probs and entropy; its backward runs inside run_micro_batches.
MicroBatchLoss = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
# Called on every pipeline stage with micro-batch i's index and this stage's output, right after its forward.
StageForwardHook = Callable[[int, torch.Tensor], None]


def run_micro_batches(model, parts: list[ResponseBatch], packed: bool, loss_fn: MicroBatchLoss | None = None,
                      after_forward: StageForwardHook | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Forward (and, with `loss_fn`, backward) over micro-batches; every rank gets each part's (log-probs, entropy).

    One pipeline stage: part by part, each backward right after its forward. Several stages:
    services.trainer.modeling.pipeline's schedule.
    """
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        return pipelined_micro_batches(model, parts, [model_inputs(p, packed) for p in parts], response_stats, loss_fn,
                                       after_forward)
    results = []
    for i, part in enumerate(parts):
        logp, entropy = forward_micro_batch(model, part, packed, None if after_forward is None else partial(after_forward, i))
        if loss_fn is not None:
            loss_fn(i, logp, entropy).backward()
        results.append((logp.detach(), entropy.detach()))
    return results


@torch.no_grad()
def compute_logprobs(model, batch: ResponseBatch, cfg: ForwardConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy [B, L] of every sample's response (old / reference / rollout-check passes).

    Each data-parallel rank computes its share of the rows; every rank gets all of them back.
    """
    was_training = model.training
    model.eval()
    width = batch.max_response_length
    logp = torch.zeros(batch.size, width)
    entropy = torch.zeros(batch.size, width)
    mine = my_rows(torch.arange(batch.size))
    if len(mine):
        indexes = [mine[index] for index in micro_batches(batch.select(mine), cfg)]
        parts = [batch.select(index) for index in indexes]
        for index, part, (lp, ent) in zip(indexes, parts, run_micro_batches(model, parts, cfg.use_remove_padding)):
            logp[index, : part.max_response_length] = lp.cpu()
            entropy[index, : part.max_response_length] = ent.cpu()
    model.train(was_training)
    return sum_over_data_parallel(logp), sum_over_data_parallel(entropy)
