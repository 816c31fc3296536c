"""Writes docs/config.md from the config dataclasses (their docstrings and field comments).

`python scripts/gen_config_docs.py` rewrites it; `--check` exits 1 when it is out of date.
"""
import argparse
import dataclasses
import inspect
import pathlib
import re
import sys
import typing

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.common import config as C  # noqa: E402
from services.common.config.types import type_name  # noqa: E402

INTRO = """# Configuration reference

One YAML file; sections and keys as in MindSpeed-RL where they exist there. Every key is optional;
the default is shown. Validation runs once at load (`dockrl config check --config FILE`, pydantic
on the sections of `services/common/config/`) and reports every error with its key path; a key's
own range or choices are in its type column, checks that span several keys follow the tables' rules.
Integers, booleans and lists are read strictly (`2.5`, `"2"` or `yes` for an integer or a boolean
are errors); a number may be written as an integer or as `1e-6`. `--set section.key=value` overrides a key.

The `*_dispatch_size` keys of `rl_config`, when unset, are derived as MindSpeed-RL derives them:
`global_batch_size * n_samples_per_prompt / dp`, where dp is `rollout.replicas` for
`actor_rollout_dispatch_size` and 1 for `reward_dispatch_size`. The trainer takes each iteration's
rows in one claim and computes log-probs, advantages and the update itself, so MindSpeed-RL's
`actor_logprob`, `ref`, `adv` and `actor_update` dispatch sizes have no counterpart here.
`mini_batch_size` defaults to `global_batch_size * n_samples_per_prompt`.

### MindSpeed-RL's layout

A config written in MindSpeed-RL's layout loads as it is (any of `defaults`, `actor_config`,
`ref_config`, `critic_config`, `msprobe_config` marks one; `services/common/mindspeed_layout.py`):

- `defaults: - model: [NAME]` loads `model/NAME.yaml` beside the config. dockrl builds the model
  from the checkpoint's `config.json`, so the model file is checked against it (`num_layers`,
  `hidden_size`, `num_query_groups`, ... must agree; RMSNorm, RoPE and SwiGLU must be what it names)
  where the checkpoint is present.
- `actor_config` is merged over `megatron_training` as MindSpeed-RL merges it. `ref_config` and
  `critic_config` must match the actor's settings (both run in the trainer's processes), except the
  critic's `lr`, which becomes `megatron_training.critic_lr`. MindSpeed-RL's `load` is the Megatron
  checkpoint converted from `tokenizer_name_or_path`; dockrl starts from that Hugging Face directory.
- Switches that select Ascend kernels (`use_flash_attn`, `use_fused_rmsnorm`, ...), Ascend speed
  and memory switches (`swap_optimizer`, `reuse_fp32_param`, `moe_alltoall_overlap_comm`, ...),
  vLLM-Ascend's (`torchair_graph`, ...), Ray resources and transports (`num_cpus_for_local_task`,
  `zmq_communication`, `hccl_buffersize`), colocation (`use_integrated_worker`, `offload_train_*`),
  `sequence_parallel` and activation recomputation (`recompute_*`; neither is built: the same
  results at more activation memory) are dropped, each with a line saying why; values that cannot
  run here (dropout, `no_save_optim: true`, a `split` with held-out shares, uneven `num_layer_list`,
  `noop_layers`, `infer_expert_parallel_size` > 1, fp16's `initial_loss_scale` without `bf16`,
  `msprobe: true`) are errors naming the key.
- `shuffle_minibatch` is `shuffle_mini_batch`; `filter_groups_metric` naming the run's one verifier
  (`acc_for_dapo`, or its series `grpo/acc_for_dapo_rewards/mean`) is the sample's verifier reward
  (`acc`); `profiler_config.integrated` is `profiler_config.trainer`; `rollout_max_tokens` takes the
  sampling budget when the overlong penalty (its only reader in MindSpeed-RL) is off; the
  multi-turn keys (`multi_turn_enable`, `tool_config_path` in verl's tool-config format,
  `max_tool_calls`, `max_tool_response_length`, `tool_parser_format`) become `rollout.multi_turn`.
- DAPO's `filter_groups_train_batch_size` is the groups one update trains, kept over as many rounds of
  `global_batch_size` prompts as it takes (`filter_groups_max_batches` bounds them), as in MindSpeed-RL.
- The forward-only log-prob passes take their own micro-batches, as in MindSpeed-RL:
  `actor_forward_micro_batch_size` / `ref_forward_micro_batch_size` (and with `use_dynamic_bsz`,
  `actor_` / `ref_` / `update_max_packing_token_size`) are `rl_config` keys here too.

MindSpeed-RL's example configs at its commit 05a90d7 (April 2026) are kept unchanged in
`tests/fixtures/mindspeed/current`; `tests/unit/test_mindspeed_current.py` loads them. 8 of the 17
load. The others are refused only on what is not built yet:

| configs | refused on | what is missing |
|---|---|---|
| `dpo_qwen3_30b_a3b_A3` | `stage: dpo`, `dpo_loss_type`, `is_pairwise_dataset`, `ref_model`, ... | DPO (the algorithm-menu issue) |
| `grpo_lora_qwen25_32b_A2` | `lora_*`, `share_backbone` | LoRA (the LoRA issue) |
| `dapo_qwen25_7b_A2_multi_turn` | `retool_reward`, `tool_response_truncate_side: middle`, `max_parallel_calls`; its `code_interpreter` maps to the tool of that name, run in the run's sandbox replicas | ReTool's reward; the rest of agentic RL |
| `grpo_deepseek_r1_671b_*` (3) | `multi_latent_attention`, uneven `num_layer_list`, expert-parallel inference | the DeepSeek-V3 layout; uneven pipeline stages |
| `dapo_qwen3_30b_a3b_A3`, `grpo_qwen3_235b_a22b_A2` | `infer_expert_parallel_size` > 1, `enable_expert_parallel` (and `noop_layers`) | expert-parallel inference and a `--platform` check |
| `grpo_qwen25_32b_A3` | `num_layer_list: 16,17,16,15` | uneven pipeline stages |

Two refusals are the configs' own: `grpo_deepseek_r1_671b_A2`'s `max_model_len` 10240 is below its
prompt and response budgets (10244), and `grpo_deepseek_r1_671b_A3_eplb` sets an expert map with
`enforce_eager: false`, where vLLM's compiled model skips the hook that counts tokens per expert.
`grpo_qwen3_8b_A3` and `dapo_qwen3_32b_A3` name dense Qwen3 (`Qwen3ForCausalLM`), which the trainer
builds and converts and vLLM serves (tested at the tiny size: `init_model.architecture: qwen3`).

`dockrl config check --config FILE` prints every change; `dockrl config import FILE --out OUT`
writes the equivalent dockrl config.
"""

OUTRO = """## Tiny model and data

`dockrl init-model --out DIR` builds the `init_model` architecture with a byte-level tokenizer
(256 byte tokens and `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, `<|pad|>`).
`dockrl data make-arithmetic --out DIR` writes disjoint `train.jsonl` / `test.jsonl`
(`{"problem": "3+5=", "answer": "8"}`). `dockrl data preprocess` takes MindSpeed-RL's preprocessing
keys (`input`, `tokenizer_name_or_path`, `output_prefix`, `handler_name`, `prompt_type`, `map_keys`,
`seq_length`, `workers`, `log_interval`) from `--config` or flags and writes `PREFIX.jsonl` (index,
prompt, prompt_ids, label) and `PREFIX.meta.json`; `megatron_training.data_path` names PREFIX.

Inputs are `.jsonl`, `.json` (an array) or `.parquet`. A dotted `map_keys` name reads a nested
field (`response: reward_model.ground_truth`), and a `reward_model` mapping given as the response
yields its `ground_truth`, as MindSpeed-RL's `Math17kAlpacaStyleInstructionHandler` reads
DAPO-Math-17k (that handler's default keys). A prompt field that holds a conversation (a list of
`{role, content}` turns) is rendered turn by turn; `prompt_type: tokenizer` renders with the
tokenizer's own chat template instead of one of `configs/model/templates.json`. Handlers:
`R1AlpacaStyleInstructionHandler` (DeepScaleR: `problem`, `answer`), `Math17kAlpacaStyleInstructionHandler`,
`AlpacaStyleInstructionHandler`. `tokenizer_type` must name a Hugging Face tokenizer and
`dataset_additional_keys` must be `[labels]` (the label is all the verifiers read); other values are errors.
"""


def _field_comments(cls: type) -> dict[str, str]:
    notes = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+):[^=]+=\s*.+?\s+#\s*(.*)$", line)
        if m:
            notes[m.group(1)] = m.group(2).replace("|", "\\|")
    return notes


def _section(name: str, cls: type, out: list[str]) -> None:
    out += [f"## `{name}`", "", (cls.__doc__ or "").strip(), "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    notes, hints = _field_comments(cls), typing.get_type_hints(cls, include_extras=True)
    nested = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            nested.append((f"{name}.{f.name}", tp))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append(f"| `{f.name}` | {type_name(tp)} | `{default!r}` | {notes.get(f.name, '')} |")
    out.append("")
    for sub_name, sub in nested:
        _section(sub_name, sub, out)


def render() -> str:
    """The whole reference as Markdown."""
    out = [INTRO]
    hints = typing.get_type_hints(C.Config)
    for f in dataclasses.fields(C.Config):
        tp = hints[f.name]
        inner = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        _section(f.name, inner[0], out)
    out.append(OUTRO)
    return "\n".join(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/config.md is out of date")
    args = parser.parse_args()
    path = ROOT / "docs" / "config.md"
    text = render()
    if args.check:
        sys.exit(0 if path.exists() and path.read_text() == text else 1)
    path.write_text(text)
