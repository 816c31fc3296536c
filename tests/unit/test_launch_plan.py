"""`dockrl up`'s process plan: which ports each server is told and where it reports the ones it bound."""
from services.common.config import DEFAULT_CONFIG, load_config
from services.launch.plan import engine_core_binds, plan_processes


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


def test_reward_model_replicas_run_apart_with_their_own_kind_ports_and_ready_files(tmp_path):
    cfg = load_config(str(DEFAULT_CONFIG), ["reward.grpc_port=50061", "reward.replicas=2", "reward_config.load=/rm",
                                            "reward_config.model_replicas=2", "rl_config.verifier_function=[acc, reward_model]",
                                            "rl_config.verifier_weight=[0.5, 0.5]"])
    specs = plan_processes(cfg, tmp_path / "config.yaml", "redis://127.0.0.1:6379/0", tmp_path / "ready")
    assert [s.name for s in specs] == ["rollout-0", "reward-0", "reward-1", "reward-model-0", "reward-model-1", "trainer"]
    kinds = {s.name: _flag(s.argv, "--kind") for s in specs if "--kind" in s.argv}
    assert kinds == {"reward-model-0": "model", "reward-model-1": "model"}  # the rule replicas take the default, rule
    assert [_flag(s.argv, "--port") for s in specs[1:5]] == ["50061", "50062", "50063", "50064"]
    assert len({s.ready_file for s in specs[1:5]}) == 4 and all("--dock" in s.argv for s in specs[1:5])


def test_behind_sentinels_the_rollout_replicas_reach_the_dock_the_config_names(tmp_path):
    cfg = load_config(str(DEFAULT_CONFIG), ["dock.redis_sentinels=[127.0.0.1:26379]", "dock.redis_sentinel_master=dockrl"])
    specs = plan_processes(cfg, tmp_path / "config.yaml", "", tmp_path / "ready")
    assert _flag(specs[0].argv, "--dock") == "config"  # the rollout server then asks the sentinels (Dock.from_config)


def test_engine_threads_leave_a_core_per_replica_for_its_scheduler_and_api_when_there_are_enough():
    # vLLM's own auto binding leaves one core per engine for its scheduler; with every core taken by
    # the engine's threads the tiny run's rollout was 1.5x slower on 2 cores (docs/benchmarks.md).
    assert engine_core_binds(1, [0, 1]) == ["0"]
    assert engine_core_binds(2, [0, 1]) == ["0", "1"]  # too few to leave any: one each, apart
    assert engine_core_binds(2, [0, 1, 2, 3, 4, 5, 6, 7]) == ["0,1,2", "3,4,5"]
    assert engine_core_binds(1, [4, 5, 6, 7]) == ["4,5,6"]
    assert engine_core_binds(1, [3]) == ["3"]


def test_dockrl_up_binds_each_replica_to_its_cores_unless_the_config_names_them(tmp_path):
    cores = engine_core_binds(2)
    specs = plan_processes(load_config(str(DEFAULT_CONFIG), ["rollout.replicas=2"]), tmp_path / "c.yaml", "", tmp_path / "ready")
    assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in specs[:2]] == cores
    specs = plan_processes(load_config(str(DEFAULT_CONFIG), ["rollout.omp_threads_bind=nobind"]), tmp_path / "c.yaml", "",
                           tmp_path / "ready")
    assert specs[0].env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_the_add_replica_command_names_the_runs_config_and_dock_free_ports_and_no_core_binding(tmp_path):
    import shlex

    from services.cli import build_parser
    from services.launch.plan import add_replica_command, write_resolved_config

    cfg = load_config(str(DEFAULT_CONFIG), ["dock.run_id=run-7"])
    resolved = write_resolved_config(cfg, "redis://127.0.0.1:41234/0", tmp_path / "config.yaml")
    argv = shlex.split(add_replica_command(cfg, resolved))
    assert argv[:3] == ["dockrl", "rollout", "serve"]
    args = build_parser().parse_args(argv[1:])  # the command `dockrl` parses
    assert (args.config, args.model, args.dock, args.grpc_port, args.http_port) == (str(resolved), cfg.megatron_training.load, "config", 0, 0)
    # `--dock config` reads the dock from the resolved config: the run's Redis and run id
    joined = load_config(args.config, args.overrides)
    assert (joined.dock.redis_url, joined.dock.run_id) == ("redis://127.0.0.1:41234/0", "run-7")
    # the binding is the run's: with `auto` the replica takes cores no running replica holds (tests/unit/test_core_claims.py)
    assert joined.rollout.omp_threads_bind == cfg.rollout.omp_threads_bind == "auto"
    named = load_config(str(DEFAULT_CONFIG), ["rollout.omp_threads_bind='0,1'"])
    assert "omp_threads_bind" not in add_replica_command(named, resolved)


def test_a_run_that_executes_model_code_starts_its_sandbox_replicas_first_and_its_clients_find_them(tmp_path):
    from services.reward.code_tests import code_sandbox

    code = ["rl_config.verifier_function=[sandbox_fusion]", "rl_config.verifier_weight=[1.0]", "sandbox.replicas=2"]
    cfg = load_config(str(DEFAULT_CONFIG), code)
    specs = plan_processes(cfg, tmp_path / "config.yaml", "redis://127.0.0.1:6379/0", tmp_path / "ready")
    assert [s.name for s in specs] == ["sandbox-0", "sandbox-1", "rollout-0", "reward-0", "trainer"]
    assert [_flag(s.argv, "--replica-index") for s in specs[:2]] == ["0", "1"] and all("--dock" in s.argv for s in specs[:2])
    assert code_sandbox(cfg).address == "127.0.0.1:50081" and cfg.sandbox.address(3) == "127.0.0.1:50082"
    # a run given another sandbox's address, or one that runs no code, starts none
    given = load_config(str(DEFAULT_CONFIG), [*code, "reward.sandbox_address=10.0.0.5:50081"])
    assert code_sandbox(given).address == "10.0.0.5:50081"
    assert not [s for s in plan_processes(given, tmp_path / "c.yaml", "", tmp_path / "r") if s.name.startswith("sandbox")]
    assert not [s for s in plan_processes(load_config(str(DEFAULT_CONFIG)), tmp_path / "c.yaml", "", tmp_path / "r")
                if s.name.startswith("sandbox")]
