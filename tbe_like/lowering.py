"""Rewrites of a scheduled module that TVM's lowering needs to see, applied before every build.

``align_params``: TVM declares every parameter buffer 64-byte aligned, and LLVM then emits
aligned vector moves (``vmovaps``) on it: a NumPy array (16-byte aligned by its allocator, any
element for a view) handed over in place crashed the kernel. CPU kernels declare their
parameters aligned to one element instead, which every array satisfies; unaligned vector moves
cost nothing on aligned data, and the kernels' own stages stay 64-byte aligned.

``skip_padding``: a reduction whose every term is a product with a value read from a
zero-padded stage adds nothing where that read lies in the padding. A rule that knows it
annotates the reduction's block with the stage's live rows (:data:`LIVE_ROWS`, through
``schedules.common.skip_padding``: a schedule step, so that tuning records replay it), and the
loop nest tests that the read is inside them, once per iteration of the innermost loop the
test depends on (outside the register tile; never inside an unrolled or vectorized loop: as the
block's own predicate, inside the tile, LLVM kept an input gradient's accumulators in memory
and it ran 2-3.6x slower). On a 4-frame clip a (3,1,1) kernel's weight gradient multiplied
zeros in 17% of its steps, on a 2x4x4 map a 3x3x3 kernel's in 54%.

``fold_guards``: a shared-memory copy of an implicit-GEMM operand reads through two padding
stages inlined into one another (the convolution's zero padding, then the padding of the GEMM
to whole tiles), so its value is ``if_then_else(a, if_then_else(b, x, 0), 0)``. TVM turns a
copy into ``cp.async`` (with zero fill where the guard is false) and a vector load only when the
value is one guarded load, ``if_then_else(a and b, x, 0)``; the nested form stays a scalar
gather. The two are the same value: ``x`` where both guards hold, else the common default.
"""

from __future__ import annotations

from tvm_ffi import structural_map, structural_walk

from ._tvm import And, BufferReplacer, Call, IRModule, Var, decl_buffer, s_tir, tirx

# The address alignment TVM declares its parameter buffers with (bytes).
DEFAULT_PARAM_ALIGNMENT = 64

_IF_THEN_ELSE = "prim.if_then_else"

# The block annotation that says where a reduction's terms can be non-zero: ``[buffer name,
# axis, first, end, axis, first, end, ...]``, the rows ``first <= index < end`` along each
# ``axis`` of the buffer it reads (:func:`skip_padding`).
LIVE_ROWS = "tbe_like.live_rows"
# The annotation (a ``te.compute`` attribute) of a zero-padded stage: ``[axis, first, end,
# ...]``, the rows along each axis that hold its source; it is zero elsewhere.
SOURCE_ROWS = "tbe_like.source_rows"


def source_rows(rows: dict[int, tuple[int, int]]) -> dict:
    """The ``te.compute`` attributes of a padded stage whose source lies in ``rows`` (``{axis:
    (first, end)}``)."""
    return {SOURCE_ROWS: [int(v) for axis, (first, end) in sorted(rows.items())
                          for v in (axis, first, end)]}


def rows_of(flat) -> dict[int, tuple[int, int]]:
    """``{axis: (first, end)}`` of the triples ``[axis, first, end, ...]`` that
    :data:`SOURCE_ROWS` and :data:`LIVE_ROWS` (after the buffer's name) hold."""
    flat = [int(v) for v in flat]
    return {flat[i]: (flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)}


def declared_rows(tensor) -> dict[int, tuple[int, int]]:
    """The source rows a padded stage (a TE tensor) declares (:func:`source_rows`)."""
    return rows_of((tensor.op.attrs or {}).get(SOURCE_ROWS, []))


def _is_guard(expr) -> bool:
    return isinstance(expr, Call) and getattr(expr.op, "name", "") == _IF_THEN_ELSE


def _same_constant(a, b) -> bool:
    return (isinstance(a, (tirx.IntImm, tirx.FloatImm)) and type(a) is type(b)
            and a.value == b.value and str(a.ty) == str(b.ty))


def _fold(call):
    """``if_then_else(a, if_then_else(b, x, c), c)`` -> ``if_then_else(a and b, x, c)``, for a
    constant ``c`` (the inner call is already folded: the map works bottom-up)."""
    if not _is_guard(call):
        return call
    cond, then, other = call.args
    if _is_guard(then) and _same_constant(then.args[2], other):
        return tirx.if_then_else(And(cond, then.args[0]), then.args[1], other)
    return call


def fold_guards(mod):
    """``mod`` with every nested zero-padding guard folded into one (see the module's doc)."""
    return structural_map(mod, [(Call, _fold)])


def _itemsize(buffer) -> int:
    return max(1, buffer.ty.dtype.dtype.itemsize)


def param_alignment(target) -> int:
    """The bytes a kernel for ``target`` assumes of its parameters' addresses: ``0`` for one
    element of each parameter's dtype (CPU kernels, see the module's doc), else TVM's 64."""
    return 0 if str(target.kind.name) == "llvm" else DEFAULT_PARAM_ALIGNMENT


def _aligned(buffer, data=None):
    """``buffer`` declared aligned to one element (on ``data``, for a view)."""
    return decl_buffer(buffer.ty.shape, buffer.ty.dtype, buffer.name, data, buffer.ty.strides,
                       buffer.ty.elem_offset, buffer.scope(), _itemsize(buffer),
                       buffer.ty.offset_factor)


def align_params(mod, target):
    """``mod`` with its parameters declared as :func:`param_alignment` says: aligned to one
    element for a CPU ``target``; unchanged for a GPU one (its vector copies need the
    alignment, which ``Kernel`` checks at call time). So are the views of a parameter
    (``bounds.prim_func``'s ``DeclBuffer``s, the only ones a scheduled module has): a view
    declared 64-byte aligned made LLVM emit aligned moves on the user's array as well."""
    if param_alignment(target):
        return mod
    funcs = {}
    for gvar, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc):
            replace = {p: _aligned(p) for p in func.params
                       if p.ty.data_alignment > _itemsize(p)}
            func = BufferReplacer(replace)(func) if replace else func
            views = []
            structural_walk(func, [(tirx.DeclBuffer, views.append)])
            replace = {v.buffer: _aligned(v.buffer, v.data) for v in views
                       if v.buffer.ty.data_alignment > _itemsize(v.buffer)}
            func = BufferReplacer(replace)(func) if replace else func
        funcs[gvar] = func
    return IRModule(funcs, attrs=mod.attrs)


def _is_true(expr) -> bool:
    return isinstance(expr, tirx.IntImm) and int(expr.value) == 1


def _live_condition(realize):
    """The condition that ``realize``'s read lies in its block's :data:`LIVE_ROWS`, in the
    loops' variables; None when the block has none or its read of the buffer is not one
    element (only a point's row is known)."""
    block = realize.block
    if LIVE_ROWS not in block.annotations:
        return None
    name, *flat = block.annotations[LIVE_ROWS]
    regions = [r for r in block.reads if r.source.name == str(name)]
    if len(regions) != 1 or not all(_is_true(rng.extent) for rng in regions[0].region):
        return None
    values = {iv.var: value for iv, value in zip(block.iter_vars, realize.iter_values,
                                                 strict=True)}
    cond = None
    for axis, (first, end) in rows_of(flat).items():
        index = structural_map(regions[0].region[axis].min, [(Var, lambda v: values.get(v, v))])
        live = And(index >= first, index < end)
        cond = live if cond is None else And(cond, live)
    return cond


def _without_live_rows(realize):
    block = realize.block
    annotations = {k: v for k, v in block.annotations.items() if k != LIVE_ROWS}
    block = s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, block.body,
                         block.init, block.alloc_buffers, block.match_buffers, annotations)
    return s_tir.SBlockRealize(realize.iter_values, realize.predicate, block)


def _vars(expr) -> set:
    found = set()
    structural_walk(expr, [(Var, found.add)])
    return found


_TILE_KINDS = (tirx.ForKind.UNROLLED, tirx.ForKind.VECTORIZED)


def _place_live_condition(loop):
    """``loop`` with its body under the live condition of the one annotated block inside it,
    where ``loop`` is the innermost loop whose variable the condition uses (the loops of one
    iteration left out): the condition is then tested once per iteration of ``loop``, outside
    every loop it does not depend on. Not where ``loop`` is unrolled or vectorized (inside a
    register tile the test is made per tile element, and LLVM left accumulators in memory)."""
    if _is_true(loop.extent):  # one iteration: the loop around it tests, its variable fixed
        return loop
    realizes = []
    structural_walk(loop.body, [(s_tir.SBlockRealize, realizes.append)])
    if len(realizes) != 1:
        return loop
    cond = _live_condition(realizes[0])
    if cond is None:
        return loop
    inner, single = set(), {}

    def note(f):
        if _is_true(f.extent):  # one iteration: its variable is its first value
            single[f.loop_var] = f.min
        else:
            inner.add(f.loop_var)

    structural_walk(loop.body, [(tirx.For, note)])
    cond = structural_map(cond, [(Var, lambda v: single.get(v, v))])
    used = _vars(cond)
    if loop.loop_var not in used or used & inner:
        return loop
    body = structural_map(loop.body, [(s_tir.SBlockRealize, lambda r: _without_live_rows(r)
                                       if r.same_as(realizes[0]) else r)])
    if loop.kind not in _TILE_KINDS:
        body = tirx.IfThenElse(cond, body, None)
    return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding,
                    loop.annotations)


def skip_padding(mod):
    """``mod`` with the loop nest of every block annotated with :data:`LIVE_ROWS` skipping the
    iterations whose read lies outside those rows (see the module's doc and
    :func:`_place_live_condition`); the annotation is then dropped. (Every build comes through
    here: a module without the annotation is returned as it is, its loops not walked.)"""
    annotated = []
    structural_walk(mod, [(s_tir.SBlock, lambda b: annotated.append(b)
                           if LIVE_ROWS in b.annotations else None)])
    if not annotated:
        return mod
    mod = structural_map(mod, [(tirx.For, _place_live_condition)])
    return structural_map(mod, [(s_tir.SBlockRealize, lambda r: _without_live_rows(r)
                                 if LIVE_ROWS in r.block.annotations else r)])


def prepare(mod):
    """What every build lowers: ``mod`` with its reductions' padding skipped
    (:func:`skip_padding`) and its guards folded, then simplified in each block's iterator
    domains (TVM's ``StmtSimplify`` on the scheduled module).

    The second step is for vectorized copies: a copy iterates (run, lane) over a contiguous
    axis ``run * lanes + lane`` (``schedules.cuda.gemm.stage_operand``); knowing the lane is
    below ``lanes``, the simplifier turns every index of that axis (``// 576``, ``% 144 // 48``
    of an im2col) into one of the run alone plus the lane in the last term. Lowered first, the
    run becomes a sum of thread and loop terms the vectorizer cannot see is a multiple of
    ``lanes``, and it falls back to scalar loads.
    """
    return s_tir.transform.StmtSimplify()(fold_guards(skip_padding(mod)))
