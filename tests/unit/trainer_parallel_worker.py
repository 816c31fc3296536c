"""One rank of the TP / PP parity tests, started by torchrun: loss, gradients, weights and log-probs of a fixed batch.

Usage: torchrun --nproc-per-node N trainer_parallel_worker.py HF_DIR OUT_DIR TP PP
Each rank writes OUT_DIR/rank{r}.pt with its (pp_rank, tp_rank), the loss, its gradients by
megatron name, the model's weights gathered in HF names (what a weight push sends), the
packed (remove-padding) log-probs of the batch, the width of the last stage's logits, and the
metrics of one update step on it.
"""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from trainer_helpers import gather_hf_weights, random_batch  # noqa: E402

from services.trainer.modeling.checkpoint_convert import load_hf_into_model, load_hf_state  # noqa: E402
from services.trainer.modeling.logprobs import ForwardConfig, compute_logprobs, model_inputs, run_micro_batches  # noqa: E402
from services.trainer.modeling.model import ModelLayout, build_model, destroy_parallel, init_parallel  # noqa: E402
from services.trainer.algorithm.update import update_policy  # noqa: E402
from services.trainer.modeling.optimizer import build_optimizer  # noqa: E402

PARITY_BATCH = dict(seed=3, prompt_lengths=[3, 5, 2], response_lengths=[4, 2, 6])


def parity_update(model, batch):
    """One GRPO update of `batch` (one group of 3, one sample per micro-batch); its metrics."""
    from services.common.config import MegatronTrainingConfig
    from services.trainer.algorithm.advantages import group_norm_advantages
    from services.trainer.algorithm.losses import PolicyLossConfig
    from services.trainer.algorithm.update import TrainBatch, UpdateConfig

    optimizer = build_optimizer(model, MegatronTrainingConfig(lr=1e-3, clip_grad=0.5), total_steps=2)
    cfg = UpdateConfig(mini_batch_size=3, forward=ForwardConfig(micro_batch_size=1),
                       loss=PolicyLossConfig(entropy_coeff=0.01))
    adv = group_norm_advantages(torch.tensor([1.0, 0.0, 0.0]), 3, batch.response_mask())
    return update_policy(model, optimizer, TrainBatch(batch, adv), cfg).metrics.as_dict()


def main() -> None:
    torch.set_num_threads(1)
    hf_dir, out_dir, tp, pp = sys.argv[1], pathlib.Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    init_parallel(tp=tp, pp=pp)
    from megatron.core import parallel_state

    layout = ModelLayout.from_hf_dir(hf_dir)
    model = build_model(layout)
    load_hf_into_model(model, load_hf_state(hf_dir), layout)
    batch = random_batch(**PARITY_BATCH)
    parts = [batch.select(torch.tensor([i])) for i in range(batch.size)]  # one sample per micro-batch
    tokens = float(batch.response_lengths.sum())

    def nll(i, logp, entropy):
        return -logp.sum() / tokens  # the parts' sum is the batch's mean NLL

    results = run_micro_batches(model, parts, packed=False, loss_fn=nll)
    loss = sum(-lp.sum().item() for lp, _ in results) / tokens
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    weights = gather_hf_weights(model, layout)
    packed_logp, _ = compute_logprobs(model, batch, ForwardConfig(micro_batch_size=2, use_remove_padding=True))
    # What the last stage's output holds: this TP rank's vocabulary slice, never the whole vocabulary.
    logits_width = model_inputs(parts[0], packed=False).run(model).size(-1) if pp == 1 else None
    model.zero_grad()
    update = parity_update(model, batch)
    key = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank())
    torch.save({"key": key, "loss": loss, "grads": grads, "hf_weights": weights, "packed_logp": packed_logp, "update": update,
                "logits_width": logits_width},
               out_dir / f"rank{torch.distributed.get_rank()}.pt")
    destroy_parallel()


if __name__ == "__main__":
    main()
