"""dockrl's trainer step vs. a plain transformers forward + backward + AdamW on the same batch.

Both start from the same weights (the tiny demo model: configs/tiny_cpu.yaml's shapes and
settings, without the warm start) and train on the same GRPO batch: GBS 16 prompts x n 8 samples
of the demo's data, response lengths drawn uniformly from 4 to the config's max_tokens, rewards
drawn 0/1, fp32.

- dockrl: `TrainerSession.train_step`, what the driver times as `timing/train_s` (the
  train/rollout log-prob agreement, advantages, the update on megatron-core's GPTModel).
- plain: transformers' `Qwen2ForCausalLM` (SDPA attention), the same micro-batches, the same
  clipped GRPO loss in a few lines of PyTorch, `clip_grad_norm_` and `torch.optim.AdamW` with
  the config's learning rate, betas and clipping: the step a single-process loop would write.

One step of each from the same weights comes first: their losses and clipped gradients must
agree (printed), so both paths do the same work. Then both are timed, interleaved, and the
ratio dockrl / plain is the median of the per-repetition ratios (issue 24's goal: <= 1.3).
`--profile` then shows where dockrl's step spends its time (torch.profiler, grouped by part).

    python bench/bench_trainer_step.py --quick
    python bench/bench_trainer_step.py
    python bench/bench_trainer_step.py --profile
"""
from __future__ import annotations

import contextlib
import importlib
import random
import sys
import time

import numpy as np
import torch

from common import REPO, interleaved, machine_line, median, paired, parser, progress, ratio, work_dir

GOAL = 1.3
MIN_RESPONSE = 4

# --profile: the parts of dockrl's step, as (module, object, attribute, label); a part nested in
# another is listed after it and printed indented.
PARTS = (
    ("services.trainer.algorithm.estimators.interface", None, "compute_logprobs", "no-grad log-prob pass"),
    ("services.trainer.loop.session", None, "compute_logprobs", "no-grad log-prob pass"),
    ("services.trainer.algorithm.update", None, "compute_logprobs", "no-grad log-prob pass"),
    ("services.trainer.modeling.model_inputs", "ModelInputs", "run", "model forward"),
    ("services.trainer.modeling.attention", "SDPACoreAttention", "forward", "  SDPA core attention (forward)"),
    ("services.trainer.modeling.logprobs", None, "model_inputs", "padding to model inputs"),
    ("services.trainer.modeling.logprobs", None, "response_stats", "log-probs + entropy from logits"),
    ("services.trainer.algorithm.update", None, "policy_loss", "loss"),
    ("torch", "Tensor", "backward", "backward"),
    ("megatron.core.distributed", None, "finalize_model_grads", "gradient reduction (megatron DDP)"),
    ("megatron.core.optimizer.optimizer", "ChainedOptimizer", "step", "clipping + optimizer (megatron Adam)"),
    ("services.trainer.algorithm.estimators.group_norm", None, "group_norm_advantages", "advantages"),
)


def tiny_config(work):
    """configs/tiny_cpu.yaml with its model and data under `work`, no warm start, evaluation or checkpoints."""
    from services.common.config import load_config

    return load_config(REPO / "configs/tiny_cpu.yaml", [
        f"megatron_training.load={work}/model", f"megatron_training.tokenizer_name_or_path={work}/model",
        f"megatron_training.data_path={work}/data/train", "megatron_training.save=", f"arithmetic.out_dir={work}/raw",
        f"trainer.log_dir={work}/logs", "trainer.eval_data_path=", "trainer.test_data_path=",
        "init_model.warm_start_accuracy=0", "trainer.grpc_port=0",
    ])


def scored_batch(cfg, prompts, seed: int):
    """GBS groups of n samples on the data's prompts: random response tokens and 0/1 rewards, rollout log-probs -1."""
    from services.dock.rows import ScoredSample
    from services.trainer.loop.iteration_data import ScoredBatch

    rng = random.Random(seed)
    n, max_tokens = cfg.rl_config.n_samples_per_prompt, cfg.generate_config.sampling_config.max_tokens
    batch = ScoredBatch()
    for _ in range(cfg.megatron_training.global_batch_size):
        prompt = np.asarray(rng.choice(prompts).prompt_ids, dtype=np.int32)
        for _ in range(n):
            length = rng.randint(MIN_RESPONSE, max_tokens)
            batch.indexes.append(len(batch.indexes))
            batch.samples.append(ScoredSample(prompt, np.array([rng.randrange(256) for _ in range(length)], np.int32),
                                              float(rng.random() < 0.5), np.full(length, -1.0, np.float32),
                                              np.zeros(length, np.int32), None, None, None))
    return batch


class PlainStep:
    """The same GRPO step written on transformers and torch alone, as a single-process loop would."""

    def __init__(self, hf_dir, cfg):
        from transformers import AutoModelForCausalLM

        mt, rl = cfg.megatron_training, cfg.rl_config
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=mt.lr, betas=(mt.adam_beta1, mt.adam_beta2),
                                           eps=mt.adam_eps, weight_decay=mt.weight_decay)
        self.n, self.clip, self.clip_grad, self.micro = rl.n_samples_per_prompt, rl.clip_ratio, mt.clip_grad, mt.micro_batch_size
        self.loss = 0.0

    def __call__(self, batch) -> None:
        """One optimizer step on `batch` (a ScoredBatch): group-normalised advantages, clipped loss over micro-batches."""
        rewards = torch.tensor(batch.scores).view(-1, self.n)
        advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
        tokens = sum(batch.response_lengths)
        self.optimizer.zero_grad(set_to_none=True)
        self.loss = 0.0
        for start in range(0, len(batch), self.micro):
            rows = range(start, min(len(batch), start + self.micro))
            seqs = [batch.samples[i].prompt_ids.tolist() + batch.samples[i].response_ids.tolist() for i in rows]
            ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
            mask = torch.zeros(len(seqs), ids.size(1) - 1)
            for j, (i, seq) in enumerate(zip(rows, seqs)):
                ids[j, : len(seq)] = torch.tensor(seq)
                mask[j, len(batch.samples[i].prompt_ids) - 1: len(seq) - 1] = 1.0  # positions predicting a response token
            logits = self.model(input_ids=ids).logits[:, :-1].float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            ratio = torch.exp(logp - logp.detach())
            adv = advantages[list(rows)].unsqueeze(1)
            per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - self.clip, 1 + self.clip))
            loss = (per_token * mask).sum() / tokens
            loss.backward()
            self.loss += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)
        self.optimizer.step()


def hf_gradients(session) -> dict[str, torch.Tensor]:
    """dockrl's last step's (clipped) gradients in HF names (megatron's DDP keeps them in `main_grad`)."""
    from services.trainer.modeling.checkpoint_convert import megatron_to_hf

    grads = {name: p.main_grad for name, p in session.model.named_parameters()}
    return megatron_to_hf({(0, 0): grads}, session.layout)


def check_same_step(session, plain: PlainStep, batch) -> None:
    """Runs one step of each from the same weights; prints the loss and gradient agreement, raises when they differ."""
    metrics = session.train_step(batch, 1)
    plain(batch)
    ours = hf_gradients(session)
    theirs = {name: p.grad for name, p in plain.model.named_parameters()}
    scale = max(float(g.abs().max()) for g in theirs.values())
    worst = max(float((ours[name] - theirs[name]).abs().max()) for name in theirs)
    print(f"same step: loss dockrl {metrics['actor/pg_loss']:.6f} vs plain {plain.loss:.6f}; "
          f"max |gradient difference| {worst:.2e} (largest gradient {scale:.2e})")
    if abs(metrics["actor/pg_loss"] - plain.loss) > 1e-5 or worst > 1e-4 * scale:
        raise SystemExit("the two steps differ: the comparison would not be of the same work")


@contextlib.contextmanager
def parts_recorded():
    """Wraps each of PARTS in a torch.profiler record_function range while inside."""
    from torch.profiler import record_function

    undo = []
    for module_name, owner_name, attr, label in PARTS:
        owner = importlib.import_module(module_name)
        owner = getattr(owner, owner_name) if owner_name else owner
        original = getattr(owner, attr)

        def wrapped(*args, _original=original, _label=label.strip(), **kwargs):
            with record_function(_label):
                return _original(*args, **kwargs)

        setattr(owner, attr, wrapped)
        undo.append((owner, attr, original))
    try:
        yield
    finally:
        for owner, attr, original in reversed(undo):
            setattr(owner, attr, original)


def profile_step(session, batch, steps: int) -> None:
    """Prints ms per step of each part of dockrl's step and of the weight gather, and the top operators."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with parts_recorded(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            with record_function("train step"):
                session.train_step(batch, 2 + i)
            with record_function("weight gather"):
                session.take_part_in_weight_gather()
    totals = {e.key: e.cpu_time_total / 1e3 / steps for e in prof.key_averages()}
    step = totals["train step"]
    print(f"\nwhere dockrl's step goes (torch.profiler, {steps} steps, ms per step; the profiler adds its own overhead):")
    print(f"{'part':<40}{'ms':>9}{'share':>8}")
    seen = set()
    for *_, label in PARTS:
        if label in seen:
            continue
        seen.add(label)
        ms = totals.get(label.strip(), 0.0)
        print(f"{label:<40}{ms:>9.1f}{ms / step:>8.1%}")
    print(f"{'train step (all of it)':<40}{step:>9.1f}{1:>8.1%}")
    print(f"{'weight gather (after the step)':<40}{totals['weight gather']:>9.1f}")
    print("\ntop operators by self CPU time:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))


def main() -> int:
    p = parser(__doc__, "3 repetitions instead of 15")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads for both paths (default 0: what the trainer picks)")
    p.add_argument("--profile", action="store_true", help="also profile dockrl's step with torch.profiler")
    args = p.parse_args()
    reps = args.reps or (3 if args.quick else 15)

    from services.common.prompt_file import read_prompt_file
    from services.launch.prepare import prepare_run
    from services.trainer.modeling.model import cpu_threads
    from services.trainer.loop.session import TrainerSession

    torch.set_num_threads(args.threads or cpu_threads())
    work = work_dir("trainer-step")
    cfg = tiny_config(work)
    prepare_run(cfg)
    prompts = read_prompt_file(cfg.megatron_training.data_path, "megatron_training.data_path").records
    batch = scored_batch(cfg, prompts, seed=0)
    progress(f"batch: {len(batch)} samples, {sum(batch.response_lengths)} response tokens, "
             f"{sum(batch.prompt_lengths) + sum(batch.response_lengths)} tokens; "
             f"micro-batches of {cfg.megatron_training.micro_batch_size}; {torch.get_num_threads()} torch threads")
    session = TrainerSession.start(cfg, "", len(prompts), port=0)
    plain = PlainStep(cfg.megatron_training.load, cfg)
    try:
        check_same_step(session, plain, batch)

        def dockrl_step() -> float:
            start = time.perf_counter()
            session.train_step(batch, 2)
            return time.perf_counter() - start

        def plain_step() -> float:
            start = time.perf_counter()
            plain(batch)
            return time.perf_counter() - start

        def gather() -> float:
            start = time.perf_counter()
            session.take_part_in_weight_gather()
            return time.perf_counter() - start

        times = interleaved({"dockrl": dockrl_step, "plain": plain_step, "gather": gather}, reps, warmups=2, label="steps: ")
        print(machine_line())
        print(f"median step: dockrl {median(times['dockrl']):.3f} s, plain {median(times['plain']):.3f} s; "
              f"weight gather for the push {median(times['gather']) * 1e3:.1f} ms")
        ratio("dockrl / plain train step time", paired(times, "dockrl", "plain"), at_most=GOAL)
        if args.profile:
            profile_step(session, batch, steps=max(3, reps // 3))
    finally:
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
