cd "$(dirname "$0")/.." || exit 1
. /root/st/setup.sh || exit 1
t0=$(date +%s)
KIND=simt timeout 100 python3 gpu_run/policies.py float32 > $OUT/simt.log 2>&1
echo "simt rc=$? $(( $(date +%s) - t0 )) s"; grep -v WARN $OUT/simt.log | tail -16
t0=$(date +%s)
timeout 150 python3 -m pytest -m gpu tests/test_cuda.py tests/test_cuda_emulated.py tests/test_ops.py \
  -q -n 14 -p no:cacheprovider --timeout 120 -rfE > $OUT/tests3.log 2>&1
echo "tests rc=$? in $(( $(date +%s) - t0 )) s"; tail -6 $OUT/tests3.log
t0=$(date +%s)
timeout 160 python3 benchmarks/bench_cuda.py --dtype float16 bfloat16 float32 --repeat 5 \
  --json $OUT/bench3.json > $OUT/bench3.log 2>&1
echo "bench rc=$? in $(( $(date +%s) - t0 )) s"; grep -v WARN $OUT/bench3.log
