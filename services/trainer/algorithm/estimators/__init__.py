"""The advantage estimators, one module each, keyed by rl_config.adv_estimator (the interface: interface.py)."""
from __future__ import annotations

from typing import Callable

from services.trainer.algorithm.estimators.gae import GAEEstimator
from services.trainer.algorithm.estimators.group_norm import GroupNormEstimator
from services.trainer.algorithm.estimators.interface import AdvantageEstimator, EstimatorSetup
from services.trainer.algorithm.estimators.reinforce_plus_plus import ReinforcePlusPlusEstimator
from services.trainer.algorithm.estimators.reinforce_plus_plus_baseline import ReinforcePlusPlusBaselineEstimator
from services.trainer.algorithm.estimators.rloo import RLOOEstimator

ESTIMATORS: dict[str, Callable[[EstimatorSetup], AdvantageEstimator]] = {
    "group_norm": GroupNormEstimator.build,
    "gae": GAEEstimator.build,
    "rloo": RLOOEstimator.build,
    "reinforce_plus_plus": ReinforcePlusPlusEstimator.build,
    "reinforce_plus_plus_baseline": ReinforcePlusPlusBaselineEstimator.build,
}


def build_estimator(setup: EstimatorSetup) -> AdvantageEstimator:
    """The estimator named by setup.cfg's rl_config.adv_estimator (a critic, for gae, is built here)."""
    name = setup.cfg.rl_config.adv_estimator
    if name not in ESTIMATORS:
        raise ValueError(f"rl_config.adv_estimator: {name!r} is not one of {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name](setup)
