"""A local redis-server for runs whose config names none (`dock.redis_url` empty)."""
from __future__ import annotations

import pathlib
import shutil
import socket
import time

from services.launch.process_group import ProcessGroup, ProcessSpec


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_redis(group: ProcessGroup, data_dir: str | pathlib.Path, durability: bool, timeout_s: float = 10.0) -> str:
    """Starts redis-server on a free loopback port inside `group`; returns its URL once it answers."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("dock.redis_url is empty and redis-server is not installed: run scripts/setup.sh or set dock.redis_url")
    data = pathlib.Path(data_dir)
    data.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data.resolve()), "--save", ""]
    argv += ["--appendonly", "yes", "--appendfsync", "always"] if durability else ["--appendonly", "no"]
    group.start(ProcessSpec("redis", tuple(argv), stops_last=True))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"local redis-server did not answer on port {port}: {group.log_tail('redis')}")
