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
and it ran 2-3.6x slower). The exception is a test that depends on unrolled loops (and loops of
one iteration) alone: it goes inside them, where each unrolled copy's test is a constant that
the simplifier folds, so the copies reading padding vanish before LLVM sees them (a register
tile of a whole row with its W taps unrolled). On a 4-frame clip a (3,1,1) kernel's weight
gradient multiplied zeros in 17% of its steps, on a 2x4x4 map a 3x3x3 kernel's in 54%.

``partition``: a loop marked with :data:`PARTITION` (``schedules.common.skip_edge_columns``)
is cut in three, its first and last iterations unrolled, each piece a copy of its body: a
register tile's columns whose taps read padding then each read constant columns, and the taps
that read padding fold away as above, while the columns between test nothing. (TVM's own
``loop_partition`` schedule primitive left a weight gradient's reduction without its
zeroing where the loops around the tile had one iteration each, and the build failed.)

``fold_guards``: a shared-memory copy of an implicit-GEMM operand reads through two padding
stages inlined into one another (the convolution's zero padding, then the padding of the GEMM
to whole tiles), so its value is ``if_then_else(a, if_then_else(b, x, 0), 0)``. TVM turns a
copy into ``cp.async`` (with zero fill where the guard is false) and a vector load only when the
value is one guarded load, ``if_then_else(a and b, x, 0)``; the nested form stays a scalar
gather. The two are the same value: ``x`` where both guards hold, else the common default.
"""

from __future__ import annotations

from tvm_ffi import structural_equal, structural_map, structural_walk

from ._tvm import And, BufferReplacer, Call, IRModule, Var, decl_buffer, s_tir, tirx


def iterations(stmt, counted=None) -> int:
    """How many times the innermost blocks under ``stmt`` (a loop) run: the product of the loop
    extents down each branch, summed over the branches. ``counted(loop)``: whether a loop's
    extent counts (default every loop; the unrolled ones alone: how many copies of the blocks
    unrolling makes)."""
    if isinstance(stmt, tirx.For):
        times = (int(stmt.extent) if counted is None or counted(stmt) else 1)
        return times * iterations(stmt.body, counted)
    if isinstance(stmt, tirx.SeqStmt):
        return sum(iterations(s, counted) for s in stmt.seq)
    if isinstance(stmt, s_tir.SBlockRealize):
        return max(1, iterations(stmt.block.body, counted))
    if isinstance(stmt, tirx.IfThenElse):
        return iterations(stmt.then_case, counted) + (
            iterations(stmt.else_case, counted) if stmt.else_case is not None else 0)
    body = getattr(stmt, "body", None)
    return iterations(body, counted) if body is not None else 0


# The address alignment TVM declares its parameter buffers with (bytes).
DEFAULT_PARAM_ALIGNMENT = 64

_IF_THEN_ELSE = "prim.if_then_else"

# The block annotation that says where a reduction's terms can be non-zero: ``[buffer name,
# axis, first, end, axis, first, end, ...]``, the rows ``first <= index < end`` along each
# ``axis`` of the buffer it reads (:func:`skip_padding`).
LIVE_ROWS = "tbe_like.live_rows"
# The annotation of a loop to be cut in three before the padding is skipped
# (:func:`partition`): ``[lo, hi]`` or ``[lo, hi, axis]``, its iterations before ``lo`` and
# from ``hi`` on unrolled; with ``axis``, the reads along that axis of :data:`LIVE_ROWS` in
# the iterations between are all live.
PARTITION = "tbe_like.partition"
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


def _live_conditions(realize) -> dict[int, object]:
    """The conditions that ``realize``'s read lies in its block's :data:`LIVE_ROWS`, one per
    axis, in the loops' variables; empty when the block has none or its read of the buffer is
    not one element (only a point's row is known)."""
    block = realize.block
    if LIVE_ROWS not in block.annotations:
        return {}
    name, *flat = block.annotations[LIVE_ROWS]
    regions = [r for r in block.reads if r.source.name == str(name)]
    if len(regions) != 1 or not all(_is_true(rng.extent) for rng in regions[0].region):
        return {}
    values = {iv.var: value for iv, value in zip(block.iter_vars, realize.iter_values,
                                                 strict=True)}
    conds = {}
    for axis, (first, end) in rows_of(flat).items():
        index = structural_map(regions[0].region[axis].min, [(Var, lambda v: values.get(v, v))])
        conds[axis] = And(index >= first, index < end)
    return conds


def _without_live_rows(realize, axes=None):
    """``realize`` without :data:`LIVE_ROWS` (``axes``: without those axes of it, the
    annotation dropped when none is left)."""
    block = realize.block
    annotations = {k: v for k, v in block.annotations.items() if k != LIVE_ROWS}
    if axes is not None and LIVE_ROWS in block.annotations:
        name, *flat = block.annotations[LIVE_ROWS]
        left = [v for axis, (first, end) in rows_of(flat).items() if axis not in axes
                for v in (axis, first, end)]
        if left:
            annotations[LIVE_ROWS] = [name, *left]
    block = s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, block.body,
                         block.init, block.alloc_buffers, block.match_buffers, annotations)
    return s_tir.SBlockRealize(realize.iter_values, realize.predicate, block)


def _vars(expr) -> set:
    found = set()
    structural_walk(expr, [(Var, found.add)])
    return found


_TILE_KINDS = (tirx.ForKind.UNROLLED, tirx.ForKind.VECTORIZED)


def _all_of(conds):
    cond = None
    for c in conds:
        cond = c if cond is None else And(cond, c)
    return cond


def _holds_blocks(realize) -> bool:
    """Whether ``realize``'s block holds other blocks (a block around others, as ``blockize``
    makes): not a reduction of its own; the blocks inside it are."""
    inner = []
    structural_walk(realize.block.body, [(s_tir.SBlockRealize, inner.append)])
    return bool(inner)


def _shared_conditions(blocks) -> dict[int, object]:
    """The live conditions (:func:`_live_conditions`) that every one of ``blocks`` has, the same:
    the copies of one block in the pieces of a partitioned loop share those of the loops
    around the pieces. Empty where any of them has none: a test around a block without live
    rows (a producer computed under the loop) would skip computing it."""
    if not blocks:
        return {}
    each = [_live_conditions(b) for b in blocks]
    first, *others = each
    return {axis: cond for axis, cond in first.items()
            if all(axis in o and structural_equal(o[axis], cond) for o in others)}


def _place_live_condition(loop, constant: frozenset = frozenset()):
    """``loop`` with its body under the live conditions of the one annotated block inside it
    that ``loop`` is the place of, the annotation's axes it tests then taken off the block.

    The axes whose condition uses only ``constant`` variables (of unrolled loops and loops of
    one iteration: after unrolling, each copy's condition is a constant, and the simplifier
    drops the copies it rules out, a dead tap of a register tile) are tested together at the
    innermost loop they use, unrolled or not. The other axes are tested together at the
    innermost loop whose variable their condition uses (the loops of one iteration left
    out), once per iteration of ``loop``, outside every loop it does not depend on; never
    where ``loop`` is unrolled or vectorized (inside a register tile the test is made per tile
    element, and LLVM left accumulators in memory): the annotation is then dropped."""
    if _is_true(loop.extent):  # one iteration: the loop around it tests, its variable fixed
        return loop
    realizes = []
    structural_walk(loop.body, [(s_tir.SBlockRealize, realizes.append)])
    blocks = [r for r in realizes if not _holds_blocks(r)]
    conds = _shared_conditions(blocks)
    if not conds:
        return loop
    inner, single = set(), {}

    def note(f):
        if _is_true(f.extent):  # one iteration: its variable is its first value
            single[f.loop_var] = f.min
        else:
            inner.add(f.loop_var)

    structural_walk(loop.body, [(tirx.For, note)])
    conds = {axis: structural_map(c, [(Var, lambda v: single.get(v, v))])
             for axis, c in conds.items()}
    folded = {axis for axis, c in conds.items() if _vars(c) and _vars(c) <= constant}
    tests, placed = [], set()
    for group in (folded, set(conds) - folded):
        if not group:
            continue
        if group is not folded and loop.kind in _TILE_KINDS:
            # Inside a register tile: the axes whose test depends on this loop are not
            # skipped; the others are left to the loops around it.
            placed |= {axis for axis in group if loop.loop_var in _vars(conds[axis])}
            continue
        cond = _all_of(conds[axis] for axis in sorted(group))
        used = _vars(cond)
        if loop.loop_var not in used or used & inner:
            continue
        placed |= group
        tests.append(cond)
    if not placed:
        return loop
    body = structural_map(loop.body, [(s_tir.SBlockRealize, lambda r: _without_live_rows(
        r, placed) if any(r.same_as(b) for b in blocks) else r)])
    if tests:
        body = tirx.IfThenElse(_all_of(tests), body, None)
    return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding,
                    loop.annotations)


def _constant_vars(mod) -> frozenset:
    """The variables of ``mod``'s unrolled loops and loops of one iteration."""
    found = set()
    structural_walk(mod, [(tirx.For, lambda f: found.add(f.loop_var) if (
        f.kind == tirx.ForKind.UNROLLED or _is_true(f.extent)) else None)])
    return frozenset(found)


def _copy(stmt, var, new):
    """``stmt`` with ``var`` read as ``new`` and every variable it defines (its loops', its
    blocks' iterators, its bound values') defined anew: a copy that may stand beside the
    original (TVM's lowering wants each variable defined once)."""
    defined = []
    structural_walk(stmt, [(tirx.For, lambda f: defined.append(f.loop_var)),
                           (s_tir.SBlock, lambda b: defined.extend(i.var for i in b.iter_vars)),
                           (tirx.Bind, lambda b: defined.append(b.var))])
    fresh = {v: Var(v.name, v.ty) for v in defined}
    fresh[var] = new
    return structural_map(stmt, [(Var, lambda v: fresh.get(v, v))])


def _partition(loop):
    """``loop`` (annotated with :data:`PARTITION` ``[lo, hi]`` or ``[lo, hi, axis]``) as three
    loops, one after the other: its iterations before ``lo``, unrolled; from ``lo`` to ``hi``,
    as ``loop`` runs them, its blocks' live rows along ``axis`` dropped (all live there); from
    ``hi`` on, unrolled. Each is a copy of the body, for its own range (a loop of none is left
    out)."""
    if (PARTITION not in loop.annotations or not isinstance(loop.extent, tirx.IntImm)
            or loop.thread_binding is not None):
        return loop
    first, end = int(loop.min), int(loop.min) + int(loop.extent)
    lo, hi, *live = (int(v) for v in loop.annotations[PARTITION])
    lo, hi = (min(max(v, first), end) for v in (lo, hi))
    hi = max(lo, hi)
    annotations = {k: v for k, v in loop.annotations.items() if k != PARTITION}
    pieces = [(first, lo, tirx.ForKind.UNROLLED), (lo, hi, loop.kind),
              (hi, end, tirx.ForKind.UNROLLED)]
    loops = []
    for i, (start, stop, kind) in enumerate(pieces):
        if stop > start:
            var = Var(f"{loop.loop_var.name}_{i}", loop.loop_var.ty)
            body = _copy(loop.body, loop.loop_var, var)
            if i == 1 and live:  # every read along that axis is live here: nothing to test
                body = structural_map(body, [(s_tir.SBlockRealize, lambda r: _without_live_rows(
                    r, set(live)) if LIVE_ROWS in r.block.annotations else r)])
            loops.append(tirx.For(var, start, stop - start, kind, body, None,
                                  annotations if i == 1 else {}))
    return loops[0] if len(loops) == 1 else tirx.SeqStmt(loops)


def partition(mod):
    """``mod`` with each loop annotated with :data:`PARTITION` cut in three (:func:`_partition`)."""
    marked = []
    structural_walk(mod, [(tirx.For, lambda f: marked.append(f) if PARTITION in f.annotations
                           else None)])
    if not marked:
        return mod
    return structural_map(mod, [(tirx.For, _partition)])


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
    constant = _constant_vars(mod)
    mod = structural_map(mod, [(tirx.For, lambda f: _place_live_condition(f, constant))])
    return structural_map(mod, [(s_tir.SBlockRealize, lambda r: _without_live_rows(r)
                                 if LIVE_ROWS in r.block.annotations else r)])


def prepare(mod):
    """What every build lowers: ``mod`` with its marked loops partitioned (:func:`partition`),
    its reductions' padding skipped (:func:`skip_padding`) and its guards folded, then
    simplified in each block's iterator domains (TVM's ``StmtSimplify`` on the scheduled
    module).

    The last step is for vectorized copies: a copy iterates (run, lane) over a contiguous
    axis ``run * lanes + lane`` (``schedules.cuda.gemm.stage_operand``); knowing the lane is
    below ``lanes``, the simplifier turns every index of that axis (``// 576``, ``% 144 // 48``
    of an im2col) into one of the run alone plus the lane in the last term. Lowered first, the
    run becomes a sum of thread and loop terms the vectorizer cannot see is a multiple of
    ``lanes``, and it falls back to scalar loads.
    """
    return s_tir.transform.StmtSimplify()(fold_guards(skip_padding(partition(mod))))
