"""The shipped network suite (tbe_like.networks): every file loads and validates, the halves
split the networks and each covers every kind of convolution, and bad files are refused.
No kernel is built here."""

from __future__ import annotations

import copy
import json
import math

import pytest

from tbe_like import networks
from tbe_like.networks import Layer

FLOPS_CAP = 2.0e9


def _kinds(layer: Layer) -> set[str]:
    """The kinds of convolution a layer counts as (classified by shape only)."""
    kd, kh, kw = layer.kernel
    _, h, w = layer.spatial
    kinds = set()
    if layer.cin <= 3:
        kinds.add("stem")
    if kd > 1 and kh == 1 and kw == 1:
        kinds.add("temporal")
    if kd == 1 and kh > 1 and kw > 1:
        kinds.add("spatial")
    if layer.kernel == (1, 1, 1) and layer.groups == 1:
        kinds.add("pointwise")
    if layer.groups == layer.cin == layer.cout > 1:
        kinds.add("depthwise")
    if 2 in layer.stride:
        kinds.add("stride2")
    if h * w <= 100 and layer.cin >= 256:
        kinds.add("late")
    return kinds


KINDS = {"stem", "temporal", "spatial", "pointwise", "depthwise", "stride2", "late"}


def _half_layers(half: str) -> list[Layer]:
    return [layer for name in networks.halves()[half] for layer in networks.load(name).layers]


def _good() -> dict:
    return {
        "name": "toy",
        "half": "dev",
        "source": "a test",
        "input": "1x4x8x8",
        "scaled": "none",
        "layers": [
            {"name": "conv1", "n": 1, "cin": 4, "spatial": [4, 8, 8], "cout": 8,
             "kernel": [3, 3, 3], "stride": [1, 2, 2], "pad": [1, 1, 1],
             "dilation": [1, 1, 1], "groups": 2, "count": 2},
        ],
    }


def _write(tmp_path, data, name="toy.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_names_are_the_shipped_files():
    names = networks.names()
    assert names == sorted(names)
    assert len(names) == len(set(names)) >= 10
    assert {"r2plus1d_18", "r3d_18", "mc3_18", "i3d_r50", "x3d_m", "slowfast_r50_slow",
            "slowfast_r50_fast", "c3d", "unet3d", "vnet"} <= set(names)


@pytest.mark.parametrize("name", networks.names())
def test_every_network_loads(name):
    net = networks.load(name)
    assert net.name == name
    assert net.half in networks.HALVES
    assert net.source and net.input and net.scaled
    assert net.layers
    assert len({layer.name for layer in net.layers}) == len(net.layers)
    assert len({layer.shape() for layer in net.layers}) == len(net.layers), "not deduplicated"
    for layer in net.layers:
        assert layer.network == name
        assert all(isinstance(v, tuple) and len(v) == 3 for v in (
            layer.spatial, layer.kernel, layer.stride, layer.pad, layer.dilation))
        assert layer.cin % layer.groups == 0 and layer.cout % layer.groups == 0
        assert min(layer.out_spatial()) >= 1
        assert layer.count >= 1


@pytest.mark.parametrize("name", networks.names())
def test_flops_under_cap(name):
    for layer in networks.load(name).layers:
        assert 0 < layer.flops() <= FLOPS_CAP, (name, layer.name, layer.flops())


def test_halves_are_disjoint_and_cover_all_networks():
    split = networks.halves()
    assert set(split) == set(networks.HALVES)
    dev, val = set(split["dev"]), set(split["validation"])
    assert dev and val
    assert not dev & val
    assert dev | val == set(networks.names())
    for half, names in split.items():
        assert names == sorted(names)
        assert all(networks.load(name).half == half for name in names)


@pytest.mark.parametrize("half", networks.HALVES)
def test_each_half_has_every_kind(half):
    found: set[str] = set()
    for layer in _half_layers(half):
        found |= _kinds(layer)
    assert found >= KINDS, f"{half} lacks {sorted(KINDS - found)}"


def test_no_shape_in_both_halves():
    dev = {layer.shape(): layer for layer in _half_layers("dev")}
    for layer in _half_layers("validation"):
        assert layer.shape() not in dev, (layer.network, layer.name, dev[layer.shape()].name)


def test_layer_arithmetic():
    layer = Layer(network="toy", name="c", n=2, cin=6, spatial=(5, 9, 9), cout=4,
                  kernel=(3, 3, 3), stride=(1, 2, 2), pad=(1, 1, 1), dilation=(1, 2, 2),
                  groups=2, count=1)
    # D: (5 + 2 - 2 - 1) // 1 + 1 = 5; H, W: (9 + 2 - 4 - 1) // 2 + 1 = 4
    assert layer.out_spatial() == (5, 4, 4)
    assert layer.flops() == 2 * 2 * 4 * (5 * 4 * 4) * 3 * 27
    assert layer.shape() == (2, 6, (5, 9, 9), 4, (3, 3, 3), (1, 2, 2), (1, 1, 1), (1, 2, 2), 2)


def test_known_shapes():
    """A few shapes checked by hand against the sources."""
    r2 = {layer.name: layer for layer in networks.load("r2plus1d_18").layers}
    assert r2["stem.0"].cout == 45 and r2["stem.0"].kernel == (1, 7, 7)
    assert r2["stem.3"].kernel == (3, 1, 1)
    assert r2["layer1.0.conv1.0.0"].cout == 144 and r2["layer1.0.conv1.0.0"].count == 4
    assert r2["layer2.0.conv1.0.3"].stride == (2, 1, 1)
    assert r2["layer4.1.conv1.0.0"].cout == 1152
    x3d = networks.load("x3d_m").layers
    assert {layer.cin for layer in x3d if layer.groups > 1} == {24, 54, 108, 216, 432}
    fast = {layer.name: layer for layer in networks.load("slowfast_r50_fast").layers}
    lateral = fast["blocks.0.multipathway_fusion.conv_fast_to_slow"]
    assert (lateral.cin, lateral.cout, lateral.kernel, lateral.stride) == (8, 16, (7, 1, 1),
                                                                          (4, 1, 1))
    slow = networks.load("slowfast_r50_slow").layers
    assert {layer.cin for layer in slow if layer.name.endswith("res_blocks.0.branch2.conv_a")} \
        == {80, 320, 640, 1280}


def test_load_by_path_matches_name(tmp_path):
    from importlib import resources

    text = (resources.files("tbe_like.networks") / "c3d.json").read_text(encoding="utf-8")
    path = _write(tmp_path, text, "copy.json")
    assert networks.load(path) == networks.load("c3d")
    assert networks.load(str(path)) == networks.load("c3d")


def test_good_toy_file(tmp_path):
    net = networks.load(_write(tmp_path, _good()))
    assert net.name == "toy" and net.notes == ()
    (layer,) = net.layers
    assert layer.spatial == (4, 8, 8) and layer.out_spatial() == (4, 4, 4)
    assert layer.flops() == 2 * 8 * math.prod((4, 4, 4)) * 2 * 27


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="unknown network 'resnet9000'") as info:
        networks.load("resnet9000")
    for name in networks.names():
        assert name in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="no network file"):
        networks.load(tmp_path / "absent.json")


def test_wrong_type():
    with pytest.raises(TypeError):
        networks.load(3)  # type: ignore[arg-type]


def _set(path, value):
    """A mutation of _good(): set (or with value None, delete) the item at ``path``."""

    def mutate(data):
        *head, last = path
        node = data
        for key in head:
            node = node[key]
        if value is None:
            del node[last]
        else:
            node[last] = value
        return data

    return mutate


LAYER = ("layers", 0)
BAD = {
    "missing-half": (_set(("half",), None), "missing field 'half'"),
    "bad-half": (_set(("half",), "test"), "field 'half'"),
    "unknown-top-field": (_set(("extra",), 1), "unknown field"),
    "empty-source": (_set(("source",), ""), "field 'source'"),
    "no-layers": (_set(("layers",), []), "field 'layers'"),
    "notes-not-strings": (_set(("notes",), [1]), "field 'notes'"),
    "layer-not-object": (_set(LAYER, [1, 2]), "layer 0: must be a JSON object"),
    "layer-no-name": (_set((*LAYER, "name"), None), "layer 0: field 'name'"),
    "missing-cout": (_set((*LAYER, "cout"), None), "'conv1'.*missing field 'cout'"),
    "unknown-layer-field": (_set((*LAYER, "bias"), True), "'conv1'.*unknown field"),
    "negative-cin": (_set((*LAYER, "cin"), -4), "'conv1'.*field 'cin'"),
    "zero-count": (_set((*LAYER, "count"), 0), "'conv1'.*field 'count'"),
    "float-n": (_set((*LAYER, "n"), 1.0), "'conv1'.*field 'n'"),
    "bool-groups": (_set((*LAYER, "groups"), True), "'conv1'.*field 'groups'"),
    "short-kernel": (_set((*LAYER, "kernel"), [3, 3]), "'conv1'.*field 'kernel'"),
    "zero-stride": (_set((*LAYER, "stride"), [1, 0, 1]), "'conv1'.*field 'stride'"),
    "negative-pad": (_set((*LAYER, "pad"), [0, -1, 0]), "'conv1'.*field 'pad'"),
    "string-spatial": (_set((*LAYER, "spatial"), "4x8x8"), "'conv1'.*field 'spatial'"),
    "groups-cin": (_set((*LAYER, "groups"), 3), "'conv1'.*field 'groups'.*cin"),
    "groups-cout": (_set((*LAYER, "cout"), 9), "'conv1'.*field 'groups'.*cout"),
    "empty-output": (_set((*LAYER, "kernel"), [7, 3, 3]), "'conv1'.*field 'spatial'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_file_is_refused(tmp_path, case):
    mutate, message = BAD[case]
    path = _write(tmp_path, mutate(copy.deepcopy(_good())), f"bad_{case}.json")
    with pytest.raises(ValueError, match=message) as info:
        networks.load(path)
    assert f"bad_{case}.json" in str(info.value)


def test_duplicate_layer_name(tmp_path):
    data = _good()
    data["layers"].append(dict(data["layers"][0], kernel=[1, 1, 1], pad=[0, 0, 0]))
    with pytest.raises(ValueError, match=r"'conv1'.*not unique"):
        networks.load(_write(tmp_path, data))


@pytest.mark.parametrize("text", ["{", "[]", "null"])
def test_not_a_network_object(tmp_path, text):
    with pytest.raises(ValueError, match=r"toy\.json"):
        networks.load(_write(tmp_path, text))
