"""A static proof that a scheduled kernel stays inside its buffers.

TVM 0.27's pass option ``tirx.instrument_bound_checkers`` checks nothing in kernels built from
an ``s_tir`` schedule: its pass only instruments buffers that carry a ``buffer_bound``
attribute, which the old ``StorageFlatten`` added and ``FlattenBuffer`` does not (an
``A[i + 10]`` read of a 64-element buffer ran unchecked here). And a schedule can break a
kernel in ways a NumPy comparison misses: ``rfactor`` of a reduction whose loop was split by a
factor that does not divide it drops the split's predicate from the block that adds the
partials, which then read and wrote 2 of 4 Winograd points past their buffers (heap corruption,
hangs) while the test sometimes passed.

:func:`check_bounds` proves, with TVM's own integer analysis (``tvm.sym.Analyzer``: the loop
ranges bound, the block predicate and every enclosing ``if_then_else``/``Select`` condition
as constraints), that

* every block's iterator bindings lie in the iterators' domains, and
* every buffer index a block body reads or writes lies in the buffer's shape,

and returns a description of each access it cannot prove. Builds call :func:`assert_in_bounds`:
a schedule that may access memory out of bounds is never compiled.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from ._tvm import (
    LT,
    And,
    Call,
    FloorDiv,
    TensorLoad,
    s_tir,
    structural_walk,
    sym,
    te,
    tirx,
    tvm,
    undefined_vars,
)

# The largest element count a buffer may have with 32-bit indices: TVM indexes buffers with
# int32 expressions (placeholder shapes are int32), and a flattened index past this wraps.
MAX_BUFFER_ELEMENTS = 2**31 - 1


def largest_buffer(tensors) -> tuple[str, tuple[int, ...], int]:
    """The largest buffer of a kernel, inputs, outputs and the stages between them (walked
    from ``tensors``, its TE tensors): its name, shape and element count."""
    seen, todo, largest = set(), list(tensors), ("", (), 0)
    while todo:
        t = todo.pop()
        if t.op.name in seen:
            continue
        seen.add(t.op.name)
        todo += list(t.op.input_tensors)
        shape = tuple(int(d) for d in t.shape)
        if math.prod(shape) > largest[2]:
            largest = (t.op.name, shape, math.prod(shape))
    return largest


def index_dtype(tensors) -> str:
    """The index type of a kernel: ``"int64"`` when one of its buffers (see
    :func:`largest_buffer`) has more than ``MAX_BUFFER_ELEMENTS`` elements, else ``"int32"``
    (the faster code: no 64-bit multiplies in the address arithmetic of ordinary kernels)."""
    return "int64" if largest_buffer(tensors)[2] > MAX_BUFFER_ELEMENTS else "int32"


def prim_func(tensors, shapes=None):
    """``te.create_prim_func(tensors)`` with the index type :func:`index_dtype` chooses: every
    loop, block iterator and buffer shape of a kernel with a buffer past 32-bit indices is
    int64 (TVM's ``index_dtype_override``), so that no flattened index wraps.

    ``shapes``: per tensor, the shape of the kernel's argument where it is not the tensor's
    (same elements, row-major; None: the tensor's). Such an argument is declared with that
    shape and the stages read or write the tensor as a view of it (a ``DeclBuffer`` on the
    argument's data, what TVMScript's ``Buffer.view`` makes). The GEMM forms see the user's
    OIDHW filter (or weight gradient) as the ``(Cout, Cin*taps)`` matrix it is: a vector of
    its columns is then one contiguous access, which TVM could not prove through the five
    axes' divisions once the columns were split into tiles.
    """
    tensors = list(tensors)
    wide = index_dtype(tensors) == "int64"
    func = te.create_prim_func(tensors, index_dtype_override="int64" if wide else None)
    shapes = list(shapes or [None] * len(tensors))
    if len(shapes) != len(tensors):
        raise ValueError(f"prim_func: {len(shapes)} shapes for {len(tensors)} tensors")
    params, views = [], []
    for param, tensor, shape in zip(func.params, tensors, shapes, strict=True):
        own = tuple(int(d) for d in tensor.shape)
        if shape is None or tuple(shape) == own:
            params.append(param)
            continue
        if math.prod(shape) != math.prod(own):
            raise ValueError(f"prim_func: argument shape {tuple(shape)} does not hold "
                             f"{tensor.op.name} {own}")
        dims = [tirx.IntImm("int64" if wide else "int32", int(d)) for d in shape]
        whole = tirx.decl_buffer(dims, param.dtype, param.name, data=param.data)
        params.append(whole)
        views.append(tirx.DeclBuffer(param, data=whole.data))
    if not views:
        return func
    realize = func.body
    root = realize.block
    root = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint,
                        tirx.SeqStmt([*views, root.body]), root.init, root.alloc_buffers,
                        root.match_buffers, root.annotations)
    return tirx.PrimFunc(params, s_tir.SBlockRealize(realize.iter_values, realize.predicate,
                                                     root), attrs=func.attrs)


class OutOfBoundsError(RuntimeError):
    """A schedule whose accesses could not be proven to stay inside their buffers."""


class KernelTooDeepError(ValueError):
    """A kernel whose expressions are nested deeper than a part of the build can walk."""


def _is_true(expr) -> bool:
    return isinstance(expr, tirx.IntImm) and int(expr.value) == 1


class _Checker:
    def __init__(self, ana):
        self.ana = ana
        self.problems: list[str] = []
        self.facts: list = []  # the conditions in force (predicates, branch conditions)
        self.loops: dict = {}  # loop variable (or iterator over its domain) -> (min, extent)
        self.values: dict = {}  # block iterator -> the expression it is bound to (if any)

    @contextlib.contextmanager
    def given(self, cond):
        """Analyse under ``cond`` (a block predicate or a branch condition); yields whether
        the code under it can run at all (a guard that is always false guards a dead
        branch: Winograd's last tile of a 1-column row reads nothing past it)."""
        if _is_true(cond):
            yield True
            return
        if self.ana.can_prove(tirx.Not(cond)):
            yield False
            return
        # One simplified constraint per conjunct: the analyzer uses a constraint as it is
        # stated (under ``... and t*4 + 4 < 8``, t in [0, 2), it did not prove t*4 + 3 < 7;
        # under ``t < 1`` it did).
        parts = [self.ana.simplify(part) for part in _conjuncts(cond)]
        self.facts += parts
        try:
            with contextlib.ExitStack() as stack:
                for part in parts:
                    stack.enter_context(self.ana.constraint_scope(part))
                # Parts that contradict each other (``v_t == 1`` and ``v_t < 1``, an odd
                # column of a tile read only at even ones) leave a variable no value.
                yield not any(self._empty(var) for var in undefined_vars(cond))
        finally:
            del self.facts[-len(parts):]

    # --------------------------------------------------------------- statements
    def stmt(self, node, block: str) -> None:
        if isinstance(node, tirx.For):  # loop variables are unique: bound for good
            self.ana.bind(node.loop_var, tvm.ir.Range.from_min_extent(node.min, node.extent),
                          allow_override=True)
            if isinstance(node.min, tirx.IntImm) and isinstance(node.extent, tirx.IntImm):
                self.loops[node.loop_var] = (int(node.min), int(node.extent))
            self.stmt(node.body, block)
        elif isinstance(node, tirx.SeqStmt):
            for s in node.seq:
                self.stmt(s, block)
        elif isinstance(node, s_tir.SBlockRealize):
            self.realize(node)
        elif isinstance(node, tirx.IfThenElse):
            self.expr(node.condition, block)
            with self.given(node.condition) as live:
                if live:
                    self.stmt(node.then_case, block)
            if node.else_case is not None:
                with self.given(tirx.Not(node.condition)) as live:
                    if live:
                        self.stmt(node.else_case, block)
        elif isinstance(node, tirx.BufferStore):
            self.access(node.buffer, node.indices, block, "writes")
            for index in node.indices:
                self.expr(index, block)
            self.expr(node.value, block)
        elif isinstance(node, tirx.Bind):  # a value bound to a variable (a tensor intrinsic's)
            self.expr(node.value, block)
        elif hasattr(node, "body"):  # LetStmt, AttrStmt, allocations: their body
            self.stmt(node.body, block)
        elif isinstance(node, tirx.Evaluate):
            self.expr(node.value, block)

    def realize(self, realize) -> None:
        block = realize.block
        name = block.name_hint
        pred = realize.predicate
        with self.given(pred) as live:
            if not live:
                return
            for iv, value in zip(block.iter_vars, realize.iter_values, strict=True):
                lo, extent = iv.dom.min, iv.dom.extent
                claim = tirx.all(value >= lo, value < lo + extent)
                if not (self.ana.can_prove(claim) or self._divided(claim, value)):
                    self.problems.append(
                        f"block {name!r}: iterator {iv.var} = {value} may leave its domain "
                        f"[{lo}, {lo + extent})")
            domains = [(iv.var, tvm.ir.Range.from_min_extent(iv.dom.min, iv.dom.extent))
                       for iv in block.iter_vars]
            found = self._body(block, domains)
            if found and not _is_true(pred):
                # A padded block (CUDA's reindexed tiles) runs only where its predicate holds,
                # over part of its iterators' domains: its accesses are proven for the
                # iterators' values, the loop variables' expressions, under the predicate.
                values = list(zip([iv.var for iv in block.iter_vars], realize.iter_values,
                                  strict=True))
                found = self._body(block, values)
            self.problems += found

    def _body(self, block, bindings) -> list[str]:
        """The problems of a block's init and body with its iterators bound to ``bindings``
        (ranges or expressions)."""
        outer, self.problems = self.problems, []
        try:
            for var, value in bindings:
                self.ana.bind(var, value, allow_override=True)
                if isinstance(value, tvm.ir.Range):  # an iterator over its domain
                    self.values.pop(var, None)
                    self.loops[var] = (int(value.min), int(value.extent))
                else:
                    self.values[var] = value
            for match in block.match_buffers:  # a tensorized block's view of a region
                self.region(match.source.source, match.source.region, block.name_hint)
            if block.init is not None:
                self.stmt(block.init, block.name_hint)
            self.stmt(block.body, block.name_hint)
            return self.problems
        finally:
            self.problems = outer

    # --------------------------------------------------------------- expressions
    def expr(self, node, block: str) -> None:
        """Check every access of ``node``, each branch of a select under its condition.

        The walk keeps its own stack instead of recursing: a result that interleaves hundreds
        of reductions is a chain of selects deeper than Python's recursion limit."""
        todo: list[tuple[str, object]] = [("expr", node)]
        while todo:
            kind, item = todo.pop()
            if kind == "leave":  # a branch is done: its condition stops holding
                item.close()
            elif kind == "branch":
                cond, sub = item
                scope = contextlib.ExitStack()
                if scope.enter_context(self.given(cond)):
                    todo += [("leave", scope), ("expr", sub)]
                else:
                    scope.close()
            elif isinstance(item, TensorLoad):
                self.access(item.source, item.indices, block, "reads")
                todo += [("expr", index) for index in reversed(item.indices)]
            elif _branches(item) is not None:
                cond, then, other = _branches(item)
                todo += [("branch", (tirx.Not(cond), other)), ("branch", (cond, then)),
                         ("expr", cond)]
            else:
                todo += [("expr", child) for child in reversed(_children(item))]

    def _empty(self, var) -> bool:
        """Whether the constraints in force leave the integer ``var`` no value."""
        if not str(getattr(var.ty, "dtype", "")).startswith(("int", "uint")):
            return False  # a float or handle variable (e.g. bfloat16 rounding's bits)
        bound = self.ana.const_int_bound(var)
        return bound.min_value > bound.max_value

    def region(self, buffer, region, block: str) -> None:
        """A region of ``buffer`` that a tensorized block matches to a buffer of its own
        (``match_buffer``): every axis's range inside the buffer's shape."""
        for axis, (r, extent) in enumerate(zip(region, buffer.ty.shape, strict=True)):
            if not self.ana.can_prove(tirx.all(r.min >= 0, r.min + r.extent <= extent)):
                self.problems.append(
                    f"block {block!r} matches {buffer.name}[...] with axis {axis} range "
                    f"[{r.min}, {r.min + r.extent}) that may leave [0, {extent})")
                return

    def access(self, buffer, indices, block: str, verb: str) -> None:
        """``buffer``: the buffer's variable (its type holds the shape). A vector index
        (``Ramp``, a tensor intrinsic's) stays inside where its first and last lanes do."""
        for axis, (index, extent) in enumerate(zip(indices, buffer.ty.shape, strict=True)):
            if isinstance(index, tirx.Ramp):
                last = index.base + index.stride * (int(index.lanes) - 1)
                in_range = tirx.all(index.base >= 0, index.base < extent, last >= 0,
                                    last < extent)
                if self.ana.can_prove(in_range):
                    continue
            in_range = tirx.all(index >= 0, index < extent)
            if not (self.ana.can_prove(in_range) or self._divided(in_range, index)
                    or _enumerated(index, extent, self.facts, self.loops, self.values)):
                self.problems.append(
                    f"block {block!r} {verb} {buffer.name}[...] with axis {axis} index "
                    f"{index} that may leave [0, {extent})")
                return

    def _divided(self, claim, index) -> bool:
        """``claim`` proven with each fact ``a < b`` also stated as ``a // d < ceil(b / d)``
        for every constant divisor ``d`` of ``index``: the analyzer does not derive
        ``c // 16 < 5`` from ``c < 80`` by itself (a padded channel block read under the
        guard of its channel)."""
        divisors = set()
        structural_walk(index, [(FloorDiv, lambda node: divisors.add(node.b))])
        derived = [FloorDiv(fact.a, d) < -(-fact.b // d) for fact in self._comparisons()
                   for d in divisors
                   if isinstance(fact.b, tirx.IntImm) and isinstance(d, tirx.IntImm)]
        if not derived:
            return False
        with self.ana.constraint_scope(tirx.all(*derived)):
            return self.ana.can_prove(claim)

    def _comparisons(self):
        """The facts in force of the form ``a < b``."""
        return [fact for fact in self.facts if isinstance(fact, LT)]


# Loop iterations up to which an access the analyzer could not prove is checked point by point.
ENUMERATE_POINTS = 1 << 21


def _enumerated(index, extent, facts, loops, values) -> bool:
    """``0 <= index < extent`` wherever ``facts`` hold, checked at every point of the loops it
    depends on (NumPy, at most ``ENUMERATE_POINTS``): the last resort for index arithmetic the
    analyzer cannot follow (CUDA's padded write-back of a grouped weight gradient: ``v2 // 16
    % 3 + v2 // 48 % 3 * 3 + v2 // 144 * 9 < 27`` under ``v2 < 432``, v2 a fused loop
    expression). ``False`` when it cannot decide."""
    def free(expr, seen):
        for var in undefined_vars(expr):
            if var in values:
                free(values[var], seen)
            elif var not in seen:
                seen.append(var)
        return seen

    names = free(index, [])
    for fact in facts:
        names = free(fact, names)
    if not all(var in loops for var in names):
        return False
    sizes = [loops[var][1] for var in names]
    if int(np.prod(sizes, dtype=np.int64)) > ENUMERATE_POINTS:
        return False
    grid = np.indices(sizes, dtype=np.int64).reshape(len(sizes), -1) if names else np.zeros(
        (0, 1), np.int64)
    env = {var: grid[i] + loops[var][0] for i, var in enumerate(names)}
    try:
        where = np.ones(grid.shape[1], bool)
        for fact in facts:
            where &= np.broadcast_to(np.asarray(_evaluate(fact, env, values), bool),
                                     where.shape)
        at = np.broadcast_to(_evaluate(index, env, values), where.shape)[where]
        bound = _evaluate(extent, env, values)
    except _Unknown:
        return False
    return bool(np.all((at >= 0) & (at < bound)))


class _Unknown(Exception):
    """An expression :func:`_evaluate` does not know."""


def _evaluate(expr, env, values):
    """An integer expression of loop variables on NumPy arrays of their values."""
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    if isinstance(expr, tirx.Var):
        if expr in env:
            return env[expr]
        if expr in values:
            return _evaluate(values[expr], env, values)
        raise _Unknown(expr)
    if isinstance(expr, tirx.Not):
        return ~np.asarray(_evaluate(expr.a, env, values), bool)
    op = _BINARY.get(type(expr).__name__)
    if op is None:
        raise _Unknown(expr)
    return op(_evaluate(expr.a, env, values), _evaluate(expr.b, env, values))


_BINARY = {
    "Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mul": lambda a, b: a * b,
    "FloorDiv": np.floor_divide, "FloorMod": np.mod, "Min": np.minimum, "Max": np.maximum,
    "LT": lambda a, b: a < b, "LE": lambda a, b: a <= b, "GT": lambda a, b: a > b,
    "GE": lambda a, b: a >= b, "EQ": lambda a, b: a == b, "NE": lambda a, b: a != b,
    "And": lambda a, b: a & b, "Or": lambda a, b: a | b,
}


def _conjuncts(cond) -> list:
    """The terms of a conjunction (``a and b and c`` -> ``[a, b, c]``)."""
    todo, found = [cond], []
    while todo:
        term = todo.pop()
        if isinstance(term, And):
            todo += [term.b, term.a]
        else:
            found.append(term)
    return found


def _branches(node) -> tuple | None:
    """``(condition, then, else)`` of a select (``if_then_else`` or ``Select``), else None."""
    if isinstance(node, Call) and _op_name(node) == "prim.if_then_else":
        return tuple(node.args)
    if isinstance(node, tirx.Select):
        return node.condition, node.true_value, node.false_value
    return None


def _op_name(call) -> str:
    op = call.op
    return str(op.name) if hasattr(op, "name") else ""


_LEAVES = (tirx.Var, tirx.IntImm, tirx.FloatImm)


def _children(node) -> list:
    """The sub-expressions of an expression node (not descending into loads, handled above)."""
    if isinstance(node, _LEAVES) or node is None:
        return []
    if isinstance(node, Call):
        return list(node.args)
    if isinstance(node, tirx.Cast):
        return [node.value]
    if isinstance(node, tirx.Not):
        return [node.a]
    if isinstance(node, tirx.Ramp):
        return [node.base, node.stride]
    if isinstance(node, tirx.Shuffle):
        return [*node.vectors, *node.indices]
    if isinstance(node, tirx.Broadcast):
        return [node.value]
    if isinstance(node, tirx.Let):
        return [node.value, node.body]
    if hasattr(node, "a") and hasattr(node, "b"):  # binary arithmetic and comparisons
        return [node.a, node.b]
    return []


def check_bounds(func) -> list[str]:
    """Every access of a scheduled PrimFunc (``s_tir`` blocks, before lowering) that cannot be
    proven to stay inside its buffer or its iterator domain; ``[]`` when all are proven."""
    checker = _Checker(sym.Analyzer())
    checker.stmt(func.body, "root")
    return checker.problems


def _refuse(mod, check, error: type[Exception], what: str, finding: str) -> None:
    """Raise ``error`` listing what ``check`` (a PrimFunc -> problems function) finds in any
    function of ``mod``: "the schedule of <what> <finding>; not compiled", then the problems."""
    problems = []
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc):
            problems += [f"{gv.name_hint}: {p}" for p in check(func)]
    if problems:
        shown = "\n  ".join(problems[:8])
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise error(f"tbe_like: the schedule of {what} {finding}; not compiled:\n  {shown}{more}")


def assert_in_bounds(mod, what: str = "kernel") -> None:
    """Raise :class:`OutOfBoundsError` unless every function of ``mod`` is proven in bounds."""
    _refuse(mod, check_bounds, OutOfBoundsError, what, "may access memory out of bounds")


class OverlappingWritesError(RuntimeError):
    """A schedule in which several iterations of a spatial block store to the same element."""


# What :func:`compile_checked` refuses a schedule for (measured selection leaves such a
# candidate out and builds from the others: ``tune._runners``).
REFUSALS = (OutOfBoundsError, OverlappingWritesError, KernelTooDeepError)


def check_single_writes(func) -> list[str]:
    """Every spatial block of a scheduled PrimFunc whose store does not depend on one of its
    iterators (of more than one value); ``[]`` when there is none.

    Each iteration of a spatial block computes one element: if an iterator does not take part
    in the index it stores to, its iterations store to the same element, and the last one wins
    (on a GPU, whichever thread stores last). ``reverse_compute_inline`` of a consumer that
    reads one row of a padded axis made such a block (CUDA's weight gradient with Cout = 1:
    16 rows of accumulators stored to one row of the result, 15 of them zeros).
    """
    problems: list[str] = []

    def visit(block):
        body = block.body
        if (block.init is not None or not isinstance(body, tirx.BufferStore)
                or any(iv.iter_type != tirx.IterVar.DataPar for iv in block.iter_vars)):
            return
        used = [v for index in body.indices for v in undefined_vars(index)]
        for iv in block.iter_vars:
            extent = iv.dom.extent
            if isinstance(extent, tirx.IntImm) and int(extent) == 1:
                continue
            if not any(v.same_as(iv.var) for v in used):
                problems.append(
                    f"block {block.name_hint!r}: its {extent} iterations over {iv.var} all "
                    f"store to the same element of {body.buffer.name}")

    structural_walk(func.body, [(s_tir.SBlock, visit)], order="post")
    return problems


def assert_single_writes(mod, what: str = "kernel") -> None:
    """Raise :class:`OverlappingWritesError` if a spatial block of ``mod`` stores to one
    element from several iterations (:func:`check_single_writes`)."""
    _refuse(mod, check_single_writes, OverlappingWritesError, what,
            "stores to one element from several iterations")


def compile_checked(mod, target, what: str = "kernel"):
    """``tvm.compile`` of a scheduled module with the pass options of its target
    (``tbe_like.target.build_config``), after :func:`assert_in_bounds` and
    :func:`assert_single_writes`, prepared for lowering
    (``tbe_like.lowering.prepare``): every build of tbe_like (DSL, framework operators,
    tuning candidates, measured selection) goes through here."""
    from .lowering import align_params, prepare
    from .target import build_config

    try:
        prepared = align_params(prepare(mod), target)
        # The two modules make the same accesses (``prepare`` only simplifies); either form
        # may be the one the analyzer follows (a guard folded, an index simplified, or a
        # predicate left as written), so either proof will do.
        try:
            assert_in_bounds(prepared, what)
        except OutOfBoundsError:
            assert_in_bounds(mod, what)
        assert_single_writes(prepared, what)
        with tvm.transform.PassContext(config=build_config(target, prepared)):
            return tvm.compile(prepared, target=target)
    except RecursionError:
        raise KernelTooDeepError(f"{what}: its expressions are nested too deeply to build "
                                 "(Python's recursion limit); please report the layer") from None
