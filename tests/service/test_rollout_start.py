"""What a rollout replica refuses at start, before its engine's tens of seconds of loading."""
import socket

import pytest

from replica_launcher import spawn_replica

pytestmark = pytest.mark.service


@pytest.mark.parametrize("flag", ["--grpc-port", "--http-port"])
def test_a_port_in_use_is_an_error_naming_it_before_the_engine_loads(tmp_path, flag):
    # As when a second replica on one host is started without ports: rollout-0 already holds the defaults.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # No model is read before the ports are checked, so none is needed here.
        pending = spawn_replica(tmp_path / "no-model", tmp_path, extra_args=(flag, str(port)))
        with pytest.raises(RuntimeError, match=rf"{flag} / rollout\.\w+_port: 127\.0\.0\.1:{port}: Address already in use; "
                                               "give another port, or 0 for a free one"):
            pending.wait(timeout_s=120)
    assert pending.proc.returncode == 2
    assert "Traceback" not in pending.log_path.read_text()
