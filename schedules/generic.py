"""Generic fallbacks: correct for any operator, used when no operator rule applies."""

from __future__ import annotations

from .registry import register_fallback


@register_fallback("llvm")
def llvm_fallback(sch, target):
    """Parallelize the outermost loop of every block; nothing that could change the result."""
    del target
    for block in sch.get_child_blocks(sch.get_sblock("root")) if False else _blocks(sch):
        loops = sch.get_loops(block)
        if loops:
            sch.parallel(loops[0])
    return sch


def _blocks(sch):
    func = next(iter(sch.mod.functions.values()))
    names = []

    def visit(node):
        if hasattr(node, "name_hint") and type(node).__name__ == "SBlock":
            names.append(node.name_hint)

    from tbe_like._tvm import tirx

    tirx.stmt_functor.post_order_visit(func.body, visit)
    return [sch.get_sblock(n) for n in names if n != "root"]
