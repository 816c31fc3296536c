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


def _wandb_history(path) -> list[dict]:
    """The history rows of a W&B run file (its LevelDB-style log of Record protobufs; wandb 0.31 has no reader of its own)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending, rows = path.read_bytes(), 32768, 7, b"", []  # 7: the ":W&B" header
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])  # after a CRC32: length, then full/first/middle/last
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows


def test_wandb_offline_run_holds_every_step_and_a_resumed_trainer_continues_the_same_run(tmp_path, monkeypatch):
    from services.common.config import load_config

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, [f"trainer.log_dir={tmp_path / 'run'}", "rl_config.use_wandb=true",
                             "rl_config.wandb_project=dockrl-test", "rl_config.use_tensorboard=false", "auth.token=s3cret-token"])
    log = RunLog.from_config(cfg)
    for step in (1, 2):
        log.log(step, {"reward/mean": 0.25 * step, "loss": float("nan")})
    log.plot()
    log.close()
    resumed = RunLog.from_config(cfg)  # a trainer restarted with --resume on the same log_dir
    resumed.log(3, {"reward/mean": 0.75})
    resumed.close()
    # W&B's service process writes the run file behind finish(); a trainer's exit flushes it, here teardown does
    import wandb
    wandb.teardown()
    files = sorted((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    run_id = (tmp_path / "run" / "wandb_run_id").read_text()
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files)
    rows = [row for f in files for row in _wandb_history(f)]
    assert [(r["_step"], r["reward/mean"]) for r in rows if "reward/mean" in r] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert not any("loss" in r for r in rows)  # a non-finite value is left out, as in TensorBoard
    raw = b"".join(f.read_bytes() for f in files)
    assert b"max_staleness" in raw and b"s3cret-token" not in raw  # the run's config is there, its token is not
    # the pictures, as W&B images, at the end of the first process
    assert any(r.get("curves/_type") == r.get("timeline/_type") == "image-file" for r in rows)


def test_a_resumed_run_keeps_each_step_once_and_its_summary_line_counts_its_own_steps(tmp_path, capsys):
    log = RunLog(tmp_path, use_tensorboard=False)
    log.log(0, {"eval/accuracy": 0.25})  # the original run's "before" evaluation
    for step in range(1, 6):  # the checkpoint holds step 3; steps 4 and 5 were recorded, then the trainer died
        log.log(step, {"reward/mean": 0.1 * step})
    assert log.keep_through(3) == 2 and log.keep_through(3) == 0
    log.log(4, {"reward/mean": 0.9})
    assert [r["step"] for r in log.records()] == [0, 1, 2, 3, 4]

    from services.launch.up import _print_summary

    (tmp_path / "summary.json").write_text(json.dumps({"steps": 6, "accounting": {"rows_trained": 384, "rows_dropped": 0, "from_step": 4}}))
    _print_summary(tmp_path)
    assert capsys.readouterr().out.startswith("steps 4-6, 384 samples trained, 0 dropped")


def test_curves_get_a_tool_call_rate_panel_only_when_the_run_logs_it(tmp_path):
    widths = []
    for name, extra in (("single", {}), ("agent", {"agent/tool_call_rate": 0.5})):
        log = RunLog(tmp_path / name, use_tensorboard=False)
        log.log(1, {"reward/mean": 0.1, **extra})
        png = log.plot().read_bytes()
        log.close()
        widths.append(int.from_bytes(png[16:20], "big"))  # the IHDR width: 5 inches (500 px) a panel
    assert widths == [1500, 2000]
