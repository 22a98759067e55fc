#!/usr/bin/env bash
# Option clip on a lent CUDA machine, and the machine's cores on the convergence grid, as one script in
# under 7 minutes. Run from the repository root, .whl/ holding the wheels device_checks.sh names:
#
#   OUT=/tmp/clip bash benchmarks/gpu/clip_and_cores.sh
#
# Steps (each writes OUT/<step>.log and a line "<step> rc=<code> <seconds>s" to OUT/summary.txt):
#   env        the device, torch, the CPU and its cores
#   clip_cost  python -m benchmarks.bench_clip --device cuda: the sketch and the scaling of one bucket in units
#              of Lion's update on the GPU (the planner's CLIP_LOCAL_PASSES["cuda"]), on a quiet machine
#   pytest     every test marked gpu (the CUDA kernels, NCCL against the virtual world, fp16/bf16, the sketch)
#   grid       beside pytest, on the cores (one torch thread per run): the pinned study's beta2 0.95 cells
#              GRID_ARGS names, into OUT/pinned, and one control run that exists on the CPU where the grid is
#              kept (exact Lion, 8 workers, seed 0), into OUT/control. The runs count only if the control's
#              losses equal that CPU's bit for bit: another torch or another CPU rounds otherwise, and then
#              pairing these runs with that CPU's exact-Lion baselines would add the devices' noise.
# What comes back: the logs, summary.txt, and grid.tgz (OUT/pinned and OUT/control, each run's JSON).
set -u
OUT=${OUT:-/tmp/clip_and_cores}
mkdir -p "$OUT"
PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-380}  # the grid's time limit; a run cut off writes nothing and is simply run again later
JOBS=${JOBS:-13}
GRID_ARGS=${GRID_ARGS:---workers 32 --beta2 0.95 --modes 1bit_sync 2bit_l1_a2a 8bit_l1 8bit_l1_a2a --seeds 0 1 2}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

. "$(dirname "$0")/steps.sh"  # the .whl/ install and run_step

run_step env 60 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; \
    $PY -c 'import sys, torch, deepspeed; print(sys.version.split()[0], torch.__version__, deepspeed.__version__)'; \
    nproc; grep -m1 'model name' /proc/cpuinfo"
DS_ACCELERATOR=cuda run_step clip_cost 120 $PY -m benchmarks.bench_clip --device cuda --repeats 15 \
    --numel 1048576 8388608 67108864 268435456

# The grid and its control on the cores (the study's own settings: the torch packing path, no CUDA op).
DS_ACCELERATOR=cpu DS_LIONCUB_PACKING=torch run_step grid "$BUDGET_S" bash -c "\
    $PY -m benchmarks.study_convergence --device cpu --jobs 1 --design lr5e-4 --results $OUT/control \
        --workers 8 --beta2 0.95 --modes exact --seeds 0 & \
    $PY -m benchmarks.study_convergence --device cpu --jobs $JOBS --design lr5e-4 --results $OUT/pinned $GRID_ARGS; \
    wait" &
DS_ACCELERATOR=cuda run_step pytest 300 $PY -m pytest -q -m gpu -p no:cacheprovider -rs tests
wait
tar czf "$OUT/grid.tgz" -C "$OUT" pinned control 2>/dev/null
cat "$OUT/clip_cost.log" "$OUT/summary.txt"
tail -3 "$OUT/pytest.log"
