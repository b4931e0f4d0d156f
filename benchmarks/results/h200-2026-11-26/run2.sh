cd "$(dirname "$0")/.." || exit 1
. /root/st/setup.sh || exit 1
t0=$(date +%s)
timeout 150 python3 gpu_run/policies.py float16 > $OUT/policies.log 2>&1
echo "policies rc=$? $(( $(date +%s) - t0 )) s"; grep -v WARN $OUT/policies.log | tail -20
t0=$(date +%s)
timeout 100 python3 benchmarks/bench_cuda.py --dtype float32 --repeat 5 --json $OUT/bench_fp32.json > $OUT/bench_fp32.log 2>&1
echo "bench rc=$? $(( $(date +%s) - t0 )) s"; grep -v WARN $OUT/bench_fp32.log | tail -20
t0=$(date +%s)
timeout 180 python3 benchmarks/sweep_cuda.py --dtype float32 --samples 20 --repeat 5 --json $OUT/sweep_fp32.json > $OUT/sweep_fp32.log 2>&1
echo "sweep rc=$? $(( $(date +%s) - t0 )) s"; grep -v WARN $OUT/sweep_fp32.log | tail -20
