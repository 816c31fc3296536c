"""One rank of the streamed weight gather tests, started by torchrun: the buckets HfWeightStream yields and the most
tensor memory held at once while they stream, against gathering the whole model first.

Usage: torchrun --nproc-per-node N weight_stream_worker.py HF_DIR OUT_DIR TP PP EP BUCKET_MB
Each rank writes OUT_DIR/rank{r}.pt: the names of each bucket yielded, the buckets' tensors merged, and the
peak extra tensor bytes alive (measured: trainer_helpers.peak_extra_tensor_bytes) while consuming the stream and while
consuming the same buckets cut from the whole gathered model.
"""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from trainer_helpers import gather_hf_weights, peak_extra_tensor_bytes  # noqa: E402

from services.common.weight_wire import DictBuckets  # noqa: E402
from services.trainer.modeling.checkpoint_convert import load_hf_into_model, load_hf_state  # noqa: E402
from services.trainer.modeling.model import ModelLayout, build_model, destroy_parallel, init_parallel  # noqa: E402
from services.trainer.weights.gather import stream_hf_weights  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    hf_dir, out_dir = sys.argv[1], pathlib.Path(sys.argv[2])
    tp, pp, ep, bucket_mb = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
    init_parallel(tp, pp, ep=ep)
    layout = ModelLayout.from_hf_dir(hf_dir)
    model = build_model(layout)
    load_hf_into_model(model, load_hf_state(hf_dir), layout)
    stream = stream_hf_weights(model, layout, bucket_mb)
    yielded = [dict(bucket) for bucket in stream]
    peak_stream = peak_extra_tensor_bytes(lambda: stream_hf_weights(model, layout, bucket_mb))
    # The push before streaming: the whole model gathered, then cut into the same buckets.
    peak_whole = peak_extra_tensor_bytes(lambda: DictBuckets(gather_hf_weights(model, layout), bucket_mb))
    torch.save({"plan": stream.plan, "bucket_names": [list(b) for b in yielded],
                "streamed": {name: t for b in yielded for name, t in b.items()},
                "peak_stream": peak_stream, "peak_whole": peak_whole},
               out_dir / f"rank{torch.distributed.get_rank()}.pt")
    destroy_parallel()


if __name__ == "__main__":
    main()
