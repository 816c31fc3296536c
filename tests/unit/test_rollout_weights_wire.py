"""The UpdateWeights wire format: buckets, chunks, offsets, and the served model's tensor spec."""
import torch

from services.common.tiny_model import build_tiny_model
from push_chunks import weight_chunks
from services.common.weight_wire import TensorSpec
from services.rollout.weight_receiver import served_weight_spec


def reassemble(chunks):
    """bucket index -> (metadata, bytes) rebuilt from the chunk stream."""
    buckets = {}
    for c in chunks:
        if c.tensors:
            buckets[c.bucket_index] = (list(c.tensors), bytearray(c.bucket_nbytes))
        meta, buf = buckets[c.bucket_index]
        buf[c.data_offset:c.data_offset + len(c.data)] = c.data
    return buckets


def test_chunks_carry_every_tensor_byte_exact_under_the_limits():
    tensors = [("a", torch.arange(10, dtype=torch.float32)), ("b", torch.ones(3, 4, dtype=torch.bfloat16)), ("c", torch.zeros(100))]
    chunks = list(weight_chunks(tensors, version=7, bucket_bytes=64, chunk_bytes=16, forward_to=["r2:1", "r3:1"]))
    assert all(len(c.data) <= 16 for c in chunks)
    assert chunks[0].num_buckets == 2  # a+b fill 64 bytes exactly; c is alone and chunks[0].num_tensors == 3 and list(chunks[0].forward_to) == ["r2:1", "r3:1"]
    assert all(not c.forward_to for c in chunks[1:]) and {c.version for c in chunks} == {7}
    got = {}
    for metas, buf in reassemble(chunks).values():
        for m in metas:
            raw = torch.frombuffer(bytearray(buf[m.offset:m.offset + m.nbytes]), dtype=getattr(torch, m.dtype))
            got[m.name] = raw.reshape(list(m.shape))
    for name, tensor in tensors:
        assert torch.equal(got[name], tensor)


def test_served_spec_lists_the_checkpoint_tensors_at_the_serving_dtype(tmp_path):
    model = build_tiny_model(tmp_path / "m")
    spec = served_weight_spec(model, "bfloat16")
    assert spec["model.embed_tokens.weight"] == TensorSpec("bfloat16", (320, 128))
    assert spec["model.layers.0.self_attn.k_proj.weight"].shape == (64, 128)
    assert spec["lm_head.weight"].nbytes == 320 * 128 * 2
