"""Reading a config: the YAML file (either layout), `DOCKRL__SECTION__KEY` environment variables and
`--set section.key=value` overrides, parsed into a validated Config; and a Config back to plain data."""
from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import typing
from typing import Any

import yaml

from services.common.config.checks import _derive_dispatch_sizes, _validate
from services.common.config.root import Config, ConfigError
from services.common.config.types import parse_section
from services.common.mindspeed_layout import Translation, load_translated

log = logging.getLogger("dockrl.config")
REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny_cpu.yaml"


def _apply_override(data: dict, override: str) -> None:
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError([f"--set {override!r}: expected section.key=value"])
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError([f"{key}: {part} is not a section"])
    # `key=` means the empty string (YAML would read it as null).
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""


def parse_dataclass(cls: type, data: dict, path: str = ""):
    """Builds any config section (`config_section`) from a mapping with the same checks as the run config."""
    if not isinstance(data, dict):
        raise ConfigError([f"{path or cls.__name__}: expected a mapping, got {type(data).__name__}"])
    value, errors = parse_section(cls, data, path)
    if errors:
        raise ConfigError(errors)
    return value


def config_from_dict(data: dict, overrides: typing.Sequence[str] = ()) -> Config:
    """Builds and validates a Config from a parsed YAML mapping plus `section.key=value` overrides."""
    data = dict(data or {})
    for override in overrides:
        _apply_override(data, override)
    cfg, errors = parse_section(Config, data)
    if not errors:
        cfg = _derive_dispatch_sizes(cfg, errors)
        _validate(cfg, errors)
    if errors:
        raise ConfigError(errors)
    return cfg


ENV_PREFIX = "DOCKRL__"


def env_overrides(environ: typing.Mapping[str, str] | None = None) -> list[str]:
    """`DOCKRL__SECTION__KEY=value` environment variables as `section.key=value` overrides.

    Containers configure services this way (compose, Kubernetes); sections nest with `__`.
    """
    environ = os.environ if environ is None else environ
    return [
        f"{name[len(ENV_PREFIX):].lower().replace('__', '.')}={value}"
        for name, value in sorted(environ.items())
        if name.startswith(ENV_PREFIX) and len(name) > len(ENV_PREFIX)
    ]


def load_config(path: str | pathlib.Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Loads a YAML config file (default: the embedded tiny CPU config).

    Precedence: the file, then `DOCKRL__SECTION__KEY` environment variables, then `overrides`.
    """
    return config_from_translation(read_config_file(path), [*env_overrides(), *overrides])


def config_from_translation(translation: Translation, overrides: typing.Sequence[str] = ()) -> Config:
    """Builds and validates the Config a read file (`read_config_file`) describes, logging each MindSpeed-RL
    layout change; the translation's errors and the config's are reported together."""
    for change in translation.changes:
        log.info("MindSpeed-RL layout: %s", change)
    try:
        cfg = config_from_dict(translation.data, overrides)
    except ConfigError as exc:
        raise ConfigError([*translation.errors, *exc.errors]) from None
    if translation.errors:
        raise ConfigError(translation.errors)
    return cfg


def read_config_file(path: str | pathlib.Path | None = None) -> Translation:
    """The YAML at `path` (default: the embedded tiny CPU config) in dockrl's layout: a file in MindSpeed-RL's
    layout comes back translated, with its changes and the keys that cannot run (docs/config.md)."""
    path = pathlib.Path(path) if path else DEFAULT_CONFIG
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError([f"{path}: no such config file"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError([f"{path}: the top level must be a mapping of sections"])
    return load_translated(data or {}, path)


def config_to_dict(cfg: Config) -> dict:
    """The config as plain data (for logs and for passing to child processes as YAML)."""
    def plain(value: Any) -> Any:
        if isinstance(value, tuple):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value
    return plain(dataclasses.asdict(cfg))
