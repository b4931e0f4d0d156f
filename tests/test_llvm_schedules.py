"""The CPU rules' choices (``schedules.llvm``): the loops they build and the results those
loops compute, for knobs the default rarely picks on the small test shapes."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import conv3d, weight_gradient
from tbe_like.schedules import Heuristic, common
from tbe_like.schedules.llvm import conv3d_backprop_filter as dw_rule
from tbe_like.schedules.llvm import conv3d_backprop_input as dx_rule

from tbe_like import stages
from tbe_like._tvm import IRModule, Target, s_tir, tvm
from tbe_like.bounds import compile_checked
from tbe_like.ops import kernels
from tbe_like.target import host_target, vector_registers
from tbe_like.testing import reference as ref

F32 = kernels.Precision("float32", "float32")
TWO_CORES = Target({**host_target().export(), "num-cores": 2})


@pytest.fixture(autouse=True)
def multi_core(monkeypatch):
    """The small test shapes scheduled as larger ones: for several cores (below
    ``SERIAL_FLOPS`` a kernel is made for one; ``test_tiny_kernels_start_no_thread``)."""
    monkeypatch.setattr(kernels, "SERIAL_FLOPS", 0)


def _scheduled(graph, knobs=None):
    """The CPU rule's schedule of ``graph`` for 2 cores."""
    return kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})), graph,
                            TWO_CORES, knobs)


def _weight_sch(conv, winograd, knobs=None):
    graph = kernels.grad_weight(conv, F32, winograd=winograd)
    return graph, _scheduled(graph, knobs)


def _blocks(sch):
    """{name: [(loop kind, extent), ...]} of every block under the root."""
    found = {}
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        loops = [sch.get(loop) for loop in sch.get_loops(block)]
        found[sch.get(block).name_hint] = [(loop.kind, int(loop.extent)) for loop in loops]
    return found


def _run_checked(graph, sch, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """``sch`` of ``graph`` built through the bounds proof and run on random float32 inputs:
    (the inputs, the result)."""
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal([int(v) for v in t.shape]).astype("float32")
              for t in graph.inputs]
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros(list(graph.result_shape()), "float32"), dev)
    compile_checked(sch.mod, host_target())["main"](
        *(tvm.runtime.tensor(a, dev) for a in inputs), out)
    return inputs, out.numpy()


def _assert_close(got, expected) -> None:
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def _checkweight_gradient(conv, graph, sch, seed: int) -> None:
    """``sch`` of ``graph`` (the weight gradient of ``conv``), built through the bounds proof
    and run on random data, equals the float64 reference."""
    (x, dy), got = _run_checked(graph, sch, seed)
    _assert_close(got, weight_gradient(conv, x, dy))


def _check_input_gradient(conv, graph, sch, seed: int) -> None:
    """The same for an input gradient."""
    (dy, w), got = _run_checked(graph, sch, seed)
    pads = [conv.pads[0], conv.pads[2], conv.pads[4]]
    _assert_close(got, ref.convolution_backward(
        dy.astype(np.float64), np.zeros(conv.x_shape), w.astype(np.float64),
        stride=list(conv.strides), padding=pads, dilation=list(conv.dilations),
        transposed=False, output_padding=[0, 0, 0], groups=conv.groups,
        output_mask=(True, False, False))[0])


SEED_LIKE = conv3d(4, 16, (4, 9, 9), 16, (2, 3, 3), stride=2, pad=0)  # 16 channels, stride 2
SPLIT_K = {
    "direct-stride2": (SEED_LIKE, False),
    "winograd": (conv3d(2, 16, (3, 6, 8), 32, (3, 3, 3)), 4),
    "groups2": (conv3d(3, 32, (2, 5, 5), 32, (3, 3, 3), groups=2), False),
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
    _checkweight_gradient(conv, graph, sch, seed=3)


def test_weight_gradient_few_channels_split_the_reduction():
    """16 output channels on 2 cores would be 4 chunks of 4, each reading the whole feature
    map: the default splits (n, do) instead, and each task pads its own planes."""
    _, sch = _weight_sch(SEED_LIKE, False)
    blocks = _blocks(sch)
    rf = blocks[stages.DW_MAD + "_rf_update"]
    assert rf[0] == (tvm.tirx.ForKind.PARALLEL, 4)  # 4 chunks of the 4 * 2 (n, do) steps
    pad = blocks[stages.DW_FMAP_PAD]
    assert pad[:2] == rf[:2]  # under the task's (n, do) loop, not a pass of its own
    pack = blocks["layout_in_grad_output"]
    assert pack[:2] == rf[:2]  # dy too: the kernel wakes the thread pool once


@pytest.mark.parametrize("cin, in_place", [(32, True), (40, False)])
def test_pointwise_input_gradient_reads_the_filter_in_place(cin, in_place):
    """A 1x1x1 filter of whole channel blocks is read where it lies (no flipped or packed
    copy); a partial last block keeps the copy. Right results either way."""
    conv = conv3d(2, cin, (2, 5, 6), 48, (1, 1, 1), stride=2, pad=0)
    graph = kernels.grad_input(conv, F32)
    sch = _scheduled(graph)
    copies = [n for n in _blocks(sch) if n == stages.DX_FILTER_FLIP or n == "layout_in_weight"]
    assert (not copies) is in_place, copies
    rng = np.random.default_rng(9)
    dy, w = (rng.standard_normal([int(v) for v in t.shape]).astype("float32")
             for t in graph.inputs)
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros(conv.x_shape, "float32"), dev)
    compile_checked(sch.mod, TWO_CORES)["main"](tvm.runtime.tensor(dy, dev),
                                                 tvm.runtime.tensor(w, dev), out)
    want = ref.convolution_backward(
        dy.astype(np.float64), np.zeros(conv.x_shape), w.astype(np.float64), stride=[2, 2, 2],
        padding=[0, 0, 0], dilation=[1, 1, 1], transposed=False, output_padding=[0, 0, 0],
        groups=1, output_mask=(True, False, False))[0]
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_stages_too_small_for_a_thread_run_on_the_calling_one():
    """A 4x4 patch embedding's weight gradient (9.4 MFLOP): the reduction in parallel, with
    x and dy packed inside its tasks; adding the partials and unpacking the 96x3x4x4 result
    (fewer than ``PARALLEL_MIN_ITERATIONS`` elements each) on the calling thread. Right
    results."""
    conv = kernels.Conv3d(4, 3, 96, (1, 64, 64), (1, 16, 16), (1, 4, 4), (1, 4, 4), (0,) * 6,
                          (1, 1, 1), 1)
    graph, sch = _weight_sch(conv, False, Heuristic(16, split_k=True))
    blocks = _blocks(sch)
    assert blocks[stages.DW_MAD + "_rf_update"][0][0] == tvm.tirx.ForKind.PARALLEL
    parallel = [name for name, loops in blocks.items()
                if any(kind == tvm.tirx.ForKind.PARALLEL for kind, _ in loops)]
    assert parallel == [stages.DW_MAD + "_rf_init", "layout_in_grad_output",
                        stages.DW_FMAP_PAD, stages.DW_MAD + "_rf_update"], parallel
    _checkweight_gradient(conv, graph, sch, seed=4)


def test_weight_gradient_many_channels_split_the_channels():
    """128 output channels: 4 chunks of 32 channels, the result (1.7 MB) too large to compute
    whole per task; no split of the reduction."""
    conv = conv3d(1, 64, (2, 8, 8), 128, (3, 3, 3))
    _, sch = _weight_sch(conv, 4)
    blocks = _blocks(sch)
    assert stages.DW_MAD + "_rf_update" not in blocks
    assert blocks[stages.DW_MAD + "_update"][0] == (tvm.tirx.ForKind.PARALLEL, 4)


@pytest.mark.parametrize("whole", [None, True])
@pytest.mark.parametrize("name, conv, in_steps", [
    ("4-positions", conv3d(1, 64, (1, 2, 2), 256, (1, 1, 1), pad=0), True),
    ("stride2", conv3d(2, 64, (2, 7, 7), 96, (1, 1, 1), stride=2, pad=0), True),
    # 40 input channels (not whole C0 blocks): placed in steps where the tile holds every
    # block (AVX-512's); AVX2's tile of one block leaves an index TVM cannot invert under
    # the step, and the result keeps its own pass (``schedules.layout``).
    ("cin40", conv3d(2, 40, (2, 7, 7), 96, (1, 1, 1), stride=2, pad=0), "avx512"),
    ("k133-late-stage", conv3d(1, 128, (1, 3, 3), 128, (1, 3, 3)), True),
    ("k333-groups2", conv3d(1, 128, (2, 2, 3), 128, (3, 3, 3), groups=2), True),
    ("196-positions", conv3d(1, 64, (4, 7, 7), 64, (1, 1, 1), pad=0), False),
])
def test_weight_gradient_of_few_positions_unpacks_in_steps(name, conv, in_steps, whole):
    """A weight gradient whose whole reduction fits a tile (at most ``ROW_STEPS`` positions:
    1x1x1 and late-stage layers on small maps) sums it inside each tile, and its NCDHW result
    is unpacked under the reduction's channel-block loop as each block completes (not in a
    pass of its own over the whole fractal result); a larger map keeps the separate pass.
    Same values either way. Measured selection's ``Heuristic(whole=True)`` does the same up to
    ``WHOLE_STEPS`` positions (the 196-position map too)."""

    graph = kernels.grad_weight(conv, F32, unpack_cells=True)
    sch = _scheduled(graph, None if whole is None else Heuristic(16, False, whole=True))
    if in_steps == "avx512":
        in_steps = vector_registers(TWO_CORES) == 32
    else:
        in_steps = in_steps or bool(whole)
    blocks = _blocks(sch)
    out = next(v for k, v in blocks.items() if k.startswith(stages.LAYOUT_OUT))
    mad = blocks[stages.DW_MAD + "_update"]
    assert (out[:3] == mad[:3]) is in_steps, (out, mad)
    if in_steps:
        assert out[-1][0] == tvm.tirx.ForKind.VECTORIZED
    _checkweight_gradient(conv, graph, sch, seed=6)


def test_winograd_transform_packs_its_own_plane(monkeypatch):
    """The input gradient's dy transform packs the NCDHW plane of its (n, d) task itself (no
    pass over the whole dy), and writes each point's planes contiguously: (N, D, point, ...)."""
    monkeypatch.setattr(common, "PARALLEL_MIN_ITERATIONS", 0)  # parallel, however small
    conv = conv3d(2, 32, (3, 6, 8), 32, (3, 3, 3))
    graph = kernels.grad_input(conv, F32, winograd=4)
    sch = _scheduled(graph)
    blocks = _blocks(sch)
    pack, wino = blocks["layout_in_grad_output"], blocks[stages.DX_WINO_DY]
    assert pack[0] == wino[0] == (tvm.tirx.ForKind.PARALLEL, 2 * 3)
    (written,) = sch.get(sch.get_sblock(stages.DX_WINO_DY)).writes
    assert [int(v) for v in written.source.shape] == [2, 3, 6, 2, 8, 2, 16]  # H padded 6 -> 8


def _dx_mad_parallel_loop(conv):
    """(extent of the parallel loop, extents of the loops inside it) of the largest input-gradient
    reduction of a Winograd CPU kernel for 2 cores (the D planes away from the borders)."""
    graph = kernels.grad_input(conv, F32, winograd=4)
    sch = _scheduled(graph)
    found = []
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        name = sch.get(block).name_hint
        if name.startswith(stages.DX_MAD) and not name.endswith("_init"):
            outer, *inner = (sch.get(loop) for loop in sch.get_loops(block))
            assert outer.kind == tvm.tirx.ForKind.PARALLEL
            found.append((int(outer.extent), [int(loop.extent) for loop in inner]))
    return max(found)


def test_input_gradient_channel_blocks_share_a_dy_chunk():
    """Enough (n, d, point) tasks: those are the parallel loop, and the 4 input-channel blocks
    run inside a reduction chunk (each reusing that chunk of transformed dy from cache)."""
    extent, inner = _dx_mad_parallel_loop(conv3d(2, 64, (8, 6, 8), 32, (3, 3, 3)))
    assert extent == 2 * 6 * 6  # n * the 6 planes off the D borders * the 6 points of F(4,3)
    assert inner[:3] == [3, 1, 4]  # kd, the one chunk of 32 output channels, 4 blocks


def test_input_gradient_few_tasks_parallel_over_channel_blocks_too():
    """One sample, one plane: 6 point tasks are too few for 2 cores (4 tasks each at least), so
    the channel blocks are parallel tasks too."""
    plane = kernels.Conv3d(1, 64, 32, (1, 6, 8), (1, 6, 8), (1, 3, 3), (1, 1, 1),
                           (0, 0, 1, 1, 1, 1), (1, 1, 1), 1)
    extent, _ = _dx_mad_parallel_loop(plane)
    assert extent == 1 * 1 * 4 * 6


@pytest.mark.parametrize("kind", ["grad_weight", "grad_input"])
def test_tiny_kernels_start_no_thread(monkeypatch, kind):
    """At most ``SERIAL_FLOPS`` a kernel has no parallel loop (waking the thread pool cost
    more than its work), and computes the same gradient."""
    monkeypatch.setattr(kernels, "SERIAL_FLOPS", 2_000_000)
    conv = conv3d(1, 32, (1, 1, 1), 16, (1, 1, 1), pad=0)  # X3D's squeeze-excitation shape
    assert 0 < conv.flops() <= kernels.SERIAL_FLOPS
    graph = getattr(kernels, kind)(conv, F32)
    sch = _scheduled(graph)
    kinds = {kind for loops in _blocks(sch).values() for kind, _ in loops}
    assert tvm.tirx.ForKind.PARALLEL not in kinds
    rng = np.random.default_rng(8)
    arrays = [rng.standard_normal([int(v) for v in t.shape]).astype("float32")
              for t in graph.inputs]
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros(list(graph.result_shape()), "float32"), dev)
    compile_checked(sch.mod, TWO_CORES)["main"](*[tvm.runtime.tensor(a, dev) for a in arrays],
                                                 out)
    if kind == "grad_weight":
        want = weight_gradient(conv, *arrays)
    else:
        dy, w = arrays
        want = ref.convolution_backward(
            dy.astype(np.float64), np.zeros(conv.x_shape), w.astype(np.float64),
            stride=[1, 1, 1], padding=[0, 0, 0], dilation=[1, 1, 1], transposed=False,
            output_padding=[0, 0, 0], groups=1, output_mask=(True, False, False))[0]
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=1e-4 * np.abs(want).max())


EDGE_CASES = {  # conv, the rule's (lo, hi) of its W output columns
    # A 5-wide kernel over 8 columns: 2 edge columns each side, 4 between.
    "k5-w8": (conv3d(1, 16, (2, 3, 8), 32, (1, 3, 5), pad=(0, 1, 2)), (2, 6)),
    # Over 4 columns: none reads no padding, every column an edge one.
    "k5-w4": (conv3d(1, 16, (2, 2, 4), 16, (3, 1, 5), pad=(1, 0, 2)), (0, 0)),
    # Stride 2 and dilation 2 (taps 0, 2, 4 of the padded row).
    "k3-s2-dil2": (conv3d(2, 16, (1, 3, 11), 16, (1, 1, 3), stride=(1, 1, 2), pad=(0, 0, 2),
                          dil=(1, 1, 2)), (1, 5)),
}


@pytest.mark.parametrize("lanes", common.HEURISTIC_LANES)
@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_weight_gradient_edge_columns_drop_their_padded_taps(name, lanes):
    """Where the packed weight gradient's register tile holds every kernel column, its loop
    over output columns is marked for partition (``common.skip_edge_columns``): the columns
    whose taps read W's padding run unrolled, and those taps drop out at compile time; the
    result is NumPy's. Its updates then number (taps + the edge columns' live taps) / taps of
    those without the mark. A tile of fewer columns (AVX2's of one) is not marked."""
    from conftest import lowered_until, update_stores

    from tbe_like.lowering import PARTITION

    conv, (lo, hi) = EDGE_CASES[name]
    graph, sch = _weight_sch(conv, False, Heuristic(lanes, split_k=False))
    _checkweight_gradient(conv, graph, sch, seed=5)
    update = sch.get_sblock(stages.DW_MAD + "_update")
    columns = sch.get_loops(update)[-5]
    marked = sch.get(columns).annotations.get(PARTITION)
    taps = conv.kernel[2]
    if int(sch.get(sch.get_loops(update)[-4]).extent) < taps:
        assert marked is None
        return
    assert [int(v) for v in marked] == [lo, hi, 4]  # W's reads all live between
    size, pad = conv.out_spatial[2], conv.pads[4]
    live = sum(0 <= o * conv.strides[2] + t * conv.dilations[2] - pad < conv.in_spatial[2]
               for o in [*range(lo), *range(hi, size)] for t in range(taps))
    edged = update_stores(lowered_until(sch.mod, "tirx.StmtSimplify"), stages.DW_MAD)
    sch.unannotate(columns, PARTITION)
    whole = update_stores(lowered_until(sch.mod, "tirx.StmtSimplify"), stages.DW_MAD)
    assert edged * taps == whole * ((taps if hi > lo else 0) + live), (edged, whole, live)


def _for_cores(cores: int) -> Target:
    return Target({**host_target().export(), "num-cores": cores})


@pytest.mark.parametrize("cores", [2, 3])
@pytest.mark.parametrize("knobs", [Heuristic(16, gemm=True), Heuristic(8)], ids=str)
def test_input_gradient_border_planes_deal_out_their_rows(cores, knobs):
    """V-Net's 5x5x5 layer on an 8x8x8 map: each D border plane (fewer live kd taps) is a
    reduction of its own. Where its channel blocks are one GEMM tile it was a single parallel
    task and the other threads waited (the kernel ran at 69% of the FMA peak); the rows of
    tiles are tasks too wherever the threads would idle (``common.balanced``). Every reduction
    keeps the threads busy, and the kernel, built for 2 or 3 cores, equals the reference."""
    conv = conv3d(1, 32, (8, 8, 8), 32, (5, 5, 5), pad=2)
    graph = kernels.grad_input(conv, F32)
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})), graph,
                           _for_cores(cores), knobs)
    reductions = {name: loops for name, loops in _blocks(sch).items()
                  if name.startswith(stages.DX_MAD) and not name.endswith("_init")}
    assert len(reductions) == 5, reductions  # 2 planes at each border, 4 in the middle
    for name, loops in reductions.items():
        kind, tasks = loops[0]
        assert kind == tvm.tirx.ForKind.PARALLEL, (name, loops)
        assert common.busy(tasks, cores) >= common.BUSY_SHARE, (name, tasks)
    _check_input_gradient(conv, graph, sch, seed=cores)


def test_balanced_adds_loops_only_while_threads_idle():
    """``common.balanced``: the least loops, then more while the tasks leave threads idle and
    one more loop keeps them busier."""
    sch = s_tir.Schedule(IRModule({"main": kernels.prim_func(
        kernels.grad_input(conv3d(1, 16, (1, 6, 8), 16, (1, 3, 3), pad=(0, 1, 1)), F32))}))
    block = sch.get_sblock("layout_in_grad_output")
    loops = sch.get_loops(block)  # (n 1, cb 1, d 1, h 6, w 8, c0 16)
    assert [int(sch.get(loop).extent) for loop in loops] == [1, 1, 1, 6, 8, 16]
    assert common.balanced(sch, loops, 2, _for_cores(2)) == 4  # 1 task -> 6 rows
    assert common.balanced(sch, loops, 4, _for_cores(2)) == 4  # 6 tasks: busy
    assert common.balanced(sch, loops, 2, _for_cores(4)) == 5  # 6 of 8 -> 48 of 48
    assert common.balanced(sch, loops, 2, _for_cores(1)) == 2  # one core: never idle
    assert common.busy(3, 2) == 0.75 and common.busy(8, 4) == 1.0


def test_winograd_transform_of_one_sample_is_parallel_over_its_planes(monkeypatch):
    """A batch-1 weight gradient's dy transform (Winograd along W) was parallel over (group,
    sample) alone: one task. Its D planes are tasks too, and the kernel equals the
    reference."""
    monkeypatch.setattr(common, "PARALLEL_MIN_ITERATIONS", 0)  # parallel, however small
    conv = conv3d(1, 16, (4, 6, 8), 32, (3, 3, 3))
    graph, sch = _weight_sch(conv, 4)
    kind, tasks = _blocks(sch)[stages.DW_WINO_DY][0]
    assert kind == tvm.tirx.ForKind.PARALLEL and tasks == 4, (kind, tasks)
    _checkweight_gradient(conv, graph, sch, seed=5)


@pytest.mark.parametrize("cout, groups, summed", [
    (24, 1, 24),  # 24 of the 32 channels of 2 blocks
    (20, 1, 24),  # rounded up to half a block
    (1, 1, 8),
    (48, 1, 48),  # whole blocks: unchanged
    (32, 2, 16),  # a merged group's 16 (2 groups of 16 in and out)
    (16, 16, 16),  # depthwise: 16 groups merged into one block
])
@pytest.mark.parametrize("form", ["phases", "winograd", "dense", "streamed"])
def test_input_gradient_sums_the_real_output_channels(cout, groups, summed, form):
    """A CPU input gradient (``live_channels``) sums the real output channels of each merged
    group, rounded up to ``LIVE_CHANNEL_STEP``, not every channel of dy's padded blocks (a
    24-channel layer's reduction had 32, a quarter of its multiply-adds by zeros); the rules
    unroll a chunk's channels by what divides it, and the result equals the reference."""
    from tbe_like.compute.conv3d_backprop_input import reduced_channels

    cin = 16 if groups != 2 else 32
    conv = conv3d(1, cin, (3, 5, 8), cout, (3, 3, 3), groups=groups)
    options = {"phases": {}, "winograd": {"winograd": 4}, "dense": {"dense": True},
               "streamed": {"streamed": True}}[form]
    graph = kernels.grad_input(conv, F32, live_channels=True, **options)
    plain = s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)}))
    reductions = [n for n in common.block_names(plain) if n.startswith(stages.DX_MAD)]
    assert reductions
    for name in reductions:  # (rows, columns, output channels summed)
        assert dx_rule._extents(plain, plain.get_sblock(name))[2] == summed
    assert reduced_channels(graph.params.geometry.group, True) == summed
    sch = _scheduled(graph, Heuristic(8) if form != "streamed" else Heuristic(8, stream=True))
    _check_input_gradient(conv, graph, sch, seed=cout)
