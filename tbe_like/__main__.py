"""``python -m tbe_like tune ...``: tune one convolution gradient with MetaSchedule.

Example (the second shape of the CPU benchmark, weight gradient, 64 trials)::

    python -m tbe_like tune --gradient weight --input 2,64,16,56,56 --cout 128 --kernel 3 \\
        --stride 1 --padding 1 --trials 64

The best records go to ``--records`` (default: ``<cache dir>/records``, which builds read);
``--records tbe_like/records`` adds them to the records shipped with the package.
"""

from __future__ import annotations

import argparse
import sys
import time


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None


def _tune(args) -> int:

    from . import ops
    from .cache import cache_dir
    from .ops import kernels
    from .ops.convolution_backward import conv_of, graph_of
    from .schedules.common import SAMPLE
    from .target import resolve_target
    from .tune import tune

    x = args.input
    nd = len(x) - 2
    k = args.kernel * nd if len(args.kernel) == 1 else args.kernel

    def per_axis(v):
        return v * nd if len(v) == 1 else v

    stride, padding, dilation = per_axis(args.stride), per_axis(args.padding), \
        per_axis(args.dilation)
    out = [(i + 2 * p - d * (kk - 1) - 1) // s + 1
           for i, kk, s, p, d in zip(x[2:], k, stride, padding, dilation, strict=True)]
    w_shape = (args.cout, x[1] // args.groups, *k)
    go_shape = (x[0], args.cout, *out)
    p = ops.convolution_backward_params(
        go_shape, args.dtype, tuple(x), args.dtype, w_shape, args.dtype, bias_sizes=None,
        stride=stride, padding=padding, dilation=dilation, transposed=False,
        output_padding=0, groups=args.groups,
        output_mask=(args.gradient == "input", args.gradient == "weight", False),
        cube_math_type=args.cube_math_type)
    conv = conv_of(p)
    target = resolve_target(args.target)
    prec = kernels.Precision.on(target, p.dtype, p.compute_dtype, p.hf32)
    graph = graph_of("grad_" + args.gradient, conv, prec, target=target)
    records = args.records or str(cache_dir() / "records")
    print(f"tuning the {args.gradient} gradient of x {tuple(x)} -> y {go_shape}, weight "
          f"{w_shape}, stride {stride}, padding {padding}, dilation {dilation}, groups "
          f"{args.groups}, {args.dtype}, for {target}; {args.trials} trials into {records}")
    func = kernels.prim_func(graph)

    def space(sch):
        return kernels.schedule(sch, graph, target, knobs=SAMPLE)

    def default(sch):
        return kernels.schedule(sch, graph, target)

    start = time.perf_counter()
    best = tune(func, space, target, args.trials, records, conv.flops(),
                per_iter=args.per_iter, default=default, search=args.search)
    minutes = (time.perf_counter() - start) / 60
    flops = conv.flops()
    print(f"best {best * 1e3:.3f} ms ({flops / best / 1e9:.1f} GFLOP/s) after {args.trials} "
          f"trials in {minutes:.1f} min")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tbe_like")
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tune", help="tune one convolution gradient (MetaSchedule + XGBoost)")
    t.add_argument("--gradient", choices=("weight", "input"), required=True)
    t.add_argument("--input", type=_ints, required=True, help="N,C,[D,[H,]]W of x")
    t.add_argument("--cout", type=int, required=True)
    t.add_argument("--kernel", type=_ints, required=True, help="k or k per axis")
    t.add_argument("--stride", type=_ints, default=[1])
    t.add_argument("--padding", type=_ints, default=[0])
    t.add_argument("--dilation", type=_ints, default=[1])
    t.add_argument("--groups", type=int, default=1)
    t.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    t.add_argument("--cube-math-type", type=int, default=0)
    t.add_argument("--trials", type=int, default=64, help="0: no search (see --search)")
    t.add_argument("--per-iter", type=int, default=16, help="candidates measured per round")
    t.add_argument("--target", default=None, help='"llvm" (this CPU, default) or "cuda"')
    t.add_argument("--records", default=None, help="records folder (default: the user's)")
    t.add_argument("--search", default=None,
                   help="where every measured candidate is kept (default: <records>/search); "
                        "with --trials 0, select from it without searching")
    args = ap.parse_args(argv)
    if args.command == "tune":
        return _tune(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
