"""Chain broadcast: forwards each chunk of a weight push to the next replica as it arrives.

The trainer sends the model once to the first replica with `forward_to = [r2, r3, ...]`; each
replica relays every chunk to the next with the rest of the list, so the push costs the trainer
one stream however many replicas there are, and the chunks are pipelined down the chain.
"""
from __future__ import annotations

import asyncio

import grpc

from services.common.auth import bearer_metadata
from services.common.errors import Unavailable
from services.common.pb import rollout_pb2, rollout_pb2_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_END = object()


class ChainForwarder:
    """One UpdateWeights stream to the next replica of the chain."""

    def __init__(self, target: str, rest: list[str], token: str):
        self.target = target
        self.rest = rest
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=8)  # bounded: a slow next replica slows this push
        self._first = True
        self._channel = grpc.aio.insecure_channel(
            target, options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        )
        stub = rollout_pb2_grpc.RolloutStub(self._channel)
        self._call = stub.UpdateWeights(self._chunks(), metadata=bearer_metadata(token))

    async def _chunks(self):
        while (chunk := await self._queue.get()) is not _END:
            yield chunk

    async def send(self, chunk: rollout_pb2.WeightChunk) -> None:
        """Queues `chunk` for the next replica; the first one carries the rest of the chain."""
        if self._first:
            chunk = rollout_pb2.WeightChunk.FromString(chunk.SerializeToString())
            del chunk.forward_to[:]
            chunk.forward_to.extend(self.rest)
            self._first = False
        if self._call.done():
            await self.finish()
        await self._queue.put(chunk)

    async def finish(self) -> int:
        """Ends the stream; returns how many replicas downstream now serve the push."""
        if not self._call.done():
            await self._queue.put(_END)
        try:
            response = await self._call
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"forward_to {self.target}: {exc.code().name}: {exc.details()}") from exc
        finally:
            await self._channel.close()
        return response.replicas_updated

    async def cancel(self) -> None:
        """Abandons the downstream push: the next replica drops what it staged."""
        self._call.cancel()
        await self._channel.close()
