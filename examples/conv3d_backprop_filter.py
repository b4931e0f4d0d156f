"""Seed 000's example, built ahead of time for this CPU and checked against NumPy.

Everything down to ``dsl.conv3d_backprop_filter(...)`` is the TBE documentation's example with only
its import line changed; the rest schedules it, builds ``kernel_meta/<kernel_name>.so`` + ``.json``,
runs the kernel on random data and compares it with tbe_like's independent NumPy reference.
"""

import time

import numpy as np

from tbe_like import dsl, tvm

shape_dedy = (16, 4, 1, 36, 36, 16)
out_backprop_dtype = "float16"
filter_sizes = [16, 2, 16, 3, 3]
shape_fmap = (16, 8, 1, 72, 72, 16)
x_dtype = "float16"

dedy = tvm.placeholder(shape_dedy, name="dedy", dtype=out_backprop_dtype)
fmap = tvm.placeholder(shape_fmap, name="fmap", dtype=x_dtype)

strides = [2, 2, 2]
pads = [0, 0, 0, 1, 0, 1]
dilations = [1, 1, 1, 1, 1]
res_dtype = "float32"
kernel_name = "conv3d_backprop_filter_dx_16_8_72_72_16_dy_16_4_36_36_16_dw_2_3_3_16_16_s_1_2_2_2_1_p_SAME"
group_dict = {'real_g': 1, 'mag_factor': 1, 'cin1_g': 1, 'cout_g': 16, 'cin_ori': 16, 'cout_ori': 16}

para_dict = {
    "strides": strides,
    "pads": pads,
    "dilations": dilations,
    "res_dtype": res_dtype,
    "kernel_name": kernel_name,
    "group_dict": group_dict
}

dedw = dsl.conv3d_backprop_filter(
    x=fmap,
    out_backprop=dedy,
    filter_size=filter_sizes,
    para_dict=para_dict
)

# ---- beyond the seed: schedule, build ahead of time, run, check --------------------------------
from tbe_like import layout, load_kernel  # noqa: E402
from tbe_like.testing import reference  # noqa: E402


def main() -> None:
    start = time.perf_counter()
    sch = dsl.auto_schedule(dedw)
    dsl.build(sch, {"name": kernel_name, "tensor_list": [fmap, dedy, dedw]})
    print(f"built kernel_meta/{kernel_name}.so for {sch.target} in "
          f"{time.perf_counter() - start:.2f} s")
    print(f"schedule: {sch.describe()}")  # measured on a first build, then the record
    kernel = load_kernel(f"kernel_meta/{kernel_name}.so")  # as another process would

    rng = np.random.default_rng(0)
    n, cin, cout = shape_fmap[0], group_dict["cin_ori"], group_dict["cout_ori"]
    x = rng.standard_normal((n, cin, shape_fmap[1], *shape_fmap[3:5])).astype(x_dtype)
    dy = rng.standard_normal((n, cout, shape_dedy[1], *shape_dedy[3:5])).astype(x_dtype)
    dw = kernel(layout.to_ndc1hwc0(x), layout.to_ndc1hwc0(dy))

    kd, cin_g, kh, kw = filter_sizes[1:]
    ref = reference.conv3d_backprop_filter(x, dy, (kd, kh, kw), strides, pads, dilations[1::2][:1]
                                           + dilations[3:], groups=1)
    expected = layout.to_fractal_z_3d(ref, groups=1).reshape(dw.shape)
    err = np.abs(dw.astype(np.float64) - expected).max()
    scale = np.abs(expected).max()
    seconds = kernel.time(layout.to_ndc1hwc0(x), layout.to_ndc1hwc0(dy))
    gflops = 2 * n * cout * np.prod(shape_dedy[1:2] + shape_dedy[3:5]) * cin_g * kd * kh * kw
    print(f"dw {dw.shape} {dw.dtype}: max abs error {err:.3e} (max |dw| {scale:.1f}, relative "
          f"{err / scale:.2e})")
    print(f"kernel time {seconds * 1e3:.2f} ms ({gflops / seconds / 1e9:.1f} GFLOP/s)")
    if not err <= 1e-4 * scale:
        raise SystemExit("FAILED: the kernel does not match the NumPy reference")
    print("OK")


if __name__ == "__main__":
    main()
