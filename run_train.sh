#!/usr/bin/env bash
# Train on this node with torchrun: ./run_train.sh [--config NAME_OR_PATH] [--section.key value ...]
#   NGPU      processes to start (default: visible GPUs, or 1 without any)
#   LOG_RANK  ranks whose output is shown, comma-separated (default: 0)
#   CONFIG_FILE  config used when --config is not given (default: debug_model.toml)
set -euo pipefail
# Import the checkout's torchtitan even when it is not pip-installed.
export PYTHONPATH="$(cd "$(dirname "$0")" && pwd)${PYTHONPATH:+:${PYTHONPATH}}"

# Check the config once, here: under torchrun a mistake fails on every rank and comes back as
# torchrun's ChildFailedError traceback (exit 1) instead of one line and exit code 2.
python -m torchtitan.config.check --errors-only "$@" || exit $?

if [ -z "${NGPU:-}" ]; then
  NGPU=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 1)")
fi
LOG_RANK=${LOG_RANK:-0}

exec python -m torchtitan.launch --nproc_per_node="${NGPU}" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
  --local-ranks-filter "${LOG_RANK}" --role rank --tee 3 \
  -m torchtitan.train "$@"
