#!/usr/bin/env bash
# The checks that need one CUDA GPU, in one command that ends in under 8 minutes:
#   1. the test suite's GPU-marked tests (tests/gpu: compiled flex BlockMask vs the exact dense
#      path, bf16 grouped-mm experts, the GPU attention kernel under op-SAC, a bf16 run, a
#      float8 run, the CUDA memory snapshots, a resume from an async_with_pinned_mem save);
#   2. each model's flex-attention debug config, 10 steps with op-SAC + compile, then full AC;
#   3. the AC benchmark through the trainer on Llama 3 1B at seq_len 8192 (bf16): tokens/s,
#      MFU and peak memory per AC mode, as one table;
#   4. building the block_causal BlockMask eagerly vs compiled at 4 x 8192 (time, peak memory).
#
#   scripts/gpu_check.sh [--quick]     # --quick: step 3 on the debug model at seq_len 2048
#   scripts/gpu_check.sh --cpu-dry-run  # every step on the CPU at toy sizes (4-9 minutes on 2
#                                       # cores): checks the script itself before GPU time is spent
#
# Needs the project's dependencies importable (the repo itself is put on PYTHONPATH); runs
# $PYTHON (default python3); writes logs under ${GPU_CHECK_DIR:-/tmp/gpu_check}.
# Exit code: 0 when every step passed, else the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${GPU_CHECK_DIR:-/tmp/gpu_check}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# The benchmarks run as scripts, whose folder, not the repo, heads sys.path.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The GPU tests launch each trainer as a plain process, as a user's run starts, not forked
# from the CPU suite's pre-imported interpreter (tests/forked_launcher.py).
export TORCHTITAN_TEST_LAUNCH=subprocess
py="${PYTHON:-python3}"
mode="${1:-}"

if [[ "$mode" == "--cpu-dry-run" ]]; then
    echo "CPU dry run: toy sizes, numbers meaningless; checks that every step runs and reports."
    train_steps=3
    bench=(--config debug_model.toml --seq-len 256 --batch 2 --steps 3 --warmup 1)
    mask_size=(--batch 1 --seq-len 1024)
    "$py" -c "import torch; print('torch', torch.__version__, 'on the CPU')"
else
    if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_check.sh needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)." >&2
        exit 2
    fi
    train_steps=10
    if [[ "$mode" == "--quick" ]]; then
        bench=(--config debug_model.toml --seq-len 2048 --batch 4 --steps 8 --warmup 3)
    else
        # Llama 3 1B on the bundled corpus and tokenizer (nothing to download), bf16 autocast.
        bench=(--config debug_model.toml --flavor 1B --seq-len 8192 --batch 1 --steps 8 --warmup 3)
    fi
    mask_size=(--batch 4 --seq-len 8192)
    "$py" -c "import torch; print('torch', torch.__version__, 'on', torch.cuda.get_device_name(0))"
fi
failed=0
start=$SECONDS

echo "== 1. GPU-marked tests (at $((SECONDS - start)) s)"
# -rP prints what passing tests print (the optimizer-in-backward peak memory figures).
if ! "$py" -m pytest -q -rP -m gpu tests/gpu 2>&1 | tee "$out/gpu_tests.log"; then
    failed=$((failed + 1))
fi

echo "== 2. flex-attention debug configs: op-SAC + compile, then full AC ($train_steps steps each; at $((SECONDS - start)) s)"
printf "| config | AC | first loss | last loss | tokens/s | peak GiB |\n|---|---|---|---|---|---|\n" > "$out/flex.md"
for config in debug_model_flex_attn qwen3_debug_model_flex_attn deepseek_v3_debug_model_flex_attn; do
    for ac in op_sac_compile full; do
        case $ac in
            op_sac_compile) ac_args=(--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op --compile.enable) ;;
            full) ac_args=(--activation_checkpoint.mode full) ;;
        esac
        dump="$out/$config-$ac"
        rm -rf "$dump"
        if "$py" -m torchtitan.train --config "$config.toml" --training.steps "$train_steps" --metrics.log_freq 1 \
            "${ac_args[@]}" --job.dump_folder "$dump" > "$dump.log" 2>&1; then
            "$py" - "$dump/metrics.jsonl" "$config" "$ac" >> "$out/flex.md" <<'EOF'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
first, last = records[0], records[-1]
print(f"| {sys.argv[2]} | {sys.argv[3]} | {first['loss']:.3f} | {last['loss']:.3f} | "
      f"{last['tps']:,.0f} | {last.get('memory/max_allocated_gib', float('nan')):.2f} |")
EOF
        else
            echo "| $config | $ac | FAILED (see $dump.log) | | | |" >> "$out/flex.md"
            failed=$((failed + 1))
        fi
    done
done
cat "$out/flex.md"

echo "== 3. AC modes through the trainer (at $((SECONDS - start)) s)"
if ! "$py" benchmarks/ac_modes_trainer.py "${bench[@]}" -- --training.mixed_precision_param bfloat16 \
    2>&1 | tee "$out/ac_modes.md"; then
    failed=$((failed + 1))
fi

echo "== 4. BlockMask build, eager vs compiled, block_causal (${mask_size[*]}; at $((SECONDS - start)) s)"
if ! "$py" benchmarks/block_mask_build.py "${mask_size[@]}" --mask-type block_causal \
    2>&1 | tee "$out/block_mask.md"; then
    failed=$((failed + 1))
fi

echo "== done in $((SECONDS - start)) s; failed steps: $failed (logs in $out)"
exit "$failed"
