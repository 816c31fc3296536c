"""The tiny demo with two data-parallel trainer ranks under `dockrl up`: the trainer starts its ranks under torchrun
itself (rl_config.actor_resource.num_npus), they split each batch, and the run trains, pushes and checkpoints."""
import math
import subprocess
import sys

import pytest

from tests.e2e.conftest import ROOT, resolved_config, steps

pytestmark = [pytest.mark.service, pytest.mark.slow]


def test_the_demo_runs_with_two_data_parallel_trainer_ranks(run_up, tmp_path):
    iters = 4
    metrics, summary, log_dir = run_up("rl_config.actor_resource.num_npus=2", f"megatron_training.train_iters={iters}",
                                       "trainer.eval_interval=0")
    records = steps(metrics)
    assert [r["step"] for r in records] == list(range(1, iters + 1))
    assert all(math.isfinite(r["actor/grad_norm"]) and r["actor/grad_norm"] > 0 for r in records)
    cfg = resolved_config(log_dir)
    assert summary["accounting"]["rows_trained"] == iters * cfg["megatron_training"]["global_batch_size"] * cfg["rl_config"]["n_samples_per_prompt"]
    assert all(r["weight_sync/replicas"] >= 1 for r in records)
    trainer_log = (log_dir / "services" / "trainer.log").read_text()
    assert "ranks world=2 tensor_parallel=1 pipeline_parallel=1 data_parallel=2 distributed_optimizer=True" in trainer_log
    # The distributed optimizer's checkpoint: each rank's half of the Adam state gathered into distrib_optim.pt.
    assert (tmp_path / "ckpt" / f"iter_{iters:07d}" / "mp_rank_00" / "distrib_optim.pt").exists()


def test_a_trainer_started_as_fewer_processes_than_num_npus_says_so():
    code = (
        "import os\n"
        "from services.common.config import load_config\n"
        "from services.trainer.loop.session import TrainerSession\n"
        "cfg = load_config(None, ['rl_config.actor_resource.num_npus=2'])\n"
        "TrainerSession.start(cfg, '', 1)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "rl_config.actor_resource.num_npus: 2, but the trainer runs as 1 process(es)" in done.stderr

