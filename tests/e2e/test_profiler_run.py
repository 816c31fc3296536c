"""profiler_config on a `dockrl up` run: the trainer, the rollout replica and the reward worker each trace
the configured steps (one Chrome trace per trainer step and rank; vLLM's traces of the replica; the reward
worker's), and nothing else."""
import json

import pytest

pytestmark = [pytest.mark.service, pytest.mark.slow]


def test_each_role_traces_only_the_configured_steps(run_up, tmp_path):
    save = tmp_path / "traces"
    roles = [f"profiler_config.{role}.{key}={value}" for role in ("trainer", "rollout", "reward")
             for key, value in (("profile", "true"), ("profile_step_start", 2), ("profile_step_end", 3),
                                ("profile_save_path", save))]
    run_up("megatron_training.train_iters=3", "trainer.eval_data_path=", "trainer.test_data_path=",
           "profiler_config.trainer.profile_with_memory=true", *roles)
    traces = sorted((save / "rank0").glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0_step2"], traces
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    # The iteration and its stages are named ranges; memory records come with profile_with_memory.
    assert {"iteration 2", "collect_scored_groups", "actor_update", "weight_gather", "weight_push"} <= names, sorted(n for n in names if n)[:50]
    assert any(e.get("name") == "[memory]" for e in events)

    # The rollout replica: vLLM's profiler, started for step 2's generation (its files carry the step).
    rollout = sorted((save / "rollout").glob("*/*.json"))
    assert rollout and all(t.name.startswith("step2") for t in rollout), rollout
    forward = {e.get("name") for t in rollout for e in json.loads(t.read_text())["traceEvents"]}
    assert any("aten::" in str(n) for n in forward), sorted(str(n) for n in forward)[:40]

    # The reward worker: one trace over step 2's claims and scoring.
    reward = sorted((save / "reward").glob("*/*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in reward] == ["reward_step2"], reward
    scored = {e.get("name") for e in json.loads(reward[0].read_text())["traceEvents"]}
    assert {"dock_claim", "score_samples", "dock_put"} <= scored, sorted(str(n) for n in scored)[:40]
