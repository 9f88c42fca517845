#!/usr/bin/env bash
# The checks that need one CUDA GPU, in one command meant to end in under 8 minutes:
#   0. a pre-flight (the trainer and the tests import with every dependency they need, and
#      torch.compile builds a kernel), so that a machine that cannot run them stops in seconds,
#      not after every step has failed;
#   1. the test suite's GPU-marked tests (tests/gpu: compiled flex BlockMask vs the exact dense
#      path, bf16 grouped-mm experts, the GPU attention kernel under op-SAC, a bf16 run, a
#      float8 run, the CUDA memory snapshots, a resume from an async_with_pinned_mem save, the
#      optimizer stepping in backward, activation offload's streams and pinned pool), in three
#      pytest processes;
#   2. each model's flex-attention debug config in bf16, 10 steps with op-SAC + compile, then
#      with full AC: six trainer runs;
#   3. the AC benchmark through the trainer on Llama 3 1B at seq_len 8192 (bf16): tokens/s,
#      MFU and peak memory per AC mode, as one table (the eager modes, op-SAC with the whole
#      logits at once against the default chunked head, op-SAC with activation offload on
#      every block and on blocks 0-7, then no AC and op-SAC with compile, then mode "auto" at
#      the budgets of full AC's and op-SAC's peaks);
#   4. building the block_causal BlockMask eagerly vs compiled at 4 x 8192 (time, peak memory).
# Steps 1 and 2 are mostly compiling on the host, so their nine processes run at once (the
# debug models use little of the GPU; step 2's tokens/s are therefore only indicative); steps 3
# and 4 measure time, so each runs alone. Every process has a time budget: one that outlasts it
# is stopped, reported, and the other steps still run.
#
#   scripts/gpu_check.sh [--quick]     # --quick: step 3 on the debug model at seq_len 2048
#   scripts/gpu_check.sh --cpu-dry-run  # every step on the CPU at toy sizes (5-10 minutes on 2
#                                       # cores): checks the script itself before GPU time is spent
#
# Needs the project's dependencies importable (the repo itself is put on PYTHONPATH; torchao
# only for the float8 test); runs $PYTHON (default python3); writes logs under
# ${GPU_CHECK_DIR:-/tmp/gpu_check}. The stage budgets add up to 10 minutes at most.
# Exit code: 0 when every step passed, else the number of failed steps; 99: the pre-flight
# failed (nothing else ran); 100: no GPU; 64: a wrong argument.
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
# Nothing is downloaded: the configs use the bundled corpus and tokenizer.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
py="${PYTHON:-python3}"
mode="${1:-}"
case "$mode" in
    ""|--quick|--cpu-dry-run) ;;
    *) echo "usage: scripts/gpu_check.sh [--quick | --cpu-dry-run] (got '$mode')" >&2; exit 64 ;;
esac
bf16=(--training.mixed_precision_param bfloat16)

if [[ "$mode" == "--cpu-dry-run" ]]; then
    echo "CPU dry run: toy sizes, numbers meaningless; checks that every step runs and reports."
    device=cpu
    train_steps=3
    bench=(--config debug_model.toml --seq-len 256 --batch 2 --steps 3 --warmup 1 --timeout 600)
    mask_size=(--batch 1 --seq-len 1024)
    budget_preflight=300 budget_parallel=1200 budget_bench=1500 budget_mask=300
else
    if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_check.sh needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)." \
            "To check the script itself on this machine, run: scripts/gpu_check.sh --cpu-dry-run" >&2
        exit 100
    fi
    device=cuda
    train_steps=10
    if [[ "$mode" == "--quick" ]]; then
        bench=(--config debug_model.toml --seq-len 2048 --batch 4 --steps 8 --warmup 3 --timeout 70)
    else
        # Llama 3 1B on the bundled corpus and tokenizer (nothing to download).
        bench=(--config debug_model.toml --flavor 1B --seq-len 8192 --batch 1 --steps 8 --warmup 3 --timeout 70)
    fi
    mask_size=(--batch 4 --seq-len 8192)
    # 60 + 220 + 190 + 90 s, plus up to 10 s each to kill a stage: under the 600 s a lent
    # machine allows one command. The pre-flight's budget covers a fresh machine's cold start
    # (first CUDA context, first Triton compile). Measured on an H200 (2026-12-04): pre-flight
    # and steps 1-2 197 s; step 3 107 s (six modes; the two offload
    # modes since added make eight, about 145 s at that rate); step 4 about 50 s, 42 of them the
    # first compiled build (the 35 s it had in the first run stopped it before its first row).
    budget_preflight=60 budget_parallel=220 budget_bench=190 budget_mask=90
fi
failed=0
start=$SECONDS

# Runs "$@" with a time limit of $1 seconds, output to the file $2; says so when the limit hit.
run_limited() {
    local limit=$1 log=$2
    shift 2
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    local rc=$?
    if [[ $rc == 124 || $rc == 137 ]]; then
        echo "STOPPED: outlasted its budget of $limit s" >> "$log"
    fi
    return $rc
}

echo "== 0. pre-flight: imports and one compiled kernel on $device"
if run_limited "$budget_preflight" "$out/preflight.log" "$py" - "$device" <<'EOF'
import sys
import torch
# The trainer and the test helpers, with everything they import (safetensors, tokenizers,
# datasets, torchdata, pytest): a missing package would fail every later step.
import torchtitan.train, tests.conftest  # noqa: F401
device = sys.argv[1]
if device == "cuda":
    import triton
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}; triton {triton.__version__}")
else:
    print(f"torch {torch.__version__} on the CPU")
try:
    import torchao
    print(f"torchao {torchao.__version__}")
except ImportError:
    print("torchao is missing: the float8 test will fail; everything else runs")
x = torch.ones(8, device=device)
assert torch.equal(torch.compile(lambda t: t.sin() + 1)(x), x.sin() + 1)
print("torch.compile built and ran a kernel")
EOF
then
    if [[ $device == cuda ]] && command -v nvidia-smi > /dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$out/preflight.log" 2>&1
    fi
else
    cat "$out/preflight.log"
    echo "pre-flight failed: nothing else would run; see above." >&2
    exit 99
fi
cat "$out/preflight.log"

echo "== 1 and 2, at once (at $((SECONDS - start)) s): GPU-marked tests; flex debug configs ($train_steps steps each, bf16)"
pids=()
# Each process would otherwise start one compile worker per core: nine pools of them, each a
# Python process with torch imported, would crowd the host's memory.
export TORCHINDUCTOR_COMPILE_THREADS=$(( $(nproc) / 4 > 1 ? $(nproc) / 4 : 1 ))
# Three pytest processes: the flex mask compiles, the two compiled training runs, the rest.
# -rfEsP lists failures, errors and skips, and prints what passing tests print (the
# optimizer-in-backward peak memory figures); --log-level=WARNING keeps torch's DEBUG trace
# records (thousands of lines per compiled flex test on torch 2.11) out of what it prints.
test_groups=("flex_block_mask" "learns" "not flex_block_mask and not learns")
test_logs=("$out/gpu_tests_flex.log" "$out/gpu_tests_training.log" "$out/gpu_tests_other.log")
for i in 0 1 2; do
    run_limited "$budget_parallel" "${test_logs[$i]}" "$py" -m pytest -q -rfEsP --log-level=WARNING -m gpu tests/gpu -k "${test_groups[$i]}" &
    pids+=($!)
done
configs=(debug_model_flex_attn qwen3_debug_model_flex_attn deepseek_v3_debug_model_flex_attn)
for config in "${configs[@]}"; do
    for ac in op_sac_compile full; do
        case $ac in
            op_sac_compile) ac_args=(--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op --compile.enable) ;;
            full) ac_args=(--activation_checkpoint.mode full) ;;
        esac
        rm -rf "${out:?}/$config-$ac"
        run_limited "$budget_parallel" "$out/$config-$ac.log" "$py" -m torchtitan.train --config "$config.toml" \
            --training.steps "$train_steps" --lr_scheduler.warmup_steps 2 --metrics.log_freq 1 \
            "${bf16[@]}" "${ac_args[@]}" --job.dump_folder "$out/$config-$ac" &
        pids+=($!)
    done
done
rcs=()
for pid in "${pids[@]}"; do
    wait "$pid"
    rcs+=($?)
done
unset TORCHINDUCTOR_COMPILE_THREADS

echo "-- 1. GPU-marked tests"
for i in 0 1 2; do
    cat "${test_logs[$i]}"
    if [[ ${rcs[$i]} != 0 ]]; then
        failed=$((failed + 1))
    fi
done

echo "-- 2. flex-attention debug configs: op-SAC + compile, then full AC (bf16; 9 processes at once: tokens/s indicative)"
printf "| config | AC | first loss | last loss | tokens/s | peak GiB |\n|---|---|---|---|---|---|\n" > "$out/flex.md"
i=3
for config in "${configs[@]}"; do
    for ac in op_sac_compile full; do
        log="$out/$config-$ac.log"
        if [[ ${rcs[$i]} == 0 ]]; then
            if ! "$py" - "$out/$config-$ac/metrics.jsonl" "$config" "$ac" >> "$out/flex.md" 2>> "$log" <<'EOF'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
first, last = records[0], records[-1]
print(f"| {sys.argv[2]} | {sys.argv[3]} | {first['loss']:.3f} | {last['loss']:.3f} | "
      f"{last['tps']:,.0f} | {last.get('memory/max_allocated_gib', float('nan')):.2f} |")
EOF
            then
                echo "| $config | $ac | FAILED: no metrics to read (see $log) | | | |" >> "$out/flex.md"
                failed=$((failed + 1))
            fi
            # torch warns when flex_attention runs uncompiled: correct, but slow and memory-hungry.
            if grep -q "unfused implementation" "$log"; then
                echo "| $config | $ac | flex_attention ran UNFUSED (see $log) | | | |" >> "$out/flex.md"
                failed=$((failed + 1))
            fi
        else
            echo "| $config | $ac | FAILED (see $log; $(tail -n 1 "$log")) | | | |" >> "$out/flex.md"
            failed=$((failed + 1))
        fi
        i=$((i + 1))
    done
done
cat "$out/flex.md"

echo "== 3. AC modes through the trainer (at $((SECONDS - start)) s)"
# Eager modes first: a stage stopped at its budget keeps the rows already printed.
# Mode "auto" last, at the budgets of full's and op-SAC's peaks in this run: each plans first (on
# the CPU, about 30 s), so the stage's budget may stop them; they then run on their own with
#   benchmarks/ac_modes_trainer.py ... --modes full "selective op" "auto at full's peak" "auto at selective op's peak"
bench_modes=(none full "selective 2" "selective op" "selective op, unchunked head" "selective op + offload"
    "selective op + offload 0-7" "none + compile" "selective op + compile" "auto at full's peak"
    "auto at selective op's peak")
run_limited "$budget_bench" "$out/ac_modes.md" "$py" benchmarks/ac_modes_trainer.py "${bench[@]}" \
    --modes "${bench_modes[@]}" -- "${bf16[@]}" --optimizer.lr 3e-4
rc=$?
cat "$out/ac_modes.md"
if [[ $rc != 0 ]]; then
    failed=$((failed + 1))
fi

echo "== 4. BlockMask build, eager vs compiled, block_causal (${mask_size[*]}; at $((SECONDS - start)) s)"
run_limited "$budget_mask" "$out/block_mask.md" "$py" benchmarks/block_mask_build.py "${mask_size[@]}" \
    --mask-type block_causal
rc=$?
cat "$out/block_mask.md"
if [[ $rc != 0 ]]; then
    failed=$((failed + 1))
fi

echo "== done in $((SECONDS - start)) s; failed steps: $failed (logs in $out)"
exit "$failed"
