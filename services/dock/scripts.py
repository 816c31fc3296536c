"""The dock's atomic steps: Lua scripts (services/dock/lua/) registered once and run by EVALSHA.

Each script is `lib.lua` followed by its own file; redis-py sends the SHA and loads the body only
when Redis answers NOSCRIPT (first use, or after a restart / SCRIPT FLUSH). Error replies carry a
tag that `run` turns into the typed error a caller sees.
"""
from __future__ import annotations

import contextlib
import pathlib

import redis

from services.common.errors import FailedPrecondition, ResourceExhausted, Unauthenticated, Unavailable

LUA_DIR = pathlib.Path(__file__).with_name("lua")
SCRIPT_NAMES = ("create", "clear", "put", "claim", "lease", "begin_iteration", "all_consumed", "sweep", "set_version")


class StaleLease(FailedPrecondition):
    """A put / ack after the claim's lease expired or was taken over by another claim."""


class DockMissing(FailedPrecondition):
    """The run's dock is not in Redis: not created yet, or lost (a Redis restarted without AOF)."""


class WritesLost(FailedPrecondition):
    """The store holds fewer of this writer's calls than it acknowledged: a failover lost the rest.

    `stored` is how many it holds; the client puts the ones after it again (client.Dock).
    """

    def __init__(self, message: str):
        super().__init__(message)
        self.stored = int(message.split(" ", 1)[0])


_ERROR_TAGS = {
    "DOCK_NOT_CREATED": DockMissing, "DOCK_AUTH": Unauthenticated, "DOCK_STALE": StaleLease,
    "DOCK_MEMORY": ResourceExhausted, "DOCK_LOST": WritesLost,
    # Redis's own replies for states that pass (a long script running, a replica failing over):
    # callers wait and ask again, as for a lost connection, instead of dying on a raw error.
    "BUSY": Unavailable, "MASTERDOWN": Unavailable, "READONLY": Unavailable, "TRYAGAIN": Unavailable,
    "CLUSTERDOWN": Unavailable,
}


class DockScripts:
    """The registered scripts of one Redis client."""

    def __init__(self, client: redis.Redis):
        lib = (LUA_DIR / "lib.lua").read_text()
        self._client = client
        self._scripts = {name: client.register_script(lib + "\n" + (LUA_DIR / f"{name}.lua").read_text()) for name in SCRIPT_NAMES}

    def run(self, name: str, base: str, *args):
        """Runs script `name` with KEYS = [base] and ARGV = args; raises typed errors for tagged replies."""
        with redis_errors():
            return self._scripts[name](keys=[base], args=list(args))

    def run_acked(self, name: str, base: str, replicas: int, timeout_ms: int, *args) -> tuple:
        """Runs script `name` and then WAIT `replicas` `timeout_ms` on the same connection; returns (reply, replicas that acked).

        One pipeline, so the WAIT counts the replicas that hold this script's writes (WAIT waits
        for the offset of its own connection's last write). A failed script raises as in `run`.
        """
        script = self._scripts[name]
        with redis_errors():
            for _ in range(2):  # a second time after loading the script into a Redis that lacks it (a new primary)
                pipe = self._client.pipeline(transaction=False)
                pipe.evalsha(script.sha, 1, base, *args)
                pipe.execute_command("WAIT", replicas, timeout_ms)
                reply, acked = pipe.execute(raise_on_error=False)
                if not isinstance(reply, redis.exceptions.NoScriptError):
                    break
                self._client.script_load(script.script)
        if isinstance(reply, redis.ResponseError):
            raise_tagged(reply)
            raise reply
        if isinstance(acked, Exception):
            raise acked
        return reply, acked


def execute(pipe: redis.client.Pipeline) -> list:
    """Runs a pipeline; the first failed command raises (typed when it is a tagged dock error)."""
    with redis_errors():
        results = pipe.execute(raise_on_error=False)
    for result in results:
        if isinstance(result, redis.ResponseError):
            raise_tagged(result)
        if isinstance(result, Exception):
            raise result
    return results


def raise_tagged(exc: redis.ResponseError) -> None:
    """Raises the typed error of a tagged dock reply or a passing Redis state; returns for any other error."""
    tag, _, message = str(exc).partition(" ")
    if tag in _ERROR_TAGS:
        raise _ERROR_TAGS[tag](message if tag.startswith("DOCK_") else f"redis: {exc}") from None


@contextlib.contextmanager
def redis_errors():
    """Turns redis-py's connection and authentication failures, tagged dock replies and passing Redis
    states (BUSY, ...) into typed errors; any other reply error is raised as it is."""
    try:
        yield
    except redis.AuthenticationError as exc:
        raise Unauthenticated(f"redis refused the credentials (dock.redis_username / redis_password): {exc}") from None
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise Unavailable(f"redis: {exc}") from None
    except redis.ResponseError as exc:
        raise_tagged(exc)
        raise
