

def test_update_config_reads_the_run_config():
    from services.common.config import DEFAULT_CONFIG, load_config

    cfg = load_config(DEFAULT_CONFIG, ["rl_config.clip_higher_enable=true", "rl_config.use_remove_padding=true"])
    update = UpdateConfig.from_config(cfg)
    assert update.mini_batch_size == cfg.samples_per_iteration  # derived at load: GBS * n
    assert (update.loss.clip_ratio_low, update.loss.clip_ratio_high) == (0.2, 0.28)
    assert update.forward.use_remove_padding and update.forward.micro_batch_size == 16
