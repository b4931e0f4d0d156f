"""Build a few small CUDA kernels (sm_90) here, for compute-sanitizer runs on the GPU machine."""
import sys, time
sys.path.insert(0, "benchmarks")
from bench_cuda import Shape, graph
from tbe_like import dsl

SMALL = {
    "seed": Shape(2, 16, (4, 12, 12), 16, (2, 3, 3), (2, 2, 2), (0, 0, 0, 1, 0, 1)),
    "k3c64": Shape(1, 64, (4, 8, 8), 32, (3, 3, 3), (1, 1, 1), (1,) * 6),
    "s123": Shape(2, 16, (5, 9, 11), 32, (2, 3, 3), (1, 2, 3), (0, 1, 1, 0, 1, 1)),
    "c20": Shape(2, 20, (3, 6, 6), 36, (2, 3, 3), (1, 1, 1), (1, 0, 1, 1, 0, 1)),
    "big": Shape(2, 64, (8, 28, 28), 128, (3, 3, 3), (1, 1, 1), (1,) * 6),
}
for name, s in SMALL.items():
    for op in ("dw", "dx"):
        for dt in ("float16", "bfloat16", "float32"):
            if name != "big" and dt == "float32" and op == "dx":
                continue
            t0 = time.time()
            res, tensors = graph(op, s, dt)
            sch = dsl.auto_schedule(res, target={"kind": "cuda", "arch": "sm_90"})
            dsl.build(sch, {"name": f"{op}_{name}_{dt}", "tensor_list": tensors,
                            "output_dir": "gpu_run/kernels"})
            print(op, name, dt, f"{time.time() - t0:.1f}s", flush=True)
