#!/usr/bin/env bash
# Estimate per-rank peak training memory on this machine, without GPUs or allocation:
#   ./run_memory_estimation.sh --config NAME_OR_PATH --ngpu N [--all-ac-modes] [--section.key value ...]
#   NGPU  ranks to simulate when --ngpu is not given
# Arguments are those of scripts/estimate_memory.py (see its --help); the config options are the trainer's.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")" && pwd)"
# Import the checkout's torchtitan even when it is not pip-installed.
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"

args=("$@")
gives_ngpu=false
for arg in "$@"; do
  # Whole arguments only: "--ngpu" inside a value (a description) is not the option.
  [[ "$arg" == --ngpu || "$arg" == --ngpu=* ]] && gives_ngpu=true
done
if [ -n "${NGPU:-}" ] && ! $gives_ngpu; then
  args=(--ngpu "${NGPU}" "$@")
fi
exec python "${ROOT}/scripts/estimate_memory.py" "${args[@]}"
