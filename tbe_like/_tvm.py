"""The one place tbe_like imports Apache TVM from.

TVM moves its namespaces between releases (``tvm.tir`` became ``tvm.tirx`` and ``tvm.s_tir`` in
0.27; AutoTVM, ``te.create_schedule`` and ``tvm.nd`` are gone). Every other module imports TVM
names from here, so the next move touches one file.
"""

from __future__ import annotations

import tvm
from tvm import runtime as tvm_runtime
from tvm import s_tir, te, tirx, topi
from tvm.ir import IRModule
from tvm.target import Target
from tvm.target import codegen as target_codegen

TVM_VERSION: str = tvm.__version__

__all__ = [
    "TVM_VERSION",
    "IRModule",
    "Target",
    "s_tir",
    "target_codegen",
    "te",
    "tirx",
    "topi",
    "tvm",
    "tvm_runtime",
]
