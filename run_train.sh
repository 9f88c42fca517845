#!/usr/bin/env bash
# Train on this node with torchrun: ./run_train.sh [--config NAME_OR_PATH] [--section.key value ...]
#   NGPU      processes to start (default: visible GPUs, or 1 without any)
#   LOG_RANK  ranks whose output is shown, comma-separated (default: 0)
#   CONFIG_FILE  config used when --config is not given (default: debug_model.toml)
#   TORCHTITAN_STOP_DEADLINE_SECONDS  after a SIGTERM, how long the ranks have to finish their
#             step and save before they are killed (default 900; see torchtitan/launch.py)
set -euo pipefail
# Import the checkout's torchtitan even when it is not pip-installed.
export PYTHONPATH="$(cd "$(dirname "$0")" && pwd)${PYTHONPATH:+:${PYTHONPATH}}"

if [ -z "${NGPU:-}" ]; then
  NGPU=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 1)")
fi
LOG_RANK=${LOG_RANK:-0}

# Check the config, and build the model for NGPU ranks on the meta device, once, here: under
# torchrun a mistake fails on every rank and comes back as torchrun's ChildFailedError
# (exit 1) instead of one line and exit code 2.
if [[ $NGPU =~ ^[0-9]+$ ]] && [ "$NGPU" -gt 0 ]; then
  python -m torchtitan.preflight --errors-only --world-size "$NGPU" "$@" || exit $?
else
  python -m torchtitan.config.check --errors-only "$@" || exit $?  # the launcher names a bad NGPU
fi

exec python -m torchtitan.launch --nproc_per_node="${NGPU}" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
  --local-ranks-filter "${LOG_RANK}" --role rank --tee 3 \
  -m torchtitan.train "$@"
