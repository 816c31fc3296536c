"""Expert-parallel load balancing (EPLB) as MindSpeed-RL does it with vllm-ascend: count, plan, place.

A rollout replica counts the tokens its router sends to each expert of each MoE layer
(`services.rollout.expert_counter`, read on `GET /v1/expert_load`). `dockrl eplb` turns those counts
into a placement of physical expert slots on devices, redundant copies of hot experts included,
with vLLM's own EPLB policy (`vllm.distributed.eplb.policy.DefaultEplbPolicy`, DeepSeek's
algorithm), and writes it as the expert map file vllm-ascend reads (`expert_map_path`):

    {"moe_layer_count": L,
     "layer_list": [{"layer_id": l, "device_count": D,
                     "device_list": [{"device_id": d, "device_expert": [logical expert ids]}, ...]}, ...]}

(the layout of vllm-ascend's `vllm_ascend/eplb/tool/generate_map.py` and its `ExpertLoadBalancer`).

Load model, as vLLM's policy assumes: a token routed to an expert with r copies costs each copy 1/r
of it, so a device's load is the sum over its slots of count / copies. Imbalance is the largest
device load over the mean (1.0 is perfect), per layer; `imbalance` reports the mean over layers.
"""
from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

Placement = list[list[list[int]]]  # [layer][device] -> logical expert ids on that device


class ExpertMapError(ValueError):
    """An expert map file that cannot serve this model; the message names the file and what is wrong."""


def contiguous_placement(num_layers: int, num_experts: int, num_devices: int) -> Placement:
    """The placement without EPLB: experts in id order cut into `num_devices` contiguous runs (sizes differ by at
    most one when the split is uneven), no copies."""
    if not 1 <= num_devices <= num_experts:
        raise ValueError(f"{num_experts} experts cannot be placed on {num_devices} devices without copies")
    bounds = [d * num_experts // num_devices for d in range(num_devices + 1)]
    return [[list(range(bounds[d], bounds[d + 1])) for d in range(num_devices)] for _ in range(num_layers)]


def _copies(devices: Sequence[Sequence[int]], num_experts: int) -> list[int]:
    """How many devices hold each expert in one layer."""
    copies = [0] * num_experts
    for experts in devices:
        for e in experts:
            copies[e] += 1
    return copies


def device_loads(counts: Sequence[float], devices: Sequence[Sequence[int]]) -> list[float]:
    """Tokens each device computes in one layer: every expert's count shared evenly by its copies."""
    copies = _copies(devices, len(counts))
    return [sum(counts[e] / copies[e] for e in experts) for experts in devices]


def layer_imbalance(counts: Sequence[float], devices: Sequence[Sequence[int]]) -> float:
    """Largest device load over the mean device load in one layer (1.0 when no token was counted)."""
    loads = device_loads(counts, devices)
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def imbalance(counts: Sequence[Sequence[float]], placement: Placement) -> float:
    """Mean over layers of max / mean tokens per device under `placement`."""
    return sum(layer_imbalance(c, p) for c, p in zip(counts, placement, strict=True)) / len(placement)


def plan_placement(counts: Sequence[Sequence[float]], num_devices: int, num_redundant: int,
                   num_groups: int = 1, num_nodes: int = 1) -> Placement:
    """The placement vLLM's EPLB policy chooses for these per-layer per-expert token counts, each device's experts
    made distinct (`spread_copies`).

    `num_devices` devices hold num_experts + `num_redundant` slots in all (a multiple of num_devices);
    `num_groups` / `num_nodes` are the policy's expert groups and server nodes (1 / 1: global balancing).
    """
    import torch
    from vllm.distributed.eplb.policy import DefaultEplbPolicy

    num_experts = len(counts[0])
    slots = num_experts + num_redundant
    if num_redundant < 0 or num_devices < 1 or slots % num_devices:
        raise ValueError(f"{num_experts} experts + {num_redundant} redundant = {slots} slots cannot be split evenly over "
                         f"{num_devices} devices")
    weight = torch.tensor(counts, dtype=torch.float64)
    phy2log = DefaultEplbPolicy.rebalance_experts(weight, slots, num_groups, num_nodes, num_devices)
    per = slots // num_devices
    return [spread_copies([row[d * per:(d + 1) * per] for d in range(num_devices)], layer_counts)
            for row, layer_counts in zip(phy2log.tolist(), counts)]


def spread_copies(devices: list[list[int]], counts: Sequence[float]) -> list[list[int]]:
    """One layer's placement with no expert twice on a device.

    vLLM's policy packs copies by load alone and can put two copies of a hot expert on one device (even more
    copies than devices), which computes its tokens no faster than one; vllm-ascend maps each expert to one slot
    per device, and MindSpeed-RL requires distinct experts per device. A second copy on a device is swapped with
    an expert of a device that holds no copy of it, the swap that leaves the two devices' larger load smallest,
    so every expert keeps its copies; where no device lacks it (more copies than devices), the slot becomes a copy
    of the expert, absent from that device, with the most tokens per copy.
    """
    num_experts = len(counts)
    if any(len(experts) > num_experts for experts in devices):
        raise ValueError(f"{len(devices[0])} slots per device cannot hold distinct experts of {num_experts}: "
                         "lower --redundant-experts")
    copies = _copies(devices, num_experts)
    devices = [list(experts) for experts in devices]
    for a, experts in enumerate(devices):
        for slot, e in enumerate(experts):
            if e not in experts[:slot]:
                continue
            loads = device_loads(counts, devices)
            share = [c / max(n, 1) for c, n in zip(counts, copies)]
            # each swap ends a duplicate and makes none: b lacked e and `a` lacks f
            swaps = [(max(loads[a] - share[e] + share[f], loads[b] - share[f] + share[e]), b, j)
                     for b, other in enumerate(devices) if e not in other
                     for j, f in enumerate(other) if f not in experts]
            if swaps:
                _, b, j = min(swaps)
                experts[slot], devices[b][j] = devices[b][j], e
            else:
                f = max((f for f in range(num_experts) if f not in experts), key=lambda f: share[f])
                experts[slot] = f
                copies[e] -= 1
                copies[f] += 1
    return devices


def write_expert_map(path: str | pathlib.Path, placement: Placement) -> pathlib.Path:
    """Writes `placement` as vllm-ascend's expert map JSON; returns the path."""
    doc = {
        "moe_layer_count": len(placement),
        "layer_list": [
            {"layer_id": layer, "device_count": len(devices),
             "device_list": [{"device_id": d, "device_expert": experts} for d, experts in enumerate(devices)]}
            for layer, devices in enumerate(placement)
        ],
    }
    path = pathlib.Path(path)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def read_expert_map(path: str | pathlib.Path, num_layers: int, num_experts: int) -> Placement:
    """Reads an expert map file and checks it places every expert of every layer of a model with
    `num_layers` MoE layers of `num_experts` experts; raises ExpertMapError saying what is wrong."""
    try:
        doc = json.loads(pathlib.Path(path).read_text())
        layers = doc["layer_list"]
        placement = [[[int(e) for e in dev["device_expert"]] for dev in layer["device_list"]] for layer in layers]
        declared = int(doc["moe_layer_count"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ExpertMapError(f"{path}: not an expert map file ({type(exc).__name__}: {exc}); expected "
                             '{"moe_layer_count": L, "layer_list": [{"device_list": [{"device_expert": [...]}]}]}') from None
    if declared != len(placement) or len(placement) != num_layers:
        raise ExpertMapError(f"{path}: moe_layer_count {declared} and {len(placement)} layers listed; the model has "
                             f"{num_layers} MoE layers")
    for layer, devices in enumerate(placement):
        if len(devices) != len(placement[0]) or not devices:
            raise ExpertMapError(f"{path}: layer {layer} lists {len(devices)} devices, layer 0 {len(placement[0])}")
        for d, experts in enumerate(devices):
            if len(set(experts)) != len(experts) or any(not 0 <= e < num_experts for e in experts):
                raise ExpertMapError(f"{path}: layer {layer} device {d} holds {experts}: distinct expert ids in "
                                     f"[0, {num_experts})")
        missing = set(range(num_experts)) - {e for experts in devices for e in experts}
        if missing:
            raise ExpertMapError(f"{path}: layer {layer} places no copy of experts {sorted(missing)}")
    return placement


def checkpoint_moe_shape(model_dir: str | pathlib.Path) -> tuple[int, int] | None:
    """(MoE layers, experts per layer) as a Qwen MoE checkpoint's config.json declares them, (0, 0) for a model
    without routed experts; None where it cannot tell (no local config.json, another MoE layout)."""
    try:
        config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    experts = config.get("num_experts")
    if experts is None:
        moe_keys = ("n_routed_experts", "num_local_experts", "moe_num_experts")
        return None if any(k in config for k in moe_keys) else (0, 0)
    # Qwen2-MoE / Qwen3-MoE: layer i is sparse unless listed in mlp_only_layers, every decoder_sparse_step-th layer
    step, dense = config.get("decoder_sparse_step", 1) or 1, set(config.get("mlp_only_layers") or ())
    layers = sum(1 for i in range(config["num_hidden_layers"]) if i not in dense and experts > 0 and (i + 1) % step == 0)
    return layers, experts


def check_map_against_checkpoint(path: str | pathlib.Path, model_dir: str | pathlib.Path) -> None:
    """Checks the expert map at `path` against the checkpoint's own config.json before the engine starts, so a
    wrong map stops a replica in a second rather than after the engine's start-up; raises ExpertMapError. The
    replica checks it again against the model vLLM built (start_expert_counting)."""
    shape = checkpoint_moe_shape(model_dir)
    if shape == (0, 0):
        raise ExpertMapError(f"{path} is set but {model_dir} has no MoE layers")
    if shape is not None:
        read_expert_map(path, *shape)


def load_report(counts: Sequence[Sequence[float]], placement: Placement | None) -> dict:
    """The imbalance of `counts` without EPLB (experts contiguous on as many devices as the map has) and under the map."""
    if placement is None:
        return {}
    devices = len(placement[0])
    report = {"devices": devices, "slots_per_device": len(placement[0][0]), "imbalance_with_map": imbalance(counts, placement)}
    if devices <= len(counts[0]):  # more devices than experts: no placement without copies to compare with
        report["imbalance_contiguous"] = imbalance(counts, contiguous_placement(len(counts), len(counts[0]), devices))
    return report
