"""The algorithm section (rl_config) and the names its keys accept."""
from __future__ import annotations

from dataclasses import field
from typing import Literal

from services.common.config.types import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, config_section


@config_section
class ActorResource:
    """Processes (GPUs / NPUs / CPU ranks) the actor trains on."""

    num_npus: PositiveInt = 1  # ranks the actor trains on (GPUs, NPUs or CPU processes)


@config_section
class RLConfig:
    """Algorithm settings (rl_config), with MindSpeed-RL's names and defaults."""

    n_samples_per_prompt: PositiveInt = 1  # responses per prompt (the group size n)
    max_prompt_length: int = 2048  # longest prompt in tokens: the trainer leaves longer ones out (counted in summary.json), a dock put refuses them
    adv_estimator: Literal["group_norm", "gae", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = "group_norm"  # group_norm: GRPO's group-normalised rewards; gae: PPO's critic and GAE; rloo: leave-one-out baseline; reinforce_plus_plus: discounted token returns whitened over the batch; reinforce_plus_plus_baseline: group-mean baseline, then whitened over the batch (verl's names; docs/trainer.md)
    norm_adv_by_std_in_grpo: bool = True  # group_norm: divide by the group's std (GRPO); false: the score minus the group mean only (Dr. GRPO; verl's key)
    policy_loss_mode: Literal["vanilla", "gspo"] = "vanilla"  # vanilla: the token-level PPO clip (with dual-clip); gspo: GSPO's sequence-level ratio and clip, aggregated seq-mean-token-mean (verl's policy_loss.loss_mode); GSPO wants clip_higher_enable with clip_ratio_low 3e-4, clip_ratio_high 4e-4
    kl_penalty: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "low_var_kl"  # kl (k1) | abs | mse | low_var_kl
    kl_ctrl_type: Literal["fixed", "adaptive"] = "fixed"  # fixed: the KL coefficient stays init_kl_coef; adaptive: it moves each step to keep the KL near kl_target
    init_kl_coef: NonNegativeFloat = 0.001  # KL penalty coefficient (the adaptive controller's start)
    kl_target: float = 100.0  # adaptive: the KL per token the coefficient steers toward (MindSpeed-RL's default)
    kl_horizon: int = 1000  # adaptive: samples over which the coefficient may change by up to 20% (MindSpeed-RL's default)
    use_kl_in_reward: bool = False  # subtract the KL penalty from the reward (PPO) instead of the loss
    gamma: float = 1.0  # GAE discount
    lam: float = 0.95  # GAE lambda
    clip_ratio: float = 0.2  # PPO clip range epsilon
    clip_higher_enable: bool = False  # DAPO clip-higher: use clip_ratio_low / clip_ratio_high
    clip_ratio_low: float = 0.2  # lower clip range with clip-higher
    clip_ratio_high: float = 0.28  # upper clip range with clip-higher
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages
    token_level_loss: bool = True  # average the loss over tokens of the batch (DAPO) rather than per sequence; loss_agg_mode, when set, decides
    loss_agg_mode: str = ""  # verl's names: token-mean | seq-mean-token-mean | seq-mean-token-sum (Dr. GRPO); empty: token_level_loss decides
    entropy_coeff: NonNegativeFloat = 0.0  # entropy bonus coefficient
    cliprange_value: float = 0.5  # critic value clip range (PPO)
    mini_batch_size: int | None = None  # samples per update; default GBS * n
    epochs: PositiveInt = 1  # passes over each iteration's data
    shuffle_mini_batch: bool = False  # shuffle samples before splitting into mini-batches
    guarantee_order: bool = False  # claims return rows in index order (reproducible runs)
    partial_rollout_max_split: PositiveInt = 1  # split a response budget into this many rollout rounds (1: off)
    require_max_age_all_finished: bool = True  # finish every group at the maximum age before the iteration ends
    rollout_max_tokens: PositiveInt = 2048  # response budget the overlong penalty measures against
    overlong_buffer_enable: bool = False  # DAPO overlong reward shaping
    overlong_buffer: NonNegativeInt = 0  # tokens before rollout_max_tokens where the penalty ramps
    overlong_buffer_penalty_factor: float = 1.0  # penalty at rollout_max_tokens
    filter_groups_enable: bool = False  # DAPO dynamic sampling: drop groups whose metric has std 0
    filter_groups_metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = "acc"  # the per-sample metric dynamic sampling looks at: acc | score | seq_reward | seq_final_reward, each the sample's reward here
    filter_groups_max_batches: int = 10  # prompt batches dynamic sampling may draw per iteration; -1: no limit
    filter_groups_train_batch_size: NonNegativeInt = 0  # DAPO: groups one update trains, kept over as many rounds of global_batch_size prompts as it takes (MindSpeed-RL's key); 0: global_batch_size
    verifier_function: tuple[str, ...] = ("base_acc",)  # rule verifiers, and `reward_model` for reward_config's model, summed into the reward
    verifier_weight: tuple[float, ...] = (1.0,)  # one weight per verifier_function entry
    verifier_parallel: PositiveInt = 1  # verifier worker processes per reward replica
    verifier_timeout: PositiveFloat = 30.0  # seconds per sample before the verifier's timeout score is given
    use_remove_padding: bool = False  # pack sequences without padding for logprob/update passes
    use_dynamic_bsz: bool = False  # form micro-batches by token count instead of sample count
    max_packing_token_size: int = 4096  # tokens per packed micro-batch with use_dynamic_bsz
    # The forward-only log-prob passes keep no activations for a backward pass, so they may take larger micro-batches
    # than the update (MindSpeed-RL's keys): each 0 takes megatron_training.micro_batch_size / max_packing_token_size.
    actor_forward_micro_batch_size: NonNegativeInt = 0  # samples per micro-batch of the policy's log-prob pass; 0: micro_batch_size
    ref_forward_micro_batch_size: NonNegativeInt = 0  # samples per micro-batch of the reference's log-prob pass; 0: micro_batch_size
    actor_max_packing_token_size: NonNegativeInt = 0  # with use_dynamic_bsz, tokens per micro-batch of the policy's log-prob pass; 0: max_packing_token_size
    ref_max_packing_token_size: NonNegativeInt = 0  # with use_dynamic_bsz, tokens per micro-batch of the reference's log-prob pass; 0: max_packing_token_size
    update_max_packing_token_size: NonNegativeInt = 0  # with use_dynamic_bsz, tokens per micro-batch of the update; 0: max_packing_token_size
    max_staleness: NonNegativeInt = 0  # AReaL's eta: rollout runs up to eta versions ahead of the trainer; 0 is synchronous
    use_decoupled_loss: bool = False  # AReaL's decoupled PPO: clip against the policy before the update, weight by it over the rollout's (behaviour) policy
    behav_imp_weight_cap: float = 0.0  # decoupled loss: tokens whose behaviour importance weight exceeds it are left out (0: no cap)
    rollout_is: Literal["", "token", "sequence"] = ""  # rollout/training mismatch: truncated importance sampling by pi_old / pi_rollout per token or per sequence (their product), capped at rollout_is_threshold (TIS; verl's key); empty: off. Recommended on GPUs (docs/trainer.md)
    rollout_is_threshold: PositiveFloat = 2.0  # rollout_is: the cap on the importance weight (verl's default 2.0)
    rollout_rs: Literal["", "token_k1", "seq_sum_k1", "seq_mean_k1"] = ""  # rollout/training mismatch: masked importance sampling, leaving out tokens (token_k1; IcePop with bounds 0.5, 2) or whole sequences (seq_sum_k1: the sequence's ratio; seq_mean_k1: its geometric mean per token) whose pi_old / pi_rollout is outside [rollout_rs_threshold_lower, rollout_rs_threshold] (verl's rollout_rs names); empty: off
    rollout_rs_threshold: PositiveFloat = 2.0  # rollout_rs: the upper bound on the ratio
    rollout_rs_threshold_lower: NonNegativeFloat = 0.0  # rollout_rs: the lower bound on the ratio; 0: 1 / rollout_rs_threshold
    routing_replay: bool = False  # MoE: rollout records each token's routed experts, the trainer's forward passes replay them (slime's R3; docs/moe.md)
    use_tensorboard: bool = True  # write TensorBoard scalars
    use_wandb: bool = False  # also log every step to Weights & Biases (the `wandb` extra; WANDB_MODE=offline logs locally)
    wandb_project: str = ""  # W&B project (required with use_wandb)
    wandb_exp_name: str = ""  # W&B run name; empty: the trainer.log_dir's name
    wandb_save_dir: str = ""  # W&B writes its run files in a wandb/ folder here; empty: trainer.log_dir
    actor_resource: ActorResource = field(default_factory=ActorResource)
    # Derived at load as MindSpeed-RL derives them when left unset.
    actor_rollout_dispatch_size: int | None = None  # samples per rollout claim
    reward_dispatch_size: int | None = None  # samples per reward claim


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")  # rl_config.loss_agg_mode, verl's names
# rl_config.verifier_function's names: the reward service's rule verifiers (services/reward/verifiers.py, whose
# registry a test keeps equal to this) and REWARD_MODEL, reward_config's model
RULE_VERIFIERS = ("format", "strict_format", "base_acc", "acc", "math_17k_acc", "acc_for_ppo", "math_verify",
                  "math_verify_reward", "acc_for_dapo", "step", "sandbox_fusion")
REWARD_MODEL = "reward_model"
