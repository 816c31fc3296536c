"""Committed gRPC stubs match proto/, and every CLI command explains its flags."""
import filecmp
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_committed_stubs_are_not_stale(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)], check=True)
    fresh = tmp_path / "services" / "common" / "pb"
    names = sorted(p.name for p in fresh.iterdir())
    assert names, "protoc generated nothing"
    stale = [n for n in names if not filecmp.cmp(fresh / n, ROOT / "services/common/pb" / n, shallow=False)]
    assert not stale, f"stubs out of date, run `python scripts/gen_protos.py`: {stale}"


def test_every_server_has_the_health_service_available():
    from grpc_health.v1 import health_pb2

    assert health_pb2.DESCRIPTOR.services_by_name["Health"]


def _commands(parser, prefix=()):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,), sub
                yield from _commands(sub, prefix + (name,))


def test_help_explains_every_flag():
    from services.cli import build_parser

    parser = build_parser()
    commands = list(_commands(parser))
    assert {c[0][0] for c in commands} >= {"init-model", "data", "config"}
    for path, sub in commands:
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"dockrl {' '.join(path)} {action.option_strings[0]} has no help text"


@pytest.mark.parametrize("argv", [["--help"], ["init-model", "--help"], ["data", "preprocess", "--help"], ["config", "check", "--help"]])
def test_help_runs_without_heavy_imports(argv):
    code = ("import sys; from services.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "heavy = [m for m in ('torch', 'vllm', 'megatron') if m in sys.modules]\nassert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code, *argv], check=True, cwd=ROOT, capture_output=True)


def test_config_check_reports_key(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("rl_config:\n  clip_ratio: wide\n")
    out = subprocess.run([sys.executable, "-m", "services", "config", "check", "--config", str(bad)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "rl_config.clip_ratio: expected a number" in out.stderr


@pytest.mark.parametrize("command", [["services", "up"], ["services", "prepare"], ["services.trainer", "train"],
                                     ["services.rollout", "serve", "--model", "m"], ["services.reward", "serve"]])
def test_an_invalid_config_stops_every_command_as_config_check_does(command):
    # `dockrl up` starts each service as `python -m services.<service>`: those report a config as dockrl does
    out = subprocess.run([sys.executable, "-m", *command, "--set", "rl_config.clip_ratio=wide",
                          "--set", "rollout.no_such_key=1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "rl_config.clip_ratio: expected a number" in out.stderr and "rollout.no_such_key" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_training_file_without_a_usable_line_stops_the_trainer_naming_the_file_before_the_model_loads(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"index": 0, "prompt": "1+1=", "prompt_ids": [1, 2]}\n')
    out = subprocess.run([sys.executable, "-m", "services", "trainer", "train", "--set", f"megatron_training.data_path={tmp_path}/train",
                          "--set", "trainer.eval_data_path=", "--set", "trainer.test_data_path="],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    said = out.stdout + out.stderr
    assert f"megatron_training.data_path: {tmp_path}/train.jsonl has no usable prompt (1 missing_field); the first: " \
           f"{tmp_path}/train.jsonl:1: missing_field: no label" in said
    assert "Traceback" not in said


def test_config_reference_is_current():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check"])
    assert out.returncode == 0, "docs/config.md is out of date: run `python scripts/gen_config_docs.py`"
