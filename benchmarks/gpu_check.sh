#!/usr/bin/env bash
# Everything a lent GPU checks, in one device call (../shared/gpu/README.md carries TVM over):
# the GPU tests, the cuDNN benchmark in three dtypes, a knob sweep of the suite and a race /
# memory check of two tensor-core kernels. Each step has its own time limit and its own log in
# OUT_DIR, so that a step that runs over still leaves the others' results.
#
#     . /root/st/setup.sh && bash benchmarks/gpu_check.sh "$OUT"
#
# What travels to the device machine is the working tree (tracked and untracked files) plus the
# carried paths, 64 MiB at most: benchmarks/results (about 40 MB of tables and charts) and
# .gpu/a (35 MB) do not fit together. Move benchmarks/results out of the tree for the device
# calls (and back after); the same then lets one call carry both .gpu/a and .gpu/b (64 MB).
# The device returns at most 8 files from $OUT: this script leaves 7.
set -u
out="${1:-${OUT:-/tmp/gpu_check}}"
mkdir -p "$out"
step() {  # step NAME SECONDS COMMAND...: run COMMAND with a time limit, its output in NAME.log
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" >"$out/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - t0)) s (limit $secs s)"
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv \
  >"$out/gpu.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())" \
  >>"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"

step tests 140 python3 -m pytest -m gpu tests/test_cuda.py tests/test_cuda_emulated.py -q -rfE \
  -n 8 -p no:cacheprovider -p no:benchmark
step bench 170 python3 benchmarks/bench_cuda.py --dtype float16 bfloat16 float32 \
  --json "$out/bench.json"
step sweep 110 python3 benchmarks/sweep_cuda.py --dtype float16 --samples 12 --repeat 3 --json "$out/sweep.json"
for case in "weight_gradient and seed000-small and float16" "input_gradient and k3-pad1-c64 and float16"; do
  step "race-${case%% *}" 35 compute-sanitizer --tool racecheck --target-processes all \
    python3 -m pytest -m gpu tests/test_cuda.py -q -p no:cacheprovider -k "$case"
done
step memcheck 35 compute-sanitizer --tool memcheck --target-processes all \
  python3 -m pytest -m gpu tests/test_cuda.py -q -p no:cacheprovider \
  -k "weight_gradient and stride-123 and float16"

# One log for the sanitizers: the device returns at most 8 files.
for f in "$out"/race-*.log "$out"/memcheck.log; do echo "==== $(basename "$f")"; cat "$f"; done \
  >"$out/sanitizers.log" && rm -f "$out"/race-*.log "$out"/memcheck.log

echo "---- tests"; tail -25 "$out/tests.log"
echo "---- bench"; grep -v '^WARNING' "$out/bench.log" | tail -50
echo "---- sweep"; tail -30 "$out/sweep.log"
echo "---- sanitizers"; grep -E "^====|ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|Error" \
  "$out/sanitizers.log"
