"""The compose tier's fixtures: one Docker host and one built image for the whole session."""
import json
import time

import pytest

from tests.deploy.docker_host import ROOT, DockerHost

TIMINGS = ROOT / "runs" / "compose_tier_timings.json"


@pytest.fixture(scope="session")
def docker_host():
    """A Docker engine with Compose, the base images and the image's wheelhouse; the time of each
    step lands in runs/compose_tier_timings.json (docs/deploy.md quotes it)."""
    host = DockerHost().start()
    try:
        host.base_images()
        host.wheelhouse()
        yield host
    finally:
        TIMINGS.parent.mkdir(exist_ok=True)
        TIMINGS.write_text(json.dumps({**host.timings, "at": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
        host.stop()


@pytest.fixture(scope="session")
def built_image(docker_host):
    """`docker compose build` of the CPU image, from the wheelhouse alone."""
    from tests.deploy.stack import Stack

    t0 = time.monotonic()
    Stack(docker_host, "dockrl-build").compose("build", timeout=2400)
    docker_host.timings["build_s"] = time.monotonic() - t0
    return docker_host
