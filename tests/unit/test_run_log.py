"""Run metrics land where a person looks: JSONL, TensorBoard scalars and a PNG."""
import json

from services.trainer.loop.run_log import RunLog


def test_run_log_writes_jsonl_tensorboard_and_png(tmp_path):
    log = RunLog(tmp_path)
    for step in range(1, 4):
        log.log(step, {"reward/mean": 0.1 * step, "eval/accuracy": 0.2 * step, "loss": float("nan")})
    png = log.plot()
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["reward/mean"] == 0.30000000000000004 and rows[0]["loss"] is None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [round(e.value, 5) for e in acc.Scalars("eval/accuracy")] == [0.2, 0.4, 0.6]
    assert "loss" not in acc.Tags()["scalars"]
