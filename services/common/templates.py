"""Chat templates selected by `prompt_type` (configs/model/templates.json)."""
from __future__ import annotations

import functools
import json

import jinja2

from services.common.config import REPO_ROOT

TEMPLATES_PATH = REPO_ROOT / "configs" / "model" / "templates.json"


@functools.cache
def load_templates() -> dict[str, str]:
    """Every template by prompt_type name."""
    return json.loads(TEMPLATES_PATH.read_text())


def render_prompt(prompt_type: str, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """Renders `messages` with the `prompt_type` template."""
    templates = load_templates()
    if prompt_type not in templates:
        raise ValueError(f"prompt_type: {prompt_type!r} is not one of {', '.join(sorted(templates))}")
    env = jinja2.Environment(autoescape=False, keep_trailing_newline=True)
    return env.from_string(templates[prompt_type]).render(messages=messages, add_generation_prompt=add_generation_prompt)
