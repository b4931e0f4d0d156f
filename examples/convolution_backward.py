"""convolution_backward (aclnnConvolutionBackward semantics) on NumPy arrays, in two phases.

Phase 1 (aclnn's GetWorkspaceSize): ``prepare_convolution_backward`` validates the shapes and
parameters and compiles the kernels (or loads them from the kernel cache). Phase 2: the executor
runs on NCDHW arrays as they are, as often as needed, without compiling. Checked against
tbe_like's NumPy reference (and against PyTorch when it is installed). The second part runs
aclnn's documented example, gradOutput/input (2,2,7,7,7) with weight (2,2,1,1,1).
"""

import time

import numpy as np

from tbe_like import ops
from tbe_like.testing import reference

# A 3D layer in float32: N=2, C=32 -> 32, D=8, H=W=28, 3x3x3, stride 1, pad 1, groups 1.
GRAD_OUTPUT, INPUT, WEIGHT = (2, 32, 8, 28, 28), (2, 32, 8, 28, 28), (32, 32, 3, 3, 3)
PARAMS = dict(stride=[1, 1, 1], padding=[1, 1, 1], dilation=[1, 1, 1], transposed=False,
              output_padding=[0, 0, 0], groups=1)


def check(got, want, what: str) -> float:
    err = max(np.abs(g.astype(np.float64) - w).max() / np.abs(w).max()
              for g, w in zip(got, want, strict=True) if g is not None)
    print(f"{what}: max relative error {err:.2e}")
    return err


def main() -> None:
    rng = np.random.default_rng(0)
    go = rng.standard_normal(GRAD_OUTPUT).astype(np.float32)
    x = rng.standard_normal(INPUT).astype(np.float32)
    w = rng.standard_normal(WEIGHT).astype(np.float32)

    start = time.perf_counter()
    executor = ops.prepare_convolution_backward(go, x, w, bias_sizes=[WEIGHT[0]],
                                                output_mask=(True, True, True), **PARAMS)
    print(f"prepared {executor} in {time.perf_counter() - start:.2f} s "
          f"(workspace {executor.workspace_size / 2**20:.1f} MiB)")
    grads = executor(go, x, w)
    want = reference.convolution_backward(go, x, w, output_mask=(True, True, True), **PARAMS)
    err = check(grads, want, "grad_input, grad_weight, grad_bias vs NumPy")

    runs = []
    for _ in range(5):
        start = time.perf_counter()
        executor(go, x, w)
        runs.append(time.perf_counter() - start)
    seconds = float(np.median(runs))
    flops = 2 * executor.params.flops()  # grad_input + grad_weight
    print(f"kernel time {seconds * 1e3:.2f} ms per call, both gradients "
          f"({flops / seconds / 1e9:.1f} GFLOP/s, host copies included)")

    # aclnn's example: 1x1x1 kernel, all outputs.
    go2 = rng.standard_normal((2, 2, 7, 7, 7)).astype(np.float32)
    x2 = rng.standard_normal((2, 2, 7, 7, 7)).astype(np.float32)
    w2 = rng.standard_normal((2, 2, 1, 1, 1)).astype(np.float32)
    params2 = dict(stride=[1, 1, 1], padding=[0, 0, 0], dilation=[1, 1, 1], transposed=False,
                   output_padding=[0, 0, 0], groups=1)
    got2 = ops.convolution_backward(go2, x2, w2, bias_sizes=[2], **params2)
    want2 = reference.convolution_backward(go2, x2, w2, output_mask=(True, True, True),
                                           **params2)
    err = max(err, check(got2, want2, "aclnn example (2,2,7,7,7) x (2,2,1,1,1)"))

    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        t = torch.ops.aten.convolution_backward(
            torch.from_numpy(go), torch.from_numpy(x), torch.from_numpy(w), [WEIGHT[0]],
            PARAMS["stride"], PARAMS["padding"], PARAMS["dilation"], False, [0, 0, 0], 1,
            [True, True, True])
        err = max(err, check(grads, [a.double().numpy() for a in t], "vs PyTorch"))
    print(f"max abs error {err:.3e} (relative, over every output)")
    if not err <= 1e-4:
        raise SystemExit("FAILED: the kernels do not match the reference")
    print("OK")


if __name__ == "__main__":
    main()
