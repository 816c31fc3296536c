"""One rank of the TP parity test, started by torchrun: loss and gradients of a fixed batch.

Usage: torchrun --nproc-per-node N trainer_tp_worker.py HF_DIR OUT_DIR
Each rank writes OUT_DIR/rank{r}.pt with the loss, its gradients by megatron name, and the
model's weights gathered over TP in HF names (what a weight push sends), and the packed
(remove-padding) log-probs of the batch.
"""
import os
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from trainer_helpers import random_batch, response_nll  # noqa: E402

from services.trainer.checkpoint_convert import load_hf_into_model, load_hf_state  # noqa: E402
from services.trainer.logprobs import forward_micro_batch  # noqa: E402
from services.trainer.model import ModelLayout, build_model, destroy_parallel, init_parallel  # noqa: E402
from services.trainer.weight_bucket import gather_hf_weights  # noqa: E402

PARITY_BATCH = dict(seed=3, prompt_lengths=[3, 5, 2], response_lengths=[4, 2, 6])


def main() -> None:
    torch.set_num_threads(1)
    hf_dir, out_dir = sys.argv[1], pathlib.Path(sys.argv[2])
    init_parallel(tp=int(os.environ["WORLD_SIZE"]), pp=1)
    layout = ModelLayout.from_hf_dir(hf_dir)
    model = build_model(layout)
    load_hf_into_model(model, load_hf_state(hf_dir), layout)
    batch = random_batch(**PARITY_BATCH)
    logp, _ = forward_micro_batch(model, batch, packed=False)
    loss = response_nll(logp, batch)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    rank = torch.distributed.get_rank()
    weights = gather_hf_weights(model, layout)
    with torch.no_grad():
        packed_logp, _ = forward_micro_batch(model, batch, packed=True)
    torch.save({"loss": loss.item(), "grads": grads, "hf_weights": weights, "packed_logp": packed_logp},
               out_dir / f"rank{rank}.pt")
    destroy_parallel()


if __name__ == "__main__":
    main()
