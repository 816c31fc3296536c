#!/usr/bin/env bash
# The README's test command: every test tier that runs on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
exec python -m pytest -q -p no:cacheprovider "$@"
