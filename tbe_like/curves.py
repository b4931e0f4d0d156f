"""Tuning curves: what each kernel's tune measured, in order, and a picture of it.

``tbe-like tune`` appends every measured candidate's time to ``<records>/curves/<kernel>.json``
as its batch comes back (an interrupted tune keeps its points; the next run continues the same
curve), and at the end writes ``<kernel>.png``: the best time so far against the trials, with
the untuned template's time as a horizontal line, and, when a record was kept, its time
re-measured against the template side by side (``tune.select``: MetaSchedule's single
measurements are noisy, and a candidate that looked faster once may not be). The picture needs
matplotlib (the ``plot`` extra); without it the JSON is all there is, and the command says so in
one line.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

PLOT_HINT = "python -m pip install 'tbe_like[plot]'"


def _stem(name: str, workload: str) -> str:
    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}-{workload}"


def curve_path(folder: str | Path, name: str, workload: str) -> Path:
    """The JSON file of kernel ``name`` (its workload's hash in the name: two networks may
    name different layers alike)."""
    return Path(folder) / f"{_stem(name, workload)}.json"


def load(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        return {"trials": []}
    return json.loads(path.read_text())


def append(folder: str | Path, name: str, workload: str, flops: float, seconds) -> Path:
    """Add measured times (seconds, ``inf`` for a failed candidate) to a kernel's curve."""
    path = curve_path(folder, name, workload)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = load(path)
    data.update(name=name, workload=workload, flops=flops)
    data["trials"] = data["trials"] + [s if math.isfinite(s) else None for s in seconds]
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
    return path


def finish(path: str | Path, untuned_s: float, selected_s: float) -> None:
    """Note the untuned template's time and the time of what the records now hold."""
    path = Path(path)
    data = load(path)
    data.update(untuned_s=untuned_s, selected_s=selected_s)
    path.write_text(json.dumps(data))


def best_so_far(trials) -> list[float]:
    best, out = math.inf, []
    for secs in trials:
        if secs is not None:
            best = min(best, secs)
        out.append(best)
    return out


def plot(path: str | Path) -> Path | None:
    """Write ``<curve>.png`` next to the curve's JSON; ``None`` without matplotlib or
    without a valid measurement."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    path = Path(path)
    data = load(path)
    best = best_so_far(data["trials"])
    points = [(i + 1, b * 1e3) for i, b in enumerate(best) if math.isfinite(b)]
    if not points:
        return None
    fig = Figure(figsize=(6, 3.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.step([p[0] for p in points], [p[1] for p in points], where="post",
            label="best candidate so far (one measurement each)")
    if data.get("untuned_s"):
        ax.axhline(data["untuned_s"] * 1e3, color="tab:red", linestyle="--",
                   label=f"untuned template ({data['untuned_s'] * 1e3:.3g} ms)")
    if data.get("selected_s") and data.get("selected_s") != data.get("untuned_s"):
        ax.axhline(data["selected_s"] * 1e3, color="tab:green", linestyle=":",
                   label=f"record kept, re-timed ({data['selected_s'] * 1e3:.3g} ms)")
    ax.set_xlabel("trials measured")
    ax.set_ylabel("kernel time (ms)")
    ax.set_title(data.get("name", path.stem), fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    png = path.with_suffix(".png")
    fig.savefig(png)
    return png
