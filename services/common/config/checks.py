"""The checks that span several keys, run once a config has been read (each key's own range or choices sit beside
it in its section); also the *_dispatch_size keys derived when unset.

`_validate` runs them in one order (the order the errors are reported in); its helpers follow, grouped by the part
of the run they check."""
from __future__ import annotations

import dataclasses

from services.common.config.algorithm import LOSS_AGG_MODES, REWARD_MODEL, RULE_VERIFIERS
from services.common.config.dock import DockConfig
from services.common.config.model import MOE_ARCHITECTURES, InitModelConfig
from services.common.config.profiler import ProfilerConfig
from services.common.config.root import Config
from services.common.config.training import MegatronTrainingConfig


def _check_choice(errors: list[str], path: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        errors.append(f"{path}: {value!r} is not one of {', '.join(choices)}")


def _check_positive(errors: list[str], path: str, value: int | float | None, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        errors.append(f"{path}: must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _derive_dispatch_sizes(cfg: Config, errors: list[str]) -> Config:
    """Fills unset *_dispatch_size keys as MindSpeed-RL does: GBS * n / data-parallel size.

    Only the rollout and reward consumers claim by dispatch size: the trainer takes each iteration's
    GBS x n rows in one claim, so MindSpeed-RL's actor_logprob, ref, adv and actor_update sizes have
    no counterpart (a MindSpeed-RL layout file's are dropped with that reason)."""
    rl = cfg.rl_config
    total = cfg.samples_per_iteration
    rollout_dp = cfg.rollout.replicas
    n = rl.n_samples_per_prompt
    derived = {
        "actor_rollout_dispatch_size": (rl.actor_rollout_dispatch_size, rollout_dp),
        "reward_dispatch_size": (rl.reward_dispatch_size, 1),
    }
    values = {}
    for key, (given, dp) in derived.items():
        if given is None:
            if total % dp:
                errors.append(
                    f"rl_config.{key}: global_batch_size * n_samples_per_prompt = {total} is not divisible "
                    f"by the data-parallel size {dp}; set {key} explicitly"
                )
                given = max(n, total // dp)
            else:
                given = total // dp
        values[key] = given
        _check_positive(errors, f"rl_config.{key}", given)
        if given and given % n:
            errors.append(f"rl_config.{key}: {given} is not a multiple of n_samples_per_prompt={n} (groups travel whole)")
    if rl.mini_batch_size is None:
        values["mini_batch_size"] = cfg.trained_samples_per_iteration
    return dataclasses.replace(cfg, rl_config=dataclasses.replace(rl, **values))


def _validate(cfg: Config, errors: list[str]) -> None:
    """The checks that span several keys (each key's own range or choices sit beside it, checked as it is read)."""
    mt, rl, gen, smp = cfg.megatron_training, cfg.rl_config, cfg.generate_config, cfg.generate_config.sampling_config
    if 0 < mt.critic_lr < mt.min_lr:
        errors.append(f"megatron_training.critic_lr: {mt.critic_lr!r} is below megatron_training.min_lr {mt.min_lr!r}")
    if smp.top_k == 0 or smp.top_k < -1:
        errors.append(f"generate_config.sampling_config.top_k: must be -1 (off) or >= 1, got {smp.top_k!r}")
    if gen.expert_map_path and not gen.enforce_eager:
        errors.append("generate_config.expert_map_path: needs generate_config.enforce_eager: true; vLLM's compiled model "
                      "(torch.compile, CUDA graphs) skips the router hook that counts the tokens the map's imbalance is of")
    if rl.loss_agg_mode:
        _check_choice(errors, "rl_config.loss_agg_mode", rl.loss_agg_mode, LOSS_AGG_MODES)
        if rl.loss_agg_mode == "token-mean" and not rl.token_level_loss:
            errors.append("rl_config.loss_agg_mode: token-mean contradicts token_level_loss: false; set one of them")
    if rl.kl_ctrl_type == "adaptive":
        if rl.init_kl_coef <= 0:
            errors.append(f"rl_config.init_kl_coef: the adaptive KL controller scales the coefficient, so it needs one > 0, got {rl.init_kl_coef!r}")
        if rl.kl_target <= 0:
            errors.append(f"rl_config.kl_target: must be > 0 for kl_ctrl_type adaptive, got {rl.kl_target!r}")
        if rl.kl_horizon < 1:
            errors.append(f"rl_config.kl_horizon: must be >= 1 for kl_ctrl_type adaptive, got {rl.kl_horizon!r}")
    if not 0 <= rl.clip_ratio < 1:
        errors.append(f"rl_config.clip_ratio: must be in [0, 1), got {rl.clip_ratio!r}")
    if rl.clip_ratio_c <= 1:
        errors.append(f"rl_config.clip_ratio_c: the dual-clip bound must be > 1, got {rl.clip_ratio_c!r}")
    if rl.rollout_max_tokens != smp.max_tokens:
        errors.append(
            f"rl_config.rollout_max_tokens: {rl.rollout_max_tokens} != generate_config.sampling_config.max_tokens "
            f"{smp.max_tokens}; the overlong penalty and the rollout budget must agree (set both to one value)"
        )
    if rl.max_prompt_length + smp.max_tokens > gen.max_model_len:
        errors.append(
            f"generate_config.max_model_len: {gen.max_model_len} < rl_config.max_prompt_length + "
            f"sampling_config.max_tokens = {rl.max_prompt_length + smp.max_tokens}"
        )
    if rl.guarantee_order and rl.partial_rollout_max_split > 1:
        errors.append(
            "rl_config.guarantee_order: cannot be true with partial_rollout_max_split > 1 "
            "(partial rollout serves the oldest groups first, which reorders rows)"
        )
    if rl.partial_rollout_max_split > 1 and smp.max_tokens % rl.partial_rollout_max_split:
        errors.append(
            f"rl_config.partial_rollout_max_split: {rl.partial_rollout_max_split} does not divide "
            f"sampling_config.max_tokens {smp.max_tokens}"
        )
    if len(rl.verifier_function) != len(rl.verifier_weight):
        errors.append(
            f"rl_config.verifier_weight: {len(rl.verifier_weight)} weights for "
            f"{len(rl.verifier_function)} verifier_function entries; give one weight per verifier"
        )
    unknown = [name for name in rl.verifier_function if name not in RULE_VERIFIERS + (REWARD_MODEL,)]
    if unknown:
        errors.append(f"rl_config.verifier_function: {', '.join(map(repr, unknown))} is not a verifier; the verifiers: "
                      f"{', '.join(RULE_VERIFIERS)}, and {REWARD_MODEL} (reward_config's model)")
    if "reward_model" in rl.verifier_function and not cfg.reward_config.load:
        errors.append("rl_config.verifier_function: reward_model is listed but reward_config.load is empty; "
                      "give the reward model's directory (dockrl init-model --reward builds a tiny one)")
    if rl.overlong_buffer_enable and not 0 < rl.overlong_buffer < rl.rollout_max_tokens:
        errors.append(
            f"rl_config.overlong_buffer: must be in (0, rollout_max_tokens={rl.rollout_max_tokens}) "
            f"when overlong_buffer_enable is true, got {rl.overlong_buffer}"
        )
    if rl.use_kl_in_reward and rl.adv_estimator == "group_norm":
        errors.append("rl_config.use_kl_in_reward: group_norm advantages normalise each group's rewards, so a KL subtracted "
                      "from them does not reach the update; use adv_estimator: gae, or the KL in the loss (use_kl_in_reward: false)")
    if rl.filter_groups_train_batch_size and not rl.filter_groups_enable:
        errors.append(f"rl_config.filter_groups_train_batch_size: {rl.filter_groups_train_batch_size} has no effect without "
                      "filter_groups_enable (every generated group trains); remove it or enable dynamic sampling")
    if rl.filter_groups_max_batches == 0 or rl.filter_groups_max_batches < -1:
        errors.append(f"rl_config.filter_groups_max_batches: must be -1 (no limit) or >= 1, got {rl.filter_groups_max_batches}")
    if rl.use_wandb and not rl.wandb_project:
        errors.append("rl_config.wandb_project: required with rl_config.use_wandb (the W&B project the run logs to)")
    if rl.behav_imp_weight_cap and rl.behav_imp_weight_cap <= 1:
        errors.append(f"rl_config.behav_imp_weight_cap: must be 0 (no cap) or > 1, got {rl.behav_imp_weight_cap!r}")
    if rl.behav_imp_weight_cap and not rl.use_decoupled_loss:
        errors.append("rl_config.behav_imp_weight_cap: caps the decoupled loss's behaviour weight; set rl_config.use_decoupled_loss: true "
                      "or leave it 0")
    if rl.clip_higher_enable and rl.clip_ratio_high < rl.clip_ratio_low:
        errors.append(f"rl_config.clip_ratio_high: {rl.clip_ratio_high} < clip_ratio_low {rl.clip_ratio_low}")
    if rl.adv_estimator in GROUP_ESTIMATORS and rl.n_samples_per_prompt < 2:
        errors.append(f"rl_config.n_samples_per_prompt: {rl.adv_estimator} advantages need at least 2 samples per prompt")
    _validate_algorithms(rl, errors)
    ep = mt.expert_model_parallel_size
    tp_pp = mt.tensor_model_parallel_size * mt.pipeline_model_parallel_size
    if ep > 1 and rl.actor_resource.num_npus % (tp_pp * ep):
        errors.append(
            f"megatron_training.expert_model_parallel_size: {ep} expert-parallel ranks x tensor_model_parallel_size x "
            f"pipeline_model_parallel_size = {tp_pp * ep} does not divide rl_config.actor_resource.num_npus {rl.actor_resource.num_npus}"
        )
    mp = tp_pp * mt.context_parallel_size
    if mp > 0 and rl.actor_resource.num_npus % mp:
        errors.append(
            f"rl_config.actor_resource.num_npus: {rl.actor_resource.num_npus} is not a multiple of "
            f"tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size = {mp}"
        )
    _validate_context_parallel(cfg, errors)
    _validate_routing_replay(cfg, errors)
    _validate_virtual_pipeline(cfg, errors)
    _validate_multi_turn(cfg, errors)
    if rl.mini_batch_size is not None:
        total = cfg.trained_samples_per_iteration
        if rl.mini_batch_size <= 0 or total % rl.mini_batch_size:
            trained = ("filter_groups_train_batch_size" if rl.filter_groups_enable and rl.filter_groups_train_batch_size
                       else "global_batch_size")
            errors.append(
                f"rl_config.mini_batch_size: {rl.mini_batch_size} must divide {trained} * "
                f"n_samples_per_prompt = {total}"
            )
        elif rl.mini_batch_size % (mt.micro_batch_size * cfg.actor_data_parallel_size):
            errors.append(
                f"rl_config.mini_batch_size: {rl.mini_batch_size} is not a multiple of micro_batch_size * "
                f"data-parallel size = {mt.micro_batch_size * cfg.actor_data_parallel_size}"
            )
    admitted_groups = (rl.max_staleness + 1) * mt.global_batch_size  # without the partial-rollout carry-over, which may wait
    if cfg.dock.capacity_groups and cfg.dock.capacity_groups < admitted_groups:
        errors.append(
            f"dock.capacity_groups: {cfg.dock.capacity_groups} < (rl_config.max_staleness + 1) * megatron_training.global_batch_size "
            f"= {admitted_groups}; the pool must hold the groups the trainer admits (or 0 for the default)"
        )
    if cfg.init_model is not None:
        _validate_init_model_moe(cfg.init_model, errors)
        _validate_tool_warm_start(cfg, errors)
    if cfg.arithmetic is not None and cfg.arithmetic.min_operand > cfg.arithmetic.max_operand:
        errors.append(f"arithmetic.min_operand: {cfg.arithmetic.min_operand} > max_operand {cfg.arithmetic.max_operand}; "
                      "no problem has operands in that range")
    if cfg.reward_config.model_replicas > 0:
        if "reward_model" not in rl.verifier_function:
            errors.append(f"reward_config.model_replicas: {cfg.reward_config.model_replicas} reward-model replicas would have "
                          "nothing to score: rl_config.verifier_function does not list reward_model (add it, or set 0)")
        elif set(rl.verifier_function) == {"reward_model"}:
            errors.append("reward_config.model_replicas: rl_config.verifier_function lists only reward_model, so the reward "
                          "replicas already score nothing else; set 0 and scale reward.replicas instead")
    _check_sentinel_keys(cfg.dock, errors)
    for role in ("trainer", "rollout", "reward"):
        _validate_profiler(getattr(cfg.profiler_config, role), f"profiler_config.{role}", errors)
        if role != "trainer" and getattr(cfg.profiler_config, role).profile_ranks != "all":
            errors.append(f"profiler_config.{role}.profile_ranks: {role} replicas have no rank; set all "
                          "(each replica writes its traces in its own directory)")
    for path, value in (("dock.prefix", cfg.dock.prefix), ("dock.run_id", cfg.dock.run_id), ("dock.rollout_consumer", cfg.dock.rollout_consumer)):
        if not value or ":" in value or "*" in value:
            errors.append(f"{path}: {value!r} must be non-empty without ':' or '*' (it is part of Redis key names)")
    _validate_sandbox(cfg, errors)


def _validate_sandbox(cfg: Config, errors: list[str]) -> None:
    """sandbox: each default within its max_* key, and paths the sandbox can bind (absolute)."""
    sb = cfg.sandbox
    for key in ("wall_s", "memory_mb", "output_bytes"):
        if getattr(sb, key) > getattr(sb, f"max_{key}"):
            errors.append(f"sandbox.{key}: {getattr(sb, key)} is above sandbox.max_{key} {getattr(sb, f'max_{key}')}")
    unaddressed = [key for key, address in cfg.sandbox_clients.items() if not address]
    if unaddressed and not sb.grpc_port:
        errors.append(f"{unaddressed[0]}: empty, so the run's own sandbox replicas at sandbox.host:sandbox.grpc_port, but "
                      "sandbox.grpc_port is 0 (a free port no client can know); give the address or a fixed port")
    if not sb.interpreter.startswith("/"):
        errors.append(f"sandbox.interpreter: {sb.interpreter!r} must be an absolute path (the sandbox has no PATH search of the host)")
    for i, path in enumerate(sb.ro_paths):
        if not path.startswith("/") or path.rstrip("/") in ("", "/proc", "/dev", "/tmp"):
            errors.append(f"sandbox.ro_paths[{i}]: {path!r} must be an absolute path other than /, /proc, /dev and /tmp")


# ---------------------------------------------------------------- rollout: multi-turn episodes


def _validate_multi_turn(cfg: Config, errors: list[str]) -> None:
    """rollout.multi_turn: what its keys need of each other and of the rollout budget (the environment's and the
    tools' names are checked where they are registered, by the rollout replica at start)."""
    mtc, budget = cfg.rollout.multi_turn, cfg.generate_config.sampling_config.max_tokens
    if not mtc.environment:
        return
    if cfg.rl_config.partial_rollout_max_split > 1:
        errors.append(f"rl_config.partial_rollout_max_split: {cfg.rl_config.partial_rollout_max_split} > 1 with "
                      f"rollout.multi_turn.environment {mtc.environment!r}: partial rollout of multi-turn episodes is not "
                      "built yet; set partial_rollout_max_split: 1 (or no environment)")
    if mtc.format == "tag" and (not mtc.tool_call_start or not mtc.tool_call_end or mtc.tool_call_start == mtc.tool_call_end):
        errors.append(f"rollout.multi_turn.tool_call_start: the tag format needs two different non-empty tags, got "
                      f"{mtc.tool_call_start!r} and tool_call_end {mtc.tool_call_end!r}")
    if mtc.tag_body == "argument" and (mtc.format != "tag" or len(mtc.tools) != 1):
        errors.append(f"rollout.multi_turn.tag_body: 'argument' names no tool, so it needs format 'tag' and exactly one tool "
                      f"(got format {mtc.format!r}, tools {list(mtc.tools)}); use tag_body 'json' or list one tool")
    if mtc.max_tokens_per_turn > budget:
        errors.append(f"rollout.multi_turn.max_tokens_per_turn: {mtc.max_tokens_per_turn} > generate_config.sampling_config."
                      f"max_tokens {budget}, the whole episode's budget; lower it (or 0: the rest of the budget)")


def _validate_tool_warm_start(cfg: Config, errors: list[str]) -> None:
    """init_model.warm_start_tool_share: its episodes are written as the rollout will run them, so it needs the tools
    environment in the tag format with the calculator, and an arithmetic section (its problems)."""
    share, mtc = cfg.init_model.warm_start_tool_share, cfg.rollout.multi_turn
    if not share:
        return
    if mtc.environment != "tools" or mtc.format != "tag" or "calculator" not in mtc.tools:
        errors.append(f"init_model.warm_start_tool_share: {share} needs rollout.multi_turn.environment 'tools' with format "
                      f"'tag' and 'calculator' among its tools (got environment {mtc.environment!r}, format {mtc.format!r}, "
                      f"tools {list(mtc.tools)}); set 0 or configure that environment")
    if cfg.arithmetic is None:
        errors.append(f"init_model.warm_start_tool_share: {share} needs an arithmetic section (its problems); add one or set 0")


# ---------------------------------------------------------------- trainer: megatron_training's parallel layout


GROUP_ESTIMATORS = ("group_norm", "rloo", "reinforce_plus_plus_baseline")  # the estimators whose baseline is the prompt's group


def _validate_algorithms(rl, errors: list[str]) -> None:
    """Dr. GRPO's option, GSPO and the rollout-mismatch correction (docs/trainer.md's table of estimators and losses)."""
    if not rl.norm_adv_by_std_in_grpo and rl.adv_estimator != "group_norm":
        errors.append(f"rl_config.norm_adv_by_std_in_grpo: false is Dr. GRPO's option of adv_estimator group_norm; "
                      f"adv_estimator is {rl.adv_estimator!r} (set adv_estimator: group_norm or leave it true)")
    if rl.use_kl_in_reward and rl.init_kl_coef <= 0 and rl.adv_estimator in ("rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        errors.append(f"rl_config.use_kl_in_reward: {rl.adv_estimator}'s KL in the reward needs a reference model, built when "
                      "rl_config.init_kl_coef > 0; got 0 (set a coefficient, or use_kl_in_reward: false)")
    if rl.policy_loss_mode == "gspo" and rl.loss_agg_mode not in ("", "seq-mean-token-mean"):
        errors.append(f"rl_config.loss_agg_mode: policy_loss_mode gspo aggregates seq-mean-token-mean (verl's GSPO); "
                      f"got {rl.loss_agg_mode!r} (leave it empty or set seq-mean-token-mean)")
    correction = [key for key in ("rollout_is", "rollout_rs") if getattr(rl, key)]
    if correction and rl.use_decoupled_loss:
        errors.append(f"rl_config.{correction[0]}: cannot be set with use_decoupled_loss: true; the decoupled loss already weights "
                      "each token by pi_prox / pi_rollout, the same weight (cap it with behav_imp_weight_cap); set one of them")
    if rl.rollout_is and rl.rollout_is_threshold <= 1:
        errors.append(f"rl_config.rollout_is_threshold: the cap on pi_old / pi_rollout must be > 1, got {rl.rollout_is_threshold!r}")
    if rl.rollout_rs:
        lower = rl.rollout_rs_threshold_lower or 1.0 / rl.rollout_rs_threshold
        if not lower < 1 < rl.rollout_rs_threshold:
            errors.append(f"rl_config.rollout_rs_threshold: the kept ratios [rollout_rs_threshold_lower, rollout_rs_threshold] = "
                          f"[{lower!r}, {rl.rollout_rs_threshold!r}] must hold 1 (lower < 1 < upper)")


def _validate_context_parallel(cfg: Config, errors: list[str]) -> None:
    """megatron_training.context_parallel_*: the algorithms built, and what context parallel cannot be combined with yet.

    The attention heads a TP rank holds are checked against Ulysses when the model is built (they are in its config.json).
    """
    mt, cp = cfg.megatron_training, cfg.megatron_training.context_parallel_size
    _validate_ulysses_degree(mt, errors)
    if cp <= 1:
        return
    if mt.seq_length % (2 * cp):
        errors.append(f"megatron_training.seq_length: {mt.seq_length} is not a multiple of 2 * context_parallel_size = {2 * cp} "
                      "(each sequence is padded to a multiple of it and split into that many chunks)")


def _validate_ulysses_degree(mt: MegatronTrainingConfig, errors: list[str]) -> None:
    """megatron_training.ulysses_degree_in_cp: hybrid_cp_algo's Ulysses groups, U consecutive CP ranks, the ring across
    the R = CP / U groups. U = 1 would be the ring alone and R = 1 Ulysses alone, which the other two algorithms are."""
    key, u, cp = "megatron_training.ulysses_degree_in_cp", mt.ulysses_degree_in_cp, mt.context_parallel_size
    if mt.context_parallel_algo != "hybrid_cp_algo":
        if u is not None:
            errors.append(f"{key}: {u} is read by context_parallel_algo hybrid_cp_algo only, not {mt.context_parallel_algo}; "
                          "set it null")
        return
    if u is None:
        if cp > 1:
            errors.append(f"{key}: hybrid_cp_algo needs it (the CP ranks of one Ulysses group, a divisor of "
                          f"context_parallel_size {cp} with both it and the quotient >= 2)")
        return
    if u < 2:
        errors.append(f"{key}: {u}; hybrid_cp_algo needs Ulysses groups of at least 2 ranks (with 1 use megatron_cp_algo)")
    elif cp % u:
        errors.append(f"{key}: {u} does not divide context_parallel_size {cp}")
    elif cp // u < 2:
        errors.append(f"{key}: {u} leaves a ring of {cp // u} group(s) out of context_parallel_size {cp}; hybrid_cp_algo "
                      "needs at least 2 (with Ulysses over every CP rank use ulysses_cp_algo)")


def _validate_virtual_pipeline(cfg: Config, errors: list[str]) -> None:
    """megatron_training.virtual_pipeline_model_parallel_size: what megatron-core 0.16.1's interleaved schedule needs.

    num_hidden_layers a multiple of PP x VPP is checked when the model is built (it is in the model's config.json).
    """
    mt, rl, vpp = cfg.megatron_training, cfg.rl_config, cfg.megatron_training.virtual_pipeline_model_parallel_size
    if vpp is None:
        return
    key, pp = "megatron_training.virtual_pipeline_model_parallel_size", mt.pipeline_model_parallel_size
    if vpp < 2:
        errors.append(f"{key}: {vpp}; use at least 2 chunks per stage, or null for the non-interleaved schedule")
    if pp < 2:
        errors.append(f"{key}: the interleaved schedule needs pipeline_model_parallel_size >= 2, got {pp}")
    if mt.context_parallel_size > 1:
        errors.append(f"{key}: not built with context_parallel_size > 1 (the schedule's one activation shape would have to "
                      "pad each CP rank's share); set one of them to 1 (or null)")
    rows = cfg.trained_samples_per_iteration // cfg.actor_data_parallel_size  # a rank's rows in a log-prob pass
    for name in ("actor_forward_micro_batch_size", "ref_forward_micro_batch_size"):
        size = getattr(rl, name)
        if size and not rl.use_dynamic_bsz and pp >= 2 and (rows % size or (rows // size) % pp):
            errors.append(f"rl_config.{name}: {size}; the interleaved schedule needs each rank's {rows} rows of a log-prob pass "
                          f"cut into a multiple of pipeline_model_parallel_size {pp} micro-batches of this size")
    mini = rl.mini_batch_size or cfg.trained_samples_per_iteration
    if rl.use_dynamic_bsz:
        # Token-budget micro-batches are cut until their count is a multiple of PP (logprobs.micro_batches), which a
        # rank's rows of a mini-batch always allow when they are a multiple of PP themselves.
        if not rl.use_remove_padding:
            errors.append(f"{key}: with rl_config.use_dynamic_bsz the interleaved schedule pads every micro-batch to the "
                          "tallest and widest of them, past max_packing_token_size; set rl_config.use_remove_padding true "
                          "(packed micro-batches stay within it)")
        rows = mini // cfg.actor_data_parallel_size
        if pp >= 2 and rows % pp:
            errors.append(f"{key}: with rl_config.use_dynamic_bsz each rank's rows of a mini-batch must be a multiple of "
                          f"pipeline_model_parallel_size {pp}; rl_config.mini_batch_size {mini} / data-parallel size "
                          f"{cfg.actor_data_parallel_size} = {rows}")
        return
    per_rank = mt.micro_batch_size * cfg.actor_data_parallel_size
    # A mini-batch that is not a multiple of micro_batch_size x DP is reported by rl_config.mini_batch_size's own check.
    if pp >= 2 and mini % per_rank == 0 and (mini // per_rank) % pp:
        errors.append(f"{key}: the interleaved schedule needs the micro-batches of a mini-batch a multiple of "
                      f"pipeline_model_parallel_size {pp}; rl_config.mini_batch_size {mini} / (micro_batch_size "
                      f"{mt.micro_batch_size} x data-parallel size {cfg.actor_data_parallel_size}) = {mini // per_rank}")


# ---------------------------------------------------------------- algorithm: rl_config


def _validate_routing_replay(cfg: Config, errors: list[str]) -> None:
    """What rl_config.routing_replay needs from the rollout (docs/moe.md)."""
    if not cfg.rl_config.routing_replay:
        return
    gen = cfg.generate_config
    if not gen.enforce_eager:
        errors.append("rl_config.routing_replay: needs generate_config.enforce_eager: true; vLLM's compiled model "
                      "(torch.compile, CUDA graphs) skips the router hook that records the routed experts")
    if gen.enable_prefix_caching:
        errors.append("rl_config.routing_replay: needs generate_config.enable_prefix_caching: false; prompt tokens found "
                      "in the prefix cache are never computed, so their routing would be missing from the record")
    if (cfg.megatron_training.virtual_pipeline_model_parallel_size or 1) > 1:
        errors.append("rl_config.routing_replay: not built with megatron_training.virtual_pipeline_model_parallel_size "
                      "(the interleaved schedule pads every micro-batch to one shape, which the replayed routing would have to follow)")


# ---------------------------------------------------------------- model: init_model


def _validate_init_model_moe(init: InitModelConfig, errors: list[str]) -> None:
    """init_model's architecture and its MoE sizes; an MoE key set for a model that has no such part is an error."""
    default = InitModelConfig()
    unused = ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"]
    if init.architecture in MOE_ARCHITECTURES:
        unused = ["shared_expert_intermediate_size"] if init.architecture == "qwen3_moe" else []
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
            _check_positive(errors, f"init_model.{key}", getattr(init, key))
        if init.num_experts_per_tok > init.num_experts:
            errors.append(f"init_model.num_experts_per_tok: {init.num_experts_per_tok} is more than num_experts {init.num_experts}")
    for key in unused:
        if getattr(init, key) != getattr(default, key):
            errors.append(f"init_model.{key}: {getattr(init, key)!r} has no effect on architecture {init.architecture!r}; remove it")


# ---------------------------------------------------------------- dock


def _check_sentinel_keys(dock: DockConfig, errors: list[str]) -> None:
    """The keys of a dock behind Redis Sentinel and of replica-acknowledged writes: each set only where it has an effect."""
    if dock.min_replicas_acked and dock.replica_ack_timeout_s >= dock.socket_timeout_s:
        errors.append(f"dock.replica_ack_timeout_s: {dock.replica_ack_timeout_s} must be below dock.socket_timeout_s "
                      f"{dock.socket_timeout_s} (the WAIT for replicas holds the connection's reply that long)")
    if dock.min_replicas_acked and dock.redis_cluster:
        errors.append("dock.min_replicas_acked: not supported with dock.redis_cluster (WAIT has no key to route it to the run's "
                      "node); set 0, or run the dock on one Redis or behind dock.redis_sentinels")
    if not dock.redis_sentinels:
        if dock.redis_sentinel_master:
            errors.append("dock.redis_sentinel_master: set without dock.redis_sentinels, where it has no effect; "
                          "list the sentinels (host:port) or remove it")
        return
    for i, address in enumerate(dock.redis_sentinels):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            errors.append(f"dock.redis_sentinels[{i}]: {address!r} is not host:port")
    if not dock.redis_sentinel_master:
        errors.append("dock.redis_sentinel_master: empty; give the master name the sentinels monitor (`sentinel monitor NAME ...`)")
    if dock.redis_url:
        errors.append(f"dock.redis_url: {dock.redis_url!r} set together with dock.redis_sentinels; the sentinels name the "
                      "primary, so leave redis_url empty")
    if dock.redis_cluster:
        errors.append("dock.redis_cluster: cannot be true with dock.redis_sentinels (a cluster fails over by itself)")
    if dock.redis_tls:
        errors.append("dock.redis_tls: not supported with dock.redis_sentinels yet (the sentinel connections would need "
                      "their own TLS settings); use one of the two")


# ---------------------------------------------------------------- profiler_config


def _validate_profiler(pc: ProfilerConfig, path: str, errors: list[str]) -> None:
    """Refuses the profiler_config values that name torch_npu's features (dockrl profiles with torch.profiler)."""
    if pc.mstx:
        errors.append(f"{path}.mstx: Ascend's mstx marks are not built; the trace names each stage already (set false)")
    if pc.profile_analysis:
        errors.append(f"{path}.profile_analysis: torch_npu's analysis is not built; the Chrome traces open as written (set false)")
    if pc.profile_level != "level0":
        errors.append(f"{path}.profile_level: {pc.profile_level!r}: the levels are torch_npu's and torch.profiler has none; "
                      "choose the detail with profile_with_cpu / profile_with_memory / profile_record_shapes / "
                      "profile_with_module (or leave level0)")
    if pc.profile_step_start < 1 or pc.profile_step_end <= pc.profile_step_start:
        errors.append(f"{path}.profile_step_end: steps {pc.profile_step_start} .. {pc.profile_step_end} (end excluded) "
                      "profile nothing; need 1 <= profile_step_start < profile_step_end")
    if isinstance(pc.profile_ranks, str) and pc.profile_ranks != "all":
        errors.append(f"{path}.profile_ranks: {pc.profile_ranks!r} is not 'all' or a list of ranks")
    if pc.profile and not (pc.profile_with_cpu or pc.profile_with_npu):
        errors.append(f"{path}.profile_with_cpu: with profile_with_npu false too the profiler records nothing")
