#!/usr/bin/env bash
# The GPU check: one script, one GPU, under about 8 minutes on an H200. Run from the repository
# root after installing the requirements (with the CUDA build of torch):
#
#     bash bench/gpu_check.sh 2>&1 | tee gpu_check.log
#
# It prints, in order: the versions; bench_h200_wan.py (real-size Wan2.1-1.3B transformer,
# random weights) with each speed lever off and on (rollout and PPO-step MFU, genrl against
# the bare transformer, peak memory; torch.profiler tables of the plain run; which PPO micro batches
# fit an 80 GB card with all levers on); the no-argument run's wall time and held-out scores;
# single-process ZeRO-2 / ZeRO-3 bf16 runs; and the tests that need a GPU. Each part runs on,
# whatever the previous one did, and says FAILED with its exit status; the script's own exit
# status is the number of parts that failed. Figures are printed, never asserted.
# GPU_CHECK_QUICK=1 runs every part at toy size (on a CPU too): a check of the script itself.

set -u
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-$(mktemp -d /tmp/gpu-check-XXXXXX)}
QUICK=${GPU_CHECK_QUICK:-0}
FAILED=0

part() {  # part NAME COMMAND...: runs the command, times it, reports its status
    local name=$1
    shift
    echo
    echo "=== ${name}"
    local start=$SECONDS
    "$@"
    local status=$?
    echo "=== ${name}: $([ $status -eq 0 ] && echo ok || echo "FAILED (exit ${status})") in $((SECONDS - start)) s"
    [ $status -eq 0 ] || FAILED=$((FAILED + 1))
}

versions() {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    python -c "import torch, diffusers, accelerate, deepspeed, transformers; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version()); \
print('diffusers', diffusers.__version__, 'accelerate', accelerate.__version__, 'deepspeed', deepspeed.__version__, \
'transformers', transformers.__version__)"
}

wan_bench() {  # the speed levers, each on its own and together
    local size=()
    [ "$QUICK" = 1 ] && size=(--quick)
    local backend=_native_cudnn
    [ "$QUICK" = 1 ] && backend=native
    python bench/bench_h200_wan.py "${size[@]}" --profile &&
        python bench/bench_h200_wan.py "${size[@]}" --attention_backend "$backend" &&
        python bench/bench_h200_wan.py "${size[@]}" --compile &&
        python bench/bench_h200_wan.py "${size[@]}" --compile --attention_backend "$backend" --fit_table
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
        accelerate launch --config_file "accelerate_configs/${config}.yaml" --num_processes 1 --mixed_precision "$mixed" \
            train_genrl.py --max_train_steps "$steps" --eval_steps 0 --eval_diversity_prompts 0 \
            --output_dir "$OUT/$config" || return $?
        echo "${config} ${mixed}: ${steps} steps and the export in $((SECONDS - start)) s"
        test -f "$OUT/$config/transformer/diffusion_pytorch_model.safetensors" || { echo "no export"; return 1; }
    done
}

gpu_tests() {  # the tests that skip without a GPU, run where there is one
    python -m pytest -q -n 0 -rs tests/test_reward_scoring.py tests/test_gpu_placement.py tests/test_acceleration.py
}

part "versions" versions
part "bench_h200_wan: levers off and on" wan_bench
part "no-argument run" default_run
part "ZeRO-2 / ZeRO-3 bf16, one process" zero_runs
part "GPU tests" gpu_tests
echo
echo "gpu_check: ${FAILED} part(s) failed; outputs in ${OUT}"
exit "$FAILED"
