"""Which candidates measured selection compiles and times: ranked by a cost model first.

Measured selection (``tune.measured_schedule``) races a kernel's candidates on the machine:
each form's knob sets (the packed form's tiles for 8 and 16 lanes, split K, whole
reductions, the col, rows, rows_out, outer, dot, direct, temporal and streamed forms', each
also on one core where a kernel is small), a dozen or more for one kernel, each compiled
before it is timed. A cost model ranks them first and only the best :data:`TOP_K` are
compiled and timed, beside the candidates it does not describe (:func:`describes`: the
streamed and rows_out forms', added after the shipped model was trained).

The model is XGBoost's (``rank:pairwise``), trained on what measured selection measured: the
fastest call of every candidate of every kernel of the network suite's development half
(``tbe-like bench --network dev`` writes them in its JSON, ``selection.times_ms``), by
``benchmarks/train_ranking.py``; the validation half is never trained on. A candidate is
described by numbers alone (:func:`features`): the layer (its gradient, channels, groups,
maps, kernel, strides, padding, flops and operand sizes), the candidate (its form, its knobs,
one core or all) and the host's vector width and cores.

A model is trained on one host class and shipped for it (``tbe_like/records/ranking_<mcpu>.json``,
with the features, vector width and core count it was trained on); on a host of another class
(LLVM ``mcpu``, vector width or cores) no model applies and every candidate is timed, as
before. ``TBE_LIKE_RANK=0`` times every candidate too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from functools import cache
from pathlib import Path
from typing import Any

from .ops.kernels import ONE_CORE_SUFFIX, Conv3d

# How many of a kernel's candidates are compiled and timed where a model ranks them.
TOP_K = 5
# Turns ranking off (every candidate timed) where set to 0.
RANK_ENV = "TBE_LIKE_RANK"
# Where the shipped models are: ``ranking_<mcpu>.json``.
MODELS_DIR = Path(__file__).parent / "records"
# What the model file's format is; a file of another version is not read.
FORMAT = 1

# The forms a candidate's name may start with (``"col: Heuristic(lanes=8)"``); "" is the
# kernel's own form.
FORMS = ("", "col", "rows", "outer", "dot", "direct", "temporal")
_KNOBS = ("split_k", "whole", "gemm", "rows")

LAYER_FEATURES = (
    "input_gradient", "log_batch", "log_cin", "log_cout", "log_groups", "log_cin_group",
    "log_cout_group", "log_in_d", "log_in_h", "log_in_w", "log_out_d", "log_out_h",
    "log_out_w", "kernel_d", "kernel_h", "kernel_w", "stride_d", "stride_h", "stride_w",
    "pad_d", "pad_h", "pad_w", "dilated", "log_flops", "log_x_bytes", "log_y_bytes",
    "log_w_bytes", "pointwise", "depthwise")
CANDIDATE_FEATURES = (
    *(f"form_{f or 'own'}" for f in FORMS), "one_core", "rule", "lanes",
    *(f"knob_{k}" for k in _KNOBS), "accumulators")
HOST_FEATURES = ("vector_bits", "cores")
FEATURES = (*LAYER_FEATURES, *CANDIDATE_FEATURES, *HOST_FEATURES)


def _log(v: float) -> float:
    return math.log2(max(float(v), 1.0))


def _layer(layer: dict) -> tuple[Conv3d, bool, int]:
    """(the convolution, whether its input gradient, the operands' bytes per element) of a
    kernel's ``para_dict`` or a benchmark row (``bench.Shape.conv3d``: a 1D or 2D row as the
    3D layer the operators compute)."""
    if "config" in layer:
        from .bench import Shape

        config = layer["config"]
        shape = Shape(**{k: tuple(v) if isinstance(v, list) else v for k, v in config.items()})
        conv, grad_input, dtype = shape.conv3d(), layer["gradient"] == "input", shape.dtype
    else:
        conv = Conv3d(**{f.name: layer[f.name] for f in dataclasses.fields(Conv3d)})
        grad_input, dtype = layer["gradient"] == "grad_input", layer.get("dtype")
    return conv, grad_input, 2 if dtype in ("float16", "bfloat16") else 4


def layer_features(layer: dict) -> list[float]:
    """The numbers that describe a layer: ``layer`` is a kernel's ``para_dict`` as the
    framework operators build it (``gradient``: grad_input or grad_weight, and the fields of
    ``kernels.Conv3d``), or a benchmark row's (``gradient``: input or weight, and
    ``config``)."""
    conv, grad_input, itemsize = _layer(layer)
    p = conv.pads
    return [
        float(grad_input), _log(conv.batch), _log(conv.cin), _log(conv.cout),
        _log(conv.groups), _log(conv.cin // conv.groups), _log(conv.cout // conv.groups),
        *map(_log, conv.in_spatial), *map(_log, conv.out_spatial),
        *map(float, conv.kernel), *map(float, conv.strides),
        float(p[0] + p[1]), float(p[2] + p[3]), float(p[4] + p[5]),
        float(max(conv.dilations) > 1), _log(conv.flops()),
        *(_log(math.prod(shape) * itemsize) for shape in (conv.x_shape, conv.y_shape,
                                                             conv.w_shape)),
        float(math.prod(conv.kernel) == 1), float(conv.cin // conv.groups == 1)]


_HEURISTIC = re.compile(r"Heuristic\((.*)\)")


def form_of(name: str) -> str:
    """The form a candidate's name starts with (``"col: Heuristic(lanes=8)"``: ``"col"``; the
    kernel's own form: ``""``)."""
    return name.rpartition(": ")[0]


def _parts(name: str) -> tuple[str, str, dict[str, str]]:
    """(form, knobs without the one-core suffix, the knobs' fields) of a candidate's name."""
    form, knobs = form_of(name), name.rpartition(": ")[2]
    knobs = knobs.removesuffix(ONE_CORE_SUFFIX)
    found = _HEURISTIC.fullmatch(knobs)
    fields = (dict(part.split("=", 1) for part in found.group(1).split(", "))
              if found and found.group(1) else {})
    return form, knobs, fields


def describes(name: str) -> bool:
    """Whether :func:`candidate_features` describes candidate ``name`` whole: its form is one
    of :data:`FORMS` and its knobs are among the features. A candidate of a form or knob
    added since the model was trained is not (the model would see it as another), and
    measured selection times it whatever the ranking (``tune.measured_schedule``)."""
    form, knobs, fields = _parts(name)
    return (form in FORMS and (knobs == "rule" or _HEURISTIC.fullmatch(knobs) is not None)
            and set(fields) <= {"lanes", "accumulators", *_KNOBS})


def candidate_features(name: str) -> list[float]:
    """The numbers that describe a candidate, from the name measured selection gives it
    (``"col: Heuristic(lanes=8)"``, ``"rule, one core"``, ``"Heuristic(lanes=16,
    split_k=False, whole=True)"``: ``tune._options``)."""
    one_core = name.endswith(ONE_CORE_SUFFIX)
    form, knobs, fields = _parts(name)

    def flag(key: str) -> float:  # unset -1, False 0, True 1
        return {"True": 1.0, "False": 0.0}.get(fields.get(key, ""), -1.0)

    return [*(float(form == f) for f in FORMS), float(one_core), float(knobs == "rule"),
            float(fields.get("lanes", 0)), *map(flag, _KNOBS),
            float(fields.get("accumulators", 0))]


def host_features(vector_bits: int, cores: int) -> list[float]:
    return [float(vector_bits), float(cores)]


def features(layer: dict, name: str, vector_bits: int, cores: int) -> list[float]:
    """:data:`FEATURES` of candidate ``name`` of ``layer``'s kernel on a host of
    ``vector_bits``-wide vectors and ``cores`` cores."""
    return [*layer_features(layer), *candidate_features(name), *host_features(vector_bits, cores)]


def enabled() -> bool:
    return os.environ.get(RANK_ENV, "1") != "0"


def model_path(mcpu: str) -> Path:
    return MODELS_DIR / f"ranking_{mcpu}.json"


@cache
def _load(path: str, vector_bits: int, cores: int) -> Any:
    """The booster of a shipped model file, None where there is none, or one of another
    format or feature set, or trained on hosts of other vector widths or core counts (one-core
    candidates against all cores rank differently with more cores), or one that cannot be
    read (with a warning)."""
    p = Path(path)
    if not p.is_file():
        return None
    import xgboost

    try:
        saved = json.loads(p.read_text(encoding="utf-8"))
        if (saved.get("format") != FORMAT or tuple(saved.get("features", ())) != FEATURES
                or vector_bits not in saved.get("vector_bits", ())
                or cores not in saved.get("cores", ())):
            return None
        booster = xgboost.Booster()
        booster.load_model(bytearray(json.dumps(saved["model"]).encode()))
    except (OSError, ValueError, TypeError, AttributeError, KeyError,
            xgboost.core.XGBoostError) as err:  # a damaged file never breaks a build
        warnings.warn(f"tbe_like: ignoring the selection's cost model {p} "
                      f"({type(err).__name__}: {err}); every candidate is timed",
                      RuntimeWarning, stacklevel=2)
        return None
    return booster


def rank(layer: dict | None, names: list[str], target) -> list[int] | None:
    """The indexes of ``names`` (a kernel's candidates) fastest first as the model of this
    host class predicts; None where there is none (a host class no model was trained on,
    ranking turned off, or a kernel not described by a ``layer``)."""
    from .schedules.common import num_threads
    from .target import vector_lanes

    if layer is None or not enabled() or str(target.kind.name) != "llvm":
        return None
    bits, cores = vector_lanes(target) * 32, num_threads(target)
    booster = _load(str(model_path(str(target.attrs.get("mcpu", "")))), bits, cores)
    if booster is None:
        return None
    return order(booster, [features(layer, n, bits, cores) for n in names])


def order(booster: Any, rows: list[list[float]]) -> list[int]:
    """The indexes of ``rows`` (:data:`FEATURES` of a kernel's candidates) fastest first as
    ``booster`` predicts: it scores a candidate higher the faster it is (``rank:pairwise``);
    ties in their given order."""
    import numpy as np
    import xgboost

    matrix = xgboost.DMatrix(np.array(rows, dtype=np.float32), feature_names=list(FEATURES))
    scores = booster.predict(matrix)
    return sorted(range(len(rows)), key=lambda i: (-float(scores[i]), i))


def write_model(path: str | os.PathLike, booster: Any, mcpu: str, vector_bits: int,
                cores: int, trained_on: list[str], kernels: int) -> None:
    """Write ``booster`` (trained on :data:`FEATURES`) as the model of hosts of LLVM ``mcpu``
    with ``vector_bits``-wide vectors and ``cores`` cores, saying what it was trained on."""
    raw = booster.save_raw("json")
    Path(path).write_text(json.dumps({
        "format": FORMAT, "features": list(FEATURES), "mcpu": mcpu,
        "vector_bits": [vector_bits], "cores": [cores], "trained_on": trained_on,
        "kernels": kernels,
        "model": json.loads(bytes(raw))}, separators=(",", ":")), encoding="utf-8")
    _load.cache_clear()


def timed(layer: dict | None, names: list[str], target) -> list[int]:
    """The indexes of a kernel's candidates ``names`` that measured selection compiles and
    times: the model's best :data:`TOP_K` of those it describes (:func:`rank`, :func:`keep`;
    all where no model applies), and every one it does not describe, whatever it ranks (they
    take none of the ``TOP_K`` places)."""
    described = [i for i, name in enumerate(names) if describes(name)]
    ranked = rank(layer, [names[i] for i in described], target)
    kept = {described[i] for i in keep(ranked, len(described))}
    return sorted(kept | (set(range(len(names))) - set(described)))


def keep(order: list[int] | None, count: int, top_k: int | None = None) -> list[int]:
    """Which of ``count`` candidates to compile and time: the ``top_k`` (default
    :data:`TOP_K`) best of ``order``, in their original order (which compiling follows); all
    where ``order`` is None."""
    top_k = TOP_K if top_k is None else top_k
    if order is None or count <= top_k:
        return list(range(count))
    return sorted(order[:top_k])
