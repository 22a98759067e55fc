#!/usr/bin/env bash
# The v2 kernels on a lent CUDA machine, as one script in under 10 minutes: build the CUDA op (both generations),
# its self-check, the benchmarks before (DS_LIONCUB_CUDA_KERNELS=v1: the kernels before v2) and after, then every
# test marked gpu. Run from the repository root, .whl/ holding the wheels device_checks.sh names when the machine's
# Python has no DeepSpeed:
#
#   OUT=/tmp/issue47 bash benchmarks/gpu/issue47.sh
#
# Each step writes OUT/<step>.log and one line "<step> rc=<code> <seconds>s" to OUT/summary.txt; a failing step
# does not stop the others; every step's time limit is cut to what is left of BUDGET_S (default 570 s), so the
# script ends in time whatever hangs. Steps, in order (the benchmarks on a quiet GPU, before the tests):
#   env          the GPU, the driver, torch, DeepSpeed, nvcc
#   build        the CUDA op's JIT build (three sources; the TORCH_CUDA_ARCH_LIST the image sets, or the GPU's)
#   report       python -m ds_lioncub.report: the op's self-check against torch, second generation (the default)
#   packing_v1   pack + vote + unpack of 774M fp32 elements, p = 8, the kernels before v2
#   packing_v2   the same with the v2 kernels
#   clip_v2      bench_clip --device cuda, 8 Mi and 64 Mi elements as 1 and as 64 tensors: the sketch in one kernel
#                beside the passes before v2 (the table's last two columns) in the same rounds
#   planner_v1   planner --calibrate --device cuda with the kernels before v2 -> OUT/local_costs_v1.json
#   planner_v2   the same after -> OUT/local_costs_v2.json
#   pytest       pytest -m gpu tests: every new kernel bit for bit against torch (tests/kernels/test_bandwidth_kernels.py)
#                and everything the earlier GPU runs checked
#   summary      OUT/summary.md: the local costs against their bound and the 1-bit step, before and after
# What comes back: the logs, summary.txt, summary.md, the two local cost tables, and issue47.tgz holding them all.
set -u
OUT=${OUT:-/tmp/issue47}
mkdir -p "$OUT"
PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-570}
DEADLINE=$(($(date +%s) + BUDGET_S))
export DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

. "$(dirname "$0")/steps.sh"  # the .whl/ install and run_step

limit() {  # a step's limit: its own, or what is left of the budget (at least 5 s, so that the step reports)
    local left=$((DEADLINE - $(date +%s)))
    [ "$left" -lt 5 ] && left=5
    [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}

run_step env "$(limit 45)" bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv; \
    $PY -c 'import sys, torch, deepspeed; print(sys.version.split()[0], torch.__version__, torch.version.cuda, \
    torch.cuda.get_device_name(), deepspeed.__version__)'; nvcc --version | tail -2; echo TORCH_CUDA_ARCH_LIST=\${TORCH_CUDA_ARCH_LIST:-}"
run_step build "$(limit 180)" $PY -c "
import time, torch
from ds_lioncub.kernels.builders import LionCubPackingCUDABuilder
start = time.perf_counter()
builder = LionCubPackingCUDABuilder()
op = builder.load()
print(builder.load_source, f'{time.perf_counter() - start:.1f} s', 'kernel generation', getattr(op, 'kernel_generation', 1))
for name in ('pack_signs_v1', 'vote_field_sums', 'quantize_l1_means_pack', 'sketch_and_squares'):
    print(name, hasattr(op, name))
"
run_step report "$(limit 90)" $PY -m ds_lioncub.report --no-color

PACKING="-m benchmarks.bench_packing --device cuda --sizes 774e6 --p 8 --threads 1 --paths compiled --no-memory"
DS_LIONCUB_CUDA_KERNELS=v1 run_step packing_v1 "$(limit 75)" $PY $PACKING
run_step packing_v2 "$(limit 75)" $PY $PACKING
run_step clip_v2 "$(limit 90)" bash -c "$PY -m benchmarks.bench_clip --device cuda --repeats 15 --numel 8388608 67108864 \
    && $PY -m benchmarks.bench_clip --device cuda --repeats 15 --numel 8388608 67108864 --tensors 64"
DS_LIONCUB_CUDA_KERNELS=v1 run_step planner_v1 "$(limit 75)" \
    $PY -m ds_lioncub.planner --calibrate --device cuda --save "$OUT/local_costs_v1.json"
run_step planner_v2 "$(limit 75)" $PY -m ds_lioncub.planner --calibrate --device cuda --save "$OUT/local_costs_v2.json"
run_step pytest "$(limit 240)" $PY -m pytest -q -m gpu -p no:cacheprovider -rs tests/kernels/test_bandwidth_kernels.py tests
run_step summary "$(limit 20)" $PY benchmarks/gpu/issue47_summary.py "$OUT"

tar czf "$OUT/issue47.tgz" -C "$OUT" --exclude issue47.tgz . 2>/dev/null
cat "$OUT/summary.txt"
tail -3 "$OUT/pytest.log"
