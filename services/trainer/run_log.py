"""What a person looks at after a run: TensorBoard scalars, a JSONL log and a PNG of the curves."""
from __future__ import annotations

import json
import math
import pathlib

CURVES = (("reward/mean", "reward mean"), ("eval/accuracy", "accuracy, prompts RL trains on"),
          ("eval/test_accuracy", "accuracy, prompts held out from RL"))


class RunLog:
    """Appends one record per step to metrics.jsonl and TensorBoard; draws curves.png at the end."""

    def __init__(self, log_dir: str | pathlib.Path, use_tensorboard: bool = True):
        self.dir = pathlib.Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.dir / "metrics.jsonl"
        self.png_path = self.dir / "curves.png"
        self._writer = None
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.dir / "tensorboard"))

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

    def records(self) -> list[dict]:
        """Every record logged so far (also those of a resumed run's earlier process)."""
        if not self.jsonl_path.exists():
            return []
        return [json.loads(line) for line in self.jsonl_path.read_text().splitlines() if line.strip()]

    def plot(self) -> pathlib.Path:
        """Draws the reward and accuracy curves into curves.png and returns its path."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = self.records()
        fig, axes = plt.subplots(1, len(CURVES), figsize=(5 * len(CURVES), 3.5))
        for ax, (key, title) in zip(axes, CURVES):
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
        return self.png_path

    def close(self) -> None:
        """Flushes and closes the TensorBoard writer."""
        if self._writer is not None:
            self._writer.close()
