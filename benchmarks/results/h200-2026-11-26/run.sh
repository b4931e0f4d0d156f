# Second device call: install TVM, then GPU tests, the CUDA benchmark and compute-sanitizer runs.
cd "$(dirname "$0")/.." || exit 1
. /root/st/setup.sh || exit 1
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv; uname -r;
  python3 -c "import torch; print(torch.__version__, torch.backends.cudnn.version())"; } 2>&1 | tee $OUT/gpu.txt
t0=$(date +%s)
timeout 240 python3 -m pytest -m gpu tests/test_cuda.py tests/test_cuda_emulated.py tests/test_ops.py \
  -q -n 14 -p no:cacheprovider --timeout 180 -rfE --durations=10 > $OUT/tests.log 2>&1
echo "tests rc=$? in $(( $(date +%s) - t0 )) s"; tail -25 $OUT/tests.log
t0=$(date +%s)
timeout 220 python3 benchmarks/bench_cuda.py --dtype float16 bfloat16 float32 --repeat 5 \
  --json $OUT/bench.json > $OUT/bench.log 2>&1
echo "bench rc=$? in $(( $(date +%s) - t0 )) s"; cat $OUT/bench.log | grep -v "^WARN"
t0=$(date +%s)
timeout 100 compute-sanitizer --tool memcheck --print-limit 20 python3 gpu_run/sanitize.py > $OUT/memcheck.log 2>&1
echo "memcheck rc=$? in $(( $(date +%s) - t0 )) s"; tail -8 $OUT/memcheck.log
k=gpu_run/kernels
t0=$(date +%s)
timeout 100 compute-sanitizer --tool racecheck --print-limit 20 python3 gpu_run/sanitize.py \
  $k/dw_seed_float16.json $k/dx_k3c64_float16.json $k/dx_s123_float16.json $k/dw_c20_bfloat16.json \
  $k/dx_c20_bfloat16.json > $OUT/racecheck.log 2>&1
echo "racecheck rc=$? in $(( $(date +%s) - t0 )) s"; tail -8 $OUT/racecheck.log
