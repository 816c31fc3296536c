"""End-to-end runs: the real services as separate processes, started by `dockrl up`."""
import json
import pathlib
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory) -> pathlib.Path:
    """The demo's tiny model, data and warm start, prepared once for every e2e test."""
    from services.common.config import load_config
    from services.launch.prepare import prepare_run

    base = tmp_path_factory.mktemp("demo")
    cfg = load_config(None, _paths(base))
    prepare_run(cfg)
    return base


def _paths(base: pathlib.Path) -> list[str]:
    return [
        f"megatron_training.load={base}/model", f"megatron_training.tokenizer_name_or_path={base}/model",
        f"megatron_training.data_path={base}/data/train", f"trainer.eval_data_path={base}/data/train",
        f"trainer.test_data_path={base}/data/test",
        f"arithmetic.out_dir={base}/raw",
    ]


def up_argv(warm_model: pathlib.Path, base: pathlib.Path, overrides=(), config: str = "configs/tiny_cpu.yaml") -> list[str]:
    """`dockrl up` on `config` with the demo's prepared model and data, its logs and checkpoints under `base`,
    free ports, and `overrides`."""
    return [sys.executable, "-m", "services", "up", str(ROOT / config),
            *[f"--set={o}" for o in _paths(warm_model)],
            f"--set=trainer.log_dir={base / 'logs'}", f"--set=megatron_training.save={base}/ckpt",
            "--set=rollout.grpc_port=0", "--set=rollout.http_port=0", "--set=reward.grpc_port=0", "--set=trainer.grpc_port=0",
            *[f"--set={o}" for o in overrides]]


def run_dockrl_up(warm_model: pathlib.Path, base: pathlib.Path, overrides=(), timeout_s: float = 900.0,
                  config: str = "configs/tiny_cpu.yaml"):
    """Runs `dockrl up` on `config` (a path under the repo) with overrides, its logs and checkpoints under `base`;
    returns (metrics rows, summary, log dir), or fails the test with each service's last log lines."""
    log_dir = base / "logs"
    proc = subprocess.run(up_argv(warm_model, base, overrides, config), cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    metrics = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()] if (log_dir / "metrics.jsonl").exists() else []
    summary = json.loads((log_dir / "summary.json").read_text()) if (log_dir / "summary.json").exists() else {}
    if proc.returncode != 0:
        tails = "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:])
                          for p in sorted((log_dir / "services").glob("*.log")))
        pytest.fail(f"dockrl up exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{tails}")
    return metrics, summary, log_dir


@pytest.fixture
def run_up(warm_model, tmp_path):
    """Runs `dockrl up` on the tiny config (or `config`, a path under the repo) with overrides; returns (metrics rows,
    summary, log dir). `name` keeps several runs of one test apart (their logs and checkpoints live under tmp_path/name)."""

    def run(*overrides: str, timeout_s: float = 900.0, name: str = "", config: str = "configs/tiny_cpu.yaml"):
        return run_dockrl_up(warm_model, tmp_path / name, overrides, timeout_s, config)

    return run


def steps(metrics: list[dict]) -> list[dict]:
    """The per-iteration records (evaluation records carry no reward)."""
    return [m for m in metrics if "reward/mean" in m]


def resolved_config(log_dir: pathlib.Path) -> dict:
    return yaml.safe_load((log_dir / "config.yaml").read_text())
