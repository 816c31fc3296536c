"""Hugging Face safetensors <-> megatron-core GPTModel state dicts, for any TP x PP (x VPP) split.

Megatron fuses q/k/v into one `linear_qkv` laid out per query group ([q heads of the group, k, v]
for each of the num_key_value_heads groups), and gate/up into one SwiGLU `linear_fc1` ([gate; up]
on every TP rank). Column-parallel weights split along dim 0, row-parallel ones along dim 1.
The same mapping converts gradients (tests compare TP=1 and TP=2 gradients through it).

Mixture-of-experts layers (Qwen2-MoE, Qwen3-MoE): every routed expert and the shared expert is a
SwiGLU MLP mapped as the dense one (`mlp.experts.{e}.*` <-> `mlp.experts.local_experts.{e}.*`,
`mlp.shared_expert.*` <-> `mlp.shared_experts.*`, each split over TP); the router
(`mlp.gate` <-> `mlp.router`), the shared expert's sigmoid gate and Qwen3's q/k norms are
replicated. Shards here hold every expert, numbered globally; `expert_parallel_part` keeps one
expert-parallel rank's experts, renumbered locally as megatron's SequentialMLP names them.

With a virtual pipeline (VPP chunks per stage) a shard names chunk v's tensors `v.<megatron name>` (the
state dict of model.ModelChunks); chunk v of stage p holds the layers of virtual stage v x PP + p, as
megatron's get_transformer_layer_offset numbers them. A checkpoint file stores the chunks as Megatron does,
under `model0`, `model1`, ... instead of `model`.
"""
from __future__ import annotations

import json
import pathlib
import shutil
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from services.trainer.modeling.model import ModelLayout

ShardKey = tuple[int, int]  # (pipeline rank, tensor rank)
MEGATRON_FILE = "model_optim_rng.pt"
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja")

# Per-layer tensors that are the same on every TP rank, and tensors split along dim 1 (row parallel).
_LAYER_REPLICATED = {"input_layernorm.weight": "input_layernorm.weight",
                     "post_attention_layernorm.weight": "pre_mlp_layernorm.weight"}
_LAYER_ROW_PARALLEL = {"self_attn.o_proj.weight": "self_attention.linear_proj.weight"}
_QK_NORMS = {"self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
             "self_attn.k_norm.weight": "self_attention.k_layernorm.weight"}
_MOE_REPLICATED = {"mlp.gate.weight": "mlp.router.weight"}
_SHARED_EXPERT_GATE = {"mlp.shared_expert_gate.weight": "mlp.shared_experts.gate_weight"}
_EXPERTS = "mlp.experts.local_experts."


def _replicated(layout: ModelLayout) -> dict[str, str]:
    """Per-layer HF -> megatron names of the tensors every TP rank holds whole."""
    names = dict(_LAYER_REPLICATED)
    if layout.qk_layernorm:
        names.update(_QK_NORMS)
    if layout.is_moe:
        names.update(_MOE_REPLICATED)
    if layout.shared_expert_ffn_hidden_size:
        names.update(_SHARED_EXPERT_GATE)
    return names


def _mlps(layout: ModelLayout) -> list[tuple[str, str]]:
    """(HF prefix, megatron prefix) of each SwiGLU MLP in a layer: the dense one, or every expert and the shared one."""
    if not layout.is_moe:
        return [("mlp.", "mlp.")]
    mlps = [(f"mlp.experts.{e}.", f"{_EXPERTS}{e}.") for e in range(layout.num_experts)]
    return mlps + ([("mlp.shared_expert.", "mlp.shared_experts.")] if layout.shared_expert_ffn_hidden_size else [])


def shard_dir_name(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """Megatron's per-rank directory name: mp_rank_TT, mp_rank_TT_PPP with pipeline parallel, and _EEE appended with
    expert parallel (megatron.training.checkpointing.get_checkpoint_name)."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if ep > 1 else "")


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ModelLayout, tp: int) -> list[torch.Tensor]:
    """HF q/k/v (weights [out, in] or biases [out]) -> per-TP-rank linear_qkv in per-group order."""
    groups, hd = layout.num_key_value_heads, layout.head_dim
    per_group = layout.num_attention_heads // groups
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(groups, per_group * hd, *rest), k.reshape(groups, hd, *rest),
                       v.reshape(groups, hd, *rest)], dim=1)
    return [c.reshape(-1, *rest) for c in fused.chunk(tp, dim=0)]


def _split_qkv(shards: list[torch.Tensor], layout: ModelLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of _fuse_qkv: per-rank linear_qkv -> HF q, k, v."""
    groups, hd = layout.num_key_value_heads, layout.head_dim
    per_group = layout.num_attention_heads // groups
    rest = shards[0].shape[1:]
    fused = torch.cat([s.reshape(-1, (per_group + 2) * hd, *rest) for s in shards], dim=0)
    q, k, v = fused.split([per_group * hd, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _virtual_stages(layout: ModelLayout, pp: int, vpp: int) -> list[tuple[int, str, range]]:
    """(pipeline rank, chunk's name prefix, global layers) of every chunk, in layer order: virtual stage g = v x PP + p
    holds layers g x L / (PP x VPP) onwards (megatron's get_transformer_layer_offset)."""
    per_chunk = layout.num_layers // (pp * vpp)
    return [(g % pp, f"{g // pp}." if vpp > 1 else "", range(g * per_chunk, (g + 1) * per_chunk)) for g in range(pp * vpp)]


def chunk_prefixes(vpp: int) -> tuple[str, str]:
    """The name prefixes of the chunk holding the embedding (stage 0's first) and of the one holding the head (the last
    stage's last)."""
    return ("0.", f"{vpp - 1}.") if vpp > 1 else ("", "")


def hf_to_megatron(hf: Mapping[str, torch.Tensor], layout: ModelLayout, tp: int = 1, pp: int = 1,
                   vpp: int = 1) -> dict[ShardKey, dict[str, torch.Tensor]]:
    """Splits a HF state dict into megatron GPTModel state dicts, one per (pp_rank, tp_rank) (chunk-prefixed names with vpp > 1)."""
    layout.check_parallel(tp, pp, vpp=vpp)
    out: dict[ShardKey, dict[str, torch.Tensor]] = {(p, t): {} for p in range(pp) for t in range(tp)}
    embed = hf["model.embed_tokens.weight"].chunk(tp, dim=0)
    head = embed if layout.tie_word_embeddings else hf["lm_head.weight"].chunk(tp, dim=0)
    first, last = chunk_prefixes(vpp)
    for p, chunk, layers in _virtual_stages(layout, pp, vpp):
        for local, i in enumerate(layers):
            src, dst = f"model.layers.{i}.", f"{chunk}decoder.layers.{local}."
            qkv = {kind: _fuse_qkv(*(hf[f"{src}self_attn.{x}_proj.{kind}"] for x in "qkv"), layout, tp)
                   for kind in (("weight", "bias") if layout.qkv_bias else ("weight",))}
            for t in range(tp):
                shard = out[(p, t)]
                for kind, parts in qkv.items():
                    shard[f"{dst}self_attention.linear_qkv.{kind}"] = parts[t].clone()
                for hf_mlp, mg_mlp in _mlps(layout):
                    gate = hf[f"{src}{hf_mlp}gate_proj.weight"].chunk(tp, dim=0)[t]
                    up = hf[f"{src}{hf_mlp}up_proj.weight"].chunk(tp, dim=0)[t]
                    shard[f"{dst}{mg_mlp}linear_fc1.weight"] = torch.cat([gate, up], dim=0)
                    shard[f"{dst}{mg_mlp}linear_fc2.weight"] = hf[f"{src}{hf_mlp}down_proj.weight"].chunk(tp, dim=1)[t].clone()
                for hf_name, mg_name in _LAYER_ROW_PARALLEL.items():
                    shard[dst + mg_name] = hf[src + hf_name].chunk(tp, dim=1)[t].clone()
                for hf_name, mg_name in _replicated(layout).items():
                    shard[dst + mg_name] = hf[src + hf_name].clone()
    for t in range(tp):
        out[(0, t)][f"{first}embedding.word_embeddings.weight"] = embed[t].clone()
        out[(pp - 1, t)][f"{last}decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        # Tied embeddings on one stage share the embedding tensor; across stages the last keeps a copy.
        if not layout.tie_word_embeddings or pp > 1:
            out[(pp - 1, t)][f"{last}output_layer.weight"] = head[t].clone()
    return out


@dataclass(frozen=True)
class HfConversion:
    """One megatron tensor of pipeline stage `pp_rank` and the HF tensors it becomes: the smallest unit the
    conversion works on, so a weight push can gather and convert the model one tensor at a time."""

    pp_rank: int
    name: str  # megatron name, local to the stage (chunk-prefixed under a virtual pipeline)
    tp_split: bool  # split over TP ranks (else every TP rank holds it whole and TP rank 0's copy is used)
    to_hf: Callable[[list[torch.Tensor]], dict[str, torch.Tensor]]  # the TP ranks' parts (one when not split) -> HF tensors


def hf_conversions(layout: ModelLayout, pp: int, vpp: int = 1) -> list[HfConversion]:
    """Every megatron tensor a tp x pp (x vpp) split holds that has an HF counterpart, in HF checkpoint order."""
    def cat(hf_name: str, dim: int):
        return lambda parts: {hf_name: torch.cat(parts, dim=dim)}

    def whole(hf_name: str):
        return lambda parts: {hf_name: parts[0]}

    def qkv(dst: str, kind: str):
        return lambda parts: dict(zip((f"{dst}self_attn.{x}_proj.{kind}" for x in "qkv"), _split_qkv(parts, layout)))

    def gate_up(dst: str):
        def split(parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
            halves = [part.chunk(2, dim=0) for part in parts]
            return {f"{dst}gate_proj.weight": torch.cat([g for g, _ in halves], dim=0),
                    f"{dst}up_proj.weight": torch.cat([u for _, u in halves], dim=0)}
        return split

    first, last = chunk_prefixes(vpp)
    plan = [HfConversion(0, f"{first}embedding.word_embeddings.weight", True, cat("model.embed_tokens.weight", 0))]
    for p, chunk, layers in _virtual_stages(layout, pp, vpp):
        for local, i in enumerate(layers):
            src, dst = f"{chunk}decoder.layers.{local}.", f"model.layers.{i}."
            for kind in ("weight", "bias") if layout.qkv_bias else ("weight",):
                plan.append(HfConversion(p, f"{src}self_attention.linear_qkv.{kind}", True, qkv(dst, kind)))
            for hf_mlp, mg_mlp in _mlps(layout):
                plan.append(HfConversion(p, f"{src}{mg_mlp}linear_fc1.weight", True, gate_up(dst + hf_mlp)))
                plan.append(HfConversion(p, f"{src}{mg_mlp}linear_fc2.weight", True, cat(f"{dst}{hf_mlp}down_proj.weight", 1)))
            for hf_name, mg_name in _LAYER_ROW_PARALLEL.items():
                plan.append(HfConversion(p, src + mg_name, True, cat(dst + hf_name, 1)))
            for hf_name, mg_name in _replicated(layout).items():
                plan.append(HfConversion(p, src + mg_name, False, whole(dst + hf_name)))
    plan.append(HfConversion(pp - 1, f"{last}decoder.final_layernorm.weight", False, whole("model.norm.weight")))
    if not layout.tie_word_embeddings:
        plan.append(HfConversion(pp - 1, f"{last}output_layer.weight", True, cat("lm_head.weight", 0)))
    return plan


def chunk_count(shard: Mapping[str, torch.Tensor]) -> int:
    """The model chunks a shard's names come from: 1 + the largest chunk prefix `v.` (1 when unprefixed)."""
    prefixes = [name.partition(".")[0] for name in shard]
    return 1 + max((int(p) for p in prefixes if p.isdigit()), default=0)


def megatron_to_hf(shards: Mapping[ShardKey, Mapping[str, torch.Tensor]], layout: ModelLayout) -> dict[str, torch.Tensor]:
    """Merges per-(pp_rank, tp_rank) megatron state dicts (or gradients) back into HF names."""
    pp = 1 + max(p for p, _ in shards)
    tp = 1 + max(t for _, t in shards)
    hf: dict[str, torch.Tensor] = {}
    for c in hf_conversions(layout, pp, chunk_count(shards[(0, 0)])):
        hf.update(c.to_hf([shards[(c.pp_rank, t)][c.name] for t in (range(tp) if c.tp_split else (0,))]))
    return hf


def _expert_index(name: str) -> tuple[str, int, str] | None:
    """(prefix, expert number, rest) of a routed expert's megatron name, else None."""
    head, sep, tail = name.partition(_EXPERTS)
    if not sep:
        return None
    number, _, rest = tail.partition(".")
    return head + sep, int(number), rest


def is_expert_tensor(name: str) -> bool:
    """Whether a megatron name is a routed expert's (split over expert-parallel ranks)."""
    return _EXPERTS in name


def expert_owner(name: str, layout: ModelLayout, ep: int) -> tuple[int, str]:
    """(expert-parallel rank holding it, its local megatron name there) of a routed expert's globally numbered name."""
    prefix, number, rest = _expert_index(name)
    local = layout.num_experts // ep
    return number // local, f"{prefix}{number % local}.{rest}"


def expert_parallel_part(shard: Mapping[str, torch.Tensor], layout: ModelLayout, ep: int, ep_rank: int) -> dict[str, torch.Tensor]:
    """Of a shard holding every expert, what expert-parallel rank `ep_rank` of `ep` holds: its num_experts / ep
    consecutive experts, renumbered from 0 (megatron's local expert names), and every other tensor."""
    local = layout.num_experts // ep
    part = {}
    for name, tensor in shard.items():
        expert = _expert_index(name)
        if expert is None:
            part[name] = tensor
        elif ep_rank * local <= expert[1] < (ep_rank + 1) * local:
            part[f"{expert[0]}{expert[1] - ep_rank * local}.{expert[2]}"] = tensor
    return part


def merge_expert_parallel(parts: list[Mapping[str, torch.Tensor]], layout: ModelLayout) -> dict[str, torch.Tensor]:
    """Inverse of expert_parallel_part: the EP ranks' parts (in rank order) -> one shard with every expert, numbered globally."""
    local = layout.num_experts // len(parts)
    merged: dict[str, torch.Tensor] = {}
    for ep_rank, part in enumerate(parts):
        for name, tensor in part.items():
            expert = _expert_index(name)
            if expert is None:
                merged.setdefault(name, tensor)  # the same on every EP rank
            else:
                merged[f"{expert[0]}{expert[1] + ep_rank * local}.{expert[2]}"] = tensor
    return merged


def load_hf_state(hf_dir: str | pathlib.Path) -> dict[str, torch.Tensor]:
    """All tensors of the *.safetensors files in `hf_dir`."""
    from safetensors.torch import load_file

    files = sorted(pathlib.Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{hf_dir}: no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def save_megatron(shards: Mapping[ShardKey, Mapping[str, torch.Tensor]], out_dir: str | pathlib.Path, hf_dir: str | pathlib.Path) -> pathlib.Path:
    """Writes one `mp_rank_*/model_optim_rng.pt` per shard (a virtual pipeline's chunks under model0, model1, ... as
    Megatron keys them) and a copy of the HF side files in hf_config/."""
    from tqdm import tqdm

    out = pathlib.Path(out_dir)
    pp = 1 + max(p for p, _ in shards)
    for (p, t), state in tqdm(shards.items(), desc="writing megatron shards", unit="shard"):
        d = out / shard_dir_name(t, p, pp)
        d.mkdir(parents=True, exist_ok=True)
        torch.save(chunked_payload(state, chunk_count(state)), d / MEGATRON_FILE)
    copy_hf_side_files(hf_dir, out / "hf_config")
    return out


def load_megatron(mg_dir: str | pathlib.Path) -> dict[ShardKey, dict[str, torch.Tensor]]:
    """Reads the shards save_megatron (or a training checkpoint) wrote, keyed by (pp_rank, tp_rank); the expert-parallel
    ranks' shards of one position are merged into one with every expert (the model's layout from mg_dir/hf_config)."""
    from tqdm import tqdm

    import numpy as np

    by_expert_rank: dict[ShardKey, dict[int, dict[str, torch.Tensor]]] = {}
    # An RL checkpoint's shard also holds the run's RNG state, numpy's among it: its array types are allowed, no other code.
    numpy_state = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]
    for f in tqdm(sorted(pathlib.Path(mg_dir).glob(f"mp_rank_*/{MEGATRON_FILE}")), desc="reading megatron shards", unit="shard"):
        with torch.serialization.safe_globals(numpy_state):
            payload = torch.load(f, map_location="cpu", weights_only=True)
        # A training checkpoint names its ranks (Megatron's mp_rank_TT_EEE reads like mp_rank_TT_PPP); a converted one has TT[_PPP].
        ranks = payload.get("parallel_ranks") or dict(zip(("tp_rank", "pp_rank"), map(int, f.parent.name.split("_")[2:])))
        model = {k: v for k, v in model_payload(payload).items() if not k.endswith("_extra_state")}
        key = (ranks.get("pp_rank", 0), ranks["tp_rank"])
        by_expert_rank.setdefault(key, {})[ranks.get("ep_rank", 0)] = model
    if not by_expert_rank:
        raise FileNotFoundError(f"{mg_dir}: no mp_rank_*/{MEGATRON_FILE}")
    if all(len(parts) == 1 for parts in by_expert_rank.values()):
        return {key: parts[0] for key, parts in by_expert_rank.items()}
    layout = ModelLayout.from_hf_dir(pathlib.Path(mg_dir) / "hf_config")
    return {key: merge_expert_parallel([parts[r] for r in sorted(parts)], layout) for key, parts in by_expert_rank.items()}


def chunked_payload(state: Mapping[str, torch.Tensor], chunks: int) -> dict[str, dict[str, torch.Tensor]]:
    """A model's state dict as a checkpoint file stores it: under "model", or with a virtual pipeline each chunk's
    under "model0", "model1", ... (Megatron's keys), its names without the chunk prefix."""
    if chunks == 1:
        return {"model": dict(state)}
    out: dict[str, dict[str, torch.Tensor]] = {f"model{v}": {} for v in range(chunks)}
    for name, tensor in state.items():
        v, _, rest = name.partition(".")
        out[f"model{v}"][rest] = tensor
    return out


def payload_chunks(payload: Mapping) -> int:
    """How many model chunks a checkpoint file holds: 1 under "model", else its model0, model1, ... keys."""
    return 1 if "model" in payload else sum(key.startswith("model") and key[len("model"):].isdigit() for key in payload)


def model_payload(payload: Mapping) -> dict[str, torch.Tensor]:
    """The inverse of chunked_payload: a checkpoint file's model state, chunk-prefixed when it holds model0, model1, ..."""
    if "model" in payload:
        return dict(payload["model"])
    return {f"{v}.{name}": tensor for v in range(payload_chunks(payload)) for name, tensor in payload[f"model{v}"].items()}


def copy_hf_side_files(src: str | pathlib.Path, dst: str | pathlib.Path) -> None:
    """Copies config, tokenizer and generation files (everything but weights) from src to dst."""
    dst = pathlib.Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for name in HF_SIDE_FILES:
        if (pathlib.Path(src) / name).exists():
            shutil.copy2(pathlib.Path(src) / name, dst / name)


def save_hf(state: Mapping[str, torch.Tensor], out_dir: str | pathlib.Path, side_files_dir: str | pathlib.Path) -> pathlib.Path:
    """Writes `state` as model.safetensors plus the HF side files, loadable by transformers and vLLM."""
    from safetensors.torch import save_file

    out = pathlib.Path(out_dir)
    copy_hf_side_files(side_files_dir, out)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def convert_hf_to_megatron(hf_dir: str | pathlib.Path, out_dir: str | pathlib.Path, tp: int, pp: int, vpp: int = 1) -> pathlib.Path:
    """`dockrl trainer convert --to megatron`: a HF directory -> megatron shards for tp x pp, each stage in vpp chunks."""
    layout = ModelLayout.from_hf_dir(hf_dir)
    return save_megatron(hf_to_megatron(load_hf_state(hf_dir), layout, tp, pp, vpp), out_dir, hf_dir)


def convert_megatron_to_hf(mg_dir: str | pathlib.Path, out_dir: str | pathlib.Path) -> pathlib.Path:
    """`dockrl trainer convert --to hf`: megatron shards (with their hf_config/) -> a HF directory."""
    side = pathlib.Path(mg_dir) / "hf_config"
    if not (side / "config.json").exists():
        raise FileNotFoundError(f"{side / 'config.json'}: missing; the shards need the model's Hugging Face config and tokenizer "
                                "there (copy them from the directory the run started from, megatron_training.load)")
    layout = ModelLayout.from_hf_dir(side)
    return save_hf(megatron_to_hf(load_megatron(mg_dir), layout), out_dir, side)


def describe(mg_dir: str | pathlib.Path) -> str:
    """One line about a converted directory, for the CLI."""
    shards = load_megatron(mg_dir)
    pp = 1 + max(p for p, _ in shards)
    tp = 1 + max(t for _, t in shards)
    params = sum(v.numel() for s in shards.values() for v in s.values())
    return json.dumps({"tp": tp, "pp": pp, "vpp": chunk_count(shards[(0, 0)]), "shards": len(shards), "parameters_in_shards": params})


def load_shard(model, shard: Mapping[str, torch.Tensor]) -> None:
    """Copies a converted shard into a built model; raises when a weight is missing or unexpected."""
    result = model.load_state_dict(dict(shard), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint does not fit the model: missing {missing}, unexpected {result.unexpected_keys}")


def load_hf_into_model(model, hf: Mapping[str, torch.Tensor], layout: ModelLayout) -> None:
    """Loads this rank's (pp_rank, tp_rank) part of a HF state dict into `model`."""
    from megatron.core import parallel_state

    from services.trainer.modeling.model import virtual_pipeline_size

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    key = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank())
    shard = hf_to_megatron(hf, layout, tp, pp, virtual_pipeline_size())[key]
    if layout.is_moe:
        shard = expert_parallel_part(shard, layout, parallel_state.get_expert_model_parallel_world_size(),
                                     parallel_state.get_expert_model_parallel_rank())
    load_shard(model, shard)
