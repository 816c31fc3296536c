"""Which CPU cores a rollout engine's OpenMP threads take, agreed between the replicas of one host.

A replica that binds its engine to cores holds an exclusive `flock` on one file per core
(`<tmp>/dockrl-cores/core-<id>.lock`). The kernel drops a lock when its holder dies, however it dies, so
a crashed or killed replica never strands a core, and nothing has to be cleaned up. A replica started
with `rollout.omp_threads_bind: auto` and no binding from its launcher takes cores no other replica of
the host holds: the free ones less one left for its scheduler and API processes when at least two are
free (vLLM's own `auto` leaves one as well), or none, with a warning, when every core is held. vLLM's
own `auto` would pin every replica to the same first core, where a second replica gets almost no time
(issue 36: 0.3 s of CPU in 150 s beside a running one).

Replicas in containers with private /tmp directories do not see each other's claims; their cpusets
keep them apart.
"""
from __future__ import annotations

import fcntl
import logging
import os
import pathlib
import tempfile

from services.common.log import log_event

log = logging.getLogger("dockrl.rollout")

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
NO_BIND = "nobind"


def claims_dir() -> pathlib.Path:
    """The host's directory of core lock files (shared by every user: cores are the host's)."""
    path = pathlib.Path(tempfile.gettempdir()) / "dockrl-cores"
    path.mkdir(exist_ok=True)
    try:
        path.chmod(0o1777)
    except PermissionError:  # another user made it, with these rights
        pass
    return path


def parse_cores(bind: str) -> list[int]:
    """The core ids of a VLLM_CPU_OMP_THREADS_BIND list ("0,2-3"); [] for auto, nobind or several ranks' lists."""
    if bind in ("", "auto", NO_BIND) or "|" in bind:
        return []
    cores: list[int] = []
    for part in bind.split(","):
        low, _, high = part.partition("-")
        cores += range(int(low), int(high or low) + 1)
    return cores


def choose_cores(free: list[int]) -> list[int]:
    """The cores an `auto` replica binds to, given the cores no replica holds: all but one when two or more are
    free (that one for its scheduler and API processes), the one when one is, none when none is."""
    return free[:-1] if len(free) >= 2 else free


class CoreClaims:
    """The core locks this process holds; they last until it exits."""

    def __init__(self, directory: pathlib.Path | None = None):
        self.directory = directory or claims_dir()
        self._held: dict[int, int] = {}  # core -> file descriptor of its lock

    @property
    def cores(self) -> list[int]:
        return sorted(self._held)

    def try_claim(self, core: int) -> bool:
        """Takes core `core` unless another process holds it."""
        if core in self._held:
            return True
        fd = os.open(self.directory / f"core-{core}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._held[core] = fd
        return True

    def keep_only(self, cores: list[int]) -> None:
        """Gives back every held core not in `cores`."""
        for core in set(self._held) - set(cores):
            os.close(self._held.pop(core))


def bind_engine_cores(configured: str, claims: CoreClaims | None = None) -> CoreClaims:
    """Sets VLLM_CPU_OMP_THREADS_BIND for this replica's engine and claims its cores on the host.

    A binding from the launcher (`dockrl up` sets the variable: distinct cores per replica) or a core list in
    the config is kept, and its cores are claimed so that replicas added later keep off them; `auto` without
    one takes the cores no other replica holds (module docstring); `nobind` claims nothing.
    """
    claims = claims or CoreClaims()
    bind = os.environ.get(BIND_ENV) or configured
    if bind != "auto":
        os.environ[BIND_ENV] = bind
        taken = [core for core in parse_cores(bind) if not claims.try_claim(core)]
        if taken:
            log_event(log, "engine cores also bound by another replica", level=logging.WARNING, cores=taken)
        log_event(log, "engine cores", bind=bind)
        return claims
    affinity = sorted(os.sched_getaffinity(0))
    free = [core for core in affinity if claims.try_claim(core)]
    chosen = choose_cores(free)
    claims.keep_only(chosen)
    if chosen:
        os.environ[BIND_ENV] = ",".join(map(str, chosen))
        log_event(log, "engine cores", bind=os.environ[BIND_ENV], held_by_others=len(affinity) - len(free))
    else:
        os.environ[BIND_ENV] = NO_BIND
        log_event(log, "every core is held by another replica; the engine's threads are not bound", level=logging.WARNING,
                  cores=len(affinity))
    return claims
