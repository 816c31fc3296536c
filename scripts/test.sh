#!/usr/bin/env bash
# The README's test command: installs what is missing (scripts/setup.sh, fast when done), makes
# sure Redis answers on 127.0.0.1:6379, and runs every test tier that runs on a CPU machine.
#
# One pytest process, tier after tier: two side by side on CI's 2 cores overlapped little (61 min against
# 65 min one after the other) and let the load of one lane fail timing-sensitive tests of the other
# (docs/testing.md).
#
# Arguments replace `tests` (e.g. `bash scripts/test.sh tests/unit -k config`, or `bash scripts/test.sh
# -m "not deploy"` for every tier but the compose one). The JUnit report (each test's time) lands in
# runs/junit.xml.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/ensure_redis.sh
. .venv/bin/activate
# pytest's exit 5 (no tests collected) fails too
exec python -m pytest -q -p no:cacheprovider --durations=40 --junitxml=runs/junit.xml "${@:-tests}"
