"""The convolutions of real 3D video and medical networks, kept as data: a benchmark and tuning
suite.

Each shipped network is one JSON file in this package, ``<name>.json``, holding every distinct
convolution of the network (its module path, shape and how many times the network applies it),
the source the shapes come from, the network's standard input and how that input was scaled.
Shapes are scaled so that no convolution exceeds 2e9 forward FLOPs: the batch is reduced to 1
first, then the network input's D, H and W are halved together (an axis that cannot be halved
without breaking the network is left as it is), so every shape is one the network really sees
at the smaller input.

The networks are split by network into two halves: ``"dev"``, the shapes to look at while
developing schedules, and ``"validation"``, held out to check that what was tuned on the dev
half carries over. A shape that occurs in both halves is kept in the dev half only.

>>> from tbe_like import networks
>>> net = networks.load("r3d_18")
>>> net.half, net.layers[0].name, net.layers[0].out_spatial()
('dev', 'stem.0', (8, 28, 28))
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["HALVES", "Layer", "Network", "halves", "load", "names"]

HALVES = ("dev", "validation")

_TEXT_FIELDS = ("name", "source", "input", "scaled")
_NETWORK_FIELDS = frozenset({*_TEXT_FIELDS, "half", "notes", "layers"})
_NETWORK_REQUIRED = ("name", "half", "source", "input", "scaled", "layers")
_POSITIVE_INTS = ("n", "cin", "cout", "groups", "count")
_TRIPLES = ("spatial", "kernel", "stride", "pad", "dilation")
_LAYER_FIELDS = ("name", "n", "cin", "spatial", "cout", "kernel", "stride", "pad", "dilation",
                 "groups", "count")


@dataclass(frozen=True)
class Layer:
    """One distinct 3D convolution of a network (NCDHW input, OIDHW weight).

    Attributes
    ----------
    network : str
        Name of the network the layer belongs to.
    name : str
        Module path of the convolution in the network's source (the first one, when the
        network applies the same shape several times).
    n : int
        Batch size.
    cin : int
        Input channels.
    spatial : tuple of int
        Input ``(D, H, W)``.
    cout : int
        Output channels.
    kernel : tuple of int
        Kernel ``(kd, kh, kw)``.
    stride : tuple of int
        Stride per axis.
    pad : tuple of int
        Symmetric zero padding per axis.
    dilation : tuple of int
        Dilation per axis.
    groups : int
        Number of groups (``groups == cin == cout`` is a depthwise convolution).
    count : int
        How many times the network applies a convolution of exactly this shape.
    """

    network: str
    name: str
    n: int
    cin: int
    spatial: tuple[int, int, int]
    cout: int
    kernel: tuple[int, int, int]
    stride: tuple[int, int, int]
    pad: tuple[int, int, int]
    dilation: tuple[int, int, int]
    groups: int
    count: int

    def out_spatial(self) -> tuple[int, int, int]:
        """Output ``(D, H, W)`` of the convolution.

        Returns
        -------
        tuple of int
            ``(i + 2 p - d (k - 1) - 1) // s + 1`` per axis.
        """
        d, h, w = (
            (i + 2 * p - dl * (k - 1) - 1) // s + 1
            for i, k, s, p, dl in zip(
                self.spatial, self.kernel, self.stride, self.pad, self.dilation, strict=True
            )
        )
        return d, h, w

    def flops(self) -> int:
        """Forward FLOPs of one application: two per multiply-add.

        Returns
        -------
        int
            ``2 * n * cout * prod(out_spatial) * (cin / groups) * prod(kernel)``.
        """
        return (
            2
            * self.n
            * self.cout
            * math.prod(self.out_spatial())
            * (self.cin // self.groups)
            * math.prod(self.kernel)
        )

    def shape(self) -> tuple[Any, ...]:
        """The layer's shape: every field but ``network``, ``name`` and ``count``.

        Returns
        -------
        tuple
            ``(n, cin, spatial, cout, kernel, stride, pad, dilation, groups)``; two layers
            with equal shapes are the same convolution problem.
        """
        return (self.n, self.cin, self.spatial, self.cout, self.kernel, self.stride, self.pad,
                self.dilation, self.groups)


@dataclass(frozen=True)
class Network:
    """A network's distinct convolutions and where they come from.

    Attributes
    ----------
    name : str
        Network name (the shipped file is ``<name>.json``).
    half : str
        ``"dev"`` or ``"validation"``.
    source : str
        Paper and public model definition the shapes were taken from.
    input : str
        The network's standard input (and batch) in its source.
    scaled : str
        The scaling applied to that input to keep every layer at most 2e9 FLOPs.
    layers : tuple of Layer
        The distinct convolutions, in network order.
    notes : tuple of str
        Deviations, uncertainties and shapes removed as duplicates of the other half.
    """

    name: str
    half: str
    source: str
    input: str
    scaled: str
    layers: tuple[Layer, ...]
    notes: tuple[str, ...] = ()


def names() -> list[str]:
    """Names of the shipped networks.

    Returns
    -------
    list of str
        Sorted names; each is a valid argument of :func:`load`.
    """
    return sorted(
        entry.name[: -len(".json")]
        for entry in resources.files(__name__).iterdir()
        if entry.name.endswith(".json")
    )


def load(name_or_path: str | os.PathLike[str]) -> Network:
    """Load a shipped network by name, or a network JSON file by path.

    Parameters
    ----------
    name_or_path : str or os.PathLike
        A name from :func:`names`, or the path of a JSON file of the same format (a string is
        taken as a path when it ends in ``.json`` or contains a path separator).

    Returns
    -------
    Network
        The validated network.

    Raises
    ------
    ValueError
        For an unknown name (the message lists the valid ones), a missing file, or a file
        that is not a valid network (the message names the file, the layer and the field).
    TypeError
        When ``name_or_path`` is neither a string nor a path.
    """
    if isinstance(name_or_path, os.PathLike) or (
        isinstance(name_or_path, str)
        and (name_or_path.endswith(".json") or "/" in name_or_path or os.sep in name_or_path)
    ):
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"no network file {str(path)!r}")
        return _parse(path.read_text(encoding="utf-8"), str(path))
    if not isinstance(name_or_path, str):
        raise TypeError(f"load() takes a network name or a path, not {type(name_or_path)!r}")
    return _load_shipped(name_or_path)


def halves() -> dict[str, list[str]]:
    """The shipped networks of each half.

    Returns
    -------
    dict of str to list of str
        ``{"dev": [...], "validation": [...]}``, each list sorted.
    """
    split: dict[str, list[str]] = {half: [] for half in HALVES}
    for name in names():
        split[load(name).half].append(name)
    return split


@functools.cache
def _load_shipped(name: str) -> Network:
    valid = names()
    if name not in valid:
        raise ValueError(f"unknown network {name!r}; valid names: {', '.join(valid)}")
    where = f"{name}.json"
    net = _parse((resources.files(__name__) / where).read_text(encoding="utf-8"), where)
    if net.name != name:
        raise ValueError(f"{where}: field 'name' is {net.name!r}, expected {name!r}")
    return net


def _parse(text: str, where: str) -> Network:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{where}: the top level must be a JSON object")
    _check_fields(data, _NETWORK_FIELDS, _NETWORK_REQUIRED, where)
    for field in _TEXT_FIELDS:
        if not isinstance(data[field], str) or not data[field].strip():
            raise ValueError(f"{where}: field {field!r} must be a non-empty string")
    if data["half"] not in HALVES:
        raise ValueError(f"{where}: field 'half' must be one of {HALVES}, got {data['half']!r}")
    notes = data.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(s, str) for s in notes):
        raise ValueError(f"{where}: field 'notes' must be a list of strings")
    raw_layers = data["layers"]
    if not isinstance(raw_layers, list) or not raw_layers:
        raise ValueError(f"{where}: field 'layers' must be a non-empty list")
    layers = tuple(
        _parse_layer(raw, data["name"], f"{where}: layer {i}") for i, raw in enumerate(raw_layers)
    )
    seen: set[str] = set()
    for layer in layers:
        if layer.name in seen:
            raise ValueError(f"{where}: layer {layer.name!r}: field 'name' is not unique")
        seen.add(layer.name)
    return Network(name=data["name"], half=data["half"], source=data["source"],
                   input=data["input"], scaled=data["scaled"], layers=layers, notes=tuple(notes))


def _check_fields(data: dict, known, required, where: str) -> None:
    """No field of ``data`` outside ``known``, every one of ``required`` present."""
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}")
    for field in required:
        if field not in data:
            raise ValueError(f"{where}: missing field {field!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _triple(values: list[int]) -> tuple[int, int, int]:
    a, b, c = values
    return a, b, c


def _parse_layer(raw: Any, network: str, where: str) -> Layer:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: must be a JSON object")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: field 'name' must be a non-empty string")
    where = f"{where} ({name!r})"
    _check_fields(raw, _LAYER_FIELDS, _LAYER_FIELDS, where)
    for field in _POSITIVE_INTS:
        value = raw[field]
        if not _is_int(value) or value < 1:
            raise ValueError(f"{where}: field {field!r} must be a positive integer, got {value!r}")
    for field in _TRIPLES:
        value = raw[field]
        low = 0 if field == "pad" else 1
        if (
            not isinstance(value, list)
            or len(value) != 3
            or not all(_is_int(v) and v >= low for v in value)
        ):
            kind = "non-negative" if low == 0 else "positive"
            raise ValueError(
                f"{where}: field {field!r} must be a list of 3 {kind} integers, got {value!r}"
            )
    groups = raw["groups"]
    for field in ("cin", "cout"):
        if raw[field] % groups:
            raise ValueError(
                f"{where}: field 'groups': {groups} does not divide {field} = {raw[field]}"
            )
    spatial, kernel, stride, pad, dilation = (_triple(raw[field]) for field in _TRIPLES)
    layer = Layer(network=network, name=name, n=raw["n"], cin=raw["cin"], spatial=spatial,
                  cout=raw["cout"], kernel=kernel, stride=stride, pad=pad, dilation=dilation,
                  groups=groups, count=raw["count"])
    out = layer.out_spatial()
    if min(out) < 1:
        raise ValueError(
            f"{where}: field 'spatial': output {out} of input {layer.spatial} is empty along "
            "an axis (kernel, stride, pad or dilation too large)"
        )
    return layer
