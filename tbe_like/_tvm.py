"""The one place tbe_like imports Apache TVM from.

TVM moves its namespaces between releases (``tvm.tir`` became ``tvm.tirx`` and ``tvm.s_tir`` in
0.27; AutoTVM, ``te.create_schedule`` and ``tvm.nd`` are gone). Every other module imports TVM
names from here, so the next move touches one file.
"""

from __future__ import annotations

import tvm
from tvm import runtime as tvm_runtime
from tvm import s_tir, sym, te, tirx, topi  # sym: the integer analysis (tvm.arith before 0.27)
from tvm.ir import IRModule
from tvm.ir.expr import Call, TensorLoad, Var  # TensorLoad: tirx.BufferLoad before 0.27
from tvm.ir.prim.expr import LT, And, FloorDiv
from tvm.s_tir import TensorIntrin
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.matmul import get_index_map as gemm_index_maps
from tvm.script import tirx as T
from tvm.support import nvcc
from tvm.target import Target
from tvm.target import codegen as target_codegen
from tvm.tirx import decl_buffer
from tvm.tirx.analysis import undefined_vars
from tvm.tirx.transform.common import BufferReplacer
from tvm_ffi import from_dlpack, structural_walk

TVM_VERSION: str = tvm.__version__

__all__ = [
    "LT",
    "TVM_VERSION",
    "And",
    "BufferReplacer",
    "Call",
    "FloorDiv",
    "IRModule",
    "T",
    "Target",
    "TensorIntrin",
    "TensorLoad",
    "Var",
    "decl_buffer",
    "from_dlpack",
    "gemm_index_maps",
    "get_root_block",
    "nvcc",
    "s_tir",
    "structural_walk",
    "sym",
    "target_codegen",
    "te",
    "tirx",
    "topi",
    "tvm",
    "tvm_runtime",
    "undefined_vars",
]
