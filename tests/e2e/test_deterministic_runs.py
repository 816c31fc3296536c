"""Deterministic runs: two `dockrl up` runs of the tiny config with guarantee_order and
megatron_training.npu_deterministic give the same responses' rewards, losses and weights at every
step; a different seed gives different ones (each rollout row samples with its own seed)."""
import pytest
import torch

from tests.e2e.conftest import steps

pytestmark = [pytest.mark.service, pytest.mark.slow]

ITERS = 3
# Wall-clock figures differ between any two runs; everything else a step records must not.
TIMED = ("timing/", "e2e_tps", "update_tps", "vllm_tps")


def _figures(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMED)} for r in steps(metrics)]


def _weights(log_dir, step: int) -> dict[str, torch.Tensor]:
    shard = next((log_dir.parent / "ckpt" / f"iter_{step:07d}").glob("*/model_optim_rng.pt"))
    model = torch.load(shard, map_location="cpu", weights_only=False)["model"]
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


def test_same_seed_repeats_every_step_and_another_seed_does_not(run_up):
    # max_staleness 0 (the default, said here): the synchronous loop, which asynchronous RL must leave bit for bit.
    common = ("rl_config.max_staleness=0", "rl_config.guarantee_order=true", "megatron_training.npu_deterministic=true",
              f"megatron_training.train_iters={ITERS}", "megatron_training.save_interval=1",
              "trainer.eval_data_path=", "trainer.test_data_path=")
    first = run_up(*common, name="a")
    again = run_up(*common, name="b")
    other = run_up(*common, "megatron_training.seed=4321", name="c")
    a, b, c = (_figures(m) for m, _, _ in (first, again, other))
    assert [r["step"] for r in a] == list(range(1, ITERS + 1))
    for step, (ra, rb) in enumerate(zip(a, b, strict=True), 1):
        assert ra == rb, f"step {step}: " + str({k: (ra.get(k), rb.get(k)) for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k)})
        wa, wb = _weights(first[2], step), _weights(again[2], step)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), f"step {step}: weights differ"
    # The group's n samples differ (a seed per row, not one per request): rewards have spread, advantages signal.
    assert all(r["reward/std"] > 0 for r in a), [r["reward/std"] for r in a]
    # Another seed draws other responses (the prompts are the same: guarantee_order keeps the data in file order).
    assert [r["reward/mean"] for r in a] != [r["reward/mean"] for r in c] or \
        [r["response_length/mean"] for r in a] != [r["response_length/mean"] for r in c]
    assert not torch.equal(*(next(iter(_weights(run[2], ITERS).values())) for run in (first, other)))
