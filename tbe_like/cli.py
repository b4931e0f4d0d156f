"""The ``tbe-like`` command (also ``python -m tbe_like``).

    tbe-like tune --gradient weight --input 2,64,16,56,56 --cout 128 --kernel 3 --padding 1
    tbe-like tune --network r2plus1d_18 --budget 30                  # a whole network, 30 min
    tbe-like tune --network my_net.json --trials 200 --rpc-tracker HOST:9190 --rpc-key zen4
    tbe-like records list | merge OTHER_FOLDER_OR_ARCHIVE | prune
    tbe-like bench --network r2plus1d_18                              # vs PyTorch: table, JSON, PNG
    tbe-like inspect kernel_meta/dw_seed.json
    tbe-like build --network c3d --target '{"kind": "cuda", "arch": "sm_90"}' --out kernels/

Records go to ``--records`` (default ``<cache dir>/records``, which builds read); log lines of
MetaSchedule and XGBoost go to ``<records>/logs``, the terminal gets one line per kernel's
batch of measurements and an overall bar, and ``<records>/curves`` a tuning curve per kernel
(JSON, and a PNG with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None


def _target_arg(text: str | None):
    """``--target``: "llvm", "cuda" or a JSON target dict."""
    if text is None or text in ("llvm", "cuda"):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise SystemExit(f"tbe-like: --target must be 'llvm', 'cuda' or a JSON dict, got "
                         f"{text!r}") from None


def _records_dir(args) -> Path:
    from .cache import cache_dir

    return Path(args.records) if args.records else cache_dir() / "records"


# ----------------------------------------------------------------------------- kernels


def kernel_task(gradient: str, x: list[int], cout: int, kernel: list[int], stride: list[int],
                padding: list[int], dilation: list[int], groups: int, dtype: str,
                cube_math_type: int, target, name: str | None = None, weight: float = 1.0):
    """The ``tune.Task`` of one gradient ("weight" or "input") of a convolution of NC...
    input ``x``, as ``ops.convolution_backward`` builds it."""
    from . import ops
    from .ops import kernels
    from .ops.convolution_backward import _other_forms, conv_of, graph_of
    from .schedules.common import SAMPLE
    from .tune import Task

    nd = len(x) - 2

    def per_axis(v):
        return list(v) * nd if len(v) == 1 else list(v)

    k, stride, padding, dilation = map(per_axis, (kernel, stride, padding, dilation))
    out = [(i + 2 * p - d * (kk - 1) - 1) // s + 1
           for i, kk, s, p, d in zip(x[2:], k, stride, padding, dilation, strict=True)]
    w_shape = (cout, x[1] // groups, *k)
    go_shape = (x[0], cout, *out)
    p = ops.convolution_backward_params(
        go_shape, dtype, tuple(x), dtype, w_shape, dtype, bias_sizes=None, stride=stride,
        padding=padding, dilation=dilation, transposed=False, output_padding=0, groups=groups,
        output_mask=(gradient == "input", gradient == "weight", False),
        cube_math_type=cube_math_type)
    conv = conv_of(p)
    prec = kernels.Precision.on(target, p.dtype, p.compute_dtype, p.hf32)
    graph = graph_of("grad_" + gradient, conv, prec, target=target)
    forms = _other_forms(graph, "grad_" + gradient, conv, prec, False, target)

    def space(sch):
        return kernels.schedule(sch, graph, target, knobs=SAMPLE)

    def default(sch):
        return kernels.schedule(sch, graph, target)

    label = name or (f"{gradient}_x{'x'.join(map(str, x))}_co{cout}_k{'x'.join(map(str, k))}")
    # A record must beat what a build without one races, every form of the kernel included.
    untuned = tuple(kernels.selection_forms(graph, target, forms))
    return Task(label, kernels.prim_func(graph), space, default, conv.flops(), weight, untuned)


def network_tasks(network: str, dtype: str, target, gradients=("weight", "input")):
    """The tasks of every distinct layer of a network (shipped name or JSON file), each
    weighted by how many times the network runs it."""
    from . import networks

    net = networks.load(network)
    tasks = []
    for layer in net.layers:
        for gradient in gradients:
            tasks.append(kernel_task(
                gradient, [layer.n, layer.cin, *layer.spatial], layer.cout, list(layer.kernel),
                list(layer.stride), list(layer.pad), list(layer.dilation), layer.groups, dtype,
                0, target, name=f"{layer.name}.{gradient}", weight=layer.count))
    return net, tasks


# ----------------------------------------------------------------------------- subcommands


def _tune(args) -> int:
    from .target import resolve_target
    from .tune import Rpc, tune_tasks

    target = resolve_target(_target_arg(args.target))
    records = _records_dir(args)
    if args.network:
        net, tasks = network_tasks(args.network, args.dtype, target, args.gradients)
        what = f"network {net.name} ({len(net.layers)} layers, {len(tasks)} kernels)"
    else:
        missing = [f"--{n}" for n in ("gradient", "input", "cout", "kernel")
                   if getattr(args, n) is None]
        if missing:
            raise SystemExit(f"tbe-like tune: give --network, or one layer with "
                             f"{', '.join(missing)}")
        tasks = [kernel_task(args.gradient, args.input, args.cout, args.kernel, args.stride,
                             args.padding, args.dilation, args.groups, args.dtype,
                             args.cube_math_type, target)]
        what = tasks[0].name
    rpc = Rpc(args.rpc_tracker, args.rpc_key) if args.rpc_tracker else None
    if rpc is not None and not args.rpc_key:
        raise SystemExit("tbe-like tune: --rpc-tracker needs --rpc-key")
    budget = None if args.budget is None else args.budget * 60
    trials = None if budget is not None else args.trials * len(tasks)
    how = (f"{args.budget} min" if budget is not None else f"{trials} trials") + (
        f", measured on the servers of {rpc.tracker} key {rpc.key}" if rpc else "")
    print(f"tuning {what} for {target}: {how}; records in {records}", file=sys.stderr)
    start = time.perf_counter()
    results = tune_tasks(tasks, target, records, trials=trials, budget_s=budget,
                         per_iter=args.per_iter, rpc=rpc, search=args.search)
    gained = [base / best for best, base in results.values() if best > 0]
    print(f"done in {(time.perf_counter() - start) / 60:.1f} min; {len(results)} kernels, "
          f"best/untuned speed-up up to {max(gained, default=1):.2f}x", file=sys.stderr)
    return 0


def _records(args) -> int:
    from .target import host_target
    from .tune import merge_records, prune_records, record_rows, target_key

    folder = _records_dir(args)
    if args.action == "list":
        rows = record_rows(folder)
        if args.json:
            print(json.dumps(rows, indent=1))
            return 0
        print(f"{len(rows)} records in {folder}")
        for r in rows:
            print(f"  {r['workload']} {r['name'] or '-':40s} {r['seconds'] * 1e3:9.3f} ms  "
                  f"{' '.join(v for v in r['target'] if v)}")
        return 0
    if args.action == "merge":
        if not args.source:
            raise SystemExit("tbe-like records merge: give the folder or archive to merge")
        merge_records(args.source, folder)
        return 0
    gone = prune_records(folder, target_key(host_target()))
    print(f"removed {gone} records of other hosts from {folder}")
    return 0


def _inspect(args) -> int:
    from .kernel import read_metadata

    path = Path(args.kernel)
    if path.suffix != ".json":
        path = path.with_suffix(".json")
    meta = read_metadata(path)
    print(f"kernel {meta['kernel_name']} ({meta.get('op', '?')}), built with TVM "
          f"{meta.get('tvm_version', '?')}")
    print(f"  library: {path.with_name(meta['library'])}")
    print(f"  target: {json.dumps(meta.get('target'))}")
    if meta.get("required_cpu_features"):
        print(f"  needs CPU features: {', '.join(meta['required_cpu_features'])}")
    for role in ("inputs", "outputs"):
        for t in meta.get(role, []):
            print(f"  {role[:-1]} {t['name']}: {t['dtype']}{list(t['shape'])} {t['layout']}")
    if meta.get("para_dict"):
        print(f"  parameters: {json.dumps(meta['para_dict'])}")
    return 0


def _bench(args) -> int:
    """``tbe-like bench ...``: :mod:`tbe_like.bench` with the user's records applied."""
    from . import bench

    argv = list(args.rest)
    if not any(a == "--records" or a.startswith("--records=") or a == "--untuned"
               for a in argv):
        argv += ["--records", str(_records_dir(argparse.Namespace(records=None)))]
    return bench.main(argv, prog="tbe-like bench")


def _build(args) -> int:
    from . import networks
    from .target import host_target, resolve_target
    from .tune import MEASURE_ENV, target_key

    target = resolve_target(_target_arg(args.target))
    elsewhere = target_key(target) != target_key(host_target())
    net = networks.load(args.network)
    saved = os.environ.get(MEASURE_ENV)
    if elsewhere:  # measured selection would time the candidates on the wrong machine
        os.environ[MEASURE_ENV] = "0"
    try:
        _build_layers(net, target, args)
    finally:
        if saved is None:
            os.environ.pop(MEASURE_ENV, None)
        else:
            os.environ[MEASURE_ENV] = saved
    where = "" if not elsewhere else " (built for another machine: not timed here)"
    print(f"{len(net.layers)} layers of {net.name} in {args.out}{where}")
    return 0


def _build_layers(net, target, args) -> None:
    from . import KernelLoadError, ops
    from .cache import KernelCache

    cache = KernelCache(args.out)
    for layer in net.layers:
        x_shape = (layer.n, layer.cin, *layer.spatial)
        w_shape = (layer.cout, layer.cin // layer.groups, *layer.kernel)
        go_shape = (layer.n, layer.cout, *layer.out_spatial())
        specs = [argparse.Namespace(shape=s, dtype=args.dtype)
                 for s in (go_shape, x_shape, w_shape)]
        start = time.perf_counter()
        try:
            ops.prepare_convolution_backward(
                *specs, bias_sizes=None, stride=list(layer.stride), padding=list(layer.pad),
                dilation=list(layer.dilation), groups=layer.groups,
                output_mask=(True, True, False), target=target, cache=cache)
        except KernelLoadError:  # built, but this machine cannot load it (no GPU)
            pass
        print(f"{layer.name}: built in {time.perf_counter() - start:.1f} s", flush=True)


# ----------------------------------------------------------------------------- parser


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tbe-like", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)

    t = sub.add_parser("tune", help="tune one convolution gradient or a whole network")
    t.add_argument("--network", default=None,
                   help="a shipped network's name (tbe_like.networks) or a network JSON file")
    t.add_argument("--gradients", nargs="+", default=["weight", "input"],
                   choices=("weight", "input"), help="with --network: which gradients")
    t.add_argument("--gradient", choices=("weight", "input"))
    t.add_argument("--input", type=_ints, help="N,C,[D,[H,]]W of x")
    t.add_argument("--cout", type=int)
    t.add_argument("--kernel", type=_ints, help="k or k per axis")
    t.add_argument("--stride", type=_ints, default=[1])
    t.add_argument("--padding", type=_ints, default=[0])
    t.add_argument("--dilation", type=_ints, default=[1])
    t.add_argument("--groups", type=int, default=1)
    t.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    t.add_argument("--cube-math-type", type=int, default=0)
    t.add_argument("--trials", type=int, default=64, help="trials per kernel (default 64)")
    t.add_argument("--budget", type=float, default=None,
                   help="minutes for the whole search instead of --trials")
    t.add_argument("--per-iter", type=int, default=16, help="candidates measured per batch")
    t.add_argument("--target", default=None,
                   help='"llvm" (this CPU, default), "cuda" or a JSON target dict')
    t.add_argument("--records", default=None, help="records folder (default: the user's)")
    t.add_argument("--search", default=None,
                   help="where every measured candidate is kept (default: <records>/search); "
                        "with --trials 0, select from it without searching")
    t.add_argument("--rpc-tracker", default=None, metavar="HOST:PORT",
                   help="measure on the RPC servers of this TVM tracker")
    t.add_argument("--rpc-key", default=None, help="the servers' key at the tracker")

    r = sub.add_parser("records", help="list, merge or prune a records folder")
    r.add_argument("action", choices=("list", "merge", "prune"))
    r.add_argument("source", nargs="?", help="merge: a records folder or a .tar.gz/.zip of one")
    r.add_argument("--records", default=None, help="records folder (default: the user's)")
    r.add_argument("--json", action="store_true", help="list: as JSON")

    bench = sub.add_parser("bench", add_help=False,
                           help="time the benchmark suite or a network's layers against PyTorch "
                                "(table, JSON, bar chart); tbe-like bench --help")
    bench.add_argument("rest", nargs=argparse.REMAINDER)

    i = sub.add_parser("inspect", help="what a built kernel is")
    i.add_argument("kernel", help="the kernel's .json (or .so)")

    b = sub.add_parser("build", help="build a network's kernels ahead of time, not run")
    b.add_argument("--network", required=True)
    b.add_argument("--out", required=True, help="folder for the kernels")
    b.add_argument("--target", default=None)
    b.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its own parser (tbe_like.bench) takes the rest as it is
        args = argparse.Namespace(command="bench", rest=argv[1:])
    else:
        args = parser().parse_args(argv)
    commands = {"tune": _tune, "records": _records, "inspect": _inspect, "build": _build,
                "bench": _bench}
    try:
        return commands[args.command](args)
    except KeyboardInterrupt:
        print("\ntbe-like: interrupted; what was measured is kept (run the same command again "
              "to continue)", file=sys.stderr)
        return 130
    except (ValueError, TypeError) as e:
        print(f"tbe-like {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
