"""A real sandbox server as a process on loopback (`python -m services.sandbox serve --port 0`), for the sandbox's
service and escape tests: started with a config of short limits, killed with the test (and by tests/reaper.py)."""
from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
import time

from services.common.ready_file import read_ready_file

# Short limits keep the tests that hit them short.
LIMITS = {"wall_s": 2.0, "max_wall_s": 4.0, "memory_mb": 256, "output_bytes": 65536, "processes": 16,
          "file_size_mb": 1, "tmpfs_mb": 8}


@contextlib.contextmanager
def sandbox_server(tmp_path: pathlib.Path, sandbox: dict | None = None, env: dict | None = None, flags: tuple[str, ...] = (),
                   config: dict | None = None):
    """Yields (process, "127.0.0.1:port") of a sandbox server on the default config with LIMITS updated by `sandbox`
    and `config`'s other sections set (each key a --set), `env` added to its environment; stops it after."""
    sections = {**(config or {}), "sandbox": {**LIMITS, **(sandbox or {})}}
    overrides = [f"--set={section}.{key}={value}" for section, keys in sections.items() for key, value in keys.items()]
    ready = tmp_path / "sandbox-ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.sandbox", "serve", *overrides, "--port", "0", "--ready-file", str(ready), *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "DOCKRL_LOG_LEVEL": "WARNING", **(env or {})},
    )
    try:
        deadline = time.monotonic() + 60
        while (ports := read_ready_file(ready)) is None:
            if proc.poll() is not None:
                raise RuntimeError(f"sandbox server exited {proc.returncode}: {proc.stderr.read()}")
            if time.monotonic() > deadline:
                raise TimeoutError("sandbox server did not write its ready file in 60 s")
            time.sleep(0.05)
        yield proc, f"127.0.0.1:{ports['grpc_port']}"
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
