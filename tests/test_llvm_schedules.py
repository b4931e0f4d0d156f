"""The CPU rules' choices (``schedules.llvm``): the loops they build and the results those
loops compute, for knobs the default rarely picks on the small test shapes."""

from __future__ import annotations

import numpy as np
import pytest
from tbe_like.schedules.llvm import conv3d_backprop_filter as dw_rule

from tbe_like import stages
from tbe_like._tvm import IRModule, Target, s_tir, tvm
from tbe_like.ops import kernels
from tbe_like.target import host_target
from tbe_like.testing import reference as ref

F32 = kernels.Precision("float32", "float32")
TWO_CORES = Target({**host_target().export(), "num-cores": 2})


def _conv(n, cin, spatial, cout, kernel, stride=1, pad=1, dil=1, groups=1):
    out = tuple((i + 2 * pad - dil * (k - 1) - 1) // stride + 1
                for i, k in zip(spatial, kernel, strict=True))
    return kernels.Conv3d(n, cin, cout, tuple(spatial), out, tuple(kernel), (stride,) * 3,
                          (pad,) * 6, (dil,) * 3, groups)


def _weight_sch(conv, winograd, knobs=None, target=TWO_CORES):
    graph = kernels.grad_weight(conv, F32, winograd=winograd)
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})), graph,
                           target, knobs)
    return graph, sch


def _blocks(sch):
    """{name: [(loop kind, extent), ...]} of every block under the root."""
    found = {}
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        loops = [sch.get(loop) for loop in sch.get_loops(block)]
        found[sch.get(block).name_hint] = [(loop.kind, int(loop.extent)) for loop in loops]
    return found


def _weight_gradient(conv, x, dy):
    _, dw, _ = ref.convolution_backward(
        dy.astype(np.float64), x.astype(np.float64), np.zeros(conv.w_shape),
        stride=list(conv.strides), padding=[conv.pads[0], conv.pads[2], conv.pads[4]],
        dilation=list(conv.dilations), transposed=False, output_padding=[0, 0, 0],
        groups=conv.groups, output_mask=(False, True, False))
    return dw


SEED_LIKE = _conv(4, 16, (4, 9, 9), 16, (2, 3, 3), stride=2, pad=0)  # 16 channels, stride 2
SPLIT_K = {
    "direct-stride2": (SEED_LIKE, False),
    "winograd": (_conv(2, 16, (3, 6, 8), 32, (3, 3, 3)), 4),
    "groups2": (_conv(3, 32, (2, 5, 5), 32, (3, 3, 3), groups=2), False),
}


@pytest.mark.parametrize("k_par", [2, 3, 5])
@pytest.mark.parametrize("name", list(SPLIT_K))
def test_weight_gradient_split_k_matches_reference(name, k_par):
    """The reduction's (n, do) in k_par parallel chunks (``rfactor``), the partials added after;
    3 and 5 do not divide the (n, do) extent of every case."""
    conv, winograd = SPLIT_K[name]
    knobs = dw_rule.Knobs(co_par=1, co_tile=4, kw_tile=1, k_par=k_par)
    graph, sch = _weight_sch(conv, winograd, knobs)
    blocks = _blocks(sch)
    rf = blocks[stages.DW_MAD + "_rf_update"]
    assert rf[0][0] == tvm.tirx.ForKind.PARALLEL and rf[0][1] % k_par == 0, rf
    rng = np.random.default_rng(3)
    x, dy = (rng.standard_normal([int(v) for v in t.shape]).astype("float32")
             for t in graph.inputs)
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros([int(v) for v in graph.output.shape], "float32"), dev)
    tvm.compile(sch.mod, target=host_target())["main"](
        tvm.runtime.tensor(x, dev), tvm.runtime.tensor(dy, dev), out)
    expected = _weight_gradient(conv, x, dy)
    np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_weight_gradient_few_channels_split_the_reduction():
    """16 output channels on 2 cores would be 4 chunks of 4, each reading the whole feature
    map: the default splits (n, do) instead, and each task pads its own planes."""
    _, sch = _weight_sch(SEED_LIKE, False)
    blocks = _blocks(sch)
    rf = blocks[stages.DW_MAD + "_rf_update"]
    assert rf[0] == (tvm.tirx.ForKind.PARALLEL, 4)  # 4 chunks of the 4 * 2 (n, do) steps
    pad = blocks[stages.DW_FMAP_PAD]
    assert pad[:2] == rf[:2]  # under the task's (n, do) loop, not a pass of its own


def test_weight_gradient_many_channels_split_the_channels():
    """128 output channels: 4 chunks of 32 channels, the result (1.7 MB) too large to compute
    whole per task; no split of the reduction."""
    conv = _conv(1, 64, (2, 8, 8), 128, (3, 3, 3))
    _, sch = _weight_sch(conv, 4)
    blocks = _blocks(sch)
    assert stages.DW_MAD + "_rf_update" not in blocks
    assert blocks[stages.DW_MAD + "_update"][0] == (tvm.tirx.ForKind.PARALLEL, 4)


def test_winograd_transform_packs_its_own_plane():
    """The input gradient's dy transform packs the NCDHW plane of its (n, d) task itself (no
    pass over the whole dy), and writes each point's planes contiguously: (N, D, point, ...)."""
    conv = _conv(2, 32, (3, 6, 8), 32, (3, 3, 3))
    graph = kernels.grad_input(conv, F32, winograd=4)
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})), graph,
                           TWO_CORES)
    blocks = _blocks(sch)
    pack, wino = blocks["layout_in_grad_output"], blocks[stages.DX_WINO_DY]
    assert pack[0] == wino[0] == (tvm.tirx.ForKind.PARALLEL, 2 * 3)
    (written,) = sch.get(sch.get_sblock(stages.DX_WINO_DY)).writes
    assert [int(v) for v in written.source.shape] == [2, 3, 6, 2, 8, 2, 16]  # H padded 6 -> 8
