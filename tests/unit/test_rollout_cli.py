"""`python -m services.rollout --help` explains every flag without importing torch or vLLM."""
import subprocess
import sys


def test_help_lists_every_flag_and_imports_nothing_heavy():
    code = (
        "import sys, argparse\n"
        "from services.rollout import cli\n"
        "p = argparse.ArgumentParser(); cli.add_arguments(p)\n"
        "heavy = [m for m in ('torch', 'vllm', 'megatron', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run([sys.executable, "-m", "services.rollout", "serve", "--help"], check=True, capture_output=True, text=True).stdout
    for flag in ("--model", "--config", "--set", "--host", "--grpc-port", "--http-port", "--served-model-name", "--ready-file"):
        assert flag in out
