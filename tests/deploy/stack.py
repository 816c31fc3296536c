"""One compose project of deploy/docker-compose.yml, driven the way the README tells a user to."""
from __future__ import annotations

import pathlib
import re
import secrets
import subprocess
import tempfile
import time

import pytest

from tests import reaper
from tests.conftest import free_port
from tests.deploy.docker_host import ROOT, DockerHost

COMPOSE_FILE = "deploy/docker-compose.yml"


class Stack:
    """A compose project with its own name, secrets, host ports and key overrides (`overrides`
    become DOCKRL__SECTION__KEY lines of the project's env file)."""

    def __init__(self, host: DockerHost, project: str, overrides: dict[str, str] | None = None):
        self.project = project
        self.http_port, self.grpc_port = free_port(), free_port()
        self.token = secrets.token_hex(8)
        self._env_file = tempfile.NamedTemporaryFile("w", prefix=f"{project}-", suffix=".env", delete=False)
        self._env_file.write("".join(f"{key}={value}\n" for key, value in (overrides or {}).items()))
        self._env_file.close()
        self.env = {**host.env, "DOCKRL_REDIS_PASSWORD": secrets.token_hex(8), "DOCKRL_TOKEN": self.token,
                    "DOCKRL_WHEELS_ONLY": "1", "DOCKRL_HTTP_PORT": str(self.http_port),
                    "DOCKRL_GRPC_PORT": str(self.grpc_port), "DOCKRL_ENV_FILE": self._env_file.name}
        # containers inherit nothing from this process: if it dies before `down`, its watchdog removes them
        reaper.on_death(["sh", "-c", "docker ps -aq --filter label=com.docker.compose.project=$0 | xargs -r docker rm -f -v",
                         project])

    def argv(self, *args: str) -> list[str]:
        return ["docker", "compose", "-p", self.project, "-f", COMPOSE_FILE, *args]

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(self.argv(*args), cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            pytest.fail(f"docker compose {' '.join(args)} failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
        return done

    def start(self, *args: str) -> subprocess.Popen:
        """`docker compose ARGS` in the background (for a command that blocks until the run ends); output to a
        file named by `.output_path`."""
        self.output_path = pathlib.Path(self._env_file.name).with_suffix(".out")
        with open(self.output_path, "w") as out:
            return subprocess.Popen(self.argv(*args), cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service).stdout

    def copy_out(self, service: str, path: str, dest: pathlib.Path) -> pathlib.Path:
        """`docker compose cp` from a (possibly stopped) container of `service`."""
        self.compose("cp", f"{service}:{path}", str(dest))
        return dest

    def wait_http(self, path: str, timeout_s: float, alive: subprocess.Popen | None = None) -> None:
        """Waits until the host's HTTP address answers `path`; fails at `timeout_s`, or when `alive` (the `up`) has ended."""
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while True:
            if alive is not None and alive.poll() is not None:
                pytest.fail(f"docker compose up ended ({alive.returncode}) before {path} answered:\n"
                            + self.output_path.read_text()[-4000:])
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=5)
                return
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"nothing answered on 127.0.0.1:{self.http_port}{path} in {timeout_s:.0f} s\n"
                                + self.compose("ps", "-a", check=False).stdout)
                time.sleep(2)

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "-t", "20", check=False, timeout=300)
        pathlib.Path(self._env_file.name).unlink(missing_ok=True)
        pathlib.Path(self._env_file.name).with_suffix(".out").unlink(missing_ok=True)


def per_replica(logs: str, pattern: str) -> dict[str, list[re.Match]]:
    """Matches of `pattern` in `docker compose logs` output, grouped by the container's prefix
    (`rollout-1`, `rollout-2`, ...)."""
    found: dict[str, list[re.Match]] = {}
    for line in logs.splitlines():
        prefix, _, text = line.partition("|")
        match = re.search(pattern, text)
        if match:
            found.setdefault(prefix.strip(), []).append(match)
    return found
