#!/usr/bin/env bash
# The GPU check: one script, one GPU. Run from the repository root after installing the
# requirements (with the CUDA build of torch):
#
#     bash bench/gpu_check.sh 2>&1 | tee gpu_check.log
#
# It prints, in order: the versions; bench_h200_wan.py (real-size Wan2.1-1.3B transformer,
# random weights) with every speed lever off (with torch.profiler tables), all on (bf16 weights
# through DeepSpeed's bf16 mode, regional compile, cuDNN attention; with the table of PPO micro
# batches that fit an 80 GB card), then each alone: rollout and PPO-step MFU, genrl against the
# bare transformer, peak memory; then, side by side (toy-sized, they share the GPU and its 16
# CPU cores without crowding each other), the no-argument run's wall time and held-out scores,
# single-process ZeRO-2 / ZeRO-3 bf16 runs and the tests that need a GPU. Each part runs on,
# whatever the previous one did, and says FAILED with its exit status; the script's own exit
# status is the number of parts that failed. Figures are printed, never asserted.
# GPU_CHECK_PARTS="levers tests ..." runs only the named parts, in that order (names: versions
# levers each_lever default zero tests); names joined by "+" run side by side, each part's
# output printed whole when it ends (default: "versions levers each_lever default+zero+tests").
# On an H200 the benchmark parts take about 4 + 4.5 minutes and the toy parts about
# 3 side by side: with a 10-minute limit per call, run "versions levers each_lever" in one and
# "default+zero+tests" in the next. GPU_CHECK_QUICK=1 runs every part at toy size (on a CPU
# too): a check of the script itself.

set -u
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-$(mktemp -d /tmp/gpu-check-XXXXXX)}
QUICK=${GPU_CHECK_QUICK:-0}
FAILED=0

part() {  # part NAME COMMAND...: runs the command, times it, reports and returns its status
    local name=$1
    shift
    echo
    echo "=== ${name}"
    local start=$SECONDS
    "$@"
    local status=$?
    echo "=== ${name}: $([ $status -eq 0 ] && echo ok || echo "FAILED (exit ${status})") in $((SECONDS - start)) s"
    return $status
}

versions() {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    python -c "import torch, diffusers, accelerate, deepspeed, transformers; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version()); \
print('diffusers', diffusers.__version__, 'accelerate', accelerate.__version__, 'deepspeed', deepspeed.__version__, \
'transformers', transformers.__version__)"
}

wan_bench() {  # bench_h200_wan.py at its Wan2.1-1.3B shape (33 frames, 240x416) with the given levers
    local size=()
    [ "$QUICK" = 1 ] && size=(--quick)
    python bench/bench_h200_wan.py "${size[@]}" "$@"
}

backend=_native_cudnn
[ "$QUICK" = 1 ] && backend=native

levers() {  # every lever off (with the profiler tables), then all on (with the 80 GB fit table)
    local status=0  # each run runs whatever the one before did
    wan_bench --profile || status=$?
    wan_bench --bf16_weights --compile --attention_backend "$backend" --fit_table || status=$?
    return $status
}

each_lever() {  # each lever on its own
    local status=0
    wan_bench --bf16_weights || status=$?
    wan_bench --attention_backend "$backend" || status=$?
    wan_bench --compile || status=$?
    return $status
}

default_run() {  # the README's no-argument command, on the GPU; scores from its metrics
    local steps=()
    [ "$QUICK" = 1 ] && steps=(--max_train_steps 2 --eval_steps 2 --eval_max_batches 1)
    local start=$SECONDS
    accelerate launch --config_file accelerate_configs/single_gpu.yaml train_genrl.py \
        --output_dir "$OUT/default" "${steps[@]}" || return $?
    echo "wall time: $((SECONDS - start)) s"
    python - "$OUT/default/logs/metrics.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    row = json.loads(line)
    if "eval/toy_geneval_mean" in row:
        print(f"step {row['step']:4d}  held-out toy_geneval {row['eval/toy_geneval_mean']:.4f}  "
              f"elapsed {row['time/elapsed_s']:.0f} s")
EOF
}

zero_runs() {  # single-process ZeRO-2 and ZeRO-3 in bf16, 10 optimizer steps each, with an export
    local steps=10
    [ "$QUICK" = 1 ] && steps=2
    local mixed=bf16
    python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || mixed=no
    for config in zero2 zero3; do
        local start=$SECONDS
        local port
        port=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
        # A port of its own: other parts may run beside this one.
        accelerate launch --config_file "accelerate_configs/${config}.yaml" --num_processes 1 --mixed_precision "$mixed" \
            --main_process_port "$port" \
            train_genrl.py --max_train_steps "$steps" --eval_steps 0 --eval_diversity_prompts 0 \
            --output_dir "$OUT/$config" || return $?
        echo "${config} ${mixed}: ${steps} steps and the export in $((SECONDS - start)) s"
        test -f "$OUT/$config/transformer/diffusion_pytorch_model.safetensors" || { echo "no export"; return 1; }
    done
}

gpu_tests() {  # the tests that skip without a GPU, and DeepSpeed's bf16 weights run where there is one
    python -m pytest -q -n 0 -rs tests/test_gpu_levers.py tests/test_reward_scoring.py tests/test_gpu_placement.py \
        tests/test_acceleration.py "tests/test_train_script.py::test_deepspeed_bf16_trains_bf16_weights_from_fp32_masters"
}

# GPU_CHECK_PARTS picks parts and their order (a short lease can put the figures it needs first).
declare -A PART_NAMES=(
    [versions]="versions" [levers]="bench_h200_wan: levers off, then all on" [each_lever]="bench_h200_wan: each lever alone"
    [default]="no-argument run" [zero]="ZeRO-2 / ZeRO-3 bf16, one process" [tests]="GPU tests"
)
declare -A PART_FUNCTIONS=(
    [versions]=versions [levers]=levers [each_lever]=each_lever [default]=default_run [zero]=zero_runs [tests]=gpu_tests
)
known() {  # known NAME: whether NAME is a part, saying so when it is not
    [ -n "${PART_FUNCTIONS[$1]:-}" ] && return 0
    echo "gpu_check: no part named $1 (parts: ${!PART_FUNCTIONS[*]})"
    return 1
}

side_by_side() {  # side_by_side NAME...: runs the parts at once, then prints each one's output in order
    local names=() pids=() name
    for name in "$@"; do
        known "$name" || { FAILED=$((FAILED + 1)); continue; }
        part "${PART_NAMES[$name]} (side by side with: $*)" "${PART_FUNCTIONS[$name]}" > "$OUT/part-${name}.log" 2>&1 &
        names+=("$name")
        pids+=($!)
    done
    local i
    for i in "${!names[@]}"; do
        wait "${pids[$i]}" || FAILED=$((FAILED + 1))
        cat "$OUT/part-${names[$i]}.log"
    done
}

for spec in ${GPU_CHECK_PARTS:-versions levers each_lever default+zero+tests}; do
    if [[ "$spec" == *+* ]]; then
        side_by_side ${spec//+/ }
    elif known "$spec"; then
        part "${PART_NAMES[$spec]}" "${PART_FUNCTIONS[$spec]}" || FAILED=$((FAILED + 1))
    else
        FAILED=$((FAILED + 1))
    fi
done
echo
echo "gpu_check: ${FAILED} part(s) failed; outputs in ${OUT}"
exit "$FAILED"
