"""Weight buckets (pack / unpack / plan), chunking for UpdateWeights, gathering HF weights, and push errors."""
import socket
import time

import pytest
import torch
from trainer_helpers import gather_hf_weights, megatron_tp1, tiny_hf_model

from services.trainer.modeling.checkpoint_convert import load_hf_state
from services.common.weight_wire import (MIB, TensorSlot, WeightBucket, bucket_slots, chunk_messages, pack_bucket, pack_into,
                                         plan_buckets, torch_dtype)
from services.trainer.weights.collective_push import CollectiveSender
from services.trainer.weights.weight_push import PushFailure, push_weights


def unpack_bucket(bucket: WeightBucket) -> dict[str, torch.Tensor]:
    """The tensors of a bucket by name (copies, independent of its bytes): how these tests read the wire format back."""
    flat = torch.frombuffer(bytearray(bucket.data), dtype=torch.uint8) if bucket.data else torch.empty(0, dtype=torch.uint8)
    out = {}
    for s in bucket.tensors:
        if s.offset + s.nbytes > bucket.nbytes:
            raise ValueError(f"tensors[{s.name}]: bytes {s.offset}..{s.offset + s.nbytes} lie past the bucket's {bucket.nbytes}")
        # The copy first: a sender need not align, and view() needs an aligned start.
        out[s.name] = flat[s.offset: s.offset + s.nbytes].clone().view(torch_dtype(s.dtype)).reshape(s.shape)
    return out


def mixed_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(3, 5, generator=gen),
        "b.weight": torch.randn(7, generator=gen).to(torch.bfloat16),
        "c.index": torch.arange(4, dtype=torch.int64),
        "d.scale": torch.tensor(2.5),
    }


def test_pack_unpack_round_trip_is_exact():
    tensors = mixed_tensors()
    bucket = pack_bucket(tensors, tensors.keys())
    # 60 bytes of fp32, 14 of bf16, 32 of int64, 4 of fp32; each start aligned to 8
    assert [(s.name, s.dtype, s.offset, s.nbytes) for s in bucket.tensors] == [
        ("a.weight", "float32", 0, 60), ("b.weight", "bfloat16", 64, 14), ("c.index", "int64", 80, 32), ("d.scale", "float32", 112, 4)]
    assert bucket.nbytes == 116
    back = unpack_bucket(bucket)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t)


def test_the_collective_layout_is_the_buckets_and_packs_in_place():
    # the collective path sends bucket_slots' layout ahead of the bytes pack_into writes: both must be pack_bucket's
    tensors = {**mixed_tensors(), "e.t": torch.randn(4, 3).t()}  # a non-contiguous view packs as its values
    slots, nbytes = bucket_slots(tensors, tensors.keys(), torch.bfloat16)
    bucket = pack_bucket(tensors, tensors.keys(), torch.bfloat16)
    assert slots == bucket.tensors and nbytes == bucket.nbytes
    flat = pack_into(tensors, slots, torch.empty(nbytes, dtype=torch.uint8))
    back = unpack_bucket(WeightBucket(flat.numpy().tobytes(), slots))
    assert torch.equal(back["e.t"], tensors["e.t"].to(torch.bfloat16)) and torch.equal(back["c.index"], tensors["c.index"])


def test_the_collective_sender_refuses_bad_settings():
    with pytest.raises(ValueError, match="trainer.push_stall_s: must be > 0, got 0"):
        CollectiveSender("", 0, "127.0.0.1")
    with pytest.raises(ValueError, match="addresses: no rollout replica to push to"):
        CollectiveSender("", 5, "127.0.0.1").push(mixed_tensors(), [], 1, bucket_mb=1)


def test_pack_casts_floating_tensors_only():
    tensors = mixed_tensors()
    back = unpack_bucket(pack_bucket(tensors, tensors.keys(), dtype=torch.bfloat16))
    assert back["a.weight"].dtype == torch.bfloat16 and torch.equal(back["a.weight"], tensors["a.weight"].to(torch.bfloat16))
    assert back["c.index"].dtype == torch.int64


def test_plan_buckets_by_size():
    quarter = {f"t{i}": torch.zeros(MIB // 16) for i in range(5)}  # 0.25 MiB each in fp32
    assert plan_buckets(quarter, 0.6) == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert plan_buckets(quarter, 0.6, dtype=torch.bfloat16) == [["t0", "t1", "t2", "t3"], ["t4"]]
    big = {"small": torch.zeros(4), "big": torch.zeros(MIB), "after": torch.zeros(4)}
    assert plan_buckets(big, 1) == [["small"], ["big"], ["after"]]  # 4 MiB alone; nothing joins it
    with pytest.raises(ValueError, match="trainer.bucket_mb: must be > 0"):
        plan_buckets(quarter, 0)


def test_unpack_accepts_unaligned_offsets():
    raw = torch.arange(3, dtype=torch.int64).view(torch.uint8).numpy().tobytes()
    bucket = WeightBucket(b"x" + raw, (TensorSlot("i", "int64", (3,), 1, 24),))
    assert torch.equal(unpack_bucket(bucket)["i"], torch.arange(3))


def test_unpack_rejects_slots_past_the_bytes():
    bucket = pack_bucket({"a": torch.zeros(4)}, ["a"])
    bad = WeightBucket(bucket.data[:8], bucket.tensors)
    with pytest.raises(ValueError, match=r"tensors\[a\]: bytes 0..16 lie past the bucket's 8"):
        unpack_bucket(bad)


def test_chunks_stay_under_the_message_limit_and_reassemble():
    bucket = pack_bucket({"w": torch.randn(3 * MIB // 4 + 17)}, ["w"])  # ~3 MiB
    limit = MIB
    first, *rest = chunk_messages(bucket, version=7, bucket_index=0, num_buckets=2, max_message_bytes=limit,
                                  forward_to=("b:1", "c:2"), num_tensors=5)
    assert len(rest) >= 2
    assert all(m.ByteSize() <= limit for m in [first, *rest])
    assert [t.name for t in first.tensors] == ["w"] and first.bucket_nbytes == bucket.nbytes
    assert list(first.forward_to) == ["b:1", "c:2"] and first.num_tensors == 5
    assert all(not m.tensors and not m.forward_to for m in rest)
    assert all(m.version == 7 and m.num_buckets == 2 for m in rest)
    data = bytearray(bucket.nbytes)
    for m in [first, *rest]:
        data[m.data_offset: m.data_offset + len(m.data)] = m.data
    assert bytes(data) == bucket.data and sum(len(m.data) for m in [first, *rest]) == bucket.nbytes
    later = next(chunk_messages(bucket, 7, 1, 2, max_message_bytes=limit, forward_to=("b:1",), num_tensors=5))
    assert not later.forward_to and later.num_tensors == 0  # push-level fields ride on bucket 0 only


def test_gathered_model_weights_pack_back_to_the_hf_checkpoint(tmp_path):
    hf_dir = tiny_hf_model(tmp_path)
    model, layout = megatron_tp1(hf_dir)
    weights = gather_hf_weights(model, layout)
    original = load_hf_state(hf_dir)
    assert weights.keys() == original.keys()
    received = {}
    for names in plan_buckets(weights, bucket_mb=0.25):
        received.update(unpack_bucket(pack_bucket(weights, names)))
    assert all(torch.equal(received[k], original[k]) for k in original)


def test_push_to_an_unreachable_replica_reports_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: connection refused
        result = push_weights(mixed_tensors(), [address], version=3, bucket_mb=1, timeout_s=10)
    assert result.replicas_updated == 0 and result.version == 3
    assert len(result.failed) == 1 and result.failed[0].address == address and result.failed[0].error.startswith("UNAVAILABLE")


def test_push_to_a_replica_that_never_answers_misses_it_after_the_stall_limit():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()  # the kernel accepts connections; nobody reads them: a hung server
        address = f"127.0.0.1:{s.getsockname()[1]}"
        t0 = time.monotonic()
        result = push_weights(mixed_tensors(), [address], version=3, bucket_mb=1, timeout_s=120, stall_s=1.0)
        took = time.monotonic() - t0
    assert result.replicas_updated == 0 and result.failed == (PushFailure(address, "STALLED: no progress for 1 s (hung or stopped?)"),)
    assert took < 20, f"the push waited {took:.1f} s on a hung replica with stall_s 1"


def test_push_rejects_bad_mode_and_empty_replica_list():
    with pytest.raises(ValueError, match="trainer.push_mode: 'ring'"):
        push_weights(mixed_tensors(), ["127.0.0.1:1"], 1, bucket_mb=1, mode="ring")
    with pytest.raises(ValueError, match="no rollout replica"):
        push_weights(mixed_tensors(), [], 1, bucket_mb=1)
