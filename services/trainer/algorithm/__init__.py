"""The RL algorithm: advantages, KL estimators, policy and value losses, DAPO's group filter, the actor update and PPO's critic."""
