"""profiler_config.trainer on a `dockrl up` run: one Chrome trace per configured step, none for the others."""
import json

import pytest

pytestmark = [pytest.mark.service, pytest.mark.slow]


def test_trainer_traces_only_the_configured_steps(run_up, tmp_path):
    save = tmp_path / "traces"
    run_up("megatron_training.train_iters=3", "trainer.eval_data_path=", "trainer.test_data_path=",
           "profiler_config.trainer.profile=true", "profiler_config.trainer.profile_step_start=2",
           "profiler_config.trainer.profile_step_end=3", "profiler_config.trainer.profile_with_memory=true",
           f"profiler_config.trainer.profile_save_path={save}")
    traces = sorted((save / "rank0").glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0_step2"], traces
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    # The iteration and its stages are named ranges; memory records come with profile_with_memory.
    assert {"iteration 2", "collect_scored_groups", "actor_update", "weight_gather", "weight_push"} <= names, sorted(n for n in names if n)[:50]
    assert any(e.get("name") == "[memory]" for e in events)
