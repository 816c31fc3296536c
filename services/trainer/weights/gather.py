"""The policy's weights in Hugging Face names for a push, gathered bucket by bucket: experts over EP, TP shards
within each stage, then stages across PP, one megatron tensor at a time.

`HfWeightStream` plans the buckets from the tensors' shapes alone, then yields one bucket of gathered HF
tensors at a time, so no rank holds more than about one bucket (plus the one megatron tensor being
converted) whatever the model's size. The bucket format they are packed into is
services/common/weight_wire.py's, shared with the replicas.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator

import torch

from services.common.weight_wire import plan_buckets
from services.trainer.modeling.checkpoint_convert import HfConversion, expert_owner, hf_conversions, is_expert_tensor


class HfWeightStream:
    """`state` (this rank's tensors by megatron name, chunk-prefixed under a virtual pipeline) gathered from every rank
    into HF names, one bucket at a time.

    A collective: every rank of the model's TP, PP and EP groups builds it and iterates it to the end, in
    step; each gets the same buckets. Floating tensors are cast to `dtype` when given (the rollout's), so a
    bucket held is the size it travels at. A BucketSource for push_weights and CollectiveSender.push.
    """

    def __init__(self, state: dict[str, torch.Tensor], layout, bucket_mb: float, dtype: torch.dtype | None = None):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from services.trainer.modeling.model import virtual_pipeline_size

        self.bucket_mb, self.dtype = bucket_mb, dtype
        self._state = state
        self._layout = layout
        self._tp = ps.get_tensor_model_parallel_world_size()
        self._pp = ps.get_pipeline_model_parallel_world_size()
        self._ep = ps.get_expert_model_parallel_world_size()
        self._pp_rank = ps.get_pipeline_model_parallel_rank()
        # Under a virtual pipeline `state` holds every chunk of the stage, its names chunk-prefixed, as the conversions name them.
        self._conversions = hf_conversions(layout, self._pp, virtual_pipeline_size())
        # Each stage's tensor shapes (metadata only): the other stages' ranks receive into buffers of these.
        shapes = {name: (tuple(t.shape), t.dtype) for name, t in state.items()}
        self._stage_shapes = [shapes]
        if self._pp > 1:
            self._stage_shapes = [None] * self._pp
            dist.all_gather_object(self._stage_shapes, shapes, group=ps.get_pipeline_model_parallel_group())
        self.specs: dict[str, torch.Tensor] = {}
        for c in self._conversions:  # the conversion itself, on meta tensors: HF names and shapes without data
            self.specs.update({name: self._cast(t) for name, t in c.to_hf(self._meta_parts(c)).items()})
        self.plan = plan_buckets(self.specs, bucket_mb)

    def over(self, state: dict[str, torch.Tensor]) -> "HfWeightStream":
        """This stream's plan over `state`: the same model's tensors at a later step, whose names, shapes and dtypes
        never change in a run (checked). A push after the first takes this: no meta conversions and, under PP, no
        collective to plan again."""
        shapes = {name: (tuple(t.shape), t.dtype) for name, t in state.items()}
        if shapes != self._stage_shapes[self._pp_rank]:
            raise ValueError("the model's tensors changed names or shapes since the weight stream was planned")
        stream = copy.copy(self)
        stream._state = state
        return stream

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """Each bucket of `plan` as {HF name: CPU tensor}, in order."""
        buckets = iter(self.plan)
        names = next(buckets, None)
        pending: dict[str, torch.Tensor] = {}
        for c in self._conversions:
            pending.update({name: self._cast(t).cpu() for name, t in c.to_hf(self._fetch(c)).items()})
            # The conversions produce the HF tensors in plan order: a bucket is complete once its last name is in.
            while names is not None and names[-1] in pending:
                yield {name: pending.pop(name) for name in names}
                names = next(buckets, None)

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype) if self.dtype is not None and t.is_floating_point() else t

    def _owner(self, c: HfConversion) -> tuple[int | None, str]:
        """(expert-parallel rank holding `c`'s tensor, or None when every EP rank does; its name there)."""
        if self._ep > 1 and is_expert_tensor(c.name):
            return expert_owner(c.name, self._layout, self._ep)
        return None, c.name

    def _meta_parts(self, c: HfConversion) -> list[torch.Tensor]:
        shape, dtype = self._stage_shapes[c.pp_rank][self._owner(c)[1]]
        return [torch.empty(shape, dtype=dtype, device="meta")] * (self._tp if c.tp_split else 1)

    def _fetch(self, c: HfConversion) -> list[torch.Tensor]:
        """`c`'s tensor from every TP rank of its stage (TP rank 0's alone when not split), on every rank."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        shape, dtype = self._stage_shapes[c.pp_rank][self._owner(c)[1]]
        if self._pp_rank == c.pp_rank:
            parts = self._gather_within_stage(c)
        else:
            parts = [torch.empty(shape, dtype=dtype, device=self._device()) for _ in range(self._tp if c.tp_split else 1)]
        if self._pp > 1:  # the owning stage's rank sends each part to the same TP rank of every other stage
            group = ps.get_pipeline_model_parallel_group()
            for part in parts:
                dist.broadcast(part, dist.get_global_rank(group, c.pp_rank), group=group)
        return parts

    def _gather_within_stage(self, c: HfConversion) -> list[torch.Tensor]:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        owner, name = self._owner(c)
        if owner is None:
            tensor = self._state[name].detach().contiguous()
        else:  # a routed expert: its EP rank sends it to the others (each holds the same-shaped local expert)
            group = ps.get_expert_model_parallel_group()
            mine = self._state[name].detach().contiguous()
            tensor = mine if ps.get_expert_model_parallel_rank() == owner else torch.empty_like(mine)
            dist.broadcast(tensor, dist.get_global_rank(group, owner), group=group)
        if self._tp == 1:
            return [tensor]
        if not c.tp_split:  # the same on every TP rank: TP rank 0's copy, as a checkpoint's conversion takes it
            group = ps.get_tensor_model_parallel_group()
            copy = tensor if ps.get_tensor_model_parallel_rank() == 0 else torch.empty_like(tensor)
            dist.broadcast(copy, dist.get_global_rank(group, 0), group=group)
            return [copy]
        # Routed experts split over the expert tensor-parallel group (megatron's default: as many ranks as TP).
        group = ps.get_expert_tensor_parallel_group() if is_expert_tensor(c.name) else ps.get_tensor_model_parallel_group()
        parts = [torch.empty_like(tensor) for _ in range(self._tp)]
        dist.all_gather(parts, tensor, group=group)
        return parts

    def _device(self) -> torch.device:
        return next(iter(self._state.values())).device


def take_part(stream: HfWeightStream | None) -> None:
    """A rank's part of a gather whose buckets another rank pushes: its collectives, keeping no bucket (None: no part)."""
    for _ in stream or ():
        pass


def model_state(model) -> dict[str, torch.Tensor]:
    """The model's tensors by megatron name, without megatron's _extra_state entries."""
    return {k: v.detach() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def stream_hf_weights(model, layout, bucket_mb: float, dtype: torch.dtype | None = None) -> HfWeightStream:
    """The model's weights in HF names, bucket by bucket (a collective: see HfWeightStream)."""
    return HfWeightStream(model_state(model), layout, bucket_mb, dtype)
