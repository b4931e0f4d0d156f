"""Group-merging maths shared by the compute, the layouts and the references.

TBE computes a grouped convolution gradient as ``real_g`` dense matrix products: it merges
``mag_factor`` consecutive original groups so that every merged group holds a multiple of 16
channels (the cube unit's fractal size). The formulas are those of ``util_common.calculate_group``
(seed 000 quotes them); they are pure integer maths and depend on nothing else in the package.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

# The fractal N0 of FRACTAL_Z_3D (output channels per fractal block) and the default C0.
FRACTAL_N0 = 16
DEFAULT_C0 = 16

GROUP_DICT_KEYS = ("real_g", "mag_factor", "cin1_g", "cout_g", "cin_ori", "cout_ori")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GroupInfo:
    """The merged-group layout of a grouped convolution.

    Attributes
    ----------
    groups : int
        The original number of groups.
    real_g : int
        The number of merged groups (dense matrix products).
    mag_factor : int
        How many original groups one merged group holds.
    cin1_g : int
        Input-channel blocks of ``cin0`` channels in one merged group.
    cout_g : int
        Output channels of one merged group, a multiple of ``cout0``.
    cin_ori, cout_ori : int
        The total input and output channel counts.
    cin0, cout0 : int
        The channel block sizes the merge was computed for.
    """

    groups: int
    real_g: int
    mag_factor: int
    cin1_g: int
    cout_g: int
    cin_ori: int
    cout_ori: int
    cin0: int = DEFAULT_C0
    cout0: int = FRACTAL_N0

    @property
    def cin_per_group(self) -> int:
        return self.cin_ori // self.groups

    @property
    def merged_share(self) -> float:
        """Multiply-adds the merged layout computes per one of the convolution's: its
        ``real_g`` dense (``cin1_g`` x ``cin0``) x ``cout_g`` products over the original
        groups' ``cin_ori`` x ``cout_ori / groups`` (16 for a depthwise layer)."""
        merged = self.real_g * self.cin1_g * self.cin0 * self.cout_g
        return merged * self.groups / (self.cin_ori * self.cout_ori)

    @property
    def cout_per_group(self) -> int:
        return self.cout_ori // self.groups

    def as_group_dict(self) -> dict[str, int]:
        """The TBE ``group_dict`` (the six keys TBE passes around)."""
        full = asdict(self)
        return {key: full[key] for key in GROUP_DICT_KEYS}


def group_info(cin: int, cout: int, groups: int, cout0: int = FRACTAL_N0,
               cin0: int = DEFAULT_C0) -> GroupInfo:
    """Compute the merged-group layout for ``cin`` input and ``cout`` output channels.

    The caller validates that the arguments are positive and that ``groups`` divides both
    channel counts; this function only does the arithmetic of seed 000.
    """
    cin_g, cout_g_ori = cin // groups, cout // groups
    mag0 = math.lcm(cin_g, cin0) // cin_g
    mag1 = math.lcm(cout_g_ori, cout0) // cout_g_ori
    mag = min(math.lcm(mag0, mag1), groups)
    return GroupInfo(
        groups=groups,
        real_g=_ceil_div(groups, mag),
        mag_factor=mag,
        cin1_g=_ceil_div(mag * cin_g, cin0),
        cout_g=_ceil_div(mag * cout_g_ori, cout0) * cout0,
        cin_ori=cin,
        cout_ori=cout,
        cin0=cin0,
        cout0=cout0,
    )
