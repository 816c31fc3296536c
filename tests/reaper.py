"""Nothing a test session starts outlives it, however pytest ends: normally, by Ctrl-C, SIGTERM or SIGKILL.

Each pytest process starts a watchdog of its own, in a session of its own so
that a Ctrl-C to the terminal's process group does not reach it. While pytest lives, the watchdog
remembers every descendant it has seen (once a second, by pid and start time: a server that
starts in a session of its own and whose parent is then killed is re-parented to init, and nothing
else then ties it to the test run). Every process pytest starts also inherits a token in its
environment (`MARK`), which catches one started just before the end; processes that rewrite their
title (redis-server, vLLM's engine) overwrite the environment block the kernel shows, which is why
the token alone is not enough; and as pytest ends normally or by Ctrl-C it hands the watchdog
the processes it has running then (`hand_over`). (So after a SIGKILL, a process that started in
pytest's last second and rewrote its title is the one that can escape.) When pytest has ended (a
pidfd: the kernel wakes the watchdog), the watchdog stops every remembered or marked process and their children, runs the commands tests
registered for that moment (`on_death`: a compose project's containers, which inherit nothing from
this process tree), and SIGKILLs them all.

SIGTERM to pytest is turned into a KeyboardInterrupt, so that a terminated run tears its fixtures
down as Ctrl-C does; the watchdog then removes whatever a teardown did not.
"""
from __future__ import annotations

import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import tempfile
import uuid

MARK = "TEST_SESSION_REAPER_ID"
_DEATH_COMMANDS = "REAPER_DEATH_COMMANDS"
_watchdog: subprocess.Popen | None = None
SCAN_S = 1.0  # how often the watchdog remembers pytest's descendants (about 5 ms of CPU a scan)


def start() -> str:
    """Marks this process's environment with a fresh token, turns SIGTERM into Ctrl-C and starts the
    watchdog; returns the token."""
    token = uuid.uuid4().hex
    commands = pathlib.Path(tempfile.gettempdir()) / f"reaper-{token}.jsonl"
    os.environ[MARK] = token
    os.environ[_DEATH_COMMANDS] = str(commands)
    env = {k: v for k, v in os.environ.items() if k != MARK}
    global _watchdog
    _watchdog = subprocess.Popen([sys.executable, __file__, token, str(os.getpid()), str(commands)], env=env,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)
    signal.signal(signal.SIGTERM, _interrupt)
    return token


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def on_death(argv: list[str]) -> None:
    """Registers a command the watchdog runs when this test process has ended, for what it started
    outside its process tree (containers); run before the remaining processes are killed."""
    path = os.environ.get(_DEATH_COMMANDS)
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(argv) + "\n")


def hand_over() -> None:
    """Tells the watchdog every process this pytest has running now, as it ends (normally or by Ctrl-C / SIGTERM):
    one started since the watchdog's last look, whose environment block a title overwrote, is found too."""
    path = os.environ.get(_DEATH_COMMANDS)
    if not path or _watchdog is None:
        return
    table = process_table()
    alive = _descendants(table, {os.getpid()}) - {_watchdog.pid}
    pathlib.Path(path).with_suffix(".pids").write_text("".join(f"{p} {table[p][1]}\n" for p in alive if p in table))


def process_table() -> dict[int, tuple[int, int, str]]:
    """Every live process: pid -> (parent pid, start time in clock ticks, state)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        table[int(entry)] = (int(fields[1]), int(fields[19]), fields[0])
    return table


def marked(token: str) -> list[int]:
    """The pids of live processes whose environment block still shows `token` (this process excluded)."""
    needle = f"{MARK}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone meanwhile, or a kernel thread
            continue
    return found


def _descendants(table: dict[int, tuple[int, int, str]], roots: set[int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _signal_all(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reap(token: str, seen: dict[int, int], commands: pathlib.Path) -> None:
    me = os.getpid()
    handed = commands.with_suffix(".pids")
    if handed.exists():
        seen = {**seen, **{int(p): int(s) for p, s in (line.split() for line in handed.read_text().splitlines())}}
        handed.unlink()
    targets: set[int] = set()
    for _ in range(3):  # stop what is found, then look again for children started meanwhile
        table = process_table()
        found = {p for p, start in seen.items() if table.get(p, (0, -1, ""))[1] == start} | set(marked(token))
        found |= _descendants(table, found)
        found.discard(me)
        _signal_all(found - targets, signal.SIGSTOP)
        if found <= targets:
            break
        targets |= found
    if commands.exists():
        for line in commands.read_text().splitlines():
            subprocess.run(json.loads(line), capture_output=True, timeout=120)
        commands.unlink()
    _signal_all(targets, signal.SIGKILL)


def _watch(token: str, pid: int, commands: pathlib.Path) -> None:
    seen: dict[int, int] = {}
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # pytest already gone
        fd = None
    me = os.getpid()
    while fd is not None:
        table = process_table()
        seen = {p: s for p, s in seen.items() if table.get(p, (0, -1, ""))[1] == s}  # forget the dead
        seen.update((p, table[p][1]) for p in _descendants(table, {pid}) if p != me)
        if select.select([fd], [], [], SCAN_S)[0]:
            break
    _reap(token, seen, commands)


if __name__ == "__main__":
    _watch(sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3]))
