"""Train measured selection's ranking model (``tbe_like.ranking``) on the development half.

    python benchmarks/train_ranking.py --train dev.json [dev2.json ...] \\
        --evaluate validation.json [...] [--out tbe_like/records/ranking_znver4.json]

``--train``: JSON files of ``tbe-like bench --network dev`` runs (each row's selection holds
the fastest call of every candidate it timed); rows of the validation half's networks are
refused. ``--evaluate``: runs of the validation half, never trained on: for each kernel, the
candidates the model keeps (``ranking.TOP_K``) against all it timed, as the time of the best
kept over the best of all (1.0: the same pick). The model is written only with ``--out``, for
the host class of the runs (their LLVM ``mcpu``, vector width and cores, which must agree).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np
import xgboost

from tbe_like import networks, ranking

# XGBoost's parameters: pairs of candidates of one kernel, shallow trees.
PARAMS = {"objective": "rank:pairwise", "eta": 0.1, "max_depth": 5, "min_child_weight": 1,
          "subsample": 0.9, "colsample_bytree": 0.9, "seed": 0}
ROUNDS = 200


def _rows(paths: list[str]) -> tuple[list[dict], dict]:
    rows, host = [], None
    for path in paths:
        run = json.loads(Path(path).read_text(encoding="utf-8"))
        this = (run["host"]["mcpu"], run["host"]["vector_bits"], int(run.get("threads", 0)))
        if host is not None and this != host:
            sys.exit(f"{path}: another host class {this} than {host}")
        host = this
        rows += [r for r in run["rows"] if len((r.get("selection") or {}).get("times_ms", {})) > 1
                 and all(math.isfinite(t) for t in r["selection"]["times_ms"].values())]
    return rows, {"mcpu": host[0], "vector_bits": host[1], "cores": host[2]}


def _matrix(rows: list[dict], host: dict):
    """Features, relevance (higher is faster: minus log2 of the time over the row's best)
    and group sizes."""
    x, y, groups = [], [], []
    for r in rows:
        times = r["selection"]["times_ms"]
        best = min(times.values())
        for name, t in times.items():
            x.append(ranking.features(r, name, host["vector_bits"], host["cores"]))
            y.append(-math.log2(t / best))
        groups.append(len(times))
    return np.array(x, dtype=np.float32), np.array(y, dtype=np.float32), groups


def regret(booster, rows: list[dict], host: dict, top_k: int) -> list[float]:
    """Per kernel: the best time among the ``top_k`` the model keeps over the best of all."""
    out = []
    for r in rows:
        times = r["selection"]["times_ms"]
        names = list(times)
        order = ranking.order(booster, [ranking.features(r, n, host["vector_bits"],
                                                         host["cores"]) for n in names])
        kept = ranking.keep(order, len(names), top_k)
        out.append(min(times[names[i]] for i in kept) / min(times.values()))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", nargs="+", required=True)
    ap.add_argument("--evaluate", nargs="*", default=[])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    train, host = _rows(args.train)
    validation = set(networks.halves()["validation"])
    refused = sorted({r["network"] for r in train if r.get("network") in validation})
    if refused:
        sys.exit(f"--train holds rows of the validation half ({', '.join(refused)}): "
                 "the model is trained on the development half only")
    x, y, groups = _matrix(train, host)
    data = xgboost.DMatrix(x, label=y, feature_names=list(ranking.FEATURES))
    data.set_group(groups)
    booster = xgboost.train(PARAMS, data, num_boost_round=ROUNDS)
    print(f"trained on {len(train)} kernels, {len(y)} candidates ({host})")
    for label, rows in (("development (trained on)", train),
                        *((("validation", _rows(args.evaluate)[0]),) if args.evaluate else ())):
        counts = [len(r["selection"]["times_ms"]) for r in rows]
        for k in (2, 3, 4, 5, 6):
            lost = regret(booster, rows, host, k)
            timed = sum(min(c, k) for c in counts) / sum(counts)
            print(f"{label:26s} top {k}: timed {timed:4.0%} of the candidates; best kept / "
                  f"best: geomean {math.exp(statistics.fmean(map(math.log, lost))):.4f}, "
                  f"worst {max(lost):.3f}, kernels above 1.05: "
                  f"{sum(v > 1.05 for v in lost)} of {len(lost)}")
    if args.out:
        ranking.write_model(args.out, booster, host["mcpu"], host["vector_bits"], host["cores"],
                            ["/".join(Path(p).resolve().parts[-2:]) for p in args.train],
                            len(train))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
