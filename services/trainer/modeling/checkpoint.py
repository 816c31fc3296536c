"""Training checkpoints: model, optimizer, LR scheduler, RNG, step and data cursor, one file per rank.

Layout follows Megatron's: `<root>/iter_<step:07d>/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` and
`<root>/latest_checkpointed_iteration.txt`. Data-parallel rank 0 of each TP/PP position (with
expert parallel: of each TP/PP/EP position, whose experts differ) writes that position's shard
(its part of the weights, the optimizer's and the LR schedule's state); with the distributed
optimizer the fp32 weights and Adam moments, sharded over the data-parallel ranks, are gathered
into `distrib_optim.pt` beside it, as Megatron does (the experts' over the expert-data-parallel
ranks, into their EP position's file). With a virtual pipeline the file holds each model chunk's
state under `model0`, `model1`, ... as Megatron's does. The tracker file is
written last, after a barrier, so a checkpoint interrupted half-way is never the one resumed.
"""
from __future__ import annotations

import os
import pathlib
import random
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import torch

from services.trainer.modeling.checkpoint_convert import (MEGATRON_FILE, chunked_payload, model_payload, payload_chunks,
                                                            shard_dir_name)
from services.trainer.modeling.model import model_chunks
from services.trainer.modeling.optimizer import ModelOptimizer

TRACKER_FILE = "latest_checkpointed_iteration.txt"
DISTRIBUTED_OPTIMIZER_FILE = "distrib_optim.pt"


@dataclass(frozen=True)
class DataCursor:
    """Where the prompt stream stands, so a resumed run claims the same prompts next (guarantee_order)."""

    epoch: int = 0
    next_prompt_index: int = 0  # index of the next prompt the driver puts in the dock


@dataclass(frozen=True)
class TrainState:
    """The run's counters saved with the weights."""

    step: int = 0  # iterations completed
    policy_version: int = 0  # weights version last pushed to rollout
    data: DataCursor = field(default_factory=DataCursor)
    kl_coef: float | None = None  # the KL controller's coefficient (it moves under kl_ctrl_type adaptive)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _ranks() -> dict[str, int]:
    """This rank's place: TP, PP and EP rank and size (saved in the shard, so a converter need not guess from names)."""
    from megatron.core import parallel_state

    return {"tp_rank": parallel_state.get_tensor_model_parallel_rank(), "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "ep_rank": parallel_state.get_expert_model_parallel_rank(), "tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(), "ep": parallel_state.get_expert_model_parallel_world_size()}


def _is_data_parallel_leader() -> bool:
    from megatron.core import parallel_state

    if parallel_state.get_expert_model_parallel_world_size() > 1:
        # Each EP rank holds other experts: rank 0 of each one's expert-data-parallel group writes its shard.
        return parallel_state.get_expert_data_parallel_rank() == 0
    # The CP ranks of a replica hold the same shard: one of them writes it.
    return parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0


def checkpoint_file(root: str | pathlib.Path, step: int) -> pathlib.Path:
    """This rank's file of the checkpoint at `step`."""
    r = _ranks()
    return pathlib.Path(root) / f"iter_{step:07d}" / shard_dir_name(r["tp_rank"], r["pp_rank"], r["pp"], r["ep_rank"], r["ep"]) / MEGATRON_FILE


def latest_step(root: str | pathlib.Path) -> int | None:
    """The step of the last complete checkpoint under `root`, or None."""
    tracker = pathlib.Path(root) / TRACKER_FILE
    return int(tracker.read_text().strip()) if tracker.exists() else None


def save_checkpoint(root: str | pathlib.Path, model, optimizer: ModelOptimizer, state: TrainState,
                    hf_dir: str | pathlib.Path | None = None) -> pathlib.Path:
    """Writes this rank's shard of the checkpoint for `state.step` (every rank calls it); returns the iteration directory.

    With `hf_dir` (the Hugging Face directory the run started from) the iteration directory also gets
    its config and tokenizer in hf_config/, so `dockrl trainer convert --to hf` exports it as a model
    transformers and vLLM load.
    """
    import torch.distributed as dist

    from services.trainer.modeling.checkpoint_convert import copy_hf_side_files

    path = checkpoint_file(root, state.step)
    if _is_data_parallel_leader():
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            **chunked_payload(model.state_dict(), len(model_chunks(model))),
            **optimizer.state_dict(),
            "distributed_optimizer": optimizer.distributed,
            "rng_state": _rng_state(),
            "train_state": asdict(state),
            "parallel_ranks": _ranks(),
        }
        tmp = path.with_suffix(".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, path)
    if optimizer.distributed:
        if dist.is_initialized():
            dist.barrier()  # the directory exists before rank 0 of the data-parallel group writes into it
        optimizer.save_sharded_state(path.parent / DISTRIBUTED_OPTIMIZER_FILE)
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        if hf_dir:
            copy_hf_side_files(hf_dir, path.parent.parent / "hf_config")
        tracker = pathlib.Path(root) / TRACKER_FILE
        tracker.with_suffix(".tmp").write_text(str(state.step))
        os.replace(tracker.with_suffix(".tmp"), tracker)
    return path.parent.parent


def load_checkpoint(root: str | pathlib.Path, model, optimizer: ModelOptimizer, step: int | None = None) -> TrainState:
    """Restores model, optimizer, scheduler and RNG from `root` (the latest step unless given); returns the saved state."""
    from services.trainer.modeling.checkpoint_convert import load_shard

    step = latest_step(root) if step is None else step
    if step is None:
        raise FileNotFoundError(f"{root}: no {TRACKER_FILE}; nothing to resume")
    path = checkpoint_file(root, step)
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing (saved with other tensor, pipeline or expert parallel sizes? resume with "
                                "the sizes it was saved with)")
    # The file holds RNG and numpy state besides tensors; it is one this trainer wrote.
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if payload.get("distributed_optimizer", False) != optimizer.distributed:
        raise ValueError(f"megatron_training.use_distributed_optimizer: {optimizer.distributed}, but {path} was saved with "
                         f"{payload.get('distributed_optimizer', False)}; resume with the setting it was saved with")
    saved_chunks = payload_chunks(payload)
    if saved_chunks != len(model_chunks(model)):
        raise ValueError(f"megatron_training.virtual_pipeline_model_parallel_size: {path} holds {saved_chunks} model chunk(s) "
                         f"per stage, this model {len(model_chunks(model))}; resume with the setting it was saved with")
    load_shard(model, {k: v for k, v in model_payload(payload).items() if not k.endswith("_extra_state")})
    optimizer.load_state_dict(payload)
    if optimizer.distributed and payload["optimizer"] is not None:  # None: saved before the first step
        optimizer.load_sharded_state(path.parent / DISTRIBUTED_OPTIMIZER_FILE)
    _set_rng_state(payload["rng_state"])
    saved = payload["train_state"]
    return TrainState(step=saved["step"], policy_version=saved["policy_version"], data=DataCursor(**saved["data"]),
                      kl_coef=saved.get("kl_coef"))


def checkpoint_handler(default_root: str, model, optimizer: ModelOptimizer, current_state: Callable[[], TrainState]):
    """A TrainerControl checkpoint handler: saves to the asked directory, or `default_root` when "" is asked.

    Single-process runs only: with several ranks every rank must save, so the driver turns the
    request into a step-boundary action of all ranks instead.
    """

    def save(path: str) -> tuple[str, int]:
        root = path or default_root
        if not root:
            raise ValueError("path: empty, and megatron_training.save is not set")
        state = current_state()
        return str(save_checkpoint(root, model, optimizer, state)), state.step

    return save
