"""Where an iteration's time goes in a whole GRPO run: per-stage breakdown, the share the trainer
waits on rollout, the share spent in the dock, and the iteration against a single-process loop.

Runs `dockrl up` on the tiny CPU config (real Redis, a vLLM rollout replica, a reward replica and
the megatron-core trainer, as separate processes on loopback) for --iters iterations, without the
warm start (only time matters here) or evaluations, and reads the trainer's metrics.jsonl: per
iteration, rollout + reward (the trainer waits on the dock for scored groups), train (log-probs,
advantages, update) and weight sync (push to the replica), and the whole. The first
iterations (--skip) are left out (first use of every kernel and code path).

The references: the same GRPO iterations in one process, as a person would write them without
dockrl: generation (sampling as the config's sampling_config, n samples per prompt), the same
rule verifiers called in-process, and bench_trainer_step.py's plain PyTorch update (same loss,
clipping and AdamW), on the same model, data, batch and learning rate. Two generators, each its
own loop (`--reference`): transformers' `generate` on the trained model itself, and vLLM's
offline `LLM` with the rollout replica's engine flags, the trained weights copied into it after
each update. They run after the `dockrl up` run, one after the other, alone, with the torch
threads the trainer picks; the ratio of median iteration times, dockrl / reference, is issue
24's (goal <= 1.5, synchronous). The vLLM loop has the same engine as dockrl's replica, so its
ratio is the cost of running the parts as services; the HF loop's adds vLLM's per-step cost on a
model whose forward is a fraction of a millisecond.

The dock's share: the same iteration's dock traffic (bench/bench_dock.py: prompts in, rollout
claims and puts, reward claims and puts, trainer claims and acks, at the run's GBS*n, prompt and
response lengths) is timed against a private redis-server right after the run, several times;
its median over the run's median iteration time is the share (goal < 2%). It counts every
service's dock calls as if they were on the critical path, so it is an upper bound.

    python bench/bench_e2e.py --quick      # 3 iterations (CI)
    python bench/bench_e2e.py              # 14 iterations
    python bench/bench_e2e.py --set "rollout.omp_threads_bind='0'"   # the vLLM engine on core 0 only
    python bench/bench_e2e.py --compare-replicas 2 --reference   # the iteration with 2 rollout replicas against 1

`--compare-replicas N` also runs `dockrl up` with N rollout replicas and again with 1, alternately
(--compare-reps times each, the main run counted with the 1-replica runs), and reports the median
iteration with N against 1: what adding replicas on the same host gives (on 2 cores, two engines
share the cores the one had, each pinned to its own).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np

from bench_dock import BenchPool, IterationData, dock_iteration, new_dock
from common import REPO, interleaved, machine_line, median, parser, private_redis, progress, ratio, work_dir

DOCK_GOAL = 0.02
REFERENCE_GOAL = 1.5
REFERENCES = {"hf": "HF generate", "vllm": "vLLM offline generate"}
STAGES = (("rollout + reward (trainer waits)", "timing/rollout_and_reward_s"), ("train", "timing/train_s"),
          ("weight sync", "timing/weight_sync_s"))


def run_up(work, iters: int, overrides: list[str] = ()) -> list[dict]:
    """Runs `dockrl up` on configs/tiny_cpu.yaml under `work` (plus `overrides`); returns the per-iteration metric records."""
    logs = work / "logs"
    sets = [
        f"megatron_training.load={work}/model", f"megatron_training.tokenizer_name_or_path={work}/model",
        f"megatron_training.data_path={work}/data/train", f"megatron_training.save={work}/ckpt",
        f"megatron_training.train_iters={iters}", f"arithmetic.out_dir={work}/raw", f"trainer.log_dir={logs}",
        "trainer.eval_data_path=", "trainer.test_data_path=", "trainer.eval_interval=0", "init_model.warm_start_accuracy=0",
        "rollout.grpc_port=0", "rollout.http_port=0", "reward.grpc_port=0", "trainer.grpc_port=0", *overrides,
    ]
    argv = [sys.executable, "-m", "services", "up", str(REPO / "configs/tiny_cpu.yaml"), *[f"--set={s}" for s in sets]]
    progress(f"dockrl up: {iters} GRPO iterations on the tiny config (logs in {logs})")
    run = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        raise RuntimeError(f"dockrl up exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    records = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "timing/iteration_s" in r]


class HFGenerate:
    """transformers' `generate` on the update's own model: nothing to copy after an update."""

    label = "HF generate"

    def __init__(self, cfg, step, tokenizer):
        self.cfg, self.model, self.tokenizer = cfg, step.model, tokenizer
        self.stop_ids = set(np.atleast_1d(step.model.generation_config.eos_token_id).tolist())

    def __call__(self, prompts) -> list[list[int]]:
        """n responses per prompt, prompt-major."""
        import torch

        sampling, n = self.cfg.generate_config.sampling_config, self.cfg.rl_config.n_samples_per_prompt
        inputs = self.tokenizer.pad({"input_ids": [p.prompt_ids for p in prompts]}, return_tensors="pt")
        self.model.eval()
        with torch.no_grad():
            out = self.model.generate(**inputs, do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                                      top_k=max(sampling.top_k, 0), max_new_tokens=sampling.max_tokens,
                                      num_return_sequences=n, pad_token_id=self.tokenizer.pad_token_id)
        self.model.train()
        responses = []
        for tokens in out[:, inputs["input_ids"].size(1):].tolist():
            # a response ends with its first stop token (the model's generation_config lists them), as vLLM's do
            ends = [k for k, t in enumerate(tokens) if t in self.stop_ids]
            responses.append(tokens[: ends[0] + 1] if ends else tokens)
        return responses

    def load(self, model) -> None:
        """Nothing to do: generation runs on the trained model itself."""


class VLLMGenerate:
    """vLLM's offline `LLM` with the rollout replica's engine flags (services.rollout.engine.serve_args), in this
    process; after each update the weights go in as one bucket through `collective_rpc` (the replica's worker
    extension), which is what a single-process vLLM loop on the CPU platform must do: vLLM's CPU worker runs in a
    process of its own."""

    label = "vLLM offline generate"

    def __init__(self, cfg):
        import os

        from vllm import LLM
        from vllm.engine.arg_utils import EngineArgs

        from services.rollout.engine import serve_args

        gen = cfg.generate_config
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(gen.cpu_kvcache_space_gb))
        if cfg.rollout.omp_threads_bind != "auto":
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cfg.rollout.omp_threads_bind)
        model = str(cfg.megatron_training.load)
        self.llm = LLM.from_engine_args(EngineArgs.from_cli_args(serve_args(model, cfg, "reference")))
        self.cfg = cfg

    def __call__(self, prompts) -> list[list[int]]:
        """n responses per prompt, prompt-major, sampled as sampling_config says."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sampling = self.cfg.generate_config.sampling_config
        params = SamplingParams(n=self.cfg.rl_config.n_samples_per_prompt, temperature=sampling.temperature,
                                top_p=sampling.top_p, top_k=sampling.top_k, max_tokens=sampling.max_tokens, detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p.prompt_ids)) for p in prompts], params,
                                    use_tqdm=False)
        return [list(c.token_ids) for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]

    def load(self, model) -> None:
        """Copies the trained weights into the engine (one bucket; the tiny model is 1.8 MB)."""
        from services.common.weight_wire import pack_bucket

        params = dict(model.named_parameters())
        bucket = pack_bucket(params, list(params))
        self.llm.collective_rpc("stage_bucket", args=(bucket.data, [(s.name, s.dtype, list(s.shape), s.offset, s.nbytes)
                                                                     for s in bucket.tensors]))
        self.llm.collective_rpc("commit_staged")


def reference_loop(cfg, iters: int, engine: str) -> list[dict[str, float]]:
    """The same GRPO iterations in one process (see the module docstring), generating with `engine` ("hf" or
    "vllm"); seconds per part of each iteration."""
    import torch
    from transformers import AutoTokenizer

    from bench_trainer_step import PlainStep
    from services.common.prompt_file import read_prompt_file
    from services.reward.pool import InProcessRunner
    from services.reward.scoring import ScoreInput, ScoringPlan, score_samples
    from services.dock.rows import ScoredSample
    from services.trainer.loop.iteration_data import ScoredBatch
    from services.trainer.loop.prompt_stream import PromptStream

    mt, rl = cfg.megatron_training, cfg.rl_config
    tokenizer = AutoTokenizer.from_pretrained(mt.tokenizer_name_or_path)
    tokenizer.padding_side = "left"  # generation continues every prompt from its last token
    step = PlainStep(mt.load, cfg)
    generate = HFGenerate(cfg, step, tokenizer) if engine == "hf" else VLLMGenerate(cfg)
    plan, runner = ScoringPlan.from_rl_config(rl), InProcessRunner()
    stream = PromptStream(read_prompt_file(mt.data_path, "megatron_training.data_path").records, mt.seed, shuffle=not rl.guarantee_order)
    torch.manual_seed(mt.seed)
    records = []
    for i in range(iters):
        start = time.perf_counter()
        prompts = stream.take(mt.global_batch_size)
        responses = generate(prompts)
        generated = time.perf_counter()
        labels = [prompts[row // rl.n_samples_per_prompt].label for row in range(len(responses))]
        scored = score_samples([ScoreInput(tokenizer.decode(r, skip_special_tokens=True), label, len(r))
                                for r, label in zip(responses, labels)], plan, runner)
        batch = ScoredBatch([ScoredSample(np.asarray(prompts[row // rl.n_samples_per_prompt].prompt_ids, np.int32),
                                          np.asarray(response, np.int32), s.total, None, None, None, None, None)
                             for row, (response, s) in enumerate(zip(responses, scored))], list(range(len(responses))))
        rewarded = time.perf_counter()
        step(batch)
        updated = time.perf_counter()
        generate.load(step.model)
        end = time.perf_counter()
        records.append({"generate": generated - start, "reward": rewarded - generated, "update": updated - rewarded,
                        "weight sync": end - updated, "iteration": end - start})
        progress(f"reference ({generate.label}) iteration {i + 1}/{iters}: {end - start:.3f} s")
    return records


def compare_replicas(work, iters: int, args, first_iteration: float) -> None:
    """Runs `dockrl up` with args.compare_replicas rollout replicas and with 1, alternately; prints the medians and their ratio."""
    count = args.compare_replicas
    medians: dict[int, list[float]] = {1: [first_iteration], count: []}
    for rep in range(args.compare_reps):
        for replicas in (count, 1) if rep < args.compare_reps - 1 else (count,):
            records = run_up(work / f"replicas{replicas}-{rep}", iters, [*args.overrides, f"rollout.replicas={replicas}"])
            medians[replicas].append(median([r["timing/iteration_s"] for r in records[args.skip:]]))
            progress(f"{replicas} replica(s), run {len(medians[replicas])}: median iteration {medians[replicas][-1]:.3f} s")
    for replicas, values in medians.items():
        print(f"{replicas} rollout replica(s): median iteration {median(values):.3f} s over {len(values)} run(s) "
              f"({', '.join(f'{v:.3f}' for v in values)})")
    ratio(f"iteration time {count} rollout replicas / 1 on this host", median(medians[count]) / median(medians[1]))


def main() -> int:
    p = parser(__doc__, "3 iterations (the first skipped), the dock replay 3 times (CI)")
    p.add_argument("--iters", type=int, default=None, help="GRPO iterations (default 14; --quick 3)")
    p.add_argument("--skip", type=int, default=None, help="first iterations left out of the medians (default 2; --quick 1)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="one more config override for the dockrl up run, e.g. rollout.omp_threads_bind='0' (repeatable)")
    p.add_argument("--reference", nargs="*", choices=sorted(REFERENCES), default=["hf", "vllm"],
                   help="the single-process loops to compare with, one after the other: hf (transformers' generate "
                        "on the trained model) and vllm (vLLM's offline LLM, weights copied in after each update); "
                        "default both; none when given without a value")
    p.add_argument("--compare-replicas", type=int, default=0, metavar="N",
                   help="also run with N rollout replicas and with 1, alternately, and report N against 1 (default: not)")
    p.add_argument("--compare-reps", type=int, default=1, help="runs with N replicas (and as many more with 1) for --compare-replicas (default 1)")
    args = p.parse_args()
    iters = args.iters or (3 if args.quick else 14)
    args.skip = args.skip if args.skip is not None else (1 if args.quick else 2)
    reps = args.reps or (3 if args.quick else 7)
    if iters <= args.skip:
        p.error(f"--iters must be more than --skip ({args.skip})")

    from services.common.config import load_config
    from services.common.prompt_file import read_prompt_file

    work = work_dir("e2e")
    records = run_up(work, iters, args.overrides)[args.skip:]
    cfg = load_config(str(work / "logs/config.yaml"))
    gbs, n = cfg.megatron_training.global_batch_size, cfg.rl_config.n_samples_per_prompt
    iteration = median([r["timing/iteration_s"] for r in records])
    print(machine_line())
    print(f"{len(records)} iterations measured (first {args.skip} skipped), GBS {gbs} x n {n}, "
          f"median iteration {iteration:.3f} s")
    print(f"{'stage':<34}{'median s':>10}{'share':>8}")
    for label, key in STAGES:
        seconds = median([r[key] for r in records])
        print(f"{label:<34}{seconds:>10.3f}{seconds / iteration:>8.1%}")

    # the dock's traffic of one such iteration, at the run's sizes (response lengths uniform up to twice the mean)
    prompt_len = round(np.mean([len(r.prompt_ids) for r in read_prompt_file(cfg.megatron_training.data_path, "megatron_training.data_path").records]))
    response_len = max(1, round(2 * median([r["response_length/mean"] for r in records])))
    with private_redis(work) as url:
        import redis

        dock = new_dock(redis.Redis.from_url(url), gbs * n)
        data = IterationData.make(gbs * n, prompt_len, response_len)
        dock_s = median(interleaved({"dock": lambda: dock_iteration(BenchPool(dock, 1, {}), data, claims=1)}, reps, warmups=1, label="dock replay: ")["dock"])
        dock.destroy()
    print(f"dock traffic of one iteration ({gbs * n} rows, {prompt_len}-token prompts, responses up to {response_len}): "
          f"{dock_s:.3f} s")
    ratio("trainer waiting on rollout / iteration time", median([r["timing/rollout_and_reward_s"] / r["timing/iteration_s"] for r in records]))
    ratio("dock time / iteration time", dock_s / iteration, at_most=DOCK_GOAL)
    tokens = np.median([r["vllm_tps"] for r in records])
    print(f"rollout throughput as the trainer sees it: {tokens:.0f} tokens/s")
    if args.compare_replicas > 1:
        compare_replicas(work, iters, args, iteration)

    import torch

    from services.trainer.modeling.model import cpu_threads

    torch.set_num_threads(cpu_threads())
    for engine in args.reference:
        progress(f"single-process reference ({engine}): {iters} iterations, {torch.get_num_threads()} torch threads")
        reference = reference_loop(cfg, iters, engine)[args.skip:]
        ref_iteration = median([r["iteration"] for r in reference])
        print(f"single-process reference, {REFERENCES[engine]}: median iteration {ref_iteration:.3f} s (" +
              ", ".join(f"{part} {median([r[part] for r in reference]):.3f} s"
                        for part in ("generate", "reward", "update", "weight sync")) + ")")
        ratio(f"dockrl / single-process reference ({REFERENCES[engine]}) iteration time", iteration / ref_iteration,
              at_most=REFERENCE_GOAL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
