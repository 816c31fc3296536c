"""Multi-turn episodes on a real replica in dock-worker mode with the shared Redis: each row runs as an episode of
the tools environment (the calculator), and comes back as one trajectory with its loss mask.

The tiny random model does not call tools by itself, so one prompt ends inside an opened call (a prefill): its
first turn continues that call, which the model never closes, and the malformed call comes back as an observation
the next turn reads. The assertions are on structure, not on the model being clever: the mask-0 spans are exactly
the observations' ids, encoded once; the mask-1 spans are the engine's tokens, their log-probs those of the model
(checked against the Hugging Face model, teacher-forced over the whole trajectory, so nothing is re-run)."""
from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import redis

from rollout_harness import DOCK_PREFIX, OVERRIDES, REDIS_URL, TOKEN, hf_logprobs, load_hf_model
from replica_launcher import spawn_replica
from services.common.config import load_config
from services.common.tiny_model import build_tiny_model
from services.dock.client import Dock
from services.dock.rows import PromptRow, episode_stat
from services.dock.schema import DockLayout

pytestmark = pytest.mark.service

RUN = "agent"
AGENT = (  # greedy, 2 samples per prompt; turns of at most 8 tokens, at most 3 of them
    f"dock.prefix={DOCK_PREFIX}", f"dock.run_id={RUN}", "rl_config.n_samples_per_prompt=2", "rollout.heartbeat_ttl_s=3",
    "generate_config.sampling_config.temperature=0.0", "generate_config.max_model_len=320", "rl_config.max_prompt_length=64",
    "rl_config.rollout_max_tokens=192", "generate_config.sampling_config.max_tokens=192",
    "rollout.multi_turn.environment=tools", "rollout.multi_turn.max_tokens_per_turn=8",
    "rollout.multi_turn.max_assistant_turns=3", "rollout.multi_turn.max_observation_tokens=128",
)
PREFILLED = "Compute 6*7 with the calculator. <tool_call>"
PLAIN = "What is 2+3? "
MALFORMED = "\n<tool_response>error: malformed tool call: <tool_call> is not closed by </tool_call></tool_response>\n"


def spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(mask value, start, end) of each run of equal mask values."""
    out, at = [], 0
    for value, run in itertools.groupby(mask):
        n = len(list(run))
        out.append((value, at, at + n))
        at += n
    return out


def test_rows_run_as_episodes_and_land_as_trajectories_with_their_loss_mask(tmp_path):
    from transformers import AutoTokenizer

    overrides = tuple(o for o in OVERRIDES if not o.startswith("generate_config.max_model_len")) + AGENT
    cfg = load_config(None, overrides)
    model_dir = build_tiny_model(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    dock = Dock(redis.Redis.from_url(REDIS_URL), DOCK_PREFIX, RUN, TOKEN)
    dock.create(DockLayout.from_config(cfg))
    n = cfg.rl_config.n_samples_per_prompt
    texts = [PREFILLED, PLAIN]
    groups = dock.begin_iteration(len(texts))[: len(texts)]
    rows = dock.rows_of(groups)
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts for _ in range(n)]
    dock.put(rows, PromptRow.to_columns([PromptRow(np.asarray(p, np.int32), "42") for p in prompts]))
    replica = spawn_replica(model_dir, tmp_path, "agent", overrides, "tiny", {"OMP_NUM_THREADS": "1"},
                            extra_args=("--dock", REDIS_URL)).wait()
    try:
        deadline = time.monotonic() + 180
        while not dock.rollout_done():
            assert time.monotonic() < deadline, f"rollout did not finish: {dock.stats()}"
            time.sleep(0.2)
        got = dock.read(rows, ["responses", "loss_mask", "rollout_log_probs", "versions", "response_length", "finish_reason",
                               "episode_stats"])
    finally:
        replica.stop()
        dock.destroy()

    hf_model = load_hf_model(model_dir)
    malformed = tok.encode(MALFORMED, add_special_tokens=False)
    for i, prompt in enumerate(prompts):
        response = [int(t) for t in got["responses"][i]]
        mask = [int(m) for m in got["loss_mask"][i]]
        log_probs = [float(x) for x in got["rollout_log_probs"][i]]
        assert len(mask) == len(response) == len(log_probs) == got["response_length"][i] > 0
        assert got["finish_reason"][i] in ("stop", "length")
        assert [int(v) for v in got["versions"][i]] == [0] * len(response)
        runs = spans(mask)
        assert runs[0][0] == 1 and runs[-1][0] == 1, "an episode starts and ends with the model's turn"
        model_turns = [r for r in runs if r[0] == 1]
        assert all(end - start <= 8 for _, start, end in model_turns), "a turn longer than max_tokens_per_turn"
        for value, start, end in runs:
            if value == 0:  # an observation: its ids as encoded once, log-prob 0
                assert tok.decode(response[start:end]).startswith("\n<tool_response>")
                assert log_probs[start:end] == [0.0] * (end - start)
            else:  # the engine's tokens: real log-probs
                assert all(np.isfinite(x) and x < 0 for x in log_probs[start:end])
        # the model's tokens are the model's: its teacher-forced log-probs over the stored trajectory agree
        reference = hf_logprobs(hf_model, prompt, response)
        for value, start, end in model_turns:
            assert log_probs[start:end] == pytest.approx(reference[start:end], abs=1e-4)
        # the episode's stats are stored with it: a model turn per model run, a tool call per observation at least
        stats = got["episode_stats"][i]
        assert episode_stat(stats, "turns") == len(model_turns)
        assert episode_stat(stats, "tool_calls") >= len(runs) - len(model_turns)
        assert episode_stat(stats, "environment_s") >= 0 and episode_stat(stats, "environment_reward") == 0
        if i < n:  # the prefilled call, never closed by the model: the malformed call is the first observation
            assert len(runs) >= 3 and runs[1][0] == 0
            assert response[runs[1][1]:runs[1][2]] == malformed
            assert episode_stat(stats, "malformed_call") >= 1
