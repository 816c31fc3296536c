"""One rank of the data-parallel tests, started by torchrun: a GRPO update and a PPO critic update on a fixed batch, a
checkpoint, and the update after it, with megatron-core's DDP and (distributed) optimizer over however many ranks run.

Usage: torchrun --nproc-per-node N data_parallel_worker.py HF_DIR OUT_DIR DISTRIBUTED(0|1) PP [RESUME_FROM]
(the data-parallel size is N / PP)
Each rank writes OUT_DIR/rank{r}.pt: the metrics of each update, the weights after them (HF names), the log-probs the
update handed back, the values of the critic, how many samples this rank's forward passes saw, and the numel of the
Adam state it holds. With RESUME_FROM it loads that checkpoint first and runs only the update after it.
"""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from trainer_helpers import gather_hf_weights, random_batch  # noqa: E402

from services.common.config import MegatronTrainingConfig  # noqa: E402
from services.trainer.algorithm.advantages import group_norm_advantages  # noqa: E402
from services.trainer.algorithm.critic import CriticUpdateConfig, build_critic, build_critic_optimizer, compute_values, critic_update  # noqa: E402
from services.trainer.algorithm.losses import PolicyLossConfig  # noqa: E402
from services.trainer.algorithm.update import TrainBatch, UpdateConfig, update_policy  # noqa: E402
from services.trainer.modeling.checkpoint import TrainState, load_checkpoint, save_checkpoint  # noqa: E402
from services.trainer.modeling.checkpoint_convert import load_hf_into_model, load_hf_state  # noqa: E402
from services.trainer.modeling.logprobs import ForwardConfig, compute_logprobs  # noqa: E402
from services.trainer.modeling.model import ModelLayout, build_model, destroy_parallel, init_parallel  # noqa: E402
from services.trainer.modeling.optimizer import build_optimizer  # noqa: E402

N = 4  # samples per prompt: 12 samples are 3 groups
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
# Two epochs of two shuffled mini-batches of 6, micro-batches of 2 and a KL term: every piece that could split wrong.
UPDATE = UpdateConfig(mini_batch_size=6, epochs=2, shuffle_mini_batch=True, forward=ForwardConfig(micro_batch_size=2),
                      loss=PolicyLossConfig(entropy_coeff=0.01, kl_coef=0.05))
CRITIC = CriticUpdateConfig(mini_batch_size=6, forward=ForwardConfig(micro_batch_size=2))


def batch():
    return random_batch(11, prompt_lengths=[3, 4, 5, 2, 3, 4, 2, 5, 3, 3, 4, 2], response_lengths=[4, 2, 3, 5, 1, 3, 4, 2, 6, 2, 3, 4])


def main() -> None:
    torch.set_num_threads(1)
    hf_dir, out_dir, distributed, pp = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
    resume_from = sys.argv[5] if len(sys.argv) > 5 else None
    init_parallel(1, pp)
    mt = MegatronTrainingConfig(lr=1e-3, clip_grad=1.0, use_distributed_optimizer=distributed)
    layout = ModelLayout.from_hf_dir(hf_dir)
    hf_state = load_hf_state(hf_dir)
    model = build_model(layout)
    load_hf_into_model(model, hf_state, layout)
    seen = [0]
    model.register_forward_hook(lambda module, args, output: seen.__setitem__(0, seen[0] + args[0].size(0)))
    optimizer = build_optimizer(model, mt, total_steps=8)
    samples = batch()
    ref = compute_logprobs(model, samples, UPDATE.forward)[0]
    train = TrainBatch(samples, group_norm_advantages(REWARDS, N, samples.response_mask()), ref_logprobs=ref)
    out = {}
    if resume_from is None:
        first = update_policy(model, optimizer, train, UPDATE, step=0)
        out.update(first=first.metrics.as_dict(), start_logprobs=first.start_logprobs)
        save_checkpoint(out_dir / "ckpt", model, optimizer, TrainState(step=1))
    else:
        load_checkpoint(resume_from, model, optimizer)
    out["second"] = update_policy(model, optimizer, train, UPDATE, step=1).metrics.as_dict()
    out["weights"] = gather_hf_weights(model, layout)
    out["samples_forwarded"] = seen[0]
    inner = optimizer.optimizer.chained_optimizers[0].optimizer
    out["adam_state_numel"] = sum(state["exp_avg"].numel() for state in inner.state.values())

    critic = build_critic(layout, hf_state)
    critic_optimizer = build_critic_optimizer(critic, mt, total_steps=1)
    values = compute_values(critic, samples, CRITIC.forward)
    returns = REWARDS.unsqueeze(1) * samples.response_mask()
    out["critic"] = critic_update(critic, critic_optimizer, samples, values, returns, CRITIC).as_dict()
    out["values"], out["values_after"] = values, compute_values(critic, samples, CRITIC.forward)
    torch.save(out, out_dir / f"rank{torch.distributed.get_rank()}.pt")
    destroy_parallel()


if __name__ == "__main__":
    main()
