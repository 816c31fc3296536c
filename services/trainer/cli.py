"""`dockrl trainer ...`: run the RL loop (`train`) or convert checkpoints (`convert`)."""
from __future__ import annotations

import argparse
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the trainer's sub-commands to `parser`."""
    sub = parser.add_subparsers(dest="trainer_command", required=True)
    train = sub.add_parser("train", help="run the RL iterations against the dock (the run's driver)",
                           description="Runs megatron_training.train_iters iterations: prompts into the dock, scored groups "
                                       "out, update, weight push to every live rollout replica. With rl_config.actor_resource.num_npus > 1 "
                                       "it starts that many local processes under torchrun itself (TP x PP x DP); started by "
                                       "torchrun (RANK set, e.g. across nodes) it is one of them.")
    train.add_argument("--config", default=None, help="run config YAML (default: the embedded configs/tiny_cpu.yaml)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one config key (repeatable)")
    train.add_argument("--host", default=None, help="address the Trainer gRPC service binds (default: trainer.host)")
    train.add_argument("--port", type=int, default=None, help="Trainer gRPC port, 0 picks a free one (default: trainer.grpc_port)")
    train.add_argument("--resume", action="store_true", help="continue from the last checkpoint in megatron_training.save")
    convert = sub.add_parser("convert", help="convert a checkpoint between Hugging Face safetensors and Megatron shards",
                             description="Convert a checkpoint between Hugging Face safetensors and megatron-core shards. "
                                         "HF -> Megatron -> HF gives back bit-identical tensors.")
    convert.add_argument("--to", choices=("megatron", "hf"), required=True,
                         help="target format: 'megatron' reads a HF directory, 'hf' reads a directory of Megatron shards")
    convert.add_argument("--src", required=True, help="source directory (HF: config.json + *.safetensors; Megatron: mp_rank_*/ "
                                                      "with hf_config/, e.g. an RL checkpoint's <megatron_training.save>/iter_NNNNNNN)")
    convert.add_argument("--dst", required=True, help="output directory (created)")
    convert.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the Megatron shards written (--to megatron)")
    convert.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the Megatron shards written (--to megatron)")
    convert.add_argument("--vpp", type=int, default=1,
                         help="model chunks per pipeline stage of the shards written, Megatron's model0, model1, ... "
                              "(megatron_training.virtual_pipeline_model_parallel_size; needs --pp >= 2; --to megatron)")


def _relaunch_under_torchrun(args: argparse.Namespace, ranks: int) -> int:
    """Runs this same `train` command as `ranks` local processes under torchrun and waits for them (never returns otherwise)."""
    argv = ["train", *(["--config", args.config] if args.config else [])]
    argv += [item for override in args.overrides for item in ("--set", override)]
    argv += [*(["--host", args.host] if args.host else []), *(["--port", str(args.port)] if args.port is not None else [])]
    argv += ["--resume"] if args.resume else []
    # --standalone: a rendezvous on a free local port; torchrun gives each rank OMP_NUM_THREADS=1 unless it is set.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "services.trainer", *argv]
    os.execv(sys.executable, command)
    return 1


def run(args: argparse.Namespace) -> int:
    """Runs the chosen sub-command; returns the exit status (2 for bad input)."""
    if args.trainer_command == "train":
        from services.common.config import load_config
        from services.trainer.loop.driver import train

        cfg = load_config(args.config, args.overrides)
        ranks = cfg.rl_config.actor_resource.num_npus
        if ranks > 1 and "RANK" not in os.environ:  # not started by torchrun (or another launcher): start the ranks here
            return _relaunch_under_torchrun(args, ranks)
        return train(cfg, resume=args.resume, host=args.host, port=args.port)
    from services.trainer.modeling.checkpoint_convert import convert_hf_to_megatron, convert_megatron_to_hf, describe

    if args.trainer_command == "convert":
        try:
            if args.to == "megatron":
                if args.tp < 1 or args.pp < 1 or args.vpp < 1:
                    raise ValueError(f"--tp/--pp/--vpp: must be >= 1, got {args.tp}/{args.pp}/{args.vpp}")
                if args.vpp > 1 and args.pp < 2:
                    raise ValueError(f"--vpp: {args.vpp} chunks need --pp >= 2 (a virtual pipeline interleaves stages; "
                                     "the trainer refuses it at PP 1 too)")
                out = convert_hf_to_megatron(args.src, args.dst, args.tp, args.pp, args.vpp)
                print(f"wrote {out}: {describe(out)}")
            else:
                print(f"wrote {convert_megatron_to_hf(args.src, args.dst)}")
        except (FileNotFoundError, ValueError) as exc:
            print(f"dockrl trainer convert: {exc}", file=sys.stderr)
            return 2
        return 0
    raise AssertionError(f"unhandled trainer command {args.trainer_command!r}")
