"""DeconvGradFilter (seed 002): the filter gradient of a transposed 2D convolution, NHWC.

The seed's example (x and dy 4x4 with 16 channels, a 4x4 kernel, pad_u=1, pad_l=2) in float32,
then a larger float16 case with stride 2 and groups; both against tbe_like's NumPy reference,
which follows SPEC.md's formula.
"""

import time

import numpy as np

from tbe_like import ops
from tbe_like.testing import reference

CASES = [
    # (dy NHWC, x NHWC, kernel, stride, pad (u, l), dilation, group, dtype)
    ((2, 4, 4, 16), (2, 4, 4, 16), (4, 4), (1, 1), (1, 2), (1, 1), 1, "float32"),
    ((8, 56, 56, 64), (8, 28, 28, 32), (3, 3), (2, 2), (1, 1), (1, 1), 2, "float16"),
]


def main() -> None:
    rng = np.random.default_rng(0)
    worst = 0.0
    for dy_shape, x_shape, k, s, p, d, g, dtype in CASES:
        dy = rng.standard_normal(dy_shape).astype(dtype)
        x = rng.standard_normal(x_shape).astype(dtype)
        start = time.perf_counter()
        executor = ops.prepare_deconv_grad_filter(dy, x, kernel=k, stride=s, pad=p,
                                                  dilation=d, group=g)
        built = time.perf_counter() - start
        dw = executor(dy, x)
        want = reference.deconv_grad_filter(dy, x, kernel=k, stride=s, pad=p, dilation=d,
                                            group=g)
        err = np.abs(dw.astype(np.float64) - want).max() / np.abs(want).max()
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            executor(dy, x)
            runs.append(time.perf_counter() - t0)
        seconds = float(np.median(runs))
        flops = 2 * dy_shape[0] * x_shape[1] * x_shape[2] * x_shape[3] * dy_shape[3] // g \
            * k[0] * k[1]
        print(f"dy {dy_shape} x {x_shape} {dtype}: dw {dw.shape}, prepared in {built:.2f} s, "
              f"max abs error {err:.3e} (relative), kernel time {seconds * 1e3:.2f} ms "
              f"({flops / seconds / 1e9:.1f} GFLOP/s)")
        # float16 output: half an ulp is ~5e-4 relative.
        worst = max(worst, err / (2e-3 if dtype == "float16" else 1e-5))
    if not worst <= 1:
        raise SystemExit("FAILED: the kernel does not match the NumPy reference")
    print("OK")


if __name__ == "__main__":
    main()
