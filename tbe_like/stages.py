"""Names and tags of the compute stages.

Schedules find stages by these names (``Schedule.get_sblock(name)``), never by walking
``input_tensors`` chains, so renaming a stage is a change to this file alone. The block name of a
stage is its ``name``; its ``tag`` says which operator and which role it belongs to.
"""

from __future__ import annotations

# conv3d_backprop_filter (weight gradient)
DW_FMAP_PAD = "dw_fmap_pad"  # x in NDC1HWC0, zero-padded in D/H/W and in channel blocks
DW_FMAP_COL = "dw_fmap_col"  # the padded x re-indexed into the (merged group) column matrix
DW_DY_MATRIX = "dw_dy_matrix"  # dy in NDC1HWC0 re-indexed into a (group, m, cout_g) matrix
DW_MAD = "dw_mad"  # the float32 reduction over n, do, ho, wo
DW_RES = "dw_res"  # the result in FRACTAL_Z_3D, cross-group and padded cells zeroed
# Winograd F(m,3) along W (CPU kernels): x and dy transformed, float32
DW_WINO_X = "dw_wino_x"  # (N, Dp, Cin1, Hp, m+2, tiles, C0): BT of the padded x
DW_WINO_DY = "dw_wino_dy"  # (G, N, Do, Ho, m+2, tiles, cout_g): A of dy
# Winograd F(m,3) along D (CPU kernels, a form raced where W has no 3 taps at stride 1)
DW_WINO_D_X = "dw_wino_d_x"  # (N, Cin1, tiles, Hp, m+2, Wp, C0): BT of the padded x's rows
DW_WINO_D_DY = "dw_wino_d_dy"  # (G, N, tiles, Ho, m+2, Wo, cout_g): A of dy's rows

# The weight gradient of a 1x1x1 convolution as dot products over positions (CPU kernels of
# tbe_like.ops, ``kernels.grad_weight_dot``), on the user's NCDHW arrays
DW_DOT_X = "dw_dot_x"  # x at the positions a strided layer reads, (N, Cin, Do*Ho*Wo)
DW_DOT = "dw_dot"  # (Cout, Cin, 1, 1, 1) float32: sum over (n, position) of dy * x
DW_DOT_CAST = "dw_dot_cast"  # the result in the arrays' dtype, where that is not float32
# The weight gradient of a layer of few input or output channels as dot products along output
# rows, one per tap (CPU kernels of tbe_like.ops, ``kernels.grad_weight_rows``)
DW_ROWS_X = "dw_rows_x"  # x zero-padded, W split by stride phase: (N, Cin, Dp, Hp, phases, Wq)
DW_ROWS_DY = "dw_rows_dy"  # dy's rows zero-padded to whole vectors, where Wo is not
DW_ROWS = "dw_rows"  # (Cout, Cin, kd, kh, kw) float32: sum over (n, do, ho, wo) of dy * x
DW_ROWS_CAST = "dw_rows_cast"  # the result in the arrays' dtype, where that is not float32

# The weight gradient of a layer of few input channels as outer products of dy's output channels
# with the value of x each tap reads (CPU kernels of tbe_like.ops, ``kernels.grad_weight_outer``)
DW_OUTER_X = "dw_outer_x"  # x zero-padded, float32: (N, Cin, Dp, Hp, Wp)
DW_OUTER_DY = "dw_outer_dy"  # dy in blocks of channels, float32: (N, Cout1, Do, Ho, Wo, block)
DW_OUTER = "dw_outer"  # (Cout1, Cin, kd, kh, kw, block) float32: sum over positions of dy * x
DW_OUTER_RES = "dw_outer_res"  # the result as the user's OIDHW, in the arrays' dtype

# The weight gradient of a layer of few positions as one GEMM over x's im2col matrix (CPU
# kernels of tbe_like.ops, ``kernels.grad_weight_col``), in the user's layout
DW_COL_X = "dw_col_x"  # x's im2col matrix (N*Do*Ho*Wo, Cin*kd*kh*kw), zero at padding
DW_COL = "dw_col"  # (Cout, Cin*kd*kh*kw) float32: sum over positions of dy * x_col
DW_COL_CAST = "dw_col_cast"  # the product in a float16 or bfloat16 result

# The input gradient of a layer of few positions as one GEMM into dX's im2col matrix (CPU
# kernels of tbe_like.ops, ``kernels.grad_input_col``)
DX_COL = "dx_col"  # (N*Do*Ho*Wo, Cin*kd*kh*kw) float32: sum over co of dy * W
DX_COL_RES = "dx_col_res"  # dX (N, Cin, D, H, W): each position's sum over the taps reaching it
DX_COL_W = "dx_col_w"  # W transposed (1, Cin, Cout): the broadcast operand of dX as W^T dy
DX_COL_PANEL = "dx_col_panel"  # W (Cout, Cin*kd*kh*kw) copied a column tile at a time
DX_COL_CAST = "dx_col_cast"  # the result in the arrays' dtype, where that is not float32

# The input gradient of a layer of few input or output channels, one stride phase of dX at a
# time, dX's rows the vector axis (CPU kernels of tbe_like.ops, ``kernels.grad_input_rows``)
DX_ROWS_DY = "dx_rows_dy"  # dy zero-padded by the taps' reach, (N, Cout, D', H', W')
DX_ROWS = "dx_rows"  # prefix of the phase stages "dx_rows_<rd>_<rh>_<rw>", float32
DX_ROWS_RES = "dx_rows_res"  # dX (N, Cin, D, H, W): each position from its phase's stage
# The input gradient of a temporal layer with Winograd F(m,3) along D (CPU kernels of
# tbe_like.ops, ``kernels.grad_input_winograd_d``), float32 stages
DX_WINO_D_DY = "dx_wino_d_dy"  # dy in channel blocks, (N, Cout1, Do, H, W, C0)
DX_WINO_D_V = "dx_wino_d_v"  # BT of dy's rows: (N, tiles, Cout1, H, m+2, W, C0)
DX_WINO_D_FILTER = "dx_wino_d_filter"  # G of the flipped taps: (m+2, Cout, Cin1 * C0)
DX_WINO_D_AT = "dx_wino_d_at"  # the constants AT, (m, m+2), inlined
DX_WINO_D_MAD = "dx_wino_d_mad"  # M: (N, tiles, Cin1, H, m+2, W, C0), summed over Cout
DX_WINO_D_ROWS = "dx_wino_d_rows"  # AT M: (N, tiles, Cin1, m, H, W, C0)
DX_WINO_D_RES = "dx_wino_d_res"  # dX (N, Cin, D, H, W) in the arrays' dtype

# conv3d_backprop_input (input gradient, also conv3d_transpose)
DX_DY_DILATE = "dx_dy_dilate"  # dy with stride - 1 zeros between neighbours
DX_DY_PAD = "dx_dy_pad"  # the dilated dy padded (or cropped) for a plain correlation
DX_FILTER_FLIP = "dx_filter_flip"  # the filter flipped in D/H/W with its channel axes swapped
DX_MAD = "dx_mad"  # the float32 reduction over (co, kd, kh, kw)
DX_RES = "dx_res"  # the result (N, D, Cin1, H*W, C0), bias added, padded channels zeroed
# Winograd F(m,3) along W (CPU kernels): the padded dy and the flipped filter transformed
DX_WINO_DY = "dx_wino_dy"  # (N, D, m+2, Cout1, H, tiles, C0) float32, one per W phase
DX_WINO_FILTER = "dx_wino_filter"  # (G, kd, kh, m+2, cout_g, cin_g) float32, one per W phase

TAG_PREFIX = "tbe_like."


def tag(op: str, stage: str) -> str:
    """The ``tag=`` of a stage: ``tbe_like.<op>.<stage>``."""
    return f"{TAG_PREFIX}{op}.{stage}"

# Layout transforms of the framework-level kernels (tbe_like.ops), which take the user's arrays
# as they are: ``layout_in_<tensor>`` packs an input into 6HD / FRACTAL_Z_3D (and converts its
# dtype for cube_math_type); ``layout_out_<tensor>`` unpacks a result into the user's layout.
LAYOUT_IN = "layout_in"
LAYOUT_OUT = "layout_out"
LAYOUT_OUT_NCDHW = "layout_out_ncdhw"  # an output unpacked from 6HD to (N, C, D, H, W)


def stage_tensors(tensor) -> dict:
    """Every stage a tensor expression's result is computed from (its own too), by name."""
    seen, todo = {}, [tensor]
    while todo:
        t = todo.pop()
        if t.op.name not in seen:
            seen[t.op.name] = t
            todo += list(t.op.input_tensors)
    return seen


def stage_names(tensor) -> set[str]:
    """The names of every stage a tensor expression's result is computed from (its own too)."""
    return set(stage_tensors(tensor))
