"""The input gradient of a real-sized 3D convolution, built ahead of time and checked.

A ResNet3D-like layer: N=2, Cin=64, D=8, H=W=28, Cout=64, 3x3x3 kernel, stride 1, pad 1, in
float16 as on Ascend, through ``dsl.conv3d_backprop_input``; the kernel lands in ``kernel_meta/``,
runs on random data and is compared with tbe_like's independent NumPy reference.
"""

import time

import numpy as np

from tbe_like import dsl, layout, load_kernel, tvm
from tbe_like.testing import reference

N, CIN, D, H, W, COUT, K = 2, 64, 8, 28, 28, 64, (3, 3, 3)
STRIDES, PADS, DILATIONS = (1, 1, 1), (1, 1, 1, 1, 1, 1), (1, 1, 1)
DTYPE = "float16"
KERNEL_NAME = "conv3d_backprop_input_n2_c64_d8_h28_w28_k64_3x3x3_s1_p1"


def main() -> None:
    out_sp = reference.conv3d_output_spatial((D, H, W), K, STRIDES, PADS, DILATIONS)
    filter_shape = layout.fractal_z_3d_shape((COUT, CIN, *K))
    dedy_shape = (N, out_sp[0], COUT // 16, out_sp[1], out_sp[2], 16)
    filt = tvm.placeholder(filter_shape, name="filter", dtype=DTYPE)
    dedy = tvm.placeholder(dedy_shape, name="dedy", dtype=DTYPE)
    para_dict = {"strides": [1, *STRIDES, 1], "pads": list(PADS),
                 "dilations": [1, *DILATIONS, 1], "res_dtype": "float16",
                 "kernel_name": KERNEL_NAME}
    dedx = dsl.conv3d_backprop_input(filt, dedy, [COUT, CIN, *K], [N, D, H, W, CIN], para_dict)

    start = time.perf_counter()
    sch = dsl.auto_schedule(dedx)
    dsl.build(sch, {"name": KERNEL_NAME, "tensor_list": [filt, dedy, dedx]})
    print(f"built kernel_meta/{KERNEL_NAME}.so for {sch.target} in "
          f"{time.perf_counter() - start:.2f} s")
    print(f"schedule: {sch.describe()}")  # measured on a first build, then the record
    kernel = load_kernel(f"kernel_meta/{KERNEL_NAME}.so")

    rng = np.random.default_rng(0)
    w = rng.standard_normal((COUT, CIN, *K)).astype(DTYPE)
    dy = rng.standard_normal((N, COUT, *out_sp)).astype(DTYPE)
    args = (layout.to_fractal_z_3d(w), layout.to_ndc1hwc0(dy))
    dx = kernel(*args)

    expected = reference.conv3d_backprop_input(dy, w, (D, H, W), STRIDES, PADS, DILATIONS)
    expected = layout.to_ndc1hwc0(expected).reshape(dx.shape)
    err = np.abs(dx.astype(np.float64) - expected).max()
    scale = np.abs(expected).max()
    seconds = kernel.time(*args)
    flops = 2 * N * COUT * np.prod(out_sp) * CIN * np.prod(K)
    print(f"dx {dx.shape} {dx.dtype}: max abs error {err:.3e} (max |dx| {scale:.1f}, relative "
          f"{err / scale:.2e})")
    print(f"kernel time {seconds * 1e3:.2f} ms ({flops / seconds / 1e9:.1f} GFLOP/s)")
    # float16 output: half an ulp of the largest value is ~5e-4 relative.
    if not err <= 2e-3 * scale:
        raise SystemExit("FAILED: the kernel does not match the NumPy reference")
    print("OK")


if __name__ == "__main__":
    main()
