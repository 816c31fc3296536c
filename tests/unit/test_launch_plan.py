"""`dockrl up`'s process plan: which ports each server is told and where it reports the ones it bound."""
from services.common.config import DEFAULT_CONFIG, load_config
from services.launch.plan import plan_processes


def _flag(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_port_zero_is_passed_down_and_each_server_reports_through_its_own_ready_file(tmp_path):
    # Picking free ports in the launcher and passing them down races every socket opened while vLLM
    # starts (~30 s); the servers bind port 0 themselves and write what they got.
    cfg = load_config(str(DEFAULT_CONFIG), ["rollout.grpc_port=0", "rollout.http_port=0", "rollout.replicas=2",
                                            "reward.grpc_port=0", "reward.replicas=2", "trainer.grpc_port=0"])
    specs = plan_processes(cfg, tmp_path / "config.yaml", "redis://127.0.0.1:6379/0", tmp_path / "ready")
    assert [s.name for s in specs] == ["rollout-0", "rollout-1", "reward-0", "reward-1", "trainer"]
    servers = specs[:-1]
    assert all(_flag(s.argv, "--grpc-port" if s.name.startswith("rollout") else "--port") == "0" for s in servers)
    assert all(_flag(s.argv, "--http-port") == "0" for s in servers[:2])
    assert _flag(specs[-1].argv, "--port") == "0"
    ready = [s.ready_file for s in servers]
    assert len(set(ready)) == 4 and all(r.startswith(str(tmp_path / "ready")) for r in ready)
    assert all(_flag(s.argv, "--ready-file") == s.ready_file for s in servers)
    assert (tmp_path / "ready").is_dir()


def test_fixed_ports_count_up_from_the_configured_base(tmp_path):
    cfg = load_config(str(DEFAULT_CONFIG), ["rollout.grpc_port=50051", "rollout.http_port=8000", "rollout.replicas=2",
                                            "reward.grpc_port=50061", "reward.replicas=2", "trainer.grpc_port=50071"])
    specs = plan_processes(cfg, tmp_path / "config.yaml", "redis://127.0.0.1:6379/0", tmp_path / "ready")
    ports = {s.name: [_flag(s.argv, f) for f in ("--grpc-port", "--http-port", "--port") if f in s.argv] for s in specs}
    assert ports == {"rollout-0": ["50051", "8000"], "rollout-1": ["50052", "8001"],
                     "reward-0": ["50061"], "reward-1": ["50062"], "trainer": ["50071"]}
