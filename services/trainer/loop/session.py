"""What one trainer process holds for a run: model, reference, optimiser, counters, control server.

The driver (driver.py) owns the loop; this owns the state and the distributed plumbing, so the
loop reads as the algorithm. Rank 0 talks to the dock and the replicas; other ranks receive
each batch by broadcast and take part in every collective (update, weight gather, checkpoint).
"""
from __future__ import annotations

import logging
import pathlib
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch.profiler import record_function

from services.common.config import Config
from services.common.log import log_event
from services.trainer.algorithm.estimators import build_estimator
from services.trainer.algorithm.rollout_correction import needs_rollout_logprobs
from services.trainer.algorithm.estimators.interface import (AdvantageEstimator, Estimate, EstimatorSetup, LogProbPasses,
                                                             EstimatorBatch)
from services.trainer.modeling.checkpoint import DataCursor, TrainState, latest_step, load_checkpoint, save_checkpoint
from services.trainer.modeling.checkpoint_convert import load_hf_into_model, load_hf_state
from services.trainer.modeling.data_parallel import data_parallel_rank_size
from services.trainer.loop.control import TrainerControl
from services.trainer.loop.determinism import enable_determinism
from services.trainer.algorithm.kl import KLController
from services.trainer.loop.iteration_data import ScoredBatch
from services.trainer.modeling.logprobs import ForwardConfig, ResponseBatch, compute_logprobs
from services.trainer.algorithm.masked import masked_mean
from services.trainer.modeling.model import ModelLayout, build_model, destroy_parallel, init_parallel
from services.trainer.loop.server import start_server
from services.trainer.algorithm.update import TrainBatch, UpdateConfig, update_policy
from services.trainer.modeling.optimizer import ModelOptimizer, build_optimizer
from services.common.weight_wire import torch_dtype
from services.trainer.weights.gather import HfWeightStream, model_state, stream_hf_weights, take_part


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def rollout_routing(batch: ScoredBatch) -> list[torch.Tensor]:
    """Each sample's routed experts as the rollout recorded them (rl_config.routing_replay): [P+L-1, MoE layers, top_k]."""
    routed = []
    for index, sample in zip(batch.indexes, batch.samples):
        record, positions = sample.routed_experts, len(sample.prompt_ids) + len(sample.response_ids) - 1
        if record is None or len(record) != positions:
            got = "none" if record is None else f"{len(record)} positions"
            raise ValueError(f"rl_config.routing_replay: row {index} came with {got} of routed_experts, not "
                             f"prompt + response - 1 = {positions}; do the rollout replicas run this "
                             "config (they record the routing only with routing_replay on)?")
        routed.append(torch.from_numpy(np.array(record, np.uint8)))  # a copy: dock values are read-only
    return routed


def rollout_logprob_matrix(batch: ScoredBatch, mask: torch.Tensor) -> torch.Tensor:
    """The rollout's (behaviour policy's) log-prob of each response token, [B, L] like `mask`, 0 past each response."""
    rollout = torch.zeros(mask.shape, dtype=torch.float32)
    for i, sample in enumerate(batch.samples):
        log_probs = sample.log_probs[: rollout.size(1)]
        rollout[i, : len(log_probs)] = torch.from_numpy(np.array(log_probs, np.float32))  # a copy: dock values are read-only
    return rollout


def rollout_agreement(trainer_logprobs: torch.Tensor, batch: ScoredBatch, mask: torch.Tensor, version: int) -> dict[str, float]:
    """train_rollout_logprob_diff (mean |trainer - rollout| log-prob) over the samples the current weights generated whole.

    `trainer_logprobs` [B, L] are the current policy's (before the update), `mask` [B, L] marks
    response tokens; older tokens (partial rollout, max_staleness) are off-policy by design and only
    counted. A sample whose first tokens came from older weights is left out of the diff: its later
    tokens were computed on the older weights' KV cache (a push does not stop generation), so only
    a sample generated whole by one version can be recomputed exactly.
    """
    rollout = rollout_logprob_matrix(batch, mask)
    current = torch.zeros_like(trainer_logprobs)  # 1 on tokens the current weights generated
    whole = torch.zeros_like(trainer_logprobs)  # 1 on every token of samples generated whole by the current weights
    for i, sample in enumerate(batch.samples):
        tagged = torch.from_numpy(np.array(sample.versions[: current.size(1)], np.int64))
        current[i, : len(tagged)] = (tagged == version).float()
        if len(tagged) and bool((tagged == version).all()):
            whole[i, : len(tagged)] = 1.0
    metrics = {"rollout/off_policy_token_fraction": float(1 - (mask * current).sum() / mask.sum())}
    same = mask * whole
    if same.sum() > 0:
        metrics["train_rollout_logprob_diff"] = float(masked_mean((trainer_logprobs - rollout).abs(), same))
    return metrics


@dataclass
class TrainerSession:
    """The trainer's state for one run (see the module docstring)."""

    cfg: Config
    token: str
    layout: ModelLayout
    model: Any
    ref_model: Any
    optimizer: ModelOptimizer
    update_cfg: UpdateConfig
    control: TrainerControl
    estimator: AdvantageEstimator  # rl_config.adv_estimator's, with its own models (gae: the critic)
    kl_ctrl: KLController = field(default_factory=lambda: KLController(0.0))
    server: Any = None
    step: int = 0
    version: int = 0
    prompt_cursor: int = 0
    num_prompts: int = 1
    # the first push's stream, whose plan every later push reuses (weight_stream); the session's own state
    _weight_stream: HfWeightStream | None = field(default=None, init=False, repr=False)

    @classmethod
    def start(cls, cfg: Config, token: str, num_prompts: int, resume: bool = False, host: str | None = None,
              port: int | None = None) -> "TrainerSession":
        """Builds the model from megatron_training.load (or the last checkpoint with `resume`) and starts the control server.

        `num_prompts` is the dataset's size: the data cursor of a checkpoint is (epoch, index) in it.
        """
        mt, rl = cfg.megatron_training, cfg.rl_config
        if mt.npu_deterministic:
            enable_determinism(mt.seed)
        init_parallel(mt.tensor_model_parallel_size, mt.pipeline_model_parallel_size, mt.distributed_backend, mt.seed,
                      cp=mt.context_parallel_size, ep=mt.expert_model_parallel_size, vpp=mt.virtual_pipeline_model_parallel_size or 1,
                      ulysses=mt.ulysses_degree_in_cp or 1)
        _, world = _world()
        if world != rl.actor_resource.num_npus:
            raise ValueError(f"rl_config.actor_resource.num_npus: {rl.actor_resource.num_npus}, but the trainer runs as {world} "
                             "process(es); `dockrl trainer train` starts num_npus local ranks itself, or launch it with "
                             f"torchrun --nproc-per-node {rl.actor_resource.num_npus}")
        dtype = torch.bfloat16 if mt.bf16 else torch.float32
        layout = ModelLayout.from_hf_dir(mt.load)
        hf_state = load_hf_state(mt.load)
        model = build_model(layout, dtype, mt.context_parallel_algo, rl.routing_replay)
        load_hf_into_model(model, hf_state, layout)
        ref_model = None
        if rl.init_kl_coef > 0:
            ref_model = build_model(layout, dtype, mt.context_parallel_algo, rl.routing_replay)
            load_hf_into_model(ref_model, hf_state, layout)
            ref_model.eval()
            ref_model.requires_grad_(False)
        update_cfg = UpdateConfig.from_config(cfg)
        steps_per_iter = rl.epochs * (cfg.trained_samples_per_iteration // update_cfg.mini_batch_size)
        optimizer = build_optimizer(model, mt, mt.train_iters * steps_per_iter)
        control = TrainerControl(mt.train_iters)
        estimator = build_estimator(EstimatorSetup(cfg, layout, hf_state, dtype, mt.train_iters * steps_per_iter))
        session = cls(cfg, token, layout, model, ref_model, optimizer, update_cfg, control, estimator,
                      num_prompts=max(1, num_prompts), kl_ctrl=KLController.from_rl_config(rl))
        if resume and mt.save and latest_step(mt.save) is not None:
            state = load_checkpoint(mt.save, model, optimizer)
            session.step, session.version = state.step, state.policy_version
            session.prompt_cursor = state.data.epoch * session.num_prompts + state.data.next_prompt_index
            if state.kl_coef is not None:  # where the adaptive controller had moved it
                session.kl_ctrl.value = state.kl_coef
            session.estimator.load(mt.save, state.step)
        if session.is_leader:
            from megatron.core import parallel_state as ps

            log_event(logging.getLogger("dockrl.trainer"), "ranks", world=world, tensor_parallel=mt.tensor_model_parallel_size,
                      pipeline_parallel=mt.pipeline_model_parallel_size, data_parallel=ps.get_data_parallel_world_size(),
                      distributed_optimizer=mt.use_distributed_optimizer, context_parallel=mt.context_parallel_size,
                      context_parallel_algo=mt.context_parallel_algo, ulysses_degree_in_cp=mt.ulysses_degree_in_cp,
                      virtual_pipeline_parallel=mt.virtual_pipeline_model_parallel_size or 1)
            # Over gRPC a checkpoint request only takes effect between steps (the step lock).
            control.checkpoint_handler = session._checkpoint_handler if world == 1 else None
            bind_host = host or cfg.trainer.host
            session.server, bound = start_server(control, bind_host, cfg.trainer.grpc_port if port is None else port, token)
            log_event(logging.getLogger("dockrl.trainer"), "control server listening", host=bind_host, port=bound)
            control.record_step(session.step, {}, session.version)
        return session

    @property
    def is_leader(self) -> bool:
        return _world()[0] == 0

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank (rank 0's decisions and the batch)."""
        import torch.distributed as dist

        if _world()[1] == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def train_step(self, batch: ScoredBatch, step: int) -> dict[str, float]:
        """The estimator's log-prob passes and advantages (with the KL in the reward, if configured), the policy update, the
        estimator's own update (the critic); returns the iteration's metrics."""
        rl, fwd = self.cfg.rl_config, self.update_cfg.forward
        masks = [s.loss_mask for s in batch.samples]
        samples = ResponseBatch.from_token_ids([s.prompt_ids for s in batch.samples], [s.response_ids for s in batch.samples],
                                               rollout_routing(batch) if rl.routing_replay else None,
                                               None if any(m is None for m in masks) else masks)
        mask = samples.response_mask()
        scored = EstimatorBatch(samples, mask, torch.tensor(batch.scores, dtype=torch.float32))
        passes = LogProbPasses(self.model, self.ref_model, samples, fwd, ForwardConfig.from_config(self.cfg, "actor"),
                               ForwardConfig.from_config(self.cfg, "ref"))
        estimate = self.estimator.estimate(scored, passes, self.kl_ctrl.value)
        behaviour = rollout_logprob_matrix(batch, mask) if needs_rollout_logprobs(rl) else None
        unreplayed = None
        if rl.routing_replay and self.cfg.trainer.log_logprob_diff:
            # the gap replay closes: the current policy's log-probs with its own routing (one more forward, before the update)
            with record_function("actor_compute_log_prob_unreplayed"):
                unreplayed = compute_logprobs(self.model, replace(samples, routed_experts=None), passes.policy_forward)[0].float().cpu()
        with record_function("actor_update"):  # its first micro-batches' log-probs are the old policy's (no separate pass)
            out = update_policy(self.model, self.optimizer, TrainBatch(samples, estimate.advantages, estimate.old_logprobs,
                                                                       estimate.ref_logprobs, behaviour),
                                self._update_config(estimate), step)
        metrics = {f"actor/{k}": v for k, v in out.metrics.as_dict().items()}
        if self.ref_model is not None:
            metrics["actor/kl_coef"] = self.kl_ctrl.value  # the coefficient this step used
            kl = out.metrics.kl
            if estimate.reward_kl is not None:  # verl's name for the KL the reward was penalised by
                kl = metrics["actor/reward_kl_penalty"] = float(masked_mean(estimate.reward_kl, mask))
            self.kl_ctrl.update(kl, len(batch))
        if self.cfg.trainer.log_logprob_diff:
            metrics.update(rollout_agreement(out.start_logprobs, batch, mask, self.version))
        if unreplayed is not None:
            gap = rollout_agreement(unreplayed, batch, mask, self.version).get("train_rollout_logprob_diff")
            if gap is not None:
                metrics["train_rollout_logprob_diff_unreplayed"] = gap
        metrics.update(self.estimator.update(samples, estimate, step))
        metrics["actor/advantage_abs_mean"] = float(masked_mean(estimate.advantages.abs(), mask))
        return metrics

    def _update_config(self, estimate: Estimate) -> UpdateConfig:
        """The policy update's settings this step: with an adaptive KL controller, its coefficient on the loss's KL term
        (when the KL is in the loss, not in the reward)."""
        if self.kl_ctrl.target and estimate.ref_logprobs is not None:
            return replace(self.update_cfg, loss=replace(self.update_cfg.loss, kl_coef=self.kl_ctrl.value))
        return self.update_cfg

    def weight_stream(self) -> HfWeightStream | None:
        """The policy in HF names, one push bucket at a time (trainer.bucket_mb, in the replicas' dtype): a collective
        over the TP and PP ranks of data-parallel rank 0, which holds rank 0, the one that pushes; None on the other
        data-parallel ranks, whose copy is the same. With expert parallel every rank takes part: the experts are
        split over data-parallel ranks. Each rank that gets a stream iterates it to the end: rank 0 by pushing it,
        the others through take_part_in_weight_gather."""
        from megatron.core import parallel_state

        if data_parallel_rank_size()[0] != 0 and parallel_state.get_expert_model_parallel_world_size() == 1:
            return None
        if self._weight_stream is None:
            self._weight_stream = stream_hf_weights(self.model, self.layout, self.cfg.trainer.bucket_mb,
                                                    torch_dtype(self.cfg.generate_config.dtype))
            return self._weight_stream
        return self._weight_stream.over(model_state(self.model))

    def take_part_in_weight_gather(self) -> None:
        """This rank's part of a weight gather whose buckets rank 0 pushes: its collectives, keeping no bucket."""
        take_part(self.weight_stream())

    def _train_state(self) -> TrainState:
        epoch, index = divmod(self.prompt_cursor, self.num_prompts)
        return TrainState(self.step, self.version, DataCursor(epoch, index), self.kl_ctrl.value)

    def _checkpoint_handler(self, path: str) -> tuple[str, int]:
        root = path or self.cfg.megatron_training.save
        return str(save_checkpoint(root, self.model, self.optimizer, self._train_state(), self.cfg.megatron_training.load)), self.step

    def save_checkpoint(self) -> pathlib.Path | None:
        """Saves to megatron_training.save (every rank takes part); None when no save directory is set."""
        root = self.cfg.megatron_training.save
        if not root:
            return None
        self.estimator.save(root, self._train_state())
        return save_checkpoint(root, self.model, self.optimizer, self._train_state(), self.cfg.megatron_training.load)

    def close(self) -> None:
        """Stops the control server and tears down the process groups."""
        if self.server is not None:
            self.server.stop(grace=1.0)
        destroy_parallel()
