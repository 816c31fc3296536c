#!/usr/bin/env bash
# The README's test command: installs what is missing (scripts/setup.sh, fast when done), makes
# sure Redis answers on 127.0.0.1:6379, and runs every test tier that runs on a CPU machine.
#
# With no arguments the suite runs as two pytest processes side by side (docs/testing.md: the
# compose tier, the end-to-end runs and the benchmarks' quick runs in one, every other tier in the
# other; on 2 cores a slice ran in 0.87 of its one-after-another time, because image builds and
# process start-ups leave a core idle). The second lane's output goes to
# runs/test-lanes/side.log and is printed when it ends; each lane's JUnit report lands in
# runs/test-lanes/<lane>.xml; the command fails when either lane fails.
#
# Extra arguments run one pytest with them instead (e.g. `bash scripts/test.sh tests/unit -k config`,
# or `bash scripts/test.sh -m "not deploy"` for every tier but the compose one).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/ensure_redis.sh
. .venv/bin/activate
PYTEST=(python -m pytest -q -p no:cacheprovider --durations=40)
if [ "$#" -gt 0 ]; then
    exec "${PYTEST[@]}" "$@"
fi

SIDE_LANE=(tests/deploy tests/e2e tests/service/test_bench_quick.py)
logs=runs/test-lanes
mkdir -p "$logs"
# unbuffered, so that the log shows the lane's progress as it goes
PYTHONUNBUFFERED=1 "${PYTEST[@]}" --junitxml="$logs/side.xml" "${SIDE_LANE[@]}" > "$logs/side.log" 2>&1 &
side=$!
# A background job starts with SIGINT ignored, so a Ctrl-C or SIGTERM of this script reaches the side
# lane as SIGTERM (tests/reaper.py makes pytest tear down on it as on Ctrl-C, and reap what is left).
trap 'kill -TERM "$side" 2>/dev/null; wait "$side"; exit 130' INT TERM
main_rc=0
"${PYTEST[@]}" --junitxml="$logs/main.xml" $(printf -- '--ignore=%s ' "${SIDE_LANE[@]}") tests || main_rc=$?
side_rc=0
wait "$side" || side_rc=$?
trap - INT TERM
echo "===== lane ${SIDE_LANE[*]} (exit $side_rc), from $logs/side.log ====="
cat "$logs/side.log"
echo "===== lanes: main exit $main_rc, ${SIDE_LANE[*]} exit $side_rc ====="
# pytest's exit 5 (no tests collected) fails too
[ "$main_rc" -eq 0 ] && [ "$side_rc" -eq 0 ]
