"""deploy/: the compose files are valid against the compose specification and resolve with
Docker Compose itself, the Kubernetes manifest against the Kubernetes schemas, and every command,
port and health check in compose and Kubernetes agrees with the code."""
import json
import os
import pathlib
import re
import subprocess

import pytest
import yaml

from services.cli import SERVICE_COMMANDS, build_parser
from services.common.config import ConfigError, load_config
from tests.deploy.docker_host import compose_binary

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "deploy/docker-compose.yml").read_text())
K8S = [d for d in yaml.safe_load_all((ROOT / "deploy/k8s/dockrl.yaml").read_text()) if d]


def _expand(arg: str) -> str:
    """Substitutes ${VAR:-default}, ${VAR?message} and $(VAR) as compose and Kubernetes would with
    defaults (a required variable becomes `value`)."""
    arg = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", arg)
    arg = re.sub(r"\$\{[A-Z_]+:?\?[^}]*\}", "value", arg)
    return re.sub(r"\$\(([A-Z_]+)\)", "value", arg)


def _parse_service_command(argv: list[str]):
    """Parses `python -m services.X ...` (or torchrun -m services.X ...) with the real parsers."""
    argv = [_expand(a) for a in argv]
    module = argv[argv.index("-m") + 1]
    rest = argv[argv.index("-m") + 2:]
    name = module.split(".")[1]
    command = {"launch": None}.get(name, name)
    parser = build_parser()
    if command is None:
        return parser.parse_args(rest)
    assert name in SERVICE_COMMANDS, f"{module} is not wired into the dockrl CLI"
    return parser.parse_args([name, *rest])


def test_compose_files_resolve_with_docker_compose():
    """Docker Compose v2 itself validates the files against the current compose specification."""
    for overrides in ((), ("deploy/docker-compose.cuda.yml",), ("deploy/docker-compose.ascend.yml",)):
        done = _compose_config(*overrides, **SECRETS)
        assert done.returncode == 0, f"{overrides}: {done.stderr}"


@pytest.mark.parametrize("name", ["prepare", "rollout", "reward", "reward-model", "trainer"])
def test_compose_commands_exist_and_ports_agree(name):
    service = COMPOSE["services"][name]
    args = _parse_service_command(service["command"])
    exposed = {int(p) for p in service.get("expose", [])}
    for flag in ("grpc_port", "http_port", "port"):
        port = getattr(args, flag, None)
        if port is not None:
            assert port in exposed, f"{name}: --{flag} {port} is not exposed ({exposed})"
    health = " ".join(service.get("healthcheck", {}).get("test", []))
    for port in re.findall(r"127\.0\.0\.1:(\d+)", health):
        assert int(port) in exposed, f"{name}: health check probes {port}, which the command does not serve"
    if getattr(args, "config", None):
        load_config(ROOT / "configs" / pathlib.Path(args.config).name)


def test_compose_scales_rollout_and_keeps_state_in_volumes():
    rollout = COMPOSE["services"]["rollout"]
    assert "ports" not in rollout and "container_name" not in rollout, "fixed host ports or names break --scale rollout=N"
    assert "redis-data:/data" in COMPOSE["services"]["redis"]["volumes"]
    assert {"redis-data", "runs"} <= set(COMPOSE["volumes"])


def test_kubernetes_commands_ports_and_probes_agree():
    kinds = {(d["kind"], d["metadata"]["name"]) for d in K8S}
    assert ("Deployment", "dockrl-rollout") in kinds and ("Job", "dockrl-trainer") in kinds
    for doc in K8S:
        if doc["kind"] not in ("Deployment", "Job"):
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            if not container["image"].startswith("dockrl:"):
                continue
            args = _parse_service_command(container["command"])
            ports = {p["containerPort"] for p in container.get("ports", [])}
            for flag in ("grpc_port", "http_port", "port"):
                port = getattr(args, flag, None)
                if port is not None:
                    assert port in ports, f"{doc['metadata']['name']}: --{flag} {port} not in containerPorts {ports}"
            probe = container.get("readinessProbe", {})
            probe_port = (probe.get("httpGet") or probe.get("grpc") or {}).get("port")
            if probe_port is not None:
                assert probe_port in ports


def test_dockerfiles_install_the_platform_extra():
    for platform in ("cpu", "cuda", "ascend"):
        text = (ROOT / f"deploy/docker/Dockerfile.{platform}").read_text()
        assert f'.[{platform}]' in text, f"Dockerfile.{platform} does not install the {platform} extra"
        for copied in re.findall(r"^COPY (\S+)", text, flags=re.M):
            assert (ROOT / copied).exists(), f"Dockerfile.{platform} copies {copied}, which is not in the repository"


def _compose_config(*overrides: str, **env: str) -> subprocess.CompletedProcess:
    files = [a for f in ("deploy/docker-compose.yml", *overrides) for a in ("-f", f)]
    base = {k: v for k, v in os.environ.items() if not k.startswith("DOCKRL")}
    return subprocess.run([compose_binary(), "-p", "dockrl", *files, "config", "--format", "json"], cwd=ROOT,
                          env={**base, **env}, capture_output=True, text=True, timeout=60)


SECRETS = {"DOCKRL_REDIS_PASSWORD": "pw", "DOCKRL_TOKEN": "tok"}


def _resolved(*overrides: str) -> dict:
    done = _compose_config(*overrides, **SECRETS)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["services"]


def test_compose_refuses_to_start_without_redis_password_or_token():
    no_password = _compose_config(DOCKRL_TOKEN="tok")
    assert no_password.returncode != 0 and "DOCKRL_REDIS_PASSWORD" in no_password.stderr
    no_token = _compose_config(DOCKRL_REDIS_PASSWORD="pw")
    assert no_token.returncode != 0 and "DOCKRL_TOKEN" in no_token.stderr
    opted_out = _compose_config(DOCKRL_REDIS_PASSWORD="pw", DOCKRL_TOKEN="")  # the README's opt-out
    assert opted_out.returncode == 0, opted_out.stderr


def test_compose_gives_the_engines_shm_and_redis_a_password_without_a_host_port():
    services = _resolved()
    for name in ("rollout", "trainer"):
        assert int(services[name]["shm_size"]) >= 512 * 2**20, f"{name}: vLLM / torch need /dev/shm above Docker's 64 MiB"
    redis = services["redis"]
    assert "ports" not in redis, "Redis must not be reachable from the host"
    assert "--requirepass" in " ".join(redis["command"]) and redis["environment"]["REDISCLI_AUTH"] == "pw"
    for name in ("prepare", "rollout", "reward", "trainer"):
        env = services[name]["environment"]
        assert env["DOCKRL__DOCK__REDIS_PASSWORD"] == "pw" and env["DOCKRL_TOKEN"] == "tok", name


def test_compose_proxy_spreads_over_the_rollout_ports_on_loopback_only():
    services = _resolved()
    rollout = _parse_service_command(COMPOSE["services"]["rollout"]["command"])
    published = {p["target"]: p for p in services["proxy"]["ports"]}
    assert set(published) == {rollout.http_port, rollout.grpc_port}
    assert all(p["host_ip"] == "127.0.0.1" for p in published.values())
    conf = (ROOT / "deploy/nginx/rollout.conf").read_text()
    assert f"proxy_pass http://$rollout:{rollout.http_port};" in conf
    assert f"grpc_pass grpc://$rollout:{rollout.grpc_port};" in conf
    assert "resolver 127.0.0.11" in conf, "without Docker's resolver nginx never sees replicas added by --scale"


@pytest.mark.parametrize("platform", ["cuda", "ascend"])
def test_accelerator_overrides_reserve_devices_and_pick_their_image(platform):
    services = _resolved(f"deploy/docker-compose.{platform}.yml")
    for name in ("prepare", "rollout", "reward", "reward-model", "trainer"):
        assert services[name]["image"] == f"dockrl:{platform}"
        assert services[name]["build"]["dockerfile"] == f"deploy/docker/Dockerfile.{platform}"
    for name in ("rollout", "reward-model", "trainer"):
        if platform == "cuda":
            [device] = services[name]["deploy"]["resources"]["reservations"]["devices"]
            assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        else:
            devices = {d["source"] for d in services[name]["devices"]}
            assert {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"} <= devices
            mounted = {v["target"] for v in services[name]["volumes"]}
            assert "/usr/local/Ascend/driver/lib64" in {m.rstrip("/") for m in mounted} and "/app/runs" in mounted


def test_kubernetes_manifest_validates_against_the_kubernetes_schemas():
    import kubernetes_validate

    for doc in K8S:
        kubernetes_validate.validate(doc, "1.33.0", strict=True)
    for doc in K8S:
        if doc["metadata"]["name"] not in ("dockrl-rollout", "dockrl-reward-model", "dockrl-trainer"):
            continue
        pod = doc["spec"]["template"]["spec"]
        shm = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        assert shm, f"{doc['metadata']['name']}: no memory emptyDir for /dev/shm"
        mounts = {m["name"]: m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
        assert mounts.get(shm[0]["name"]) == "/dev/shm"


def test_dockerfiles_fail_when_an_install_fails_and_cpu_takes_the_cpu_torch():
    for platform in ("cpu", "cuda", "ascend"):
        text = (ROOT / f"deploy/docker/Dockerfile.{platform}").read_text()
        assert "|| true" not in text, f"Dockerfile.{platform}: a failed install must fail the build"
    cpu = (ROOT / "deploy/docker/Dockerfile.cpu").read_text()
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in cpu


def test_rollout_gets_its_drain_time_before_it_is_killed():
    drain_s = load_config(ROOT / "configs/tiny_cpu.yaml").rollout.drain_s
    grace = COMPOSE["services"]["rollout"]["stop_grace_period"]
    assert int(grace.rstrip("s")) > drain_s, f"compose kills rollout after {grace}, before its {drain_s} s drain ends"
    [rollout] = [d for d in K8S if d["metadata"]["name"] == "dockrl-rollout"]
    assert rollout["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain_s


def test_compose_runs_reward_model_replicas_apart_with_one_variable():
    """DOCKRL_REWARD_MODEL_REPLICAS starts that many `reward-model` containers and tells every container's
    config (reward_config.model_replicas) that the model runs there; unset, none start and the key is 0."""
    default = _resolved()
    assert default["reward-model"]["deploy"]["replicas"] == 0
    done = _compose_config(**SECRETS, DOCKRL_REWARD_MODEL_REPLICAS="2")
    assert done.returncode == 0, done.stderr
    services = json.loads(done.stdout)["services"]
    model = services["reward-model"]
    assert model["deploy"]["replicas"] == 2
    assert int(model["shm_size"]) >= 512 * 2**20, "vLLM's pooling engine needs /dev/shm above Docker's 64 MiB"
    assert "ports" not in model and "container_name" not in model, "fixed host ports or names break --scale reward-model=N"
    assert model["depends_on"]["prepare"]["condition"] == "service_completed_successfully"  # the checkpoint prepare builds
    for name in ("prepare", "rollout", "reward", "reward-model", "trainer"):
        assert default[name]["environment"]["DOCKRL__REWARD_CONFIG__MODEL_REPLICAS"] == "0", name
        assert services[name]["environment"]["DOCKRL__REWARD_CONFIG__MODEL_REPLICAS"] == "2", name
    assert _parse_service_command(model["command"]).kind == "model"
    assert _parse_service_command(services["reward"]["command"]).kind == "rule"
    # What the containers then load: the split, or an error naming the key when the config has no model part.
    env = {k: v for k, v in model["environment"].items() if k.startswith("DOCKRL__REWARD_CONFIG__")}
    mix = ["reward_config.load=/app/runs/tiny/reward_model", "rl_config.verifier_function=[math_17k_acc, reward_model]",
           "rl_config.verifier_weight=[0.5, 0.5]"]
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        assert load_config(ROOT / "configs/tiny_cpu.yaml", mix).reward_config.model_replicas == 2
        with pytest.raises(ConfigError, match=r"reward_config.model_replicas: 2 reward-model replicas would have nothing to score"):
            load_config(ROOT / "configs/tiny_cpu.yaml")


def test_kubernetes_reward_model_deployment_serves_the_model_kind_on_a_gpu():
    [model] = [d for d in K8S if d["metadata"]["name"] == "dockrl-reward-model"]
    [env] = [d for d in K8S if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "dockrl-env"]
    assert env["data"]["DOCKRL__REWARD_CONFIG__MODEL_REPLICAS"] == "0" and model["spec"]["replicas"] == 0  # off until both are raised
    [container] = model["spec"]["template"]["spec"]["containers"]
    assert _parse_service_command(container["command"]).kind == "model"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["envFrom"] == [{"configMapRef": {"name": "dockrl-env"}}]
