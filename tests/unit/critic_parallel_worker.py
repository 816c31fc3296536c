"""One rank of the critic's TP / PP parity tests, started by torchrun: values of a fixed batch and one critic update on it.

Usage: torchrun --nproc-per-node N critic_parallel_worker.py HF_DIR OUT_DIR TP PP [CP CP_ALGO]
Each rank writes OUT_DIR/rank{r}.pt with the values before and after the update and its metrics.
"""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from trainer_helpers import random_batch  # noqa: E402

from services.trainer.modeling.checkpoint_convert import load_hf_state  # noqa: E402
from services.trainer.algorithm.critic import build_critic, compute_values  # noqa: E402
from services.trainer.modeling.logprobs import ForwardConfig  # noqa: E402
from services.trainer.modeling.model import ModelLayout, destroy_parallel, init_parallel  # noqa: E402

CRITIC_BATCH = dict(seed=11, prompt_lengths=[3, 5, 2, 4], response_lengths=[4, 2, 6, 3])
FORWARD = ForwardConfig(micro_batch_size=2)


def parity_critic_update(critic, batch):
    """One critic step on `batch` toward returns of 1.0 (two micro-batches, clipping on); (metrics, values after)."""
    from services.common.config import MegatronTrainingConfig
    from services.trainer.algorithm.critic import CriticUpdateConfig, build_critic_optimizer, critic_update

    optimizer = build_critic_optimizer(critic, MegatronTrainingConfig(lr=1e-3, clip_grad=0.5), total_steps=1)
    cfg = CriticUpdateConfig(mini_batch_size=batch.size, cliprange_value=0.2, forward=FORWARD)
    old = compute_values(critic, batch, FORWARD)
    metrics = critic_update(critic, optimizer, batch, old, torch.ones_like(old), cfg)
    return metrics.as_dict(), compute_values(critic, batch, FORWARD)


def main() -> None:
    torch.set_num_threads(1)
    hf_dir, out_dir, tp, pp = sys.argv[1], pathlib.Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    cp, cp_algo = (int(sys.argv[5]), sys.argv[6]) if len(sys.argv) > 6 else (1, "megatron_cp_algo")
    init_parallel(tp=tp, pp=pp, cp=cp)
    critic = build_critic(ModelLayout.from_hf_dir(hf_dir), load_hf_state(hf_dir), cp_algo=cp_algo)
    batch = random_batch(**CRITIC_BATCH)
    values = compute_values(critic, batch, FORWARD)
    metrics, after = parity_critic_update(critic, batch)
    torch.save({"values": values, "metrics": metrics, "values_after": after}, out_dir / f"rank{torch.distributed.get_rank()}.pt")
    destroy_parallel()


if __name__ == "__main__":
    main()
