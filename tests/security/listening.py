"""The TCP addresses a process tree listens on, read from the kernel (psutil), not from any config."""
from __future__ import annotations

import psutil


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(ip, port) of every listening TCP socket of `pid` and its descendants."""
    root = psutil.Process(pid)
    found = set()
    for proc in [root, *root.children(recursive=True)]:
        try:
            sockets = proc.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found |= {(s.laddr.ip, s.laddr.port) for s in sockets if s.status == psutil.CONN_LISTEN}
    return found


def all_loopback(addresses: set[tuple[str, int]]) -> bool:
    """True when every address is 127.0.0.0/8, its IPv4-mapped form (gRPC's sockets) or ::1, and there is one."""
    return bool(addresses) and all(ip.removeprefix("::ffff:").startswith("127.") or ip == "::1" for ip, _ in addresses)
