"""The ready file: how a service started with port 0 tells its launcher which ports it bound.

A launcher that picked free ports itself and passed them down would race every other socket on
the machine while the service starts (vLLM takes ~30 s before it binds), so services bind port 0
and write this file once they accept calls.
"""
from __future__ import annotations

import json
import os
import pathlib


def write_ready_file(path: str | pathlib.Path, **ports: int) -> None:
    """Writes {port name: port, ..., "pid": this process} to `path` atomically (readers never see half a file)."""
    target = pathlib.Path(path)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps({**ports, "pid": os.getpid()}))
    tmp.rename(target)


def read_ready_file(path: str | pathlib.Path) -> dict[str, int] | None:
    """The ports a service wrote to `path`, or None while it has not written them."""
    target = pathlib.Path(path)
    if not target.exists():
        return None
    return json.loads(target.read_text())
