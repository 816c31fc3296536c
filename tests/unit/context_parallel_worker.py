"""One rank of the context-parallel tests, started by torchrun: log-probs, entropy, loss, gradients and one update of a
fixed batch, padded and packed, under TP x CP.

Usage: torchrun --nproc-per-node TP*CP*DP*PP context_parallel_worker.py HF_DIR OUT_DIR TP CP ALGO [PP [ULYSSES [CRITIC]]]
(ULYSSES: hybrid_cp_algo's ulysses_degree_in_cp; CRITIC 1: the PPO critic too)
Each rank writes OUT_DIR/rank{r}.pt with its (tp_rank, cp_rank), per layout (padded, packed): the log-probs and
entropy of the batch, the mean response NLL, the gradients by megatron name summed over the CP group (what DDP
reduces), the token ids this rank's forward took and the ones megatron-core's get_batch_on_this_cp_rank gives;
and the metrics and gathered HF weights of one GRPO update with dynamic batch size on the packed layout. With CRITIC,
also the PPO critic's values of critic_parallel_worker's batch and one critic step on it (its metrics, the values after),
in this launch: another torchrun launch for them would cost CI its start-up again.
"""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from critic_parallel_worker import CRITIC_BATCH, FORWARD, parity_critic_update  # noqa: E402
from trainer_helpers import gather_hf_weights, random_batch, response_nll  # noqa: E402

from services.common.config import MegatronTrainingConfig  # noqa: E402
from services.trainer.algorithm.advantages import group_norm_advantages  # noqa: E402
from services.trainer.algorithm.critic import build_critic, compute_values  # noqa: E402
from services.trainer.algorithm.losses import PolicyLossConfig  # noqa: E402
from services.trainer.algorithm.update import TrainBatch, UpdateConfig, update_policy  # noqa: E402
from services.trainer.modeling.checkpoint_convert import load_hf_into_model, load_hf_state  # noqa: E402
from services.trainer.modeling.logprobs import ForwardConfig, compute_logprobs, model_inputs, run_micro_batches  # noqa: E402
from services.trainer.modeling.model import ModelLayout, build_model, destroy_parallel, init_parallel  # noqa: E402
from services.trainer.modeling.optimizer import build_optimizer  # noqa: E402

# Lengths 7..13: under CP 2 every sequence is padded to a multiple of 4, some by 3 positions.
BATCH = dict(seed=5, prompt_lengths=[3, 5, 2, 4, 6, 3], response_lengths=[4, 2, 9, 5, 7, 6])


def main() -> None:
    torch.set_num_threads(1)
    hf_dir, out_dir, tp, cp, algo = sys.argv[1], pathlib.Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    pp = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    ulysses = int(sys.argv[7]) if len(sys.argv) > 7 else 1
    critic = len(sys.argv) > 8 and sys.argv[8] == "1"
    init_parallel(tp=tp, pp=pp, cp=cp, ulysses=ulysses)
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    layout = ModelLayout.from_hf_dir(hf_dir)
    model = build_model(layout, cp_algo=algo)
    load_hf_into_model(model, load_hf_state(hf_dir), layout)
    batch = random_batch(**BATCH)
    out = {"key": (parallel_state.get_data_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(),
                   parallel_state.get_context_parallel_rank())}
    for name, packed in (("padded", False), ("packed", True)):
        fwd = ForwardConfig(micro_batch_size=3, use_remove_padding=packed)
        logp, entropy = compute_logprobs(model, batch, fwd)
        parts = [batch.select(torch.arange(i, i + 3)) for i in (0, 3)]
        tokens = float(batch.response_lengths.sum())
        run_micro_batches(model, parts, packed, loss_fn=lambda i, lp, ent: -lp.sum() / tokens)
        grads = {}
        for param_name, param in model.named_parameters():
            grad = param.grad.detach().clone()
            torch.distributed.all_reduce(grad, group=parallel_state.get_context_parallel_group())
            grads[param_name] = grad
        model.zero_grad()
        inputs = model_inputs(parts[0], packed)
        out[name] = {"logp": logp, "entropy": entropy, "loss": response_nll(logp, batch).item(), "grads": grads,
                     "local_tokens": inputs.tokens.cpu()}
        if not packed and cp > 1:  # the same positions megatron-core's own split takes
            width = inputs.tokens.size(1) * cp
            full = torch.nn.functional.pad(parts[0].tokens, (0, width - parts[0].tokens.size(1)))
            out[name]["megatron_tokens"] = get_batch_on_this_cp_rank({"tokens": full})["tokens"]
    optimizer = build_optimizer(model, MegatronTrainingConfig(lr=1e-3, clip_grad=0.5), total_steps=2)
    update = UpdateConfig(mini_batch_size=6, forward=ForwardConfig(use_remove_padding=True, use_dynamic_bsz=True,
                                                                   max_packing_token_size=24),
                          loss=PolicyLossConfig(entropy_coeff=0.01))
    advantages = group_norm_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0]), 3, batch.response_mask())
    out["update"] = update_policy(model, optimizer, TrainBatch(batch, advantages), update).metrics.as_dict()
    out["weights"] = gather_hf_weights(model, layout)
    if critic:
        value_model = build_critic(layout, load_hf_state(hf_dir), cp_algo=algo)
        critic_batch = random_batch(**CRITIC_BATCH)
        values = compute_values(value_model, critic_batch, FORWARD)
        metrics, after = parity_critic_update(value_model, critic_batch)
        out["critic"] = {"values": values, "metrics": metrics, "values_after": after}
    torch.save(out, out_dir / f"rank{torch.distributed.get_rank()}.pt")
    destroy_parallel()


if __name__ == "__main__":
    main()
