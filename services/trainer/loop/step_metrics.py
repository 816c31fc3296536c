"""Metrics of one iteration's batch: rewards, lengths, policy lag, groups without signal."""
from __future__ import annotations

import statistics

from services.trainer.loop.iteration_data import ScoredBatch


def batch_metrics(batch: ScoredBatch, trained_version: int, n_samples_per_prompt: int,
                  verifiers: tuple[str, ...] = ()) -> dict[str, float]:
    """Reward mean/std, the share of samples with a positive reward, each verifier's mean score
    (`{verifier}_rewards/mean`, MindSpeed-RL's name; from the rows that stored their parts),
    response lengths, policy lag, flat groups."""
    scores = batch.scores
    # python numbers (tolist), as the metrics are written to JSON
    lags = [trained_version - v for sample in batch.samples for v in sample.versions.tolist()]
    groups = [scores[i:i + n_samples_per_prompt] for i in range(0, len(scores), n_samples_per_prompt)]
    parts = [s.parts.tolist() for s in batch.samples if s.parts is not None and len(s.parts) == len(verifiers)]
    per_verifier = {f"{name}_rewards/mean": statistics.fmean(p[i] for p in parts) for i, name in enumerate(verifiers)} if parts else {}
    return {
        **per_verifier,
        "reward/mean": statistics.fmean(scores),
        "reward/std": statistics.pstdev(scores),
        "reward/positive_fraction": sum(s > 0 for s in scores) / len(scores),
        **_length_stats("response_length", batch.response_lengths),
        **_length_stats("prompt_length", batch.prompt_lengths),
        "policy_lag/mean": statistics.fmean(lags) if lags else 0.0,
        "policy_lag/max": max(lags) if lags else 0.0,
        "groups/flat_fraction": sum(len(set(g)) == 1 for g in groups) / len(groups),
    }


def _length_stats(name: str, lengths: list[int]) -> dict[str, float]:
    """`{name}/mean`, `/max` and `/min` of token counts."""
    return {f"{name}/mean": statistics.fmean(lengths), f"{name}/max": max(lengths), f"{name}/min": min(lengths)}


def throughput_metrics(batch: ScoredBatch, rollout_s: float, train_s: float, iteration_s: float) -> dict[str, float]:
    """MindSpeed-RL's throughputs, in tokens per second of the whole system (MindSpeed-RL divides by its
    device count; here rollout and trainer may share or not share devices, so the figure is not split):
    e2e_tps (prompt + response tokens over the iteration), update_tps (the same tokens over the train
    stage) and vllm_tps (response tokens over the wait for scored groups)."""
    responses = sum(batch.response_lengths)
    tokens = responses + sum(batch.prompt_lengths)
    return {"e2e_tps": tokens / max(iteration_s, 1e-9), "update_tps": tokens / max(train_s, 1e-9),
            "vllm_tps": responses / max(rollout_s, 1e-9)}
