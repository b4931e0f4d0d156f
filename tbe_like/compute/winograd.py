"""Winograd minimal filtering F(m, r) along W, shared by the input and the weight gradient.

F(m, r) computes m outputs of an r-tap correlation ``y_i = sum_k x[i + k] * g[k]`` from
m+r-1 inputs with m+r-1 multiplications (Lavin & Gray); F(2,3) and F(4,3) serve both gradients
(3 taps), F(2,5) both gradients of 5-tap layers (6 multiplications per 2 columns instead of
10; the points of F(4,3), so the same rounding):

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
    """The transforms of F(m, r): ``bt`` (p, p), ``g`` (p, r), ``at`` (m, p); p = m + r - 1."""

    m: int
    bt: tuple[tuple[Fraction, ...], ...]
    g: tuple[tuple[Fraction, ...], ...]
    at: tuple[tuple[Fraction, ...], ...]

    @property
    def r(self) -> int:
        """The taps."""
        return len(self.g[0])

    @property
    def points(self) -> int:
        return self.m + self.r - 1


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


def toom_cook(m: int, r: int, finite: tuple[int, ...]) -> Winograd:
    """F(m, r) from the interpolation points ``finite`` (m + r - 2 of them) and infinity.

    ``at[i][j] = a_j**i`` (the infinite point adds to the last output), ``g[j][k] = a_j**k /
    prod_l (a_j - a_l)`` and row j of ``bt`` is the polynomial ``prod_{l != j} (x - a_l)``
    (the infinite point's: the product over every point); the test checks the identity
    exactly.
    """
    if len(finite) != m + r - 2:
        raise ValueError(f"F({m},{r}) needs {m + r - 2} finite points, got {finite}")
    n = m + r - 1
    points = [Fraction(a) for a in finite]

    def poly(roots) -> list[Fraction]:  # coefficients of prod (x - root), lowest first
        coeffs = [Fraction(1)]
        for root in roots:
            coeffs = [(coeffs[i - 1] if i else 0) - root * (coeffs[i] if i < len(coeffs) else 0)
                      for i in range(len(coeffs) + 1)]
        return coeffs

    def pad(coeffs):
        return tuple(coeffs) + (Fraction(0),) * (n - len(coeffs))

    at = [[a ** i for a in points] + [Fraction(int(i == m - 1))] for i in range(m)]
    g = []
    for j, a in enumerate(points):
        scale = 1
        for i, b in enumerate(points):
            if i != j:
                scale *= a - b
        g.append([a ** k / scale for k in range(r)])
    g.append([Fraction(int(k == r - 1)) for k in range(r)])
    bt = [pad(poly([b for i, b in enumerate(points) if i != j])) for j in range(n - 1)]
    bt.append(pad(poly(points)))
    return Winograd(m, tuple(bt), tuple(tuple(row) for row in g),
                    tuple(tuple(row) for row in at))


F25 = toom_cook(2, 5, (0, 1, -1, 2, -2))
# The transforms by taps, then by m.
WINOGRAD = {3: {2: F23, 4: F43}, 5: {2: F25}}


def choose(winograd: bool | int, columns: int, s: int, op: str, taps: int = 3
           ) -> Winograd | None:
    """The transform for a row of ``columns`` outputs ``s`` apart of a ``taps``-tap
    correlation: ``winograd`` True takes the one with fewer multiply-adds over the rounded-up
    row (a tie keeps the smaller tile), 2 or 4 that F(m, taps). None where there is none for
    these taps (F(4,5) is not offered: its points would reach +-3)."""
    sizes = sorted({m for table in WINOGRAD.values() for m in table})
    if winograd is not True and not (isinstance(winograd, int) and winograd in sizes):
        raise ValueError(f"{op}: winograd must be a bool or one of {sizes}, got {winograd!r}")
    table = WINOGRAD.get(taps, {})
    if winograd is True:
        if not table:
            return None
        m = min(table, key=lambda m: (winograd_tiles(columns, m, s) * table[m].points, m))
        return table[m]
    return table.get(winograd)


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
