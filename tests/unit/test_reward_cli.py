"""`dockrl reward score` for a person trying a rule, and a --help that imports nothing heavy."""
import argparse
import subprocess
import sys

from services.reward.cli import add_arguments, run


def parse(argv):
    parser = argparse.ArgumentParser(prog="dockrl reward")
    add_arguments(parser)
    return parser.parse_args(argv)


def test_help_imports_no_engine():
    code = ("import sys; from services.reward import cli; "
            "assert not {'torch', 'vllm', 'megatron', 'transformers', 'sympy'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run([sys.executable, "-m", "services.reward", "serve", "--help"], check=True, capture_output=True, text=True).stdout
    for flag in ("--config", "--host", "--port", "--dock"):
        assert flag in out


def test_score_prints_each_part_and_the_total(capsys):
    args = parse(["score", "--label", "34", "--response", r"so \boxed{34 \text{ cm}}.", "--verifier", "acc",
                  "--verifier", "format", "--weight", "1", "--weight", "0.5"])
    assert run(args) == 0
    out = capsys.readouterr().out
    assert "extracted answer: '34\\\\text{cm}'" in out
    assert "acc: +1.0000 x 1" in out and "format: +0.0000 x 0.5" in out and "total: +1.0000" in out


def test_score_with_an_unknown_verifier_says_which(capsys):
    assert run(parse(["score", "--label", "1", "--response", "1", "--verifier", "acx"])) == 2
    assert "verifier_function: unknown verifier 'acx'" in capsys.readouterr().err
