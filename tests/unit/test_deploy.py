"""deploy/: the compose file is valid against the compose specification, and every command,
port and health check in compose and Kubernetes agrees with the code."""
import json
import pathlib
import re
import shlex

import jsonschema
import pytest
import yaml

from services.cli import SERVICE_COMMANDS, build_parser
from services.common.config import load_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "deploy/docker-compose.yml").read_text())
K8S = [d for d in yaml.safe_load_all((ROOT / "deploy/k8s/dockrl.yaml").read_text()) if d]
SCHEMA = ROOT / ".cache/compose-spec/compose_spec.json"


def _expand(arg: str) -> str:
    """Substitutes ${VAR:-default} and $(VAR) as compose and Kubernetes would with defaults."""
    arg = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", arg)
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


def test_compose_file_matches_the_compose_specification():
    assert SCHEMA.exists(), "run scripts/setup.sh: it fetches the compose specification schema"
    jsonschema.validate(COMPOSE, json.loads(SCHEMA.read_text()))


@pytest.mark.parametrize("name", ["prepare", "rollout", "reward", "trainer"])
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
