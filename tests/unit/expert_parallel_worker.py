"""One rank of the expert-parallel test, started by torchrun: a GRPO update of a tiny MoE model with megatron-core's DDP
and optimizer, its experts split over EP ranks (the data-parallel ranks, which also split the batch).

Usage: torchrun --nproc-per-node N expert_parallel_worker.py HF_DIR OUT_DIR EP [cpC] [ppP] [checkpoint [RESUME_FROM]]
(cpC: context parallel over C ranks, ring attention, beside EP; ppP: P pipeline stages (1F1B); N = EP x C x P).
Each rank writes OUT_DIR/rank{r}.pt: the batch's log-probs before the update, with the routers' own choice and with a
given routing replayed (padded and packed), the update's metrics (its loss, grad norm and the routers' load-balancing loss),
the reduced gradients of the update's optimizer step and the weights after it, both gathered in HF names (experts
over EP: what a weight push sends), and how many experts this rank holds per layer.
With `checkpoint` (the distributed optimizer): two updates with a checkpoint between them in OUT_DIR/ckpt, the weights
after each; with RESUME_FROM it loads that checkpoint instead of the first update and runs only the second.
"""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from trainer_helpers import gather_hf_tensors, gather_hf_weights, random_batch  # noqa: E402

from services.common.config import MegatronTrainingConfig  # noqa: E402
from services.trainer.algorithm.advantages import group_norm_advantages  # noqa: E402
from services.trainer.algorithm.losses import PolicyLossConfig  # noqa: E402
from services.trainer.algorithm.update import TrainBatch, UpdateConfig, update_policy  # noqa: E402
from services.trainer.modeling.checkpoint import TrainState, load_checkpoint, save_checkpoint  # noqa: E402
from services.trainer.modeling.checkpoint_convert import load_hf_into_model, load_hf_state  # noqa: E402
from services.trainer.modeling.logprobs import ForwardConfig, ResponseBatch, run_micro_batches  # noqa: E402
from services.trainer.modeling.model import ModelLayout, build_model, destroy_parallel, init_parallel  # noqa: E402
from services.trainer.modeling.optimizer import build_optimizer  # noqa: E402

N = 4  # samples per prompt: 8 samples are 2 groups
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
# One mini-batch of every sample (the gradients compared are that step's), one sample per micro-batch: the load-balancing
# loss is a function of a micro-batch's own tokens, so both splits must cut the batch into the same micro-batches.
UPDATE = UpdateConfig(mini_batch_size=8, forward=ForwardConfig(micro_batch_size=1), loss=PolicyLossConfig(entropy_coeff=0.01))


def batch():
    """8 samples of 4 or 8 tokens: multiples of 2 x CP, so context parallel pads none. The routers score padding tokens
    too (megatron is given no padding mask), so CP's padding would change the load-balancing loss a little."""
    return random_batch(5, prompt_lengths=[3, 4, 5, 2, 3, 4, 2, 5], response_lengths=[5, 4, 3, 2, 1, 4, 6, 3])


def replayed_logprobs(model, layout: ModelLayout, samples: ResponseBatch) -> dict:
    """The batch's log-probs with the routers' own choice, and with a fixed draw of experts replayed (routing replay),
    padded and packed: under context parallel the replayed experts must follow each CP rank's reordered share."""
    gen = torch.Generator().manual_seed(11)
    layers = layout.num_layers  # every layer of the tiny model is an MoE layer
    routed = [torch.rand(n - 1, layers, layout.num_experts, generator=gen).argsort(-1)[..., : layout.moe_topk].to(torch.uint8)
              for n in samples.sequence_lengths.tolist()]
    replayed = ResponseBatch(samples.tokens, samples.prompt_lengths, samples.response_lengths, routed)
    return {"natural": run_micro_batches(model, [samples], packed=False)[0][0],
            **{name: run_micro_batches(model, [replayed], packed)[0][0] for name, packed in (("padded", False), ("packed", True))}}


def checkpointed_updates(hf_dir: str, out_dir: pathlib.Path, model, layout, train: TrainBatch, resume_from: str | None) -> dict:
    """Two updates with the distributed optimizer and a checkpoint between them (or the checkpoint, then the second)."""
    optimizer = build_optimizer(model, MegatronTrainingConfig(lr=1e-3, use_distributed_optimizer=True), total_steps=2)
    out = {}
    if resume_from is None:
        update_policy(model, optimizer, train, UPDATE, step=0)
        # copies: unconverted tensors (norms, routers) are the live parameters, which the second update moves
        out["first_weights"] = {name: w.clone() for name, w in gather_hf_weights(model, layout).items()}
        save_checkpoint(out_dir / "ckpt", model, optimizer, TrainState(step=1), hf_dir=hf_dir)
    else:
        load_checkpoint(resume_from, model, optimizer)
    out["second"] = update_policy(model, optimizer, train, UPDATE, step=1).metrics.as_dict()
    out["weights"] = gather_hf_weights(model, layout)
    return out


def main() -> None:
    torch.set_num_threads(1)
    hf_dir, out_dir, ep = sys.argv[1], pathlib.Path(sys.argv[2]), int(sys.argv[3])
    sizes = {"cp": 1, "pp": 1}
    while sys.argv[4:5] and sys.argv[4][:2] in sizes:
        arg = sys.argv.pop(4)
        sizes[arg[:2]] = int(arg[2:])
    init_parallel(1, sizes["pp"], ep=ep, cp=sizes["cp"])
    layout = ModelLayout.from_hf_dir(hf_dir)
    model = build_model(layout, routing_replay=True)  # the routers replay only when given a routing
    load_hf_into_model(model, load_hf_state(hf_dir), layout)
    if sys.argv[4:5] == ["checkpoint"]:
        samples = batch()
        train = TrainBatch(samples, group_norm_advantages(REWARDS, N, samples.response_mask()))
        out = checkpointed_updates(hf_dir, out_dir, model, layout, train, sys.argv[5] if len(sys.argv) > 5 else None)
        torch.save(out, out_dir / f"rank{torch.distributed.get_rank()}.pt")
        destroy_parallel()
        return
    # The replicated optimizer all-reduces whole gradients, so every rank's buffer holds them after the step.
    optimizer = build_optimizer(model, MegatronTrainingConfig(lr=1e-3, use_distributed_optimizer=False), total_steps=1)
    samples = batch()
    replayed = replayed_logprobs(model, layout, samples)
    metrics = update_policy(model, optimizer, TrainBatch(samples, group_norm_advantages(REWARDS, N, samples.response_mask())), UPDATE)
    grads = gather_hf_tensors({name: p.main_grad for name, p in model.named_parameters()}, layout)
    experts = sum(1 for name, _ in model.named_parameters() if "layers.0.mlp.experts.local_experts." in name and "fc1" in name)
    torch.save({"replayed_logprobs": replayed, "metrics": metrics.metrics.as_dict(), "grads": grads, "weights": gather_hf_weights(model, layout),
                "local_experts": experts}, out_dir / f"rank{torch.distributed.get_rank()}.pt")
    destroy_parallel()


if __name__ == "__main__":
    main()
