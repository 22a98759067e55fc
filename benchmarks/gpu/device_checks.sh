#!/usr/bin/env bash
# Part 3 of the GPU work on a lent CUDA machine, as one script (benchmarks/RESULTS.md, "On a GPU", has
# what it printed). Run from the repository root on a machine with one or more CUDA devices, torch with
# CUDA, nvcc and cupy, but possibly without DeepSpeed and the other pure-Python dependencies: those
# come as wheels in .whl/ (see the section in RESULTS.md for how they were downloaded), installed first.
#
#   OUT=/tmp/gpu bash benchmarks/gpu/device_checks.sh [STEP ...]     # default: every step
#
# Every step writes OUT/<step>.log and one line "<step> rc=<code> <seconds>s" to OUT/summary.txt; a
# failing step does not stop the others. Steps:
#   env       the device, the driver, torch, nvcc and cupy
#   report    python -m ds_lioncub.report: the CUDA op's JIT build, its self-check against torch, the fused step
#   pytest    every test marked gpu: the CUDA kernels and the cupy path against torch (every dtype, odd
#             lengths), the fused step kernels, NCCL against the virtual world, fp16 (with an overflow) and bf16
#   gpt       the example GPT through the deepspeed launcher on the GPU (1-bit fp32, 4-bit sign bf16)
#   packing   pack + vote + unpack of 774M fp32 elements (compiled, torch and cupy paths)
#   step      the fused step's bytes per element against the GPU's copy bandwidth (256 Mi elements)
#   planner   python -m ds_lioncub.planner --calibrate --device cuda, and the derived table beside it
set -u
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
export DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(env report pytest gpt packing step planner)

. "$(dirname "$0")/steps.sh"  # the .whl/ install and run_step

for step in "${STEPS[@]}"; do
    case $step in
    env) run_step env 60 bash -c "nvidia-smi; $PY -c 'import torch, deepspeed, cupy; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), deepspeed.__version__, cupy.__version__)'; nvcc --version" ;;
    report) run_step report 240 $PY -m ds_lioncub.report --no-color ;;
    pytest) run_step pytest 420 $PY -m pytest -q -m gpu -p no:cacheprovider -rs tests ;;
    gpt) run_step gpt 240 bash -c "$PY -m deepspeed.launcher.runner --num_gpus 1 examples/train_gpt.py --deepspeed_config configs/lioncub_1bit.json --steps 150 --no-progress --json-out $OUT/gpt_1bit.json && $PY -m deepspeed.launcher.runner --num_gpus 1 examples/train_gpt.py --deepspeed_config configs/lioncub_4bit_sign.json --steps 150 --no-progress --json-out $OUT/gpt_4bit_sign_bf16.json" ;;
    packing) run_step packing 240 $PY -m benchmarks.bench_packing --device cuda --sizes 774e6 --p 8 --threads 1 --paths compiled,cupy,torch --no-memory ;;
    step) run_step step 180 $PY -m benchmarks.bench_step --device cuda --numel 268435456 --reps 15 ;;
    planner) run_step planner 240 bash -c "$PY -m ds_lioncub.planner --calibrate --device cuda --save $OUT/local_costs_cuda.json && $PY -m ds_lioncub.planner --params 1.3e9 --nodes 8 --gpus-per-node 8 --inter-node-bandwidth 25gbit --device cuda --local-costs $OUT/local_costs_cuda.json && $PY -m ds_lioncub.planner --params 1.3e9 --nodes 8 --gpus-per-node 8 --inter-node-bandwidth 25gbit --gpu H100" ;;
    *) echo "unknown step $step" | tee -a "$OUT/summary.txt" ;;
    esac
done
cat "$OUT/summary.txt"
