"""`dockrl`: one CLI over every service.

Each service keeps its own flags in `services/<service>/cli.py` (`add_arguments`, `run`); this
module only wires them as subcommands and hosts the few commands that belong to no service
(model, data and config helpers). Heavy libraries load inside the command that needs them, so
`--help` is instant.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with add_arguments/run, one-line help)
SERVICE_COMMANDS: dict[str, tuple[str, str]] = {
    "rollout": ("services.rollout.cli", "the vLLM rollout server: gRPC, OpenAI-compatible HTTP, dock worker"),
    "reward": ("services.reward.cli", "the reward server: rule verifiers and a reward model over gRPC, dock worker"),
    "trainer": ("services.trainer.cli", "the Megatron trainer: run the RL loop, convert checkpoints"),
    "dock": ("services.dock.cli", "look at or empty a run's data dock"),
    "sandbox": ("services.sandbox.cli", "the code sandbox server: untrusted programs under bubblewrap over gRPC"),
}


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="run config YAML (default: the embedded configs/tiny_cpu.yaml)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override one config key, e.g. --set rollout.grpc_port=50052 (repeatable)",
    )


def _cmd_init_model(args: argparse.Namespace) -> int:
    import dataclasses

    from services.common.config import ArithmeticConfig, InitModelConfig, load_config
    from services.common.tiny_model import build_tiny_model, fit_reward_model

    cfg = load_config(args.config, args.overrides)
    init = cfg.init_model or InitModelConfig()
    if args.seed is not None:
        init = dataclasses.replace(init, seed=args.seed)
    out = args.out or (cfg.reward_config.load if args.reward else cfg.megatron_training.load)
    if not out:
        print(f"init-model: give --out or set {'reward_config' if args.reward else 'megatron_training'}.load", file=sys.stderr)
        return 2
    if args.fit_steps and not args.reward:
        print("init-model: --fit-steps trains a reward model; give --reward too", file=sys.stderr)
        return 2
    path = build_tiny_model(out, init, prompt_type=args.prompt_type or init.prompt_type, reward=args.reward)
    if args.fit_steps:
        ranked = fit_reward_model(path, args.fit_steps, cfg.arithmetic or ArithmeticConfig(), seed=init.seed)
        print(f"reward model fit for {args.fit_steps} steps: ranks {ranked:.0%} of (right, wrong) answer pairs right (50%: chance)")
    print(f"tiny {'reward ' if args.reward else ''}model written to {path}")
    return 0


def _cmd_data_make_arithmetic(args: argparse.Namespace) -> int:
    from services.common.config import ArithmeticConfig
    from services.common.arithmetic_data import write_arithmetic_dataset

    spec = ArithmeticConfig(max_operand=args.max_operand, ops=tuple(args.ops), test_fraction=args.test_fraction, seed=args.seed)
    paths = write_arithmetic_dataset(args.out, spec)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _cmd_data_preprocess(args: argparse.Namespace) -> int:
    import yaml

    from services.common.config import ConfigError, parse_dataclass
    from services.common.log import setup_logging
    from services.common.preprocess import PreprocessConfig, preprocess

    setup_logging("data")
    data = yaml.safe_load(open(args.config)) if args.config else {}
    for key in ("input", "tokenizer_name_or_path", "output_prefix", "handler_name", "prompt_type", "seq_length", "workers", "log_interval"):
        value = getattr(args, key)
        if value is not None:
            data[key] = value
    try:
        cfg = parse_dataclass(PreprocessConfig, data)
        kept = preprocess(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"preprocess: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {kept} prompts to {cfg.output_prefix}.jsonl")
    return 0


def _cmd_config_check(args: argparse.Namespace) -> int:
    import yaml

    from services.common.config import ConfigError, config_from_translation, config_to_dict, env_overrides, read_config_file

    try:
        translation = read_config_file(args.config)
        for change in translation.changes:
            print(f"MindSpeed-RL layout: {change}")
        cfg = config_from_translation(translation, [*env_overrides(), *args.overrides])
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.print:
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    else:
        print(f"config OK: {cfg.samples_per_iteration} samples per iteration, "
              f"actor_rollout_dispatch_size={cfg.rl_config.actor_rollout_dispatch_size}")
    return 0


def _cmd_config_import(args: argparse.Namespace) -> int:
    import pathlib

    import yaml

    from services.common.config import ConfigError, config_from_translation, read_config_file

    try:
        translation = read_config_file(args.file)
        config_from_translation(translation)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    for change in translation.changes:
        print(change)
    text = yaml.safe_dump(translation.data, sort_keys=False)
    if args.out:
        pathlib.Path(args.out).write_text(f"# dockrl config imported from MindSpeed-RL's {args.file}\n" + text)
        print(f"wrote {args.out} ({len(translation.changes)} changes)")
    else:
        print(text)
    return 0


def _read_expert_load(source: str) -> list[list[int]]:
    """[MoE layer][expert] token counts from a replica's base URL (its GET /v1/expert_load) or a file saved from it."""
    import json
    import pathlib
    import urllib.request

    if source.startswith(("http://", "https://")):
        with urllib.request.urlopen(source.rstrip("/") + "/v1/expert_load", timeout=30) as response:
            return json.load(response)["counts"]
    return json.loads(pathlib.Path(source).read_text())["counts"]


def _cmd_eplb(args: argparse.Namespace) -> int:
    from services.rollout.eplb import load_report, plan_placement, write_expert_map

    try:
        loads = [_read_expert_load(source) for source in args.counts]
    except (OSError, ValueError, KeyError) as exc:
        print(f"eplb: cannot read the expert load: {exc}", file=sys.stderr)
        return 2
    if any(len(c) != len(loads[0]) or len(c[0]) != len(loads[0][0]) for c in loads):
        print("eplb: the --counts sources are of different models (layers x experts differ)", file=sys.stderr)
        return 2
    counts = [[sum(layer) for layer in zip(*layers)] for layers in zip(*loads)]  # summed over replicas
    num_experts = len(counts[0])
    try:
        placement = plan_placement(counts, args.devices, args.redundant_experts, args.groups, args.nodes)
    except ValueError as exc:
        print(f"eplb: {exc}", file=sys.stderr)
        return 2
    path = write_expert_map(args.out, placement)
    report = load_report(counts, placement)
    print(f"{sum(counts[0]):,} routed tokens in layer 0; {len(counts)} MoE layers x {num_experts} experts on "
          f"{args.devices} devices, {args.redundant_experts} redundant")
    # more devices than experts: every placement needs copies, so there is no contiguous one to compare with
    before = (f"contiguous {report['imbalance_contiguous']:.3f}" if "imbalance_contiguous" in report
              else f"contiguous: none ({num_experts} experts on {args.devices} devices need copies)")
    print(f"imbalance (max / mean tokens per device, mean over layers): {before}, "
          f"with the map {report['imbalance_with_map']:.3f}")
    print(f"wrote {path}")
    return 0


def _add_builtin_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init-model", help="build the tiny Qwen2-layout (or Qwen MoE) model and tokenizer locally",
                       description="Builds a randomly initialised Qwen2, Qwen2-MoE or Qwen3-MoE Hugging Face checkpoint "
                                   "(init_model.architecture) and a byte-level tokenizer from the config's init_model "
                                   "section (deterministic for a seed).")
    _add_config_args(p)
    p.add_argument("--out", help="output directory (default: megatron_training.load)")
    p.add_argument("--seed", type=int, default=None, help="init seed (default: init_model.seed)")
    p.add_argument("--prompt-type", default=None, help="chat template stored with the tokenizer (default: init_model.prompt_type)")
    p.add_argument("--reward", action="store_true",
                   help="build a reward model instead: Qwen2ForSequenceClassification with one label "
                        "(default --out: reward_config.load)")
    p.add_argument("--fit-steps", type=int, default=0, metavar="N",
                   help="with --reward: train it N steps on the arithmetic demo so its score rises with correctness "
                        "(default 0: random head)")
    p.set_defaults(func=_cmd_init_model)

    data = sub.add_parser("data", help="datasets: preprocess, or generate the arithmetic demo data")
    dsub = data.add_subparsers(dest="data_command", required=True)
    p = dsub.add_parser("preprocess", help="jsonl/parquet -> tokenized prompt dataset",
                        description="Tokenizes a jsonl/json/parquet file of problems into {output_prefix}.jsonl. Flags override "
                                    "the keys of the YAML given with --config (MindSpeed-RL's preprocessing keys).")
    p.add_argument("--config", help="preprocessing YAML (input, tokenizer_name_or_path, output_prefix, handler_name, prompt_type, map_keys, ...)")
    p.add_argument("--input", help="input .jsonl, .json or .parquet file")
    p.add_argument("--tokenizer-name-or-path", dest="tokenizer_name_or_path", help="Hugging Face tokenizer directory")
    p.add_argument("--output-prefix", dest="output_prefix", help="output path prefix; writes PREFIX.jsonl and PREFIX.meta.json")
    p.add_argument("--handler-name", dest="handler_name", help="how input rows map to prompt and label (default R1AlpacaStyleInstructionHandler)")
    p.add_argument("--prompt-type", dest="prompt_type", help="chat template name from configs/model/templates.json")
    p.add_argument("--seq-length", dest="seq_length", type=int, help="drop prompts longer than this many tokens (0 keeps all)")
    p.add_argument("--workers", type=int, help="tokenizer processes")
    p.add_argument("--log-interval", dest="log_interval", type=int, help="log a rate line every N prompts")
    p.set_defaults(func=_cmd_data_preprocess)
    p = dsub.add_parser("make-arithmetic", help="write the arithmetic demo dataset (train, test)",
                        description="Generates every `a op b=` problem with operands in [0, max-operand], split into disjoint sets: "
                                    "train (RL's prompts) and test (held out from RL).")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--max-operand", type=int, default=9, help="largest operand")
    p.add_argument("--ops", nargs="+", default=["+"], choices=["+", "-", "*"], help="operators to use")
    p.add_argument("--test-fraction", type=float, default=0.2, help="share of problems held out from RL (test.jsonl)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed")
    p.set_defaults(func=_cmd_data_make_arithmetic)

    p = sub.add_parser("eplb", help="plan an MoE expert placement from rollout token counts (vLLM's EPLB policy)",
                       description="Reads the tokens routed to each expert of each MoE layer (rollout replicas count them, "
                                   "GET /v1/expert_load), places num_experts + --redundant-experts expert slots on --devices "
                                   "devices with vLLM's EPLB policy (DeepSeek's algorithm: hot experts get copies), writes "
                                   "vllm-ascend's expert map file (generate_config.expert_map_path reads it) and prints the imbalance "
                                   "(max / mean tokens per device) with experts placed contiguously and with the map.")
    p.add_argument("--counts", action="append", required=True, metavar="URL_OR_FILE",
                   help="a rollout replica's HTTP base URL (http://host:port) or a JSON file saved from its /v1/expert_load; "
                        "repeatable: the replicas' counts are summed")
    p.add_argument("--devices", type=int, required=True, help="devices the experts are placed on (expert-parallel size)")
    p.add_argument("--redundant-experts", type=int, default=0,
                   help="extra expert slots for copies of hot experts; experts + this must divide by --devices (default 0)")
    p.add_argument("--groups", type=int, default=1, help="expert groups of the policy's hierarchical balancing (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="server nodes of the policy's hierarchical balancing (default 1)")
    p.add_argument("--out", required=True, help="expert map JSON to write")
    p.set_defaults(func=_cmd_eplb)

    cfg = sub.add_parser("config", help="validate a run config, or import one in MindSpeed-RL's layout")
    csub = cfg.add_subparsers(dest="config_command", required=True)
    p = csub.add_parser("check", help="load and validate a config; every error names its key",
                        description="Loads CONFIG with the same validation the services apply at start-up.")
    _add_config_args(p)
    p.add_argument("--print", action="store_true", help="print the resolved config (defaults and derived dispatch sizes filled in)")
    p.set_defaults(func=_cmd_config_check)
    p = csub.add_parser("import", help="write a MindSpeed-RL config in dockrl's layout and list every change",
                        description="Reads FILE in MindSpeed-RL's layout (defaults model files, actor/ref/critic_config merged "
                                    "over megatron_training, its Megatron and Ray switches) and writes the dockrl config "
                                    "it is equivalent to. Keys that cannot run here are errors naming the key and why.")
    p.add_argument("file", metavar="FILE", help="the MindSpeed-RL config YAML (its model files in model/ beside it)")
    p.add_argument("--out", default=None, help="write the dockrl config here (default: print it)")
    p.set_defaults(func=_cmd_config_import)


def build_parser() -> argparse.ArgumentParser:
    """The full `dockrl` argument parser."""
    from services.launch.cli import COMMANDS as LAUNCH_COMMANDS

    parser = argparse.ArgumentParser(
        prog="dockrl",
        description="RL post-training of LLMs as services: vLLM rollout, rule reward, Megatron trainer, Redis data dock.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add, run, help_text) in LAUNCH_COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add(p)
        p.set_defaults(func=run)
    for name, (module, help_text) in SERVICE_COMMANDS.items():
        cli = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=(cli.__doc__ or help_text).strip())
        cli.add_arguments(p)
        p.set_defaults(func=cli.run)
    _add_builtin_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dockrl` console script.

    A config that cannot run is reported by every command as `dockrl config check` reports it: every
    problem with its key's path, no traceback, exit 2.
    """
    from services.common.config import exit_status

    args = build_parser().parse_args(argv)
    return exit_status(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
