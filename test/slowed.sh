#!/usr/bin/env bash
# Run a command (by default the README's test command) with the machine slowed down: BUSY busy
# processes pinned to each core (default 2), so every test process gets about a third of a core.
# A test that passes here and as is waits for states, not for a pace (issue 35).
#   bash test/slowed.sh                      # python -m pytest -v
#   BUSY=1 bash test/slowed.sh python -m pytest test/e2e/test_cluster.py
set -euo pipefail
cd "$(dirname "$0")/.."
busy=${BUSY:-2}
pids=()
stop() { ((${#pids[@]})) && kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null || true; }
trap stop EXIT
for core in $(seq 0 $(($(nproc) - 1))); do
  for _ in $(seq "$busy"); do
    taskset -c "$core" python3 -c "while True: pass" &
    pids+=($!)
  done
done
echo "slowed: ${#pids[@]} busy processes on $(nproc) cores (pids ${pids[*]})"
if (($#)); then "$@"; else python -m pytest -v; fi
