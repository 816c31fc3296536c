"""A short GRPO run across real processes: Redis, two rollout replicas, one reward, the trainer."""
import json
import statistics
import subprocess
import sys

import pytest

from tests.e2e.conftest import ROOT, resolved_config, steps

pytestmark = [pytest.mark.service, pytest.mark.slow]


def test_grpo_learns_and_the_dock_accounts_for_every_sample(run_up):
    # The weights move on the collective path (trainer.weight_transport collective: each push over the replicas'
    # gloo groups); the default gRPC path runs in the other e2e runs, the compose demo and the whole-loop faults.
    iters = 48
    metrics, summary, log_dir = run_up("rollout.replicas=2", f"megatron_training.train_iters={iters}", "trainer.eval_interval=0",
                                       "trainer.weight_transport=collective")
    records = steps(metrics)
    assert [r["step"] for r in records] == list(range(1, iters + 1))
    cfg = resolved_config(log_dir)
    gbs, n = cfg["megatron_training"]["global_batch_size"], cfg["rl_config"]["n_samples_per_prompt"]

    rewards = [r["reward/mean"] for r in records]
    # 128 samples a step: a quarter of the run averages out the sampling noise (about 0.03 std).
    quarter = iters // 4
    assert statistics.fmean(rewards[-quarter:]) > statistics.fmean(rewards[:quarter]), rewards

    # Every sample put was trained exactly once: nothing lost, nothing twice, nothing left over.
    acc = summary["accounting"]
    assert acc["rows_put"] == acc["rows_trained"] == iters * gbs * n and acc["from_step"] == 1
    assert acc["groups_trained"] == iters * gbs and acc["rows_dropped"] == 0
    assert summary["dock"]["requeued"] == 0
    assert summary["prompts"]["over_max_prompt_length"] == 0 and summary["prompts"]["trained_from"] > 0

    # Every push reached every replica registered by then, and rollout and trainer agree on the same weights. The
    # trainer starts on the first replica that serves (`dockrl up` starts both with it); one that finished starting
    # later (a loaded machine: 15 s later in one CI run) joins at the next push, and from then on takes every push.
    synced = [r["weight_sync/replicas"] for r in records]
    assert synced == sorted(synced) and set(synced) <= {1, 2} and synced[-1] == 2 and synced.count(2) >= iters // 2, synced
    assert max(r["train_rollout_logprob_diff"] for r in records) < 1e-3
    assert all(r["rollout/off_policy_token_fraction"] == 0 for r in records)
    assert all(r["policy_lag/max"] == 0 for r in records)  # synchronous: max_staleness 0
    assert (log_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (log_dir / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    trace = json.loads((log_dir / "timeline.trace.json").read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in trace) == sum(summary["timeline"]["stages"].values())
    # The picture's rows: each rollout replica's claims, the reward replica's batches, the trainer's three stages a step.
    timeline = summary["timeline"]
    assert timeline["stages"]["train"] == timeline["stages"]["push"] == iters and timeline["workers"]["trainer"] == 3 * iters
    assert sum(w.startswith("rollout-") for w in timeline["workers"]) == 2 and timeline["stages"]["generate"] > 0
    assert sum(w.startswith("reward-") for w in timeline["workers"]) == 1 and timeline["stages"]["score"] > 0
    # The demo's figure: greedy accuracy on the 40 prompts RL never trains on rises by 20 points or more.
    assert summary["eval_prompts"]["test_accuracy"] == 40
    assert summary["test_accuracy_after"] - summary["test_accuracy_before"] >= 0.2, summary
    assert summary["accuracy_after"] > summary["accuracy_before"], summary

    # The trained policy leaves the run as a Hugging Face model that plain vLLM serves as transformers does.
    _exports_to_a_model_vllm_serves(log_dir.parent / "ckpt", iters, log_dir.parent / "exported")


def _exports_to_a_model_vllm_serves(ckpt, step: int, out) -> None:
    from rollout_harness import hf_greedy, load_hf_model, offline_vllm_generate

    convert = subprocess.run([sys.executable, "-m", "services", "trainer", "convert", "--to", "hf",
                              "--src", str(ckpt / f"iter_{step:07d}"), "--dst", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert convert.returncode == 0, convert.stderr[-3000:]
    prompts = [[49, 43, 50, 61], [52, 45, 51, 61]]  # "1+2=", "4-3=" in the demo's byte tokens
    hf = load_hf_model(out)
    assert offline_vllm_generate(out, prompts, 8) == [hf_greedy(hf, p, 8) for p in prompts]


def test_partial_rollout_resumes_truncated_samples(run_up):
    # A 4-token budget per round: the warm start answers bare (2 tokens) or boxed (~10 tokens, several rounds).
    iters = 4
    metrics, summary, log_dir = run_up("rl_config.partial_rollout_max_split=4", f"megatron_training.train_iters={iters}",
                                       "trainer.eval_data_path=", "trainer.test_data_path=")
    records = steps(metrics)
    assert len(records) == iters
    cfg = resolved_config(log_dir)
    gbs, n = cfg["megatron_training"]["global_batch_size"], cfg["rl_config"]["n_samples_per_prompt"]
    acc = summary["accounting"]
    assert acc["rows_resumed"] > 0
    assert acc["rows_trained"] == iters * gbs * n
    # Groups still generating when the last iteration filled up stay in the dock for the next one.
    carried = acc["rows_put"] - acc["rows_trained"]
    assert 0 <= carried <= gbs * n and carried % n == 0
    assert all(r["response_length/max"] > 4 for r in records)  # longer than one round's budget: resumed and completed
    # Tokens generated by the weights being trained agree with the trainer; carried-over ones are older.
    assert max(r.get("train_rollout_logprob_diff", 0.0) for r in records) < 1e-3


def test_dapo_runs_end_to_end_with_dynamic_sampling_on_two_context_parallel_ranks(run_up):
    # The DAPO keys come from a config in MindSpeed-RL's layout (defaults model file, actor_config, its switches), whose
    # actor runs on two context-parallel ranks (Ulysses): each rank holds half of every sequence, data parallel 1.
    iters = 4
    metrics, summary, log_dir = run_up("trainer.eval_data_path=", "trainer.test_data_path=",
                                       config="tests/fixtures/mindspeed/tiny_dapo.yaml")
    resolved = resolved_config(log_dir)["rl_config"]
    assert resolved["clip_higher_enable"] and resolved["filter_groups_max_batches"] == 3 and resolved["overlong_buffer"] == 4
    trainer_log = (log_dir / "services" / "trainer.log").read_text()
    assert "data_parallel=1 distributed_optimizer=True context_parallel=2 context_parallel_algo=ulysses_cp_algo" in trainer_log
    # The trainer's log-probs, taken under CP, agree with the rollout engine's on the tokens of the current weights.
    assert max(r["train_rollout_logprob_diff"] for r in steps(metrics)) < 1e-3
    records = steps(metrics)
    assert len(records) == iters
    # Dynamic sampling trains only groups whose scores differ, and counts the dropped ones.
    assert all(r["groups/flat_fraction"] == 0 for r in records)
    acc = summary["accounting"]
    assert acc["rows_trained"] + acc["rows_dropped"] == acc["rows_put"]
    assert all(r["dynamic_sampling/rounds"] >= 1 for r in records)


def test_ppo_runs_end_to_end_with_a_critic_and_the_adaptive_kl_controller(run_up):
    # A config in MindSpeed-RL's layout: the critic's own lr comes from its critic_config section. Actor and critic
    # train on two context-parallel ranks (ring attention).
    iters = 3
    metrics, summary, log_dir = run_up("trainer.eval_data_path=", "trainer.test_data_path=",
                                       "megatron_training.context_parallel_size=2", "rl_config.actor_resource.num_npus=2",
                                       config="tests/fixtures/mindspeed/tiny_ppo.yaml")
    resolved = resolved_config(log_dir)
    assert resolved["megatron_training"]["critic_lr"] == 5.0e-4 and resolved["megatron_training"]["context_parallel_size"] == 2
    records = steps(metrics)
    assert len(records) == iters
    assert all(r["critic/optimizer_steps"] == 4 and r["actor/optimizer_steps"] == 4 for r in records)
    assert all(r["critic/vf_loss"] > 0 for r in records)
    # The coefficient starts at init_kl_coef and moves after each step by the reward's KL against
    # the target: x (1 + clip(kl / target - 1, -0.2, 0.2) * 128 samples / kl_horizon).
    coef = [r["actor/kl_coef"] for r in records]
    assert coef[0] == pytest.approx(0.01)
    for r, after in zip(records, coef[1:]):
        error = min(max(r["actor/reward_kl_penalty"] / 0.0001 - 1, -0.2), 0.2)
        assert after == pytest.approx(r["actor/kl_coef"] * (1 + error * 128 / 256), rel=1e-5)
    assert len(set(coef)) == iters  # it moved at every step
    assert (log_dir / "summary.json").exists() and summary["accounting"]["rows_trained"] == summary["accounting"]["rows_put"]
