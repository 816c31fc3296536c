"""The gRPC Trainer service on loopback: Status, Checkpoint of a real megatron model, Pause/Resume, auth, health."""
import pathlib
import sys
import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "unit"))
from trainer_helpers import megatron_tp1, tiny_hf_model  # noqa: E402

from services.common.auth import bearer_metadata  # noqa: E402
from services.common.config import MegatronTrainingConfig  # noqa: E402
from services.common.pb import trainer_pb2, trainer_pb2_grpc  # noqa: E402
from services.trainer.modeling.checkpoint import TrainState, checkpoint_handler, latest_step, load_checkpoint  # noqa: E402
from services.trainer.loop.control import TrainerControl  # noqa: E402
from services.trainer.loop.server import start_server  # noqa: E402
from services.trainer.modeling.optimizer import build_optimizer  # noqa: E402

pytestmark = pytest.mark.service
TOKEN = "s3cret-trainer"


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    hf_dir = tiny_hf_model(tmp_path_factory.mktemp("hf"))
    model, _ = megatron_tp1(hf_dir)
    optimizer = build_optimizer(model, MegatronTrainingConfig(lr=1e-3), 10)
    save_dir = tmp_path_factory.mktemp("save")
    control = TrainerControl(train_iters=10)
    control.checkpoint_handler = checkpoint_handler(str(save_dir), model, optimizer,
                                                    lambda: TrainState(step=control.snapshot().step, policy_version=control.snapshot().version))
    server, port = start_server(control, "127.0.0.1", 0, token=TOKEN)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield control, trainer_pb2_grpc.TrainerStub(channel), channel, save_dir, (model, optimizer)
    channel.close()
    server.stop(grace=None).wait()


def test_status_shows_recorded_step(running):
    control, stub, *_ = running
    control.set_state("train")
    control.record_step(3, {"loss": 0.25, "grad_norm": 1.5}, version=3)
    status = stub.Status(trainer_pb2.StatusRequest())
    assert (status.step, status.version, status.state, status.train_iters, status.paused) == (3, 3, "train", 10, False)
    assert dict(status.metrics) == {"loss": 0.25, "grad_norm": 1.5}


def test_checkpoint_writes_a_resumable_checkpoint(running, tmp_path):
    control, stub, _, save_dir, (model, optimizer) = running
    control.record_step(4, {}, version=4)
    answer = stub.Checkpoint(trainer_pb2.CheckpointRequest(path=""), metadata=bearer_metadata(TOKEN))
    assert answer.step == 4 and answer.path == str(save_dir / "iter_0000004")
    assert latest_step(save_dir) == 4
    other = stub.Checkpoint(trainer_pb2.CheckpointRequest(path=str(tmp_path / "elsewhere")), metadata=bearer_metadata(TOKEN))
    assert pathlib.Path(other.path).is_dir()
    weight = next(model.parameters())
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.add_(1.0)
    assert load_checkpoint(save_dir, model, optimizer).step == 4
    assert torch.equal(next(model.parameters()), saved)


def test_checkpoint_to_an_unwritable_path_is_invalid_argument(running, tmp_path):
    _, stub, *_ = running
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(grpc.RpcError) as err:
        stub.Checkpoint(trainer_pb2.CheckpointRequest(path=str(blocker / "ckpt")), metadata=bearer_metadata(TOKEN))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("path:")
    assert stub.Status(trainer_pb2.StatusRequest()).train_iters == 10  # still serving


def test_state_changing_calls_need_the_token(running):
    _, stub, *_ = running
    for call, request in [(stub.Pause, trainer_pb2.PauseRequest()), (stub.Checkpoint, trainer_pb2.CheckpointRequest())]:
        with pytest.raises(grpc.RpcError) as err:
            call(request, metadata=bearer_metadata("wrong"))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert stub.Status(trainer_pb2.StatusRequest()).paused is False


def test_pause_holds_the_driver_until_resume(running):
    control, stub, *_ = running
    control.set_state("rollout")
    assert stub.Pause(trainer_pb2.PauseRequest(), metadata=bearer_metadata(TOKEN)).paused
    passed = threading.Event()
    driver = threading.Thread(target=lambda: control.wait_while_paused(timeout_s=30) and passed.set())
    driver.start()
    assert not passed.wait(0.3)
    status = stub.Status(trainer_pb2.StatusRequest())
    assert status.paused and status.state == "paused"
    assert not stub.Resume(trainer_pb2.ResumeRequest(), metadata=bearer_metadata(TOKEN)).paused
    assert passed.wait(5)
    driver.join()
    assert stub.Status(trainer_pb2.StatusRequest()).state == "rollout"


def test_health_serves(running):
    channel = running[2]
    check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="dockrl.trainer.v1.Trainer"))
    assert check.status == health_pb2.HealthCheckResponse.SERVING
