"""Builds what a run needs and does not have yet: the tiny model, the demo data, the warm start,
and the tiny reward model when `reward_model` is a verifier and reward_config.load holds none.

Only for configs with an `init_model` / `arithmetic` section (the tiny CPU demo); a run on a real
checkpoint and dataset skips all of it. Each step is skipped when its output exists, so a second
`dockrl up` starts at once.
"""
from __future__ import annotations

import json
import logging
import pathlib
import time

from services.common.config import ArithmeticConfig, Config
from services.common.preprocess import PreprocessConfig, preprocess

logger = logging.getLogger("dockrl.prepare")


def prepare_run(cfg: Config) -> list[str]:
    """Makes the model and data `cfg` points at when missing; returns what it did, for the log."""
    done = []
    mt = cfg.megatron_training
    model_dir = pathlib.Path(mt.load)
    if cfg.init_model is not None and not (model_dir / "config.json").exists():
        from services.common.tiny_model import build_tiny_model

        build_tiny_model(model_dir, cfg.init_model, prompt_type=cfg.init_model.prompt_type)
        done.append(f"built tiny model in {model_dir}")
    if cfg.arithmetic is not None and not pathlib.Path(f"{mt.data_path}.jsonl").exists():
        from services.common.arithmetic_data import write_arithmetic_dataset

        paths = write_arithmetic_dataset(cfg.arithmetic.out_dir, cfg.arithmetic)
        prompt_type = cfg.init_model.prompt_type if cfg.init_model else "empty"
        targets = {"train": mt.data_path, "test": cfg.trainer.test_data_path}
        for name, prefix in targets.items():
            if prefix:
                preprocess(PreprocessConfig(input=str(paths[name]), tokenizer_name_or_path=mt.tokenizer_name_or_path,
                                            output_prefix=prefix, prompt_type=prompt_type), progress=False)
        done.append(f"wrote arithmetic data: {', '.join(f'{k} -> {v}' for k, v in targets.items() if v)}")
    reward_dir = pathlib.Path(cfg.reward_config.load)
    wants_model = cfg.reward_config.load and "reward_model" in cfg.rl_config.verifier_function
    if cfg.init_model is not None and wants_model and not (reward_dir / "config.json").exists():
        from services.common.tiny_model import build_tiny_model, fit_reward_model

        init = cfg.init_model
        build_tiny_model(reward_dir, init, prompt_type=init.prompt_type, reward=True)
        ranked = fit_reward_model(reward_dir, init.reward_fit_steps, cfg.arithmetic or ArithmeticConfig(), seed=init.seed) \
            if init.reward_fit_steps else 0.5
        done.append(f"built tiny reward model in {reward_dir} (fit {init.reward_fit_steps} steps: ranks {ranked:.0%} of answer pairs right)")
    marker = model_dir / "warm_start.json"
    if cfg.init_model is not None and cfg.init_model.warm_start_accuracy > 0 and not marker.exists():
        from services.common.arithmetic_data import arithmetic_problems
        from services.common.warm_start import ToolTeacher, WarmStartSpec, warm_start

        if cfg.arithmetic is None:
            raise ValueError("init_model.warm_start_accuracy: the warm start needs an arithmetic section for its data")
        start, init, mtc = time.monotonic(), cfg.init_model, cfg.rollout.multi_turn
        tool = ToolTeacher(init.warm_start_tool_share, mtc.tool_call_start, mtc.tool_call_end, mtc.tag_body) if init.warm_start_tool_share else None
        # a tool teacher's probe decodes whole episodes: probed less often, as each probe costs more
        spec = WarmStartSpec(target_accuracy=init.warm_start_accuracy, boxed_fraction=init.warm_start_boxed_fraction,
                             max_steps=init.warm_start_max_steps, seed=init.seed, tool=tool, eval_every=100 if tool else 25)
        result = warm_start(model_dir, arithmetic_problems(cfg.arithmetic).all, spec)
        marker.write_text(json.dumps({**result.__dict__, "seconds": round(time.monotonic() - start, 1)}))
        calls = (f"; greedy calls {result.greedy_calls:.0%}, sampled call probability {result.call_probability:.0%}, "
                 f"episodes made to call right {result.call_answered:.0%}") if tool else ""
        done.append(f"warm-started in {time.monotonic() - start:.0f} s: greedy answers right {result.answered:.0%}, "
                    f"boxed {result.boxed:.0%}, right and boxed {result.scored:.0%}{calls}")
    return done
