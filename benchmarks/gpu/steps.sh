# Shared by the scripts of benchmarks/gpu/ (sourced, with OUT and PY set): the pure-Python wheels in .whl/
# installed when the machine's torch has no DeepSpeed, and run_step, which runs one step under a time limit
# into OUT/<name>.log and adds "<name> rc=<code> <seconds>s" to OUT/summary.txt.
if [ -d .whl ] && ! $PY -c "import deepspeed" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl > "$OUT/install.log" 2>&1 \
        || echo "install of .whl/ failed: see install.log" | tee -a "$OUT/summary.txt"
fi

run_step() {  # name, time limit in seconds, command...
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $(($(date +%s) - start))s" | tee -a "$OUT/summary.txt"
}
