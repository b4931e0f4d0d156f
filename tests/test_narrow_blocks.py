"""The input gradient in blocks of half a C0 of input channels (``kernels.narrow_blocks_apply``,
``grad_input(c0=NARROW_C0)``), for layers of 8 mod 16 input channels."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import conv3d, input_gradient, run_graph
from tbe_like.schedules import Heuristic

from tbe_like import stages
from tbe_like._tvm import IRModule, Target, s_tir, tirx
from tbe_like.ops import kernels
from tbe_like.ops.convolution_backward import _other_forms, graph_of
from tbe_like.target import host_target

F32 = kernels.Precision("float32", "float32")
TARGET = host_target()
# What a Zen 3 and a Zen 4 build (the kernels run here are built for this host).
AVX2 = Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2})
AVX512 = Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})

CASES = {
    # X3D-like: 24 channels, (3, 5, 5) kernel at stride (1, 2, 2).
    "cin24-k355-s122": conv3d(1, 24, (3, 8, 9), 48, (3, 5, 5), stride=(1, 2, 2),
                              pad=(1, 2, 2)),
    "cin40-k3-batch2": conv3d(2, 40, (3, 5, 6), 24, (3, 3, 3)),
    "cin56-pointwise-s2": conv3d(1, 56, (4, 6, 6), 32, (1, 1, 1), stride=2, pad=0),
    "cin8-k3": conv3d(1, 8, (4, 5, 5), 16, (3, 3, 3)),
}


@pytest.fixture(autouse=True)
def multi_core(monkeypatch):
    """The small test shapes scheduled as larger ones (not for one core)."""
    monkeypatch.setattr(kernels, "SERIAL_FLOPS", 0)


def test_narrow_blocks_apply_to_channels_half_a_block_past_whole_ones():
    """For 8-lane vectors (an AVX2 host's; AVX-512's 16 lanes took the packed form)."""
    for cin in (8, 24, 40, 56, 72):
        assert kernels.narrow_blocks_apply(conv3d(1, cin, (4, 8, 8), 32, (3, 3, 3)), AVX2)
        assert not kernels.narrow_blocks_apply(conv3d(1, cin, (4, 8, 8), 32, (3, 3, 3)),
                                               AVX512)
    for cin in (3, 12, 16, 32, 48, 20):
        assert not kernels.narrow_blocks_apply(conv3d(1, cin, (4, 8, 8), 32, (3, 3, 3)), AVX2)
    assert not kernels.narrow_blocks_apply(conv3d(1, 32, (4, 8, 8), 32, (3, 3, 3), groups=2),
                                           AVX2)  # groups of 16 (groups of 24: below)


@pytest.mark.parametrize("name", list(CASES))
def test_the_operator_races_narrow_blocks_and_each_candidate_is_exact(name):
    """The operator's input gradient races the narrow form; its reductions' vectors are 8
    channels wide; every candidate selection times, built under the bounds proof, equals the
    float64 reference."""
    conv = CASES[name]
    forms = _other_forms(graph_of("grad_input", conv, F32, target=AVX2), "grad_input", conv,
                         F32, False, AVX2)
    narrow = forms[kernels.NARROW]
    assert kernels.NARROW not in _other_forms(graph_of("grad_input", conv, F32, target=AVX512),
                                              "grad_input", conv, F32, False, AVX512)
    assert narrow.params.geometry.c0 == kernels.NARROW_C0
    rng = np.random.default_rng(len(name))
    dy, w = (rng.standard_normal(s).astype("float32") for s in (conv.y_shape, conv.w_shape))
    want = input_gradient(conv, dy, w)
    knob_sets = kernels.alternative_candidates(narrow, AVX2)
    assert {k.lanes for k in knob_sets} == {kernels.NARROW_C0}
    assert any(k.fused for k in knob_sets) and any(not k.fused for k in knob_sets)
    # (And AVX-512's tiles of 8-lane vectors: built here, timed on no host.)
    for knobs in [*knob_sets, Heuristic(16), Heuristic(16, gemm=True)]:
        sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(narrow)})),
                               narrow, TARGET, knobs)
        widths = set()
        for block in sch.get_child_blocks(sch.get_sblock("root")):
            if sch.get(block).name_hint.startswith(stages.DX_MAD):
                widths |= {int(loop.extent) for loop in map(sch.get, sch.get_loops(block))
                           if loop.kind == tirx.ForKind.VECTORIZED}
        assert widths <= {kernels.NARROW_C0}, (knobs, widths)
        got = run_graph(narrow, knobs, [dy, w])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(),
                                   err_msg=str(knobs))


def test_grouped_layers_whose_groups_the_packed_form_merges_race_narrow_blocks_on_any_host():
    """Groups of 24 or 40 channels (merged in pairs or threes into blocks of 16: 2x the
    multiply-adds and more) are whole narrow blocks on both sides: the narrow form, on 8-lane
    and 16-lane hosts alike, merges no group. Groups of 16, of 8 (the rows forms') and of 12
    (not whole narrow blocks) do not race it."""
    for conv in (conv3d(1, 96, (1, 8, 8), 96, (1, 3, 3), pad=(0, 1, 1), groups=4),
                 conv3d(1, 120, (4, 8, 8), 120, (3, 3, 3), groups=3),
                 conv3d(1, 48, (4, 8, 8), 80, (3, 3, 3), groups=2)):  # 24 -> 40 a group
        for target in (AVX2, AVX512):
            assert kernels.narrow_blocks_apply(conv, target), (conv, target)
        narrow = kernels.grad_input(conv, F32, live_channels=True, c0=kernels.NARROW_C0)
        assert narrow.params.geometry.group.merged_share == 1.0
    for conv in (conv3d(1, 64, (4, 8, 8), 64, (3, 3, 3), groups=4),
                 conv3d(1, 32, (4, 8, 8), 32, (3, 3, 3), groups=4),
                 conv3d(1, 36, (4, 8, 8), 36, (3, 3, 3), groups=3)):
        assert not kernels.narrow_blocks_apply(conv, AVX512), conv


GROUPED = {
    "g24-k133": conv3d(1, 96, (1, 7, 9), 96, (1, 3, 3), pad=(0, 1, 1), groups=4),
    # 24 -> 40 a group, stride 2, a batch of 2
    "g24to40-k3-s2-batch2": conv3d(2, 48, (4, 7, 6), 80, (3, 3, 3), stride=2, groups=2),
}


@pytest.mark.parametrize("name", list(GROUPED))
def test_grouped_narrow_candidates_are_exact(name):
    """Every candidate of a grouped layer's narrow form that selection times on an AVX-512
    host, built under the bounds proof, equals the float64 reference."""
    conv = GROUPED[name]
    forms = _other_forms(graph_of("grad_input", conv, F32, target=AVX512), "grad_input", conv,
                         F32, False, AVX512)
    narrow = forms[kernels.NARROW]
    rng = np.random.default_rng(len(name))
    dy, w = (rng.standard_normal(s).astype("float32") for s in (conv.y_shape, conv.w_shape))
    want = input_gradient(conv, dy, w)
    for knobs in kernels.alternative_candidates(narrow, AVX512):
        got = run_graph(narrow, knobs, [dy, w])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(),
                                   err_msg=str(knobs))
