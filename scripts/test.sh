#!/usr/bin/env bash
# The README's test command: installs what is missing (scripts/setup.sh, fast when done), makes
# sure Redis answers on 127.0.0.1:6379, and runs every test tier that runs on a CPU machine.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/unit -k config`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/ensure_redis.sh
. .venv/bin/activate
exec python -m pytest -q -p no:cacheprovider --durations=40 "$@"
