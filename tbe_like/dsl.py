"""The face that mirrors ``tbe.dsl``: operators, ``auto_schedule`` and ``build``.

A script written for TBE runs with its import line changed to ``from tbe_like import tvm, dsl``::

    dedw = dsl.conv3d_backprop_filter(x=fmap, out_backprop=dedy, filter_size=[16, 2, 16, 3, 3],
                                      para_dict={"strides": [2, 2, 2], "pads": [0, 0, 0, 1, 0, 1]})
    sch = dsl.auto_schedule(dedw)                    # LLVM for this CPU unless a target is given
    kernel = dsl.build(sch, {"name": "my_kernel", "tensor_list": [fmap, dedy, dedw]})
    dw = kernel(x_6hd, dy_6hd)                       # NumPy in, NumPy out

``build`` writes ``kernel_meta/my_kernel.so`` and ``kernel_meta/my_kernel.json``;
``tbe_like.load_kernel`` loads them in another process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import bounds, compute, params
from ._tvm import IRModule, Target, s_tir, te, tirx
from .bounds import compile_checked
from .kernel import DEFAULT_OUTPUT_DIR, Kernel, TensorSpec, export_kernel
from .params import calculate_group
from .target import resolve_target

__all__ = [
    "Schedule",
    "auto_schedule",
    "build",
    "calculate_group",
    "conv3d_backprop_filter",
    "conv3d_backprop_input",
    "conv3d_transpose",
]

# Attribute keys under which an operator's result stage records how it was made.
_ATTR_OP = "tbe_like.op"
_ATTR_ARGS = "tbe_like.args"
_ATTR_INPUTS = "tbe_like.inputs"


@dataclass(frozen=True)
class _OpSpec:
    validate: Callable[..., Any]  # (**recorded args) -> params dataclass
    input_layouts: tuple[str, ...]
    output_layout: str


_OPS: dict[str, _OpSpec] = {
    params.FILTER_OP: _OpSpec(params.backprop_filter_params,
                              (params.NDC1HWC0, params.NDC1HWC0), params.FRACTAL_Z_3D),
    params.INPUT_OP: _OpSpec(params.backprop_input_params,
                             (params.FRACTAL_Z_3D, params.NDC1HWC0, "ND"), params.NDC1HWC0),
}


def _static_shape(op: str, name: str, tensor: Any) -> tuple[tuple[int, ...], str]:
    if not isinstance(tensor, te.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor from tvm.placeholder, got "
                        f"{type(tensor).__name__}")
    if not isinstance(tensor.op, te.PlaceholderOp):
        # create_prim_func would fail with a TVM InternalError: the inputs must be placeholders.
        raise TypeError(f"{op}: {name} must be a tensor from tvm.placeholder, got the output of "
                        f"{type(tensor.op).__name__} {tensor.op.name!r}")
    shape = []
    for extent in tensor.shape:
        if not isinstance(extent, tirx.IntImm):
            raise ValueError(f"{op}: {name} must have a static shape, got {list(tensor.shape)}")
        shape.append(int(extent))
    return tuple(shape), str(tensor.dtype)


def _normalized(para_dict: Any) -> Any:
    """para_dict as plain JSON values (lists for tuples), for recording and metadata."""
    if isinstance(para_dict, Mapping):
        return {str(k): _normalized(v) for k, v in para_dict.items()}
    if isinstance(para_dict, (list, tuple)):
        return [_normalized(v) for v in para_dict]
    if hasattr(para_dict, "__index__") and not isinstance(para_dict, bool):
        return int(para_dict)
    return para_dict


def conv3d_backprop_filter(x: te.Tensor, out_backprop: te.Tensor, filter_size: Any,
                           para_dict: Mapping[str, Any]) -> te.Tensor:
    """The weight gradient of a 3D convolution, as TBE's ``dsl.conv3d_backprop_filter``.

    Parameters
    ----------
    x : te.Tensor
        The forward input, NDC1HWC0 ``(N, D, Cin1, H, W, C0)``; float16, bfloat16 or float32.
        C0 is 16 (also 8 for float32).
    out_backprop : te.Tensor
        The gradient of the forward output, NDC1HWC0 ``(N, Do, Cout1, Ho, Wo, C0)``, same dtype.
    filter_size : list of 5 ints
        ``[Cout, kd, Cin/groups, kh, kw]``.
    para_dict : dict
        ``strides`` ``[sd, sh, sw]`` (or ``[1, sd, sh, sw, 1]``), ``pads``
        ``[front, back, top, bottom, left, right]`` (both required); ``dilations``
        ``[1, dd, 1, dh, dw]`` (or 3 entries, default 1s); ``res_dtype`` (``"float32"``,
        float16, bfloat16); ``kernel_name``; ``group_dict`` (see ``calculate_group``; default
        groups = 1).

    Returns
    -------
    te.Tensor
        dW as FRACTAL_Z_3D with groups, ``(real_g, kd*cin1_g*kh*kw, cout_g, C0)`` in
        ``res_dtype``, accumulated in float32; zero in cross-group and padded channel cells.
    """
    op = params.FILTER_OP
    x_shape, x_dtype = _static_shape(op, "x", x)
    dy_shape, dy_dtype = _static_shape(op, "out_backprop", out_backprop)
    if x.same_as(out_backprop):
        raise ValueError(f"{op}: x and out_backprop must be two different placeholders, got "
                         f"{x.op.name!r} for both")
    p = params.backprop_filter_params(x_shape, x_dtype, dy_shape, dy_dtype, filter_size,
                                      para_dict)
    args = {"x_shape": x_shape, "x_dtype": x_dtype, "dy_shape": dy_shape, "dy_dtype": dy_dtype,
            "filter_size": filter_size, "para_dict": para_dict}
    attrs = {_ATTR_OP: op, _ATTR_ARGS: json.dumps(_normalized(args)),
             _ATTR_INPUTS: [x, out_backprop]}
    return compute.conv3d_backprop_filter(x, out_backprop, p, attrs=attrs)


def _split_bias(op: str, para_dict: Any) -> tuple[Any, Any]:
    """para_dict without ``tensor_bias``, and the bias placeholder (or None)."""
    if not isinstance(para_dict, Mapping) or para_dict.get("tensor_bias") is None:
        return para_dict, None
    bias = para_dict["tensor_bias"]
    _static_shape(op, "tensor_bias", bias)
    return {k: v for k, v in para_dict.items() if k != "tensor_bias"}, bias


def conv3d_backprop_input(filter: te.Tensor, out_backprop: te.Tensor, filter_size: Any,
                          input_size: Any, para_dict: Mapping[str, Any]) -> te.Tensor:
    """The input gradient of a 3D convolution, as TBE's ``dsl.conv3d_backprop_input``.

    Parameters
    ----------
    filter : te.Tensor
        The forward weight in FRACTAL_Z_3D with groups, ``(real_g*kd*cin1_g*kh*kw, cout_g/16,
        16, C0)``; float16, bfloat16 or float32 (``tbe_like.layout.to_fractal_z_3d``).
    out_backprop : te.Tensor
        The gradient of the forward output, NDC1HWC0 ``(N, Do, Cout1, Ho, Wo, C0)``, same dtype.
    filter_size : list of 5 ints
        ``[Cout, Cin/groups, kd, kh, kw]`` (NCDHW order, unlike the filter operator's).
    input_size : list of 5 ints
        ``[N, D, H, W, Cin]`` (NDHWC): the forward input's shape.
    para_dict : dict
        ``strides`` ``[1, sd, sh, sw, 1]`` (or 3 entries) and ``pads`` ``[front, back, top,
        bottom, left, right]`` (required); ``dilations`` ``[1, dd, dh, dw, 1]`` (or 3);
        ``res_dtype`` (``"float16"`` default, float32, bfloat16); ``kernel_name``;
        ``group_dict`` (``calculate_group``; default groups = 1); ``tensor_bias`` (a placeholder
        ``(ceil(Cin/C0), C0)`` added to every position; it becomes the kernel's last input).

    Returns
    -------
    te.Tensor
        dX as ``(N, D, Cin1, H*W, C0)`` (the bytes of NDC1HWC0) in ``res_dtype``, accumulated
        in float32, padded channels zero.
    """
    return _backprop_input(params.INPUT_OP, filter, out_backprop, filter_size, input_size,
                           para_dict)


def _backprop_input(op: str, filter: te.Tensor, out_backprop: te.Tensor, filter_size: Any,
                    input_size: Any, para_dict: Any) -> te.Tensor:
    """``conv3d_backprop_input``, its errors named after ``op`` (the operator the user called)."""
    w_shape, w_dtype = _static_shape(op, "filter", filter)
    dy_shape, dy_dtype = _static_shape(op, "out_backprop", out_backprop)
    if filter.same_as(out_backprop):
        raise ValueError(f"{op}: filter and out_backprop must be two different placeholders, "
                         f"got {filter.op.name!r} for both")
    pd, bias = _split_bias(op, para_dict)
    bias_spec = None if bias is None else _static_shape(op, "tensor_bias", bias)
    p = params.backprop_input_params(w_shape, w_dtype, dy_shape, dy_dtype, filter_size,
                                     input_size, pd, bias_spec, op=op)
    args = {"filter_shape": w_shape, "filter_dtype": w_dtype, "dy_shape": dy_shape,
            "dy_dtype": dy_dtype, "filter_size": filter_size, "input_size": input_size,
            "para_dict": pd, "bias": bias_spec}
    inputs = [filter, out_backprop] + ([bias] if bias is not None else [])
    attrs = {_ATTR_OP: params.INPUT_OP, _ATTR_ARGS: json.dumps(_normalized(args)),
             _ATTR_INPUTS: inputs}
    return compute.conv3d_backprop_input(filter, out_backprop, p, bias=bias, attrs=attrs)


def conv3d_transpose(x: te.Tensor, filter: te.Tensor, filter_size: Any,
                     para_dict: Mapping[str, Any]) -> te.Tensor:
    """A 3D transposed convolution (Conv3DTranspose): the input gradient's maths, run forward.

    ``x`` plays out_backprop's role (NDC1HWC0, ``Cout`` channels of ``filter_size``); the output
    has ``Cin`` channels and spatial extents ``(in - 1)*stride - front - back + dilation*(k - 1)
    + output_padding + 1``. ``para_dict`` takes the keys of ``conv3d_backprop_input`` plus
    ``output_padding`` (3 entries ``[od, oh, ow]`` or 5 ``[0, od, oh, ow, 0]`` as TBE's
    ``conv3d_transpose_d``, each below the stride; default 0). Returns ``(N, D, Cin1, H*W, C0)``.
    """
    op = params.TRANSPOSE_OP
    x_shape, _ = _static_shape(op, "x", x)
    _static_shape(op, "filter", filter)
    if x.same_as(filter):
        raise ValueError(f"{op}: x and filter must be two different placeholders, got "
                         f"{x.op.name!r} for both")
    # The keys are checked here: the valid ones include output_padding.
    params.check_para_dict(op, para_dict, ("strides", "pads"), params.TRANSPOSE_DEFAULTS)
    pd = dict(para_dict)
    output_padding = pd.pop("output_padding", (0, 0, 0))
    input_size = params.transpose_output_size(op, x_shape, filter_size, pd, output_padding)
    return _backprop_input(op, filter, x, filter_size, input_size, pd)


# ----------------------------------------------------------------------------- scheduling


@dataclass
class Schedule:
    """What ``auto_schedule`` returns and ``build`` takes.

    Attributes
    ----------
    op : str
        The operator (``"conv3d_backprop_filter"``, ...).
    params : object
        Its validated parameters (``tbe_like.params``).
    target : tvm.target.Target
        The target the schedule was made for.
    sch : tvm.s_tir.Schedule
        The TensorIR schedule of the operator's PrimFunc (``sch.mod["main"]``).
    inputs, output : te.Tensor
        The operator's placeholders, in the order of the PrimFunc's parameters, and its result.
    origin : str
        ``"record"`` (a tuning record replayed), ``"measured"`` (the fastest of the rule's
        candidates timed on this machine, now a record), or ``"rule"`` (the untimed rule).
    selection : dict or None
        For ``"measured"``: the choice, each candidate's time and the seconds it took.
    """

    op: str
    params: Any
    target: Target
    sch: Any
    inputs: tuple
    output: Any
    origin: str = "rule"
    selection: dict | None = None

    @property
    def mod(self) -> IRModule:
        return self.sch.mod

    def describe(self) -> str:
        """Where the schedule comes from, in words (with what measured selection timed)."""
        if self.selection is None:
            return {"record": "a stored tuning record", "rule": "rule"}.get(self.origin,
                                                                          self.origin)
        times = ", ".join(f"{k} {v:.3f} ms" for k, v in self.selection["times_ms"].items())
        return (f"measured in {self.selection['seconds']:.1f} s, chose "
                f"{self.selection['choice']} ({times}); stored as a record")

    def script(self) -> str:
        """The scheduled TensorIR as TVMScript text."""
        return self.sch.mod.script()


def _op_of(res: Any) -> tuple[str, Any, tuple]:
    if isinstance(res, (list, tuple)) and len(res) == 1:
        res = res[0]
    attrs = getattr(getattr(res, "op", None), "attrs", None)
    if not isinstance(res, te.Tensor) or attrs is None or _ATTR_OP not in attrs:
        got = f"tensor {res.op.name!r}" if isinstance(res, te.Tensor) else type(res).__name__
        raise TypeError("auto_schedule: res must be the tensor returned by a tbe_like dsl "
                        f"operator (e.g. dsl.conv3d_backprop_filter), got {got}")
    return str(attrs[_ATTR_OP]), res, tuple(attrs[_ATTR_INPUTS])


def _prim_func(tensors: list, symbol: str):
    return bounds.prim_func(tensors).with_attr("global_symbol", symbol)


def auto_schedule(res: te.Tensor, target: Any = None) -> Schedule:
    """Schedule an operator's result for a target with the registered rules.

    Parameters
    ----------
    res : te.Tensor
        The output of a dsl operator.
    target : None, str, dict or tvm.target.Target
        ``None``: the enclosing ``with Target(...)`` if any, else this CPU (LLVM with its real
        ``mcpu`` and all cores). ``"llvm"`` / ``"cuda"`` or a target dict are completed likewise;
        ``"cuda"`` means ``{"kind": "cuda", "arch": "sm_80"}``, another GPU is named with
        ``{"kind": "cuda", "arch": "sm_90"}`` (``sm_75`` and newer).

    A tuning record of the same operator, shapes and target (``tbe_like.tune``) is replayed.
    Without one, on a CPU, the rule's few candidate knob sets are compiled and timed here once
    and the fastest is stored as a record (measured selection, a few seconds;
    ``TBE_LIKE_MEASURE=0`` takes the rule's untimed choice instead).
    """
    from . import schedules  # the rules register themselves on import
    from .tune import plan

    op, res, inputs = _op_of(res)
    spec = _OPS[op]
    p = spec.validate(**json.loads(str(res.op.attrs[_ATTR_ARGS])))
    try:
        tgt = resolve_target(target)
    except (TypeError, ValueError) as e:  # also TVM's own errors for a bad target dict
        kind = TypeError if isinstance(e, TypeError) else ValueError
        raise kind(f"auto_schedule: {e}") from None
    func = _prim_func([*inputs, res], p.kernel_name)
    sch, origin, selection = plan(
        func, lambda s, knobs: schedules.apply_schedule(s, op, p, tgt, knobs),
        schedules.candidates(op, tgt), tgt)
    return Schedule(op, p, tgt, sch, inputs, res, origin,
                    None if selection is None else selection.as_dict())


# ----------------------------------------------------------------------------- building

_BUILD_KEYS = ("name", "tensor_list", "output_dir", "print_ir")


def _ordered_schedule(sch: Schedule, tensor_list: list) -> Any:
    """The schedule with its PrimFunc parameters in ``tensor_list`` order (trace replayed)."""
    canonical = [*sch.inputs, sch.output]
    if all(a.same_as(b) for a, b in zip(tensor_list, canonical, strict=True)):
        return sch.sch
    fresh = s_tir.Schedule(IRModule({"main": _prim_func(tensor_list, sch.params.kernel_name)}))
    sch.sch.trace.apply_to_schedule(fresh, remove_postproc=False)
    return fresh


def _check_tensor_list(sch: Schedule, tensor_list: Any) -> list:
    if not isinstance(tensor_list, (list, tuple)):
        raise TypeError(f"build: tensor_list must be a list of tensors, got "
                        f"{type(tensor_list).__name__}")
    expected = [*sch.inputs, sch.output]
    names = [t.op.name for t in expected]
    for t in tensor_list:
        if not isinstance(t, te.Tensor):
            raise TypeError(f"build: tensor_list entries must be tensors, got {type(t).__name__}")
    if len(tensor_list) != len(expected) or not all(
            sum(t.same_as(e) for t in tensor_list) == 1 for e in expected):
        got = [t.op.name for t in tensor_list]
        raise ValueError(f"build: tensor_list must hold each of the operator's inputs and its "
                         f"result exactly once {names}, got {got}")
    if not tensor_list[-1].same_as(sch.output):
        raise ValueError(f"build: the result {sch.output.op.name!r} must be the last entry of "
                         f"tensor_list, got {[t.op.name for t in tensor_list]}")
    return list(tensor_list)


def _layout_of(tensor: te.Tensor, inputs: tuple, spec: _OpSpec) -> str:
    for t, layout in zip(inputs, spec.input_layouts, strict=False):
        if t.same_as(tensor):
            return layout
    return spec.output_layout


def build(sch: Schedule, config: Mapping[str, Any]) -> Kernel:
    """Compile a schedule ahead of time into ``<output_dir>/<name>.so`` and ``.json``.

    Parameters
    ----------
    sch : Schedule
        From ``auto_schedule``.
    config : dict
        ``name`` (the kernel name: an identifier), ``tensor_list`` (the inputs then the result,
        the order of the kernel's arguments), optional ``output_dir`` (default
        ``"kernel_meta"``) and ``print_ir`` (print the scheduled TensorIR).

    Returns
    -------
    Kernel
        The built kernel, loaded: call it with NumPy arrays for the inputs. A CUDA kernel (its
        device code compiled by nvcc into the library) runs only where a GPU is present.
    """
    if not isinstance(sch, Schedule):
        raise TypeError(f"build: sch must come from dsl.auto_schedule, got {type(sch).__name__}")
    if not isinstance(config, Mapping):
        raise TypeError(f"build: config must be a dict, got {type(config).__name__}")
    unknown = sorted(str(k) for k in config if k not in _BUILD_KEYS)
    if unknown:
        raise ValueError(f"build: config has unknown key(s) {unknown}; valid keys are "
                         f"{list(_BUILD_KEYS)}")
    for key in ("name", "tensor_list"):
        if key not in config:
            raise ValueError(f"build: config is missing the required key {key!r}")
    name = params.check_kernel_name("build", config["name"])
    output_dir = config.get("output_dir", DEFAULT_OUTPUT_DIR)
    if not isinstance(output_dir, (str, os.PathLike)):
        raise TypeError(f"build: output_dir must be a str or os.PathLike, got {output_dir!r}")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"build: output_dir {str(output_dir)!r} exists and is not a folder")
    tensor_list = _check_tensor_list(sch, config["tensor_list"])
    ordered = _ordered_schedule(sch, tensor_list)
    mod = IRModule({"main": ordered.mod["main"].with_attr("global_symbol", name)})
    if config.get("print_ir"):
        print(mod.script())
    executable = compile_checked(mod, sch.target, name)
    spec = _OPS[sch.op]
    specs = [TensorSpec.of(t, _layout_of(t, sch.inputs, spec)) for t in tensor_list]
    para = dict(sch.params.para_dict)
    para["group_dict"] = sch.params.geometry.group.as_group_dict()
    para["kernel_name"] = name  # the name the kernel was built under (config wins, as in TBE)
    para["schedule"] = sch.origin
    para["index_dtype"] = bounds.index_dtype(tensor_list)
    if sch.selection is not None:
        para["selection"] = sch.selection
    return export_kernel(executable, output_dir, name, sch.op, sch.target, specs[:-1],
                         specs[-1:], _normalized(para))
