"""tbe_like against PyTorch on the CPU: ``tbe_like.bench`` (also ``tbe-like bench``) with only
the tuning records shipped in the package, none of the user's.

    python -m pip install -e ".[bench]"
    python benchmarks/bench_cpu.py [--quick] [--only NAME ...] [--network NAME ...]
"""

import sys

from tbe_like.bench import KINDS, PATCH, QUICK, SUITE, WIDENED, Shape, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
