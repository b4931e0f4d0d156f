"""Every vector a CPU kernel loads or stores is one contiguous or strided access: no lane
computes an index of its own (TVM lowers such a vector index to one scalar load per lane).

The shapes' rows are 7, 14 and 28 wide, so that vectors of 8 and 16 positions cross rows:
a form that indexes a flattened axis by (d, h, w) would divide per lane there (the dot weight
gradient did: 0.41 ms where contiguous loads take 0.06). Every form the operators race, every
candidate of each, as TVM lowers it (its pipeline up to ``VectorizeLoop``)."""

from __future__ import annotations

import pytest
from conftest import conv3d, lowered_until
from tbe_like.schedules import candidates

from tbe_like import stages
from tbe_like._tvm import IRModule, TensorLoad, s_tir, structural_walk, tirx
from tbe_like.ops import kernels
from tbe_like.ops.convolution_backward import _other_forms, graph_of
from tbe_like.target import host_target

TARGET = host_target()
F32 = kernels.Precision("float32", "float32")

CASES = {
    # 1x1x1 on 4x28 rows: the dot, col (x transposed) and packed weight gradients, the col
    # and row-by-row input gradients.
    "pointwise-28": conv3d(1, 8, (2, 4, 28), 32, (1, 1, 1), pad=0),
    # ... and at stride 2 (x gathered at the positions the dot form reads).
    "pointwise-s2-28": conv3d(1, 16, (2, 16, 28), 24, (1, 1, 1), stride=2, pad=0),
    # 3x3x3 on 7-wide rows: packed and Winograd forms, the col forms (70 positions).
    "k3-w7": conv3d(1, 16, (2, 5, 7), 16, (3, 3, 3)),
    # A stem: the rows and outer forms; stride (1, 2, 2) on 14-wide rows.
    "stem-3ch-w14": conv3d(1, 3, (2, 14, 14), 16, (3, 5, 5), stride=(1, 2, 2), pad=(1, 2, 2)),
    # Depthwise and a temporal kernel on 14-wide rows.
    "depthwise-w14": conv3d(1, 16, (2, 6, 14), 16, (3, 3, 3), groups=16),
    "temporal-w14": conv3d(1, 16, (4, 3, 14), 16, (3, 1, 1), pad=(1, 0, 0)),
}

# Stages whose gathers are what they compute: a strided layer's x gathered at the positions
# it reads (every lane a scalar read of a strided row, whatever the index).
GATHERS = {stages.DW_DOT_X}


def _lane_indices(func) -> list[str]:
    """The vector loads and stores of ``func`` whose last index is neither a ramp nor a
    broadcast (but for stores to ``GATHERS`` and what they load): per-lane index
    arithmetic."""
    found = []

    def check(node, buffer):
        index = node.indices[-1]
        if "x" in str(index.ty) and not isinstance(index, tirx.Ramp | tirx.Broadcast):
            found.append(f"{buffer}: {str(index)[:80]}")

    def store(node):
        if node.buffer.name in GATHERS:
            return
        check(node, node.buffer.name)
        structural_walk(node.value, [(TensorLoad, lambda load: check(load, load.source))])

    structural_walk(func.body, [(tirx.BufferStore, store)])
    return found


def _forms(conv):
    for kind in ("grad_weight", "grad_input"):
        graph = graph_of(kind, conv, F32, target=TARGET)
        yield from ((f"{kind} {name}".strip(), g) for name, g in
                    {"": graph, **_other_forms(graph, kind, conv, F32, False, TARGET)}.items())


@pytest.mark.parametrize("name", list(CASES))
def test_no_lane_computes_its_own_index(name):
    failures, built = [], 0
    for form, graph in _forms(CASES[name]):
        for knobs in [None, *candidates(graph.op, TARGET)]:
            sch = s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)}))
            sch = kernels.schedule(sch, graph, TARGET, knobs)
            built += 1
            vectorized = lowered_until(sch.mod, "tirx.VectorizeLoop")
            failures += [f"{form} {knobs}: {f}" for f in _lane_indices(vectorized)]
    assert built > 2
    assert not failures, "\n".join(failures[:10])
