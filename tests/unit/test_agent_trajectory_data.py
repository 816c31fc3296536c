"""A multi-turn trajectory's loss mask on its way from the dock worker to the loss: the layout holds the column only
with an environment configured, the records carry it through the dock's codec, and the trainer's response mask and
PPO's per-token reward honour it."""
import numpy as np
import pytest
import torch

from services.common.config import config_from_dict
from services.common.errors import InvalidArgument
from services.dock.rows import PromptRow, RewardPart, RolloutPart, ScoredSample
from services.dock.schema import DEFAULT_COLUMNS, LOSS_MASK, DockLayout
from services.trainer.algorithm.advantages import token_level_rewards
from services.trainer.modeling.logprobs import ResponseBatch
from dock_helpers import stored_claim

BASE = {"rl_config": {"n_samples_per_prompt": 2}}


def test_the_layout_holds_the_loss_mask_only_with_an_environment():
    assert not DockLayout.from_config(config_from_dict(BASE)).has(LOSS_MASK)
    agent = config_from_dict({**BASE, "rollout": {"multi_turn": {"environment": "tools"}}})
    layout = DockLayout.from_config(agent)
    assert layout.has(LOSS_MASK) and layout.columns[:len(DEFAULT_COLUMNS)] == DEFAULT_COLUMNS
    assert DockLayout.from_json(layout.to_json()) == layout


def test_a_trajectory_round_trips_with_its_mask():
    mask = np.array([1, 1, 0, 0, 0, 1], np.uint8)
    part = RolloutPart(np.arange(6, dtype=np.int32), np.array([-.5, -.5, 0, 0, 0, -.25], np.float32),
                       np.full(6, 2, np.int32), "stop", loss_mask=mask)
    columns = RolloutPart.to_columns([part])
    assert columns[LOSS_MASK.name][0] is mask
    assert LOSS_MASK.name not in RolloutPart.to_columns([RolloutPart(np.arange(2, dtype=np.int32), np.zeros(2, np.float32),
                                                                    np.zeros(2, np.int32), "stop")])
    sample, = ScoredSample.from_claim(stored_claim(PromptRow.to_columns([PromptRow(np.array([7], np.int32), "")]), columns,
                                             RewardPart.to_columns([RewardPart(1.0, None)])))
    assert sample.loss_mask.tolist() == mask.tolist() and sample.loss_mask.dtype == np.uint8


def test_a_mask_of_another_length_is_refused():
    with pytest.raises(InvalidArgument, match="loss_mask"):
        RolloutPart(np.arange(3, dtype=np.int32), np.zeros(3, np.float32), np.zeros(3, np.int32), "stop",
                    loss_mask=np.ones(2, np.uint8))


def test_the_response_mask_is_the_loss_mask_within_each_response():
    batch = ResponseBatch.from_token_ids([[1, 2], [3]], [[4, 5, 6, 7], [8, 9]], loss_masks=[[1, 0, 0, 1], [1, 1]])
    assert batch.response_mask().tolist() == [[1, 0, 0, 1], [1, 1, 0, 0]]
    assert batch.select(torch.tensor([1])).response_mask().tolist() == [[1, 1]]
    plain = ResponseBatch.from_token_ids([[1, 2], [3]], [[4, 5, 6, 7], [8, 9]])
    assert plain.response_mask().tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    with pytest.raises(ValueError, match="one mask value per response token"):
        ResponseBatch.from_token_ids([[1]], [[4, 5]], loss_masks=[[1]])


def test_ppos_reward_sits_on_the_last_model_token():
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0, 1.0]])
    rewards = token_level_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 1, 0], [0, 2, 0, 0, 0], [0, 0, 0, 0, 3]]
