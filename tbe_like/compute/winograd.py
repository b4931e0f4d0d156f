"""Winograd minimal filtering F(m, 3) along W, shared by the input and the weight gradient.

F(m, 3) computes m outputs of a 3-tap correlation ``y_i = sum_k x[i + k] * g[k]`` from m+2
inputs with m+2 multiplications (Lavin & Gray):

    y = AT ((G g) * (BT x))

The **input gradient** uses it as written: g is the (flipped) filter, x a row of dy, and the
products are summed over (co, kd, kh) before AT is applied.

The **weight gradient** uses the same identity read the other way. With dy's row as the m
outputs' weights, ``sum_i dy_i y_i = sum_e (A dy)_e (G g)_e (BT x)_e`` (A = AT transposed), so
the gradient with respect to the taps is

    dW_k = sum_e G[e][k] * M_e,      M_e = sum over (n, do, ho, tiles) of (A dy)_e * (BT x)_e

and G is applied once, to the reduced M: m+2 multiply-adds per m output columns and tap row
instead of 3m.

Tile ``t`` covers the columns ``base + j*s`` (j < m) with ``base = (t // s) * m*s + t % s``:
with dilation ``s`` the columns of one tile are ``s`` apart, like the inputs they read.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from .._tvm import tirx

ACC_DTYPE = "float32"


@dataclass(frozen=True)
class Winograd:
    """The transforms of F(m, 3): ``bt`` (m+2, m+2), ``g`` (m+2, 3), ``at`` (m, m+2)."""

    m: int
    bt: tuple[tuple[Fraction, ...], ...]
    g: tuple[tuple[Fraction, ...], ...]
    at: tuple[tuple[Fraction, ...], ...]

    @property
    def points(self) -> int:
        return self.m + 2


def _fractions(rows) -> tuple[tuple[Fraction, ...], ...]:
    return tuple(tuple(Fraction(v) for v in row) for row in rows)


F23 = Winograd(2, _fractions([(1, 0, -1, 0), (0, 1, 1, 0), (0, -1, 1, 0), (0, 1, 0, -1)]),
               _fractions([(1, 0, 0), ("1/2", "1/2", "1/2"), ("1/2", "-1/2", "1/2"), (0, 0, 1)]),
               _fractions([(1, 1, 1, 0), (0, 1, -1, -1)]))
# Points 0, 1, -1, 2, -2 and infinity. float32 relative error about 4e-7 (F(2,3): 2e-7).
F43 = Winograd(4, _fractions([(4, 0, -5, 0, 1, 0), (0, -4, -4, 1, 1, 0), (0, 4, -4, -1, 1, 0),
                              (0, -2, -1, 2, 1, 0), (0, 2, -1, -2, 1, 0), (0, 4, 0, -5, 0, 1)]),
               _fractions([("1/4", 0, 0), ("-1/6", "-1/6", "-1/6"), ("-1/6", "1/6", "-1/6"),
                           ("1/24", "1/12", "1/6"), ("1/24", "-1/12", "1/6"), (0, 0, 1)]),
               _fractions([(1, 1, 1, 1, 1, 0), (0, 1, -1, 2, -2, 0), (0, 1, 1, 4, 4, 0),
                           (0, 1, -1, 8, -8, 1)]))
WINOGRAD = {2: F23, 4: F43}


def choose(winograd: bool | int, columns: int, s: int, op: str) -> Winograd:
    """The transform for a row of ``columns`` outputs ``s`` apart: ``winograd`` True takes the
    one with fewer multiply-adds over the rounded-up row (a tie keeps the smaller tile), 2 or 4
    that F(m,3)."""
    if winograd is True:
        m = min(WINOGRAD, key=lambda m: (winograd_tiles(columns, m, s) * (m + 2), m))
        return WINOGRAD[m]
    if isinstance(winograd, int) and winograd in WINOGRAD:
        return WINOGRAD[winograd]
    raise ValueError(f"{op}: winograd must be a bool or one of {sorted(WINOGRAD)}, got "
                     f"{winograd!r}")


def winograd_tiles(columns: int, m: int, s: int) -> int:
    """Tiles covering ``columns`` columns ``s`` apart (the last may reach past them)."""
    return -(-columns // (m * s)) * s


def tile_base(t, m: int, s: int):
    return t * m if s == 1 else t // s * (m * s) + t % s


def combine(coeffs, values):
    """``sum(c * v)`` without the zero terms and without multiplying by 1 or -1."""
    total = None
    for c, v in zip(coeffs, values, strict=True):
        if c == 0:
            continue
        term = v if abs(c) == 1 else v * tirx.const(float(abs(c)), ACC_DTYPE)
        if total is None:
            total = term if c > 0 else -term
        else:
            total = total + term if c > 0 else total - term
    return total


def pick(index, options):
    """``options[index]`` for an index expression: a chain of selects."""
    value = options[-1]
    for i in range(len(options) - 2, -1, -1):
        value = tirx.Select(index == i, options[i], value)
    return value
