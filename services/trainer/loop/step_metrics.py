"""Metrics of one iteration's batch: rewards, lengths, policy lag, groups without signal, and multi-turn episodes."""
from __future__ import annotations

import statistics

from services.dock.rows import episode_stat
from services.dock.schema import TOOL_ERROR_FIELDS
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
        **agent_metrics(batch),
    }


def agent_metrics(batch: ScoredBatch) -> dict[str, float]:
    """The multi-turn episodes' metrics, from the rows that stored episode stats (none: {}): per episode the model
    turns, tool calls, failed calls, environment seconds and reward, and response tokens (model and environment) and
    model tokens; the share of episodes that called a tool; over all calls the error rate, each error kind's rate
    (agent/error_rate/{kind}) and the success rate (0 calls: no rates). The train/rollout log-prob gap over model tokens is
    train_rollout_logprob_diff: its mask is the response mask times the loss mask (session.py)."""
    episodes = [s for s in batch.samples if s.episode_stats is not None]
    if not episodes:
        return {}

    def per_episode(name: str) -> list[float]:
        return [episode_stat(s.episode_stats, name) for s in episodes]

    calls = per_episode("tool_calls")
    kinds = {kind: sum(per_episode(kind)) for kind in TOOL_ERROR_FIELDS}
    errors = [sum(episode_stat(s.episode_stats, k) for k in TOOL_ERROR_FIELDS) for s in episodes]
    lengths = [len(s.response_ids) for s in episodes]
    model_tokens = [len(s.response_ids) if s.loss_mask is None else int(s.loss_mask.sum()) for s in episodes]
    metrics = {
        "agent/turns_mean": statistics.fmean(per_episode("turns")),
        "agent/tool_calls_mean": statistics.fmean(calls),
        "agent/tool_errors_mean": statistics.fmean(errors),
        "agent/tool_call_rate": sum(c > 0 for c in calls) / len(calls),
        "agent/environment_s_mean": statistics.fmean(per_episode("environment_s")),
        "agent/environment_reward_mean": statistics.fmean(per_episode("environment_reward")),
        "agent/episode_length_mean": statistics.fmean(lengths),
        "agent/episode_length_max": max(lengths),
        "agent/model_tokens_mean": statistics.fmean(model_tokens),
    }
    total = sum(calls)
    if total > 0:
        metrics["agent/tool_error_rate"] = sum(errors) / total
        metrics["agent/tool_success_rate"] = 1.0 - sum(errors) / total
        metrics.update({f"agent/error_rate/{kind}": count / total for kind, count in kinds.items()})
    return metrics


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
