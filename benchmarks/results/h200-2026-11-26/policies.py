"""Compare tile-shrinking policies for under-filled GEMMs on the GPU (default knobs otherwise)."""
import concurrent.futures, multiprocessing, os, sys, tempfile, time
from dataclasses import replace
sys.path.insert(0, "benchmarks")
import numpy as np
from bench_cuda import SUITE, _data, _gpu_time, _tbe_args, graph


def _none(extents, tile, target, op):
    return tile


def _warps(extents, tile, target, op):
    from tbe_like.schedules.cuda import knobs as K
    while K._blocks(extents, tile, K._split_for(extents, tile, target, op)) < K.sm_count(target):
        tm, tn, _ = tile.shape
        if tm >= tn and tile.frag_m > 1:
            tile = replace(tile, frag_m=tile.frag_m // 2)
        elif tm >= tn and tile.warp_m > 1 and tile.warp_m * tile.warp_n > 4:
            tile = replace(tile, warp_m=tile.warp_m // 2)
        elif tile.frag_n > 1:
            tile = replace(tile, frag_n=tile.frag_n // 2)
        elif tile.warp_n > 1 and tile.warp_m * tile.warp_n > 4:
            tile = replace(tile, warp_n=tile.warp_n // 2)
        elif tile.frag_m > 1:
            tile = replace(tile, frag_m=tile.frag_m // 2)
        else:
            break
    return tile


def _half(extents, tile, target, op):  # frags halved until at least half a wave of SMs
    from tbe_like.schedules.cuda import knobs as K
    while (2 * K._blocks(extents, tile, K._split_for(extents, tile, target, op))
           < K.sm_count(target) and tile.frag_m * tile.frag_n > 1):
        tm, tn, _ = tile.shape
        if tile.frag_m > 1 and (tm >= tn or tile.frag_n == 1):
            tile = replace(tile, frag_m=tile.frag_m // 2)
        else:
            tile = replace(tile, frag_n=tile.frag_n // 2)
    return tile


def _simt_old(m, n, k):
    from tbe_like.schedules.cuda.knobs import SimtTile, _fit
    threads_n = 16 if n > 8 else 8
    threads_m = 16 if m > 8 else 8
    return SimtTile(threads_m, threads_n, _fit(m, threads_m, (1, 2, 4)),
                    _fit(n, threads_n, (1, 2, 4)), 16 if k >= 16 else 8)


def _simt_n1(m, n, k):
    from tbe_like.schedules.cuda.knobs import SimtTile, _fit
    threads_n = 32 if n >= 32 else 16 if n > 8 else 8
    return SimtTile(8, threads_n, _fit(m, 8, (1, 2, 4)), 1, 8)


_ORIGINAL = None
KIND = os.environ.get("KIND", "filling")
POLICIES = ({"none": _none, "frags": None, "warps": _warps, "half": _half} if KIND == "filling"
            else {"new": None, "old": _simt_old, "n1": _simt_n1})


def _build(job):
    op, name, dtype, policy, out_dir = job
    from tbe_like import dsl
    from tbe_like.schedules.cuda import knobs as K
    global _ORIGINAL
    attr = "_filling" if KIND == "filling" else "_simt_tile"
    if _ORIGINAL is None:
        _ORIGINAL = getattr(K, attr)
    setattr(K, attr, POLICIES[policy] or _ORIGINAL)
    res, tensors = graph(op, SUITE[name], dtype)
    sch = dsl.auto_schedule(res, target={"kind": "cuda", "arch": "sm_90"})
    kname = f"p_{op}_{name}_{dtype}_{policy}".replace("-", "_")
    dsl.build(sch, {"name": kname, "tensor_list": tensors, "output_dir": out_dir})
    return job, os.path.join(out_dir, kname + ".json")


def main():
    import torch
    from tbe_like import load_kernel
    dtype = sys.argv[1] if len(sys.argv) > 1 else "float16"
    names = [n for n in SUITE]
    with tempfile.TemporaryDirectory() as out_dir:
        jobs = [(op, n, dtype, p, out_dir) for n in names for op in ("dw", "dx") for p in POLICIES]
        ctx = multiprocessing.get_context("spawn")
        t0 = time.time()
        with concurrent.futures.ProcessPoolExecutor(os.cpu_count(), mp_context=ctx) as pool:
            built = dict(pool.map(_build, jobs))
        print(f"built {len(jobs)} in {time.time() - t0:.0f} s", flush=True)
        for n in names:
            s = SUITE[n]
            x, w, dy = _data(s, dtype)
            for op in ("dw", "dx"):
                args = _tbe_args(op, s, x, w, dy, dtype)
                ref, cells = None, []
                for p in POLICIES:
                    k = load_kernel(built[(op, n, dtype, p, out_dir)])
                    got = k(*args).float()
                    if ref is None:
                        ref = got
                    err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                    ms = _gpu_time(k.runner(*args, sync=False), 7)
                    cells.append(f"{p} {ms:7.3f}{' WRONG' if err > 2e-2 else ''}")
                print(f"{n:14s} {op} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
