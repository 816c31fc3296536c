"""The gRPC `Trainer` service (proto/trainer.proto) and grpc.health.v1 on one server.

Status is open; Checkpoint, Pause and Resume change the run and need the bearer token.
"""
from __future__ import annotations

from concurrent import futures

import grpc

from services.common.auth import TokenInterceptor
from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.grpc_status import StatusInterceptor
from services.common.grpc_serving import start_with_health
from services.common.pb import trainer_pb2, trainer_pb2_grpc
from services.trainer.loop.control import TrainerControl

SERVICE_NAME = "dockrl.trainer.v1.Trainer"
PROTECTED_METHODS = tuple(f"/{SERVICE_NAME}/{m}" for m in ("Checkpoint", "Pause", "Resume"))
MAX_PATH_CHARS = 4096


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    """Answers from a TrainerControl shared with the iteration driver."""

    def __init__(self, control: TrainerControl):
        self.control = control

    def Status(self, request, context):
        s = self.control.snapshot()
        return trainer_pb2.StatusResponse(step=s.step, version=s.version, state=s.state, paused=s.paused,
                                          metrics=s.metrics, train_iters=s.train_iters)

    def Checkpoint(self, request, context):
        if len(request.path) > MAX_PATH_CHARS or "\0" in request.path:
            raise InvalidArgument("path", f"must be a directory path of at most {MAX_PATH_CHARS} characters without NUL")
        try:
            path, step = self.control.checkpoint(request.path)
        except RuntimeError as exc:
            raise FailedPrecondition(f"Checkpoint: {exc}") from exc
        except ValueError as exc:
            raise InvalidArgument("path", str(exc).removeprefix("path: ")) from exc
        except OSError as exc:
            raise InvalidArgument("path", f"cannot write a checkpoint to {request.path!r}: {exc.strerror or exc}") from exc
        return trainer_pb2.CheckpointResponse(path=path, step=step)

    def Pause(self, request, context):
        self.control.pause()
        return trainer_pb2.PauseResponse(paused=True)

    def Resume(self, request, context):
        self.control.resume()
        return trainer_pb2.ResumeResponse(paused=False)


def start_server(control: TrainerControl, host: str, port: int, token: str = "") -> tuple[grpc.Server, int]:
    """Starts Trainer + health on host:port (0: any free port); returns the server and its bound port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[TokenInterceptor(token, PROTECTED_METHODS), StatusInterceptor()])
    trainer_pb2_grpc.add_TrainerServicer_to_server(TrainerServicer(control), server)
    bound, _ = start_with_health(server, host, port, SERVICE_NAME, "trainer.grpc_port")
    return server, bound
