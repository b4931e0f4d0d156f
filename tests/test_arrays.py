"""Arrays in and out of kernels without copies (``tbe_like.arrays``): NumPy arrays and torch
tensors reach the kernel by reference, outputs come back in the inputs' library, and the few
inputs a kernel cannot read in place (non-contiguous, below the kernel's alignment, read-only)
are copied and still give right results."""

from __future__ import annotations

import numpy as np
import pytest
import test_cuda_emulated as emulated
from conftest import NP_DTYPES, RTOL, misaligned
from test_kernel import DY_SHAPE, FILTER_SIZE, X_SHAPE, assert_matches, expected_dw, para

from tbe_like import arrays, layout, ops
from tbe_like.kernel import Kernel
from tbe_like.testing import reference as ref

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def kernel(filter_kernel):
    """The weight gradient of test_kernel's small layer, float32 (a float16 one is there)."""
    return filter_kernel(X_SHAPE, DY_SHAPE, "float32", FILTER_SIZE, para(), "arrays_small")


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 16, 3, 5, 5)).astype(np.float32)
    dy = rng.standard_normal((1, 16, 2, 5, 5)).astype(np.float32)
    return layout.to_ndc1hwc0(x), layout.to_ndc1hwc0(dy), expected_dw(x, dy)


def spy(kernel, monkeypatch) -> list:
    """Record the addresses of the arguments the kernel's function receives."""
    seen, func = [], kernel._func

    def recording(*args):
        seen.append([arrays.view_of(a).pointer for a in args])
        return func(*args)

    monkeypatch.setattr(kernel, "_func", recording)
    return seen


def address(a) -> int:
    return arrays.view_of(a).pointer


def test_numpy_inputs_are_read_in_place(kernel, data, monkeypatch):
    x, dy, want = data
    seen = spy(kernel, monkeypatch)
    dw = kernel(x, dy)
    assert isinstance(dw, np.ndarray)
    assert seen[0][:2] == [x.ctypes.data, dy.ctypes.data]
    assert seen[0][2] == dw.ctypes.data  # the result is the array the kernel wrote
    assert_matches(dw, want)


def test_torch_tensors_are_read_in_place_and_give_torch(kernel, data, monkeypatch):
    x, dy, want = data
    tx, tdy = torch.from_numpy(x).requires_grad_(True), torch.from_numpy(dy)
    seen = spy(kernel, monkeypatch)
    dw = kernel(tx, tdy)
    assert isinstance(dw, torch.Tensor) and dw.dtype == torch.float32
    assert seen[0] == [tx.data_ptr(), tdy.data_ptr(), dw.data_ptr()]
    assert_matches(dw.numpy(), want)


@pytest.mark.parametrize("elements", [1, 3])
def test_misaligned_arrays_are_read_in_place_by_cpu_kernels(kernel, data, monkeypatch,
                                                            elements):
    """CPU kernels assume one element of alignment (``lowering.align_params``): an array that
    starts anywhere is read where it lies, with the same result."""
    x, dy, want = data
    mx, mdy = misaligned(x, elements), misaligned(dy, elements)
    assert kernel.alignment == 0
    seen = spy(kernel, monkeypatch)
    assert_matches(kernel(mx, mdy), want)
    assert seen[0][:2] == [mx.ctypes.data, mdy.ctypes.data]


def test_kernels_that_assume_more_alignment_get_an_aligned_copy(kernel, data, monkeypatch):
    """A kernel whose metadata records no ``arg_alignment`` (built before it was recorded)
    assumed TVM's 64 bytes: a misaligned input is copied, an aligned one is not."""
    x, dy, want = data
    meta = {k: v for k, v in kernel.metadata.items() if k != "arg_alignment"}
    old = Kernel(kernel._func, meta)
    assert old.alignment == 64
    seen = spy(old, monkeypatch)
    aligned, mdy = misaligned(x, 0), misaligned(dy, 1)
    assert_matches(old(aligned, mdy), want)
    assert seen[0][0] == aligned.ctypes.data
    assert seen[0][1] != mdy.ctypes.data and seen[0][1] % 64 == 0


@pytest.mark.parametrize("view", ["transposed", "strided", "read-only", "torch-transposed"])
def test_inputs_that_cannot_be_read_in_place_are_copied(kernel, data, monkeypatch, view):
    x, dy, want = data
    if view == "transposed":  # the same values, in memory with W and H swapped
        vx = np.ascontiguousarray(x.swapaxes(3, 4)).swapaxes(3, 4)
    elif view == "strided":
        vx = np.repeat(x, 2, axis=-1)[..., ::2]
    elif view == "read-only":
        vx = x.copy()
        vx.flags.writeable = False
    else:
        vx = torch.from_numpy(np.ascontiguousarray(x.swapaxes(3, 4))).transpose(3, 4)
    seen = spy(kernel, monkeypatch)
    got = kernel(vx, dy)
    assert_matches(np.asarray(got), want)
    assert seen[0][0] != address(vx) and seen[0][1] == dy.ctypes.data


def test_cpu_tensors_reach_a_kernel_without_the_general_checks(kernel, data, monkeypatch):
    """A DSL kernel called with CPU tensors of its shapes and dtypes (one requiring grad, one
    a ``torch.nn.Parameter``) hands them to its function as they are, through the short path
    (``_tensors_in_place``: the general path's checks took 14.6 us of Python a call), and
    returns a tensor of the reference's values; a transposed view or a wrong dtype takes the
    general path, which copies the one and names the other."""
    x, dy, want = data
    tx, tdy = torch.nn.Parameter(torch.from_numpy(x)), torch.from_numpy(dy).requires_grad_(True)
    general = Kernel._args
    monkeypatch.setattr(Kernel, "_args", lambda *a: pytest.fail("took the general path"))
    seen = spy(kernel, monkeypatch)
    got = kernel(tx, tdy)
    assert isinstance(got, torch.Tensor) and not got.requires_grad
    assert seen[0][:2] == [x.ctypes.data, dy.ctypes.data]
    assert seen[0][2] == got.data_ptr()
    assert_matches(got.numpy(), want)
    monkeypatch.setattr(Kernel, "_args", general)
    view = torch.from_numpy(np.ascontiguousarray(x.swapaxes(3, 4))).transpose(3, 4)
    assert not view.is_contiguous() and kernel._tensors_in_place((view, tdy)) is None
    assert_matches(kernel(view, tdy).numpy(), want)
    assert kernel._tensors_in_place((tx.double(), tdy)) is None
    with pytest.raises(ValueError, match="must have dtype float32"):
        kernel(tx.double(), tdy)


def test_a_dropped_result_is_reused_and_a_held_one_never(kernel, data):
    """``arrays.Spares``: the next call writes into the last result's memory once nothing
    refers to it (no array, view or tensor), never while something does."""
    x, dy, want = data
    first = kernel(x, dy)
    second = kernel(x, dy)  # ``first`` is held: new memory
    assert second.ctypes.data != first.ctypes.data
    freed = second.ctypes.data
    del second
    third = kernel(x, dy)
    assert third.ctypes.data == freed
    view = third.reshape(-1)
    del third
    fourth = kernel(torch.from_numpy(x), torch.from_numpy(dy)).numpy()  # other memory
    fifth = kernel(x, dy)  # the kept memory is the torch result's, which ``fourth`` holds
    assert len({first.ctypes.data, view.ctypes.data, fourth.ctypes.data,
                fifth.ctypes.data}) == 4
    for result in (first, view.reshape(want.shape), fourth, fifth):
        assert_matches(result, want)
    # Dropped, a NumPy result's memory serves a torch call, and a tensor's a NumPy call (the
    # same NumPy array, handed out as a tensor or not): calls of both kinds in turn allocated
    # a result each, 18 us a call of a 0.1 ms layer.
    freed = fifth.ctypes.data
    del fifth, result
    tensor = kernel(torch.from_numpy(x), torch.from_numpy(dy))
    assert tensor.data_ptr() == freed
    assert_matches(tensor.numpy(), want)
    del tensor
    assert kernel(x, dy).ctypes.data == freed


def test_results_are_cache_line_aligned_and_reused(kernel, data):
    """A host result, NumPy's or torch's, starts on a 64-byte line (NumPy's own arrays of a
    few pages start 16 bytes past one, and every vector store of a row then straddled two
    lines); it is an aligned view of the memory NumPy owns, kept for the next call while
    nothing holds either: a view of the result, or a tensor made from it, keeps it."""
    x, dy, want = data
    first = kernel(x, dy)
    assert first.ctypes.data % arrays.RESULT_ALIGNMENT == 0 and first.base is not None
    memory = first.ctypes.data
    del first
    again = kernel(x, dy)
    assert again.ctypes.data == memory  # reused
    row = again[0]  # a view: it holds the owner, not ``again``
    del again
    other = kernel(x, dy)
    assert other.ctypes.data != memory and other.ctypes.data % arrays.RESULT_ALIGNMENT == 0
    del other
    tensor = kernel(torch.from_numpy(x), torch.from_numpy(dy))
    assert tensor.data_ptr() % arrays.RESULT_ALIGNMENT == 0
    assert row.ctypes.data == memory  # still there, never written over
    assert_matches(row, want[0])
    assert_matches(tensor.numpy(), want)


def test_out_is_written_in_place(kernel, data, monkeypatch):
    x, dy, want = data
    out = np.full(kernel.outputs[0].shape, np.nan, np.float32)
    seen = spy(kernel, monkeypatch)
    assert kernel(x, dy, out=out) is out
    assert seen[0][2] == out.ctypes.data
    assert_matches(out, want)
    tout = torch.empty(kernel.outputs[0].shape)
    assert kernel(torch.from_numpy(x), torch.from_numpy(dy), out=tout) is tout
    assert_matches(tout.numpy(), want)


def test_a_non_contiguous_out_is_filled_through_a_copy(kernel, data):
    x, dy, want = data
    shape = kernel.outputs[0].shape
    holder = np.zeros((*shape[:-1], 2 * shape[-1]), np.float32)
    out = holder[..., ::2]
    kernel(x, dy, out=out)
    assert_matches(out, want)
    assert not holder[..., 1::2].any()


@pytest.mark.parametrize("case, error, match", [
    ("overlaps-input", ValueError, "out 'dw_res' overlaps an input"),
    ("wrong-shape", ValueError, r"out 'dw_res' must have shape \(1, 18, 16, 16\)"),
    ("wrong-dtype", ValueError, "out 'dw_res' must have dtype float32, got float16"),
    ("two-outs", TypeError, r"out must hold 1 array\(s\), got 2"),
])
def test_bad_out_is_refused(kernel, data, case, error, match):
    x, dy, _ = data
    shape = kernel.outputs[0].shape
    shared = np.zeros(x.size + int(np.prod(shape)), np.float32)
    if case == "overlaps-input":  # x and out share the middle of one buffer
        x = shared[:x.size].reshape(x.shape)
    out = {"overlaps-input": lambda: shared[x.size // 2:][:np.prod(shape)].reshape(shape),
           "wrong-shape": lambda: np.empty((1, 18, 16, 8), np.float32),
           "wrong-dtype": lambda: np.empty(shape, np.float16),
           "two-outs": lambda: (np.empty(shape, np.float32),) * 2}[case]()
    with pytest.raises(error, match=f"^kernel arrays_small: {match}"):
        kernel(x, dy, out=out)


def test_bfloat16_numpy_arrays_are_read_in_place(filter_kernel, monkeypatch):
    """NumPy exports no bfloat16 through DLPack: the bytes go as uint16, relabelled."""
    k = filter_kernel(X_SHAPE, DY_SHAPE, "bfloat16", FILTER_SIZE, para(), "arrays_bf16")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 16, 3, 5, 5)).astype(NP_DTYPES["bfloat16"])
    dy = rng.standard_normal((1, 16, 2, 5, 5)).astype(NP_DTYPES["bfloat16"])
    x6, dy6 = layout.to_ndc1hwc0(x), layout.to_ndc1hwc0(dy)
    seen = spy(k, monkeypatch)
    got = k(x6, dy6)
    assert seen[0][:2] == [x6.ctypes.data, dy6.ctypes.data]
    want = expected_dw(x.astype(np.float64), dy.astype(np.float64))
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=0,
                               atol=RTOL["bfloat16"] * np.abs(want).max())
    tgot = k(torch.from_numpy(x6.view(np.int16)).view(torch.bfloat16),
             torch.from_numpy(dy6.view(np.int16)).view(torch.bfloat16))
    assert tgot.dtype == torch.float32  # the weight gradient's res_dtype
    assert np.array_equal(tgot.numpy(), got)


# ----------------------------------------------------------------------------- the operators


def _torch_reference(config, go, x, w):
    """``aten.convolution_backward`` on the same data (float32 math on the rounded inputs)."""
    nd = len(config.x) - 2
    t = [torch.from_numpy(a.astype(np.float32)) for a in (go, x, w)]
    kw = config.kwargs()
    return torch.ops.aten.convolution_backward(
        *t, [w.shape[1] * config.groups if config.transposed else w.shape[0]],
        list(kw["stride"]), list(kw["padding"]), list(kw["dilation"]), kw["transposed"],
        list(kw["output_padding"]) if kw["transposed"] else [0] * nd, kw["groups"],
        list(kw["output_mask"]))


def _to_torch(a: np.ndarray):
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


@pytest.mark.parametrize("seed", range(8))
def test_numpy_and_torch_inputs_equal_pytorch(seed, tmp_path_factory):
    """Random configurations (1D/2D/3D, transposed, groups, masks, dtypes): NumPy in gives
    NumPy out and torch in gives torch out, the same values, equal to PyTorch's."""
    from tbe_like.cache import KernelCache

    config = emulated.random_config(100 + seed)
    go, x, w = emulated._data(config)
    cache = KernelCache(tmp_path_factory.getbasetemp() / "arrays_cache")
    kw = config.kwargs()
    got = ops.convolution_backward(go, x, w, bias_sizes=None, cache=cache, **kw)
    tgot = ops.convolution_backward(*(_to_torch(a) for a in (go, x, w)), bias_sizes=None,
                                    cache=cache, **kw)
    want = _torch_reference(config, go, x, w)
    for name, g, tg, e in zip(("grad_input", "grad_weight", "grad_bias"), got, tgot, want,
                              strict=True):
        if g is None:
            assert tg is None, name
            continue
        assert isinstance(g, np.ndarray) and isinstance(tg, torch.Tensor), name
        assert str(tg.dtype) == f"torch.{g.dtype.name}", name
        e = e.double().numpy()
        atol = RTOL[config.dtype] * max(np.abs(e).max(), 1.0)
        if name == "grad_bias":  # summed by NumPy and by torch, in their own orders
            np.testing.assert_allclose(tg.double().numpy(), g.astype(np.float64), atol=atol)
        else:  # the same kernel on the same memory
            assert np.array_equal(tg.float().numpy(), g.astype(np.float32)), name
        np.testing.assert_allclose(g.astype(np.float64), e, rtol=0, atol=atol, err_msg=name)


def test_operator_out_is_written_in_place(tmp_path_factory):
    from tbe_like.cache import KernelCache

    rng = np.random.default_rng(4)
    go = rng.standard_normal((2, 8, 4, 5)).astype(np.float32)
    x = rng.standard_normal((2, 4, 6, 7)).astype(np.float32)
    w = rng.standard_normal((8, 4, 3, 3)).astype(np.float32)
    kw = dict(bias_sizes=[8], stride=1, padding=0, dilation=1, output_mask=(True, True, True),
              cache=KernelCache(tmp_path_factory.getbasetemp() / "arrays_cache"))
    want = ref.convolution_backward(go, x, w, stride=[1, 1], padding=[0, 0], dilation=[1, 1],
                                    transposed=False, output_padding=[0, 0], groups=1,
                                    output_mask=(True, True, True))
    out = (np.empty_like(x), np.empty_like(w), np.empty(8, np.float32))
    got = ops.convolution_backward(go, x, w, out=out, **kw)
    assert all(g is o for g, o in zip(got, out, strict=True))
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-4 * np.abs(e).max())
    with pytest.raises(ValueError, match=r"^convolution_backward: out grad_weight must have "
                                         r"shape \(8, 4, 3, 3\)"):
        ops.convolution_backward(go, x, w, out=(None, np.empty((8, 4, 3, 2), np.float32),
                                                None), **kw)


def _small_layer(tmp_path_factory, seed: int, mask=(True, True, True)):
    """An executor of a small layer (2x4x3x6x7 -> 8 channels, a 1x3x3 filter, bias) prepared
    for ``mask``, its float32 operands (grad_output, input, weight) and NumPy's gradients."""
    from tbe_like.cache import KernelCache

    rng = np.random.default_rng(seed)
    go = rng.standard_normal((2, 8, 3, 4, 5)).astype(np.float32)
    x = rng.standard_normal((2, 4, 3, 6, 7)).astype(np.float32)
    w = rng.standard_normal((8, 4, 1, 3, 3)).astype(np.float32)
    conv = dict(stride=1, padding=0, dilation=1)
    ex = ops.prepare_convolution_backward(
        go, x, w, bias_sizes=[8] if mask[2] else None, output_mask=mask, transposed=False,
        output_padding=0, groups=1,
        cache=KernelCache(tmp_path_factory.getbasetemp() / "arrays_cache"), **conv)
    want = ref.convolution_backward(go, x, w, transposed=False, output_padding=0, groups=1,
                                    output_mask=mask, **conv)
    return ex, (go, x, w), want


@pytest.mark.parametrize("library", ["numpy", "torch", "torch-requires-grad",
                                     "torch-parameter"])
def test_the_operator_reads_plain_arrays_without_the_general_checks(tmp_path_factory,
                                                                     monkeypatch, library):
    """Contiguous NumPy arrays and CPU tensors of the prepared shapes and dtype go straight to
    the kernels (``_plain_call``: a 1x1x1 layer's call took 25-40 us on the general path, its
    kernel 1-13 us), read in place, with results of the inputs' library equal to the
    reference's; a module's weight (``torch.nn.Parameter``, what ``tbe_like.torch``'s backward
    pass hands over) too; anything else (a transposed view, a wrong dtype) takes the general
    path."""
    ex, (go, x, w), want = _small_layer(tmp_path_factory, 5)
    args = (go, x, w)
    if library != "numpy":
        args = tuple(torch.from_numpy(a) for a in args)
        if library == "torch-requires-grad":
            args[2].requires_grad_(True)
        if library == "torch-parameter":
            args = (*args[:2], torch.nn.Parameter(args[2]))
    general = Kernel._args
    monkeypatch.setattr(Kernel, "_args", lambda *a: pytest.fail("took the general path"))
    seen = [spy(k, monkeypatch) for k in (ex.kernels["grad_input"], ex.kernels["grad_weight"])]
    got = ex(*args)
    kind = np.ndarray if library == "numpy" else torch.Tensor
    assert all(isinstance(g, kind) for g in got)
    assert seen[0][0][:2] == [address(args[0]), address(args[2])]  # dX: (grad_output, weight)
    assert seen[1][0][:2] == [address(args[1]), address(args[0])]  # dW: (input, grad_output)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), e, rtol=0, atol=1e-4 * np.abs(e).max())
    # A transposed view of x takes the general path (which copies it), same values.
    monkeypatch.setattr(Kernel, "_args", general)
    tx = np.ascontiguousarray(x.swapaxes(3, 4)).swapaxes(3, 4)
    assert ex._plain(go, tx, w) is None
    np.testing.assert_allclose(ex(go, tx, w)[1], want[1], rtol=0,
                               atol=1e-4 * np.abs(want[1]).max())
    if library != "numpy":  # the same as a tensor (the kernels take tensors as they come)
        ttx = torch.from_numpy(tx)
        assert not ttx.is_contiguous() and ex._plain(args[0], ttx, args[2]) is None
        got = ex(args[0], ttx, args[2])[1]
        assert isinstance(got, torch.Tensor)
        np.testing.assert_allclose(got.numpy(), want[1], rtol=0,
                                   atol=1e-4 * np.abs(want[1]).max())
    with pytest.raises(ValueError, match="input must have shape"):
        ex(go, x.astype(np.float64), w)


@pytest.mark.parametrize("mask", [(False, True, False), (True, False, True)])
def test_numpy_calls_of_a_2d_layer_take_the_short_path(tmp_path_factory, monkeypatch, mask):
    """NumPy operands and no ``out`` (``_plain_call``'s shortest path): a 2D layer's operands
    reach the kernels as 5-D views of their memory, the results come back in the operator's
    shapes, equal to NumPy's, and a dropped result's memory is written again by the next
    call; an operand no kernel reads (the weight of a weight gradient) may be a transposed
    view, a read operand may not (the general path copies it)."""
    from tbe_like.cache import KernelCache

    rng = np.random.default_rng(11)
    go = rng.standard_normal((2, 6, 5, 4)).astype(np.float32)
    x = rng.standard_normal((2, 3, 7, 6)).astype(np.float32)
    w = rng.standard_normal((6, 3, 3, 3)).astype(np.float32)
    conv = dict(stride=1, padding=0, dilation=1, transposed=False, output_padding=0, groups=1)
    ex = ops.prepare_convolution_backward(
        go, x, w, bias_sizes=[6] if mask[2] else None, output_mask=mask,
        cache=KernelCache(tmp_path_factory.getbasetemp() / "arrays_cache"), **conv)
    want = ref.convolution_backward(go, x, w, output_mask=mask, **conv)
    weight = w if mask[0] else np.ascontiguousarray(w.swapaxes(2, 3)).swapaxes(2, 3)
    general = Kernel._args
    monkeypatch.setattr(Kernel, "_args", lambda *a: pytest.fail("took the general path"))
    seen = {name: spy(k, monkeypatch) for name, k in ex.kernels.items()}
    got = ex(go, x, weight)
    for g, e in zip(got, want, strict=True):
        assert (g is None) == (e is None)
        if g is not None:
            assert isinstance(g, np.ndarray) and g.shape == e.shape
            np.testing.assert_allclose(g, e, rtol=0, atol=1e-4 * np.abs(e).max())
    slot = 0 if mask[0] else 1
    (name,) = ex.kernels
    assert seen[name][0][:2] == ([address(go), address(w)] if mask[0] else
                                 [address(x), address(go)])
    memory = address(got[slot])
    del got, g
    again = ex(go, x, weight)
    assert address(again[slot]) == memory
    np.testing.assert_allclose(again[slot], want[slot], rtol=0,
                               atol=1e-4 * np.abs(want[slot]).max())
    monkeypatch.setattr(Kernel, "_args", general)
    transposed = np.ascontiguousarray(go.swapaxes(2, 3)).swapaxes(2, 3)
    assert ex._plain(transposed, x, weight) is None
    np.testing.assert_allclose(ex(transposed, x, weight)[slot], want[slot], rtol=0,
                               atol=1e-4 * np.abs(want[slot]).max())


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_out_arrays_are_written_without_the_general_checks(tmp_path_factory, monkeypatch,
                                                           library):
    """``out=`` arrays that need no conversion (contiguous, the prepared shapes and dtype, no
    byte shared with an input) are handed to the kernels as they are, on the plain path (the
    general path's checks cost 30-40 us a call); the call returns them, filled with the
    reference's values. A non-contiguous ``out`` takes the general path (through a copy)."""
    ex, (go, x, w), want = _small_layer(tmp_path_factory, 6)
    args = (go, x, w)
    out = tuple(np.full(a.shape, np.nan, np.float32) for a in (x, w, want[2]))
    if library == "torch":
        args, out = (tuple(torch.from_numpy(a) for a in group) for group in (args, out))
    general = Kernel._args
    monkeypatch.setattr(Kernel, "_args", lambda *a: pytest.fail("took the general path"))
    seen = [spy(k, monkeypatch) for k in (ex.kernels["grad_input"], ex.kernels["grad_weight"])]
    got = ex(*args, out=out)
    assert all(g is o for g, o in zip(got, out, strict=True))
    assert seen[0][0][2] == address(out[0]) and seen[1][0][2] == address(out[1])
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), e, rtol=0, atol=1e-4 * np.abs(e).max())
    # The kernel alone: the same, through Kernel.__call__'s plain path.
    kx, kgo = x.reshape(ex.kernels["grad_weight"].inputs[0].shape), go
    dw = np.full(ex.kernels["grad_weight"].outputs[0].shape, np.nan, np.float32)
    assert ex.kernels["grad_weight"](kx, kgo, out=dw) is dw
    np.testing.assert_allclose(dw.reshape(w.shape), want[1], rtol=0,
                               atol=1e-4 * np.abs(want[1]).max())
    # An out that shares memory with an operand another kernel reads: refused, whichever path.
    for shared in (x.reshape(-1)[:w.size].reshape(w.shape), go.reshape(-1)[:w.size].reshape(
            w.shape)):
        assert ex._plain(go, x, w, (None, shared, None)) is None
        with pytest.raises(ValueError, match=r"^convolution_backward: out grad_weight shares "
                                             r"memory with (input|grad_output)"):
            ex(go, x, w, out=(None, shared, None))
    # A strided out: the general path, which writes it through a copy.
    monkeypatch.setattr(Kernel, "_args", general)
    holder = np.zeros((*w.shape[:-1], 2 * w.shape[-1]), np.float32)
    strided = holder[..., ::2]
    assert ex._plain(go, x, w, (None, strided, None)) is None
    ex(go, x, w, out=(None, strided, None))
    np.testing.assert_allclose(strided, want[1], rtol=0, atol=1e-4 * np.abs(want[1]).max())
    assert not holder[..., 1::2].any()


def test_a_torch_operand_no_kernel_reads_is_checked_as_a_tensor(tmp_path_factory,
                                                                  monkeypatch):
    """A weight-gradient-only call on CPU tensors hands grad_output and input to NumPy and
    checks the weight (which no kernel reads) as a tensor: a transposed view of it still takes
    the plain path; a weight of the wrong dtype or shape falls to the general path, which
    names it."""
    ex, (go, x, w), want = _small_layer(tmp_path_factory, 7, (False, True, False))
    want = want[1]
    tw = torch.from_numpy(np.ascontiguousarray(w.swapaxes(3, 4))).transpose(3, 4)
    general = Kernel._args
    monkeypatch.setattr(Kernel, "_args", lambda *a: pytest.fail("took the general path"))
    got = ex(torch.from_numpy(go), torch.from_numpy(x), tw)[1]
    assert isinstance(got, torch.Tensor)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-4 * np.abs(want).max())
    monkeypatch.setattr(Kernel, "_args", general)
    for bad, match in ((tw.double(), "weight must have shape .* dtype float32"),
                       (tw[:4], r"weight must have shape \(8, 4, 1, 3, 3\)")):
        assert ex._plain(torch.from_numpy(go), torch.from_numpy(x), bad) is None
        with pytest.raises(ValueError, match=f"^convolution_backward: {match}"):
            ex(torch.from_numpy(go), torch.from_numpy(x), bad)


def test_the_plain_path_refuses_what_the_kernel_cannot_read_in_place(kernel, data):
    """``Kernel._reads_in_place``: a kernel that assumes 64-byte addresses takes an aligned
    array as it is and a misaligned one through the general path (which copies it)."""
    x, dy, _ = data
    meta = {k: v for k, v in kernel.metadata.items() if k != "arg_alignment"}
    old = Kernel(kernel._func, meta)
    assert old._reads_in_place((misaligned(x, 0), misaligned(dy, 0)))
    assert not old._reads_in_place((misaligned(x, 0), misaligned(dy, 1)))
    assert kernel._reads_in_place((misaligned(x, 1), misaligned(dy, 3)))  # assumes 4 bytes
    read_only = x.copy()
    read_only.flags.writeable = False
    for bad in (x[..., ::2], read_only, x.astype(np.float64), x[:, :1], list(x)):
        assert not kernel._reads_in_place((bad, dy))
    assert not kernel._reads_in_place((x,))


# ----------------------------------------------------------------------------- CUDA


class _FakeDtype:
    """Stands for ``torch.float16`` (``tbe_like.arrays`` reads torch dtypes by their name)."""

    __module__ = "torch.fake"

    def __str__(self):
        return "torch.float16"


class _FakeCudaTensor:
    """Stands for a contiguous torch CUDA tensor: what ``tbe_like.arrays`` reads of one."""

    __module__ = "torch.fake"
    is_cuda, requires_grad = True, False
    device = type("FakeDevice", (), {"type": "cuda", "index": 0, "__str__": lambda _: "cuda:0"})()

    def __init__(self, shape, pointer):
        self.shape, self.dtype, self._pointer = tuple(shape), _FakeDtype(), pointer

    def data_ptr(self):
        return self._pointer

    def is_contiguous(self):
        return True

    def stride(self):
        return tuple(int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))


def test_the_cuda_call_path_allocates_no_host_buffer(kernel, monkeypatch):
    """Without a GPU: a CUDA kernel called on (stand-ins for) torch CUDA tensors passes them by
    reference and gets its output from torch on the same device; nothing is allocated or copied
    on the host (NumPy arrays, TVM host tensors)."""
    from tbe_like import device_code
    from tbe_like import kernel as kernel_module

    meta = {**kernel.metadata, "target_kind": "cuda", "arg_alignment": 64}
    specs = (meta["inputs"], meta["outputs"])
    for spec in (*specs[0], *specs[1]):
        spec["dtype"] = "float16"
    calls, made = [], []
    cuda = Kernel(lambda *args: calls.append(args), meta)
    monkeypatch.setattr(device_code, "cuda_present", lambda: True)

    def on_gpu(shape, dtype=None, device=None):
        assert str(dtype) == "torch.float16" and str(device) == "cuda:0"
        made.append(_FakeCudaTensor(shape, 1 << 20))
        return made[-1]

    def refuse(*args, **kwargs):
        raise AssertionError("a host buffer was allocated on the CUDA call path")

    monkeypatch.setattr(torch, "empty", on_gpu)
    for name in ("empty", "array", "ascontiguousarray", "copyto"):
        monkeypatch.setattr(np, name, refuse)
    monkeypatch.setattr(kernel_module.tvm_runtime, "tensor", refuse)
    monkeypatch.setattr(kernel_module.tvm_runtime, "empty", refuse)
    inputs = [_FakeCudaTensor(spec["shape"], 4096 * (i + 1)) for i, spec in
              enumerate(specs[0])]
    result = cuda(*inputs)
    assert result is made[0] and len(made) == 1
    assert calls == [(*inputs, made[0])]


def test_an_array_on_another_device_is_refused(kernel, data):
    x, dy, _ = data
    on_gpu = _FakeCudaTensor(x.shape, 1 << 20)
    on_gpu.dtype = type("FakeFloat32", (), {"__module__": "torch.fake",
                                             "__str__": lambda self: "torch.float32"})()
    with pytest.raises(ValueError, match=r"^kernel arrays_small: input 'x' must be on the llvm "
                                         r"kernel's device \(cpu\), got cuda$"):
        kernel(on_gpu, dy)


def test_tensors_without_memory_are_refused_by_name(kernel, data, tmp_path_factory):
    """torch's meta tensors (shapes, no memory; no DLPack) get the operator's ValueError
    naming the parameter and the device, not PyTorch's DLPack error."""
    from tbe_like.cache import KernelCache

    cache = KernelCache(tmp_path_factory.getbasetemp() / "arrays_cache")
    go, x, w = (torch.empty(s, device="meta") for s in ((2, 8, 4, 5), (2, 4, 6, 7), (8, 4, 3, 3)))
    with pytest.raises(ValueError, match=r"^convolution_backward: grad_output must be on the "
                                         r"cpu \(the kernels were built for llvm\), got an array "
                                         r"on meta$"):
        ops.convolution_backward(go, x, w, bias_sizes=None, stride=1, padding=0, dilation=1,
                                 cache=cache)
    dy, xs = torch.empty((1, 4, 4, 8), device="meta"), torch.empty((1, 6, 6, 3), device="meta")
    with pytest.raises(ValueError, match=r"^deconv_grad_filter: dy must be on the cpu"):
        ops.deconv_grad_filter(dy, xs, kernel=(3, 3), stride=1, pad=0, dilation=1, group=1,
                               cache=cache)
    x_np, dy_np, _ = data
    with pytest.raises(ValueError, match=r"^kernel arrays_small: input 'x' must be on the llvm "
                                         r"kernel's device \(cpu\), got meta$"):
        kernel(torch.empty(x_np.shape, device="meta"), dy_np)


@pytest.mark.parametrize("shape", [
    (1, 8, 4, 16, 16),     # rows of whole blocks (1024 = 4 x 256)
    (3, 5, 3, 7, 13),      # 273 = one block and a rest, three images
    (2, 16, 2, 4, 4),      # rows shorter than a block
    (2, 4, 600),           # 1D: 600 = 2 blocks and a rest
    (1, 3, 2, 300, 300),   # 180000 elements a channel
])
@pytest.mark.parametrize("values", ["normal", "positive"])
def test_channel_sums_are_as_accurate_as_numpys_sum(shape, values):
    """grad_bias's host sum (``arrays.sum_float32`` over all axes but the channels, float32)
    in blocks of a row: within a few float32 roundings of float64's sum, as NumPy's pairwise
    ``sum`` is, for any row length, batch and sign of the values; a non-contiguous array and
    other dtypes too (those take ``sum`` itself)."""
    rng = np.random.default_rng(sum(shape))
    a = rng.standard_normal(shape).astype(np.float32)
    if values == "positive":
        a = np.abs(a) + 1
    axes = (0, *range(2, a.ndim))
    want = a.astype(np.float64).sum(axis=axes)
    scale = np.abs(a).astype(np.float64).sum(axis=axes)
    got = arrays.sum_float32(a, axes, "float32")
    assert got.dtype == np.float32 and got.shape == (shape[1],)
    numpys = np.abs(a.sum(axis=axes, dtype=np.float32) - want) / scale
    assert np.all(np.abs(got - want) / scale <= np.maximum(4 * numpys, 1e-6))
    flipped = a[..., ::-1]  # not contiguous: summed the same way after a copy
    np.testing.assert_allclose(arrays.sum_float32(flipped, axes, "float32"), got,
                               rtol=1e-5, atol=1e-6 * scale.max())
    a16 = a.astype(np.float16)  # summed in float32, rounded once (inf past float16's range)
    with np.errstate(over="ignore"):
        half = arrays.sum_float32(a16, axes, "float16")
        want16 = a16.astype(np.float64).sum(axis=axes).astype(np.float16)
    assert half.dtype == np.float16
    np.testing.assert_allclose(half, want16, rtol=1e-3, atol=1e-6 * scale.max())
