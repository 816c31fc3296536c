#!/usr/bin/env bash
# The checks that need an NVIDIA GPU: every `cuda` test (tests/cuda), in under 10 minutes.
# Run on a machine with a GPU and the project's CUDA environment (`pip install -e ".[cuda,dev]"`, or a .venv
# made so); extra arguments go to pytest. Without a GPU it says so and exits 1 (the tests would all skip).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'device_check: torch sees no CUDA device')"
"$PY" -c "import torch; print('device_check:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
exec timeout 600 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/cuda -rs "$@"
