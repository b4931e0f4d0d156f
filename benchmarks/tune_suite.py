"""Tune both gradients of the CPU benchmark suite and store the records (what ships in
``tbe_like/records/``).

    python benchmarks/tune_suite.py [--trials 16] [--only NAME ...] [--records DIR]

Each (shape, gradient) is one ``python -m tbe_like tune`` run in its own process (MetaSchedule
is happiest with one tuning per process): every measured candidate goes to ``--search``, then
the best few and the record already stored are re-measured against the untuned template, and
the fastest is kept only where it beats the template (one record per workload and target: a
stored record that the template now beats is removed). The tuning time per shape and the best
time are printed as a table and written as JSON next to the records. Records are per target:
those in the repository were tuned for the CPU named in ``tuning_log.json`` and apply only
there; other machines build the untuned templates (or tune themselves).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import SUITE

REPO = Path(__file__).resolve().parents[1]
BEST = re.compile(r"best ([0-9.]+) ms \(([0-9.]+) GFLOP/s\)")
STORED = re.compile(r"^(stored the|kept the stored) tuned schedule", re.MULTILINE)


def command(shape, gradient: str, trials: int, per_iter: int, records: Path, search: Path
            ) -> list[str]:
    return [sys.executable, "-m", "tbe_like", "tune", "--gradient", gradient,
            "--input", ",".join(map(str, (shape.n, shape.cin, *shape.spatial))),
            "--cout", str(shape.cout), "--kernel", ",".join(map(str, shape.kernel)),
            "--stride", str(shape.stride), "--padding", str(shape.pad),
            "--dilation", str(shape.dilation), "--groups", str(shape.groups),
            "--dtype", shape.dtype, "--trials", str(trials), "--per-iter", str(per_iter),
            "--records", str(records), "--search", str(search)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--per-iter", type=int, default=8)
    ap.add_argument("--only", nargs="*", help="shape names to tune")
    ap.add_argument("--gradients", nargs="*", default=["weight", "input"],
                    choices=["weight", "input"])
    ap.add_argument("--records", default=str(REPO / "tbe_like" / "records"))
    ap.add_argument("--search", default=str(REPO / ".tune_search"),
                    help="every measured candidate (not shipped)")
    ap.add_argument("--select-only", action="store_true",
                    help="no search: re-select the records from --search")
    args = ap.parse_args(argv)
    records, search = Path(args.records), Path(args.search)
    trials = 0 if args.select_only else args.trials
    shapes = [s for s in SUITE if not args.only or s.name in args.only]
    rows = []
    print(f"{'shape':18} {'grad':6} {'trials':>6} {'tune s':>7} {'best ms':>9} {'GF/s':>7}")
    for shape in shapes:
        for gradient in args.gradients:
            start = time.perf_counter()
            run = subprocess.run(command(shape, gradient, trials, args.per_iter, records, search),
                                 capture_output=True, text=True, cwd=REPO)
            seconds = time.perf_counter() - start
            found = BEST.findall(run.stdout)
            if run.returncode != 0 or not found:
                print(run.stdout[-2000:], run.stderr[-2000:], file=sys.stderr)
                print(f"{shape.name} {gradient}: tuning failed (exit {run.returncode})",
                      file=sys.stderr)
                return 1
            ms, gflops = (float(v) for v in found[-1])
            # A record of the workload is kept (new, or the stored one still faster) or none.
            stored = STORED.search(run.stderr) is not None
            rows.append({"shape": shape.name, "gradient": gradient, "trials": trials,
                         "tune_s": round(seconds, 1), "best_ms": ms, "gflops": gflops,
                         "record": stored})
            print(f"{shape.name:18} {gradient:6} {trials:6} {seconds:7.0f} {ms:9.2f} "
                  f"{gflops:7.1f} {'record' if stored else 'untuned template kept'}",
                  flush=True)
    from tbe_like.target import host_target

    log = records / "tuning_log.json"
    previous = json.loads(log.read_text())["rows"] if log.is_file() else []
    done = {(r["shape"], r["gradient"]) for r in rows}
    rows = [r for r in previous if (r["shape"], r["gradient"]) not in done] + rows
    log.write_text(json.dumps({"target": str(host_target()), "rows": rows}, indent=2) + "\n")
    print(f"wrote {records}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
