"""What a person looks at after a run: TensorBoard scalars (and W&B), a JSONL log, a PNG of the curves
and one of the run's timeline."""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import uuid

from services.common.config import config_to_dict
from services.dock.timeline import Span

CURVES = (("reward/mean", "reward mean"), ("eval/accuracy", "accuracy, prompts RL trains on"),
          ("eval/test_accuracy", "accuracy, prompts held out from RL"))
# Panels drawn only when a record holds their metric (multi-turn episodes' runs).
OPTIONAL_CURVES = (("agent/tool_call_rate", "share of episodes calling a tool"),)


TIMELINE_STAGES = (("waiting for scored groups (rollout + reward)", "timing/rollout_and_reward_s", "tab:orange"),
                   ("train", "timing/train_s", "tab:blue"), ("weight push", "timing/weight_sync_s", "tab:green"))


def draw_timeline(runs: dict[str, list[dict]], path: str | pathlib.Path, iterations: int | None = None, title: str = "") -> None:
    """The trainer's iterations laid end to end, one row per run, each split into its stages, from the
    runs' own per-step timing metrics (the first `iterations` of each; all when None). With
    rl_config.max_staleness >= 1 the wait for scored groups shrinks: rollout ran during the update and push."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 1.4 + 0.6 * len(runs)))
    for row, (label, records) in enumerate(runs.items()):
        start = 0.0
        for record in [r for r in records if "timing/iteration_s" in r][:iterations]:
            for _, key, color in TIMELINE_STAGES:
                ax.barh(row, record[key], left=start, color=color, edgecolor="white", linewidth=0.5)
                start += record[key]
    ax.set_yticks(range(len(runs)), list(runs))
    ax.invert_yaxis()
    ax.set_xlabel("seconds" + (f" (first {iterations} iterations of each run)" if iterations else ""))
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for _, _, c in TIMELINE_STAGES],
              labels=[s for s, _, _ in TIMELINE_STAGES], loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    ax.set_title(title or "trainer timeline")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# stage -> (legend, colour, row group: the trainer's rows first, then rollout, then reward)
WORKER_STAGES = {"wait": ("trainer: waiting for scored groups", "tab:orange", 0), "train": ("trainer: update", "tab:blue", 0),
                 "push": ("trainer: weight push", "tab:green", 0), "generate": ("rollout: generating a claim", "tab:purple", 1),
                 "score": ("reward: scoring a claim", "tab:red", 2)}


def draw_worker_timeline(spans: list[Span], path: str | pathlib.Path) -> list[str]:
    """One row per worker (the trainer, each rollout replica, each reward replica), a bar for every span
    it recorded in the run's timeline, at its wall-clock time: where rollout, reward and training overlap.
    Returns the rows' workers, top to bottom."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min(s.start for s in spans)
    bars: dict[str, dict[str, list[tuple[float, float]]]] = {}  # worker -> stage -> (start, width)
    for s in spans:
        if s.stage in WORKER_STAGES:
            bars.setdefault(s.worker, {}).setdefault(s.stage, []).append((s.start - origin, max(s.end - s.start, 1e-3)))
    workers = sorted(bars, key=lambda w: (min(WORKER_STAGES[stage][2] for stage in bars[w]), w))
    fig, ax = plt.subplots(figsize=(14, 1.4 + 0.5 * len(workers)))
    for row, worker in enumerate(workers):
        for stage, stage_bars in bars[worker].items():
            ax.broken_barh(stage_bars, (row - 0.35, 0.7), facecolors=WORKER_STAGES[stage][1], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(workers)), workers)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first recorded span")
    present = [stage for stage in WORKER_STAGES if any(stage in by_stage for by_stage in bars.values())]
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=WORKER_STAGES[s][1]) for s in present],
              labels=[WORKER_STAGES[s][0] for s in present], loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    ax.set_title("run timeline: rollout replicas generating, reward scoring, the trainer waiting, training and pushing")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return workers


def write_trace(spans: list[Span], path: str | pathlib.Path) -> None:
    """Writes the spans as a Chrome trace (Trace Event Format): one process per worker, one complete
    event per span, so the run can be zoomed into in Perfetto (ui.perfetto.dev) or chrome://tracing,
    down to one claim, where timeline.png shows the whole run at once."""
    workers = sorted({s.worker for s in spans}, key=lambda w: (w != "trainer", w))
    pids = {w: i + 1 for i, w in enumerate(workers)}
    events = [{"name": "process_name", "ph": "M", "pid": pids[w], "args": {"name": w}} for w in workers]
    events += [{"name": s.stage, "ph": "X", "pid": pids[s.worker], "tid": 1, "ts": round(s.start * 1e6),
                "dur": max(round((s.end - s.start) * 1e6), 1), "args": {"rows": s.rows}} for s in spans]
    pathlib.Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


class RunLog:
    """Appends one record per step to metrics.jsonl, TensorBoard and (optionally) Weights & Biases; draws
    curves.png and timeline.png at the end."""

    def __init__(self, log_dir: str | pathlib.Path, use_tensorboard: bool = True, wandb: WandbSettings | None = None):
        self.dir = pathlib.Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.dir / "metrics.jsonl"
        self.png_path = self.dir / "curves.png"
        self.timeline_path = self.dir / "timeline.png"
        self.trace_path = self.dir / "timeline.trace.json"
        self._writer = None
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.dir / "tensorboard"))
        self._wandb = wandb.start(self.dir) if wandb else None

    @classmethod
    def from_config(cls, cfg) -> RunLog:
        """The run log trainer.log_dir and rl_config's use_tensorboard / use_wandb keys describe."""
        rl = cfg.rl_config
        wandb = WandbSettings(rl.wandb_project, rl.wandb_exp_name, rl.wandb_save_dir, config=_without_secrets(cfg)) if rl.use_wandb else None
        return cls(cfg.trainer.log_dir, rl.use_tensorboard, wandb)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Records `metrics` for `step` (non-finite values are kept in JSONL as null)."""
        clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()}
        with self.jsonl_path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        if self._writer is not None:
            for key, value in clean.items():
                if value is not None:
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in clean.items() if v is not None}, step=step)

    def keep_through(self, step: int) -> int:
        """Drops metrics.jsonl's records of steps after `step` (a resumed run trains them again, so each step
        is recorded once); returns how many were dropped. TensorBoard's event files keep theirs."""
        records = self.records()
        kept = [r for r in records if r["step"] <= step]
        if len(kept) < len(records):
            self.jsonl_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        return len(records) - len(kept)

    def records(self) -> list[dict]:
        """Every record logged so far (also those of a resumed run's earlier process)."""
        if not self.jsonl_path.exists():
            return []
        return [json.loads(line) for line in self.jsonl_path.read_text().splitlines() if line.strip()]

    def plot(self, spans: list[Span] | None = None) -> pathlib.Path:
        """Draws the reward and accuracy curves into curves.png and the run's timeline into timeline.png
        (every worker's spans when given, else the trainer's stages from its records); returns curves.png's path."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = self.records()
        curves = (*CURVES, *((key, title) for key, title in OPTIONAL_CURVES if any(r.get(key) is not None for r in records)))
        fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.5))
        for ax, (key, title) in zip(axes, curves):
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", markersize=3)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.png_path, dpi=100)
        plt.close(fig)
        if spans:
            draw_worker_timeline(spans, self.timeline_path)
            write_trace(spans, self.trace_path)
        else:
            draw_timeline({"trainer": records}, self.timeline_path,
                          title="trainer timeline: each iteration's wait for scored groups, update and weight push")
        return self.png_path

    def close(self) -> None:
        """Flushes and closes the TensorBoard writer and ends the W&B run (with the pictures, when drawn)."""
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            import wandb

            pictures = {p.stem: wandb.Image(str(p)) for p in (self.png_path, self.timeline_path) if p.exists()}
            if pictures:
                self._wandb.log(pictures)
            self._wandb.finish()
            self._wandb = None


def _without_secrets(cfg) -> dict:
    """The config as plain data, its shared token and Redis password blanked: W&B stores it off the machine."""
    data = config_to_dict(cfg)
    for section, key in (("auth", "token"), ("dock", "redis_password")):
        if data[section][key]:
            data[section][key] = "(set)"
    return data


@dataclasses.dataclass(frozen=True)
class WandbSettings:
    """MindSpeed-RL's W&B keys (rl_config.wandb_*) and the run's config to record."""

    project: str
    exp_name: str = ""
    save_dir: str = ""
    config: dict = dataclasses.field(default_factory=dict)

    def start(self, log_dir: pathlib.Path):
        """Starts (or, for a resumed trainer, continues) the W&B run of `log_dir`.

        The run's id is kept in `log_dir`, so a trainer restarted with --resume appends to the same run.
        W&B's own environment applies: WANDB_MODE=offline writes locally (`wandb sync` uploads later),
        WANDB_API_KEY or `wandb login` for online runs.
        """
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError("rl_config.use_wandb: the wandb package is not installed; pip install -e '.[wandb]'") from exc
        id_file = log_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        save_dir = pathlib.Path(self.save_dir or log_dir)  # W&B writes a wandb/ folder in it
        save_dir.mkdir(parents=True, exist_ok=True)
        return wandb.init(project=self.project, name=self.exp_name or log_dir.name, dir=str(save_dir), id=run_id,
                          resume="allow", config=self.config)
