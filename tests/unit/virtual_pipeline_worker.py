"""One rank of the virtual pipeline (interleaved 1F1B) test, started by torchrun: PP 2 x VPP 2 on 2 ranks.

Usage: torchrun --nproc-per-node 2 virtual_pipeline_worker.py HF_DIR OUT_DIR
Each rank writes OUT_DIR/rank{r}.pt with its pipeline rank, the loss and gradients (by chunk-prefixed megatron
name) of one forward and backward over the batch's micro-batches, the packed log-probs, the weights streamed in
HF names before any update, the metrics and gathered weights of two update steps, and those of the second step
again after resuming from the checkpoint saved (to OUT_DIR/ckpt) between them; and the PPO critic's values, one
critic step's metrics and the values after it; and a first update step's metrics and weights with token-budget
micro-batches (DYNAMIC).
"""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from critic_parallel_worker import CRITIC_BATCH, FORWARD, parity_critic_update  # noqa: E402
from trainer_helpers import gather_hf_weights, random_batch  # noqa: E402

from services.trainer.algorithm.critic import build_critic, compute_values  # noqa: E402

from services.trainer.modeling.checkpoint import TrainState, load_checkpoint, save_checkpoint  # noqa: E402
from services.trainer.modeling.checkpoint_convert import load_hf_into_model, load_hf_state  # noqa: E402
from services.trainer.modeling.logprobs import ForwardConfig, compute_logprobs, run_micro_batches  # noqa: E402
from services.trainer.modeling.model import ModelLayout, build_model, destroy_parallel, init_parallel  # noqa: E402
from services.trainer.weights.gather import stream_hf_weights  # noqa: E402

# Four samples of different lengths: one per micro-batch (padded) and two per micro-batch (packed), both multiples of PP.
VPP_BATCH = dict(seed=5, prompt_lengths=[3, 5, 2, 4], response_lengths=[4, 2, 6, 3])
STREAM_BUCKET_MB = 0.02  # several buckets for the tiny model


# Token-budget micro-batches of VPP_BATCH (7, 7, 8 and 7 tokens): [0, 1] [2] [3] in one rank's greedy grouping, which
# the interleaved schedule cannot run (3 is no multiple of PP 2); cut to four there.
DYNAMIC = ForwardConfig(use_remove_padding=True, use_dynamic_bsz=True, max_packing_token_size=14, count_multiple_of=2)


def vpp_update(model, optimizer, batch, step: int, forward: ForwardConfig = ForwardConfig(micro_batch_size=1)) -> dict:
    """One GRPO step on `batch` (one group of 4; by default one sample per micro-batch); its metrics."""
    from services.trainer.algorithm.advantages import group_norm_advantages
    from services.trainer.algorithm.losses import PolicyLossConfig
    from services.trainer.algorithm.update import TrainBatch, UpdateConfig, update_policy

    cfg = UpdateConfig(mini_batch_size=4, forward=forward, loss=PolicyLossConfig(entropy_coeff=0.01))
    adv = group_norm_advantages(torch.tensor([1.0, 0.0, 0.5, 0.0]), 4, batch.response_mask())
    return update_policy(model, optimizer, TrainBatch(batch, adv), cfg, step).metrics.as_dict()


def vpp_optimizer(model):
    """The test's optimizer: megatron's distributed Adam, two steps of schedule."""
    from services.common.config import MegatronTrainingConfig
    from services.trainer.modeling.optimizer import build_optimizer

    return build_optimizer(model, MegatronTrainingConfig(lr=1e-3, clip_grad=0.5), total_steps=2)


def weights_now(model, layout) -> dict:
    """The gathered HF weights, copied: the owning stage's replicated tensors are views of the live weights."""
    return {name: t.clone() for name, t in gather_hf_weights(model, layout).items()}


def loaded_model(hf_dir: str, layout):
    model = build_model(layout)
    load_hf_into_model(model, load_hf_state(hf_dir), layout)
    return model


def main() -> None:
    torch.set_num_threads(1)
    hf_dir, out_dir = sys.argv[1], pathlib.Path(sys.argv[2])
    init_parallel(tp=1, pp=2, vpp=2)
    from megatron.core import parallel_state

    layout = ModelLayout.from_hf_dir(hf_dir)
    model = loaded_model(hf_dir, layout)
    batch = random_batch(**VPP_BATCH)
    parts = [batch.select(torch.tensor([i])) for i in range(batch.size)]
    tokens = float(batch.response_lengths.sum())
    out = {"pp_rank": parallel_state.get_pipeline_model_parallel_rank(), "chunks": len(model)}

    results = run_micro_batches(model, parts, packed=False, loss_fn=lambda i, logp, entropy: -logp.sum() / tokens)
    out["loss"] = sum(-lp.sum().item() for lp, _ in results) / tokens
    out["grads"] = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    model.zero_grad()
    out["packed_logp"] = compute_logprobs(model, batch, ForwardConfig(micro_batch_size=2, use_remove_padding=True))[0]
    out["streamed"] = {name: t.clone() for bucket in stream_hf_weights(model, layout, STREAM_BUCKET_MB) for name, t in bucket.items()}

    optimizer = vpp_optimizer(model)
    out["update1"] = vpp_update(model, optimizer, batch, 0)
    out["weights1"] = weights_now(model, layout)
    save_checkpoint(out_dir / "ckpt", model, optimizer, TrainState(step=1), hf_dir)
    out["update2"] = vpp_update(model, optimizer, batch, 1)
    out["weights2"] = weights_now(model, layout)

    resumed = loaded_model(hf_dir, layout)
    resumed_optimizer = vpp_optimizer(resumed)
    out["resumed_step"] = load_checkpoint(out_dir / "ckpt", resumed, resumed_optimizer).step
    out["resumed_update2"] = vpp_update(resumed, resumed_optimizer, batch, 1)
    out["resumed_weights2"] = weights_now(resumed, layout)

    critic = build_critic(layout, load_hf_state(hf_dir))
    critic_batch = random_batch(**CRITIC_BATCH)
    out["values"] = compute_values(critic, critic_batch, FORWARD)
    out["critic_update"], out["values_after"] = parity_critic_update(critic, critic_batch)

    fresh = loaded_model(hf_dir, layout)
    out["dynamic_update"] = vpp_update(fresh, vpp_optimizer(fresh), batch, 0, DYNAMIC)
    out["dynamic_weights"] = weights_now(fresh, layout)
    torch.save(out, out_dir / f"rank{torch.distributed.get_rank()}.pt")
    destroy_parallel()


if __name__ == "__main__":
    main()
