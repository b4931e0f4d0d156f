"""Measured selection's cost model (``tbe_like.ranking``): features, the shipped model, and a
selection that compiles and times only the candidates the model ranks best."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest
import xgboost
from tbe_like.schedules.common import num_threads

from tbe_like import ranking
from tbe_like.ops import kernels
from tbe_like.target import host_target, vector_lanes
from tbe_like.testing import reference as ref

F32 = kernels.Precision("float32", "float32")


def _conv(cin=8, cout=16, spatial=(4, 6, 6), kernel=(1, 3, 3), stride=(1, 2, 2),
          pad=(0, 1, 1), groups=1) -> kernels.Conv3d:
    out = tuple((i + 2 * p - k) // s + 1
                for i, p, k, s in zip(spatial, pad, kernel, stride, strict=True))
    return kernels.Conv3d(2, cin, cout, spatial, out, kernel, stride,
                          (pad[0], pad[0], pad[1], pad[1], pad[2], pad[2]), (1, 1, 1), groups)


def _para(conv: kernels.Conv3d, kind: str) -> dict:
    """A kernel's ``para_dict`` as the framework operators build it."""
    return {**asdict(conv), **asdict(F32), "gradient": kind}


def _row(conv: kernels.Conv3d, gradient: str) -> dict:
    """A benchmark row of the same layer (``tbe-like bench`` JSON)."""
    return {"gradient": gradient, "config": {
        "name": "layer", "n": conv.batch, "cin": conv.cin, "cout": conv.cout,
        "spatial": list(conv.in_spatial),
        "kernel": list(conv.kernel), "stride": list(conv.strides),
        "pad": [conv.pads[0], conv.pads[2], conv.pads[4]], "dilation": list(conv.dilations),
        "groups": conv.groups, "dtype": "float32"}}


@pytest.mark.parametrize("conv", [_conv(), _conv(cin=16, groups=16, cout=16),
                                  _conv(kernel=(1, 1, 1), pad=(0, 0, 0), stride=(2, 2, 2))])
@pytest.mark.parametrize("kind", ["grad_weight", "grad_input"])
def test_a_layer_is_described_alike_when_built_and_when_benchmarked(conv, kind):
    """The model is trained on benchmark rows and asked about the kernels a build makes: the
    two descriptions of one layer are the same numbers."""
    gradient = kind.removeprefix("grad_")
    built = ranking.layer_features(_para(conv, kind))
    assert built == ranking.layer_features(_row(conv, gradient))
    assert len(built) == len(ranking.LAYER_FEATURES)
    other = ranking.layer_features(_para(conv, "grad_input" if kind == "grad_weight"
                                         else "grad_weight"))
    assert other != built  # the gradient is part of it


def test_a_candidate_is_described_by_its_form_knobs_and_cores():
    names = ["rule", "rule, one core", "col: Heuristic(lanes=8)",
             "temporal: Heuristic(lanes=16, rows=True), one core",
             "Heuristic(lanes=16, split_k=False, whole=True)",
             "Heuristic(lanes=16, accumulators=8)", "direct: Heuristic(lanes=16, gemm=True)"]
    described = {n: dict(zip(ranking.CANDIDATE_FEATURES, ranking.candidate_features(n),
                             strict=True)) for n in names}
    assert len({tuple(d.values()) for d in described.values()}) == len(names)
    assert described["rule"]["rule"] == 1 and described["rule"]["form_own"] == 1
    assert described["rule, one core"]["one_core"] == 1
    col = described["col: Heuristic(lanes=8)"]
    assert col["form_col"] == 1 and col["lanes"] == 8 and col["knob_split_k"] == -1
    temporal = described["temporal: Heuristic(lanes=16, rows=True), one core"]
    assert temporal["form_temporal"] == 1 and temporal["knob_rows"] == 1
    assert temporal["one_core"] == 1
    whole = described["Heuristic(lanes=16, split_k=False, whole=True)"]
    assert whole["knob_split_k"] == 0 and whole["knob_whole"] == 1
    assert described["Heuristic(lanes=16, accumulators=8)"]["accumulators"] == 8


def test_keep_takes_the_best_in_their_original_order():
    assert ranking.keep([3, 0, 5, 1, 2, 4], 6, top_k=3) == [0, 3, 5]
    assert ranking.keep(None, 6, top_k=3) == list(range(6))
    assert ranking.keep([1, 0], 2, top_k=3) == [0, 1]


def _fake_model(path, mcpu: str, bits: int, cores: int, favour: str = "lanes") -> None:
    """A model that scores a candidate by its ``favour`` feature alone (a 16-lane tile over
    an 8-lane one), trained here on made-up kernels."""
    rng = np.random.default_rng(0)
    column = ranking.FEATURES.index(favour)
    x = rng.standard_normal((64, len(ranking.FEATURES))).astype(np.float32)
    x[:, column] = rng.choice([0, 8, 16], 64)
    data = xgboost.DMatrix(x, label=x[:, column], feature_names=list(ranking.FEATURES))
    data.set_group([8] * 8)
    booster = xgboost.train({"objective": "rank:pairwise", "seed": 0}, data, 20)
    ranking.write_model(path, booster, mcpu, bits, cores, ["made up"], 8)


@pytest.fixture
def host_model(tmp_path, monkeypatch):
    """A model for this host's class, in a models folder of the test's own."""
    target = host_target()
    monkeypatch.setattr(ranking, "MODELS_DIR", tmp_path / "models")
    (tmp_path / "models").mkdir()
    _fake_model(ranking.model_path(str(target.attrs["mcpu"])), str(target.attrs["mcpu"]),
                vector_lanes(target) * 32, num_threads(target))
    yield target
    ranking._load.cache_clear()


def test_a_model_ranks_only_for_its_host_class(host_model, monkeypatch):
    target = host_model
    layer = _para(_conv(), "grad_weight")
    names = ["Heuristic(lanes=8)", "Heuristic(lanes=16)", "rule"]
    order = ranking.rank(layer, names, target)
    assert order[0] == 1 and sorted(order) == [0, 1, 2]
    assert ranking.rank(None, names, target) is None  # a kernel without a layer (DSL)
    monkeypatch.setenv(ranking.RANK_ENV, "0")
    assert ranking.rank(layer, names, target) is None
    monkeypatch.delenv(ranking.RANK_ENV)
    from tbe_like._tvm import Target

    other = Target({**json.loads(str(target)), "mcpu": "a-cpu-no-model-was-trained-on"})
    assert ranking.rank(layer, names, other) is None
    # A model file of another vector width, core count or feature list is not read.
    path = ranking.model_path(str(target.attrs["mcpu"]))
    saved = json.loads(path.read_text())
    path.write_text(json.dumps(dict(saved, vector_bits=[vector_lanes(target) * 16])))
    ranking._load.cache_clear()
    assert ranking.rank(layer, names, target) is None
    path.write_text(json.dumps(dict(saved, cores=[num_threads(target) + 2])))
    ranking._load.cache_clear()
    assert ranking.rank(layer, names, target) is None
    path.write_text(json.dumps(dict(saved, features=["x"])))
    ranking._load.cache_clear()
    assert ranking.rank(layer, names, target) is None
    # A damaged file: a warning, and every candidate is timed.
    for damaged in ("not json\n", json.dumps(dict(saved, model={"learner": 3}))):
        path.write_text(damaged)
        ranking._load.cache_clear()
        with pytest.warns(RuntimeWarning, match="ignoring the selection's cost model"):
            assert ranking.rank(layer, names, target) is None


def test_a_selection_times_only_the_candidates_ranked_best(measuring, host_model,
                                                            monkeypatch):
    """With a model for this host class, a framework operator's build compiles and times the
    ``TOP_K`` candidates it ranks best (here: the 16-lane ones), names the others, and its
    kernel computes the gradient."""
    from tbe_like import ops

    monkeypatch.setenv(ranking.RANK_ENV, "1")
    monkeypatch.setattr(ranking, "TOP_K", 2)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 16, 4, 8, 8)).astype(np.float32)
    w = rng.standard_normal((16, 16, 3, 3, 3)).astype(np.float32)
    dy = rng.standard_normal((1, 16, 4, 8, 8)).astype(np.float32)
    ex = ops.prepare_convolution_backward(
        dy, x, w, bias_sizes=None, stride=[1] * 3, padding=[1] * 3, dilation=[1] * 3,
        transposed=False, output_padding=[0] * 3, groups=1, output_mask=(False, True, False))
    selection = ex.kernels["grad_weight"].metadata["para_dict"]["selection"]
    timed, ranked_out = list(selection["times_ms"]), selection["ranked_out"]
    assert len(timed) == 2 and len(ranked_out) >= 1 and not set(timed) & set(ranked_out)
    assert all("lanes=16" in name for name in timed), timed
    assert any("lanes=8" in name for name in ranked_out), ranked_out
    want = ref.convolution_backward(dy.astype(np.float64), x.astype(np.float64),
                                    w.astype(np.float64), stride=[1] * 3, padding=[1] * 3,
                                    dilation=[1] * 3, transposed=False, output_padding=[0] * 3,
                                    groups=1, output_mask=(False, True, False))[1]
    got = ex(dy, x, w)[1]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_a_candidate_the_model_does_not_describe_is_always_timed(measuring, host_model,
                                                                  monkeypatch):
    """A candidate of a form or knob the features do not have (the streamed form, added after
    the shipped model was trained) is not described (``ranking.describes``), and a selection
    times it whatever the model ranks: here a late stage's input gradient with ``TOP_K`` 1
    times its streamed candidates and the one the model ranks first, and computes NumPy's
    gradient."""
    from tbe_like import ops

    assert ranking.describes("col: Heuristic(lanes=8)")
    assert ranking.describes("rule, one core")
    assert ranking.describes("temporal: Heuristic(lanes=16, gemm=True, rows=True), one core")
    assert not ranking.describes("streamed: Heuristic(lanes=16, stream=True)")
    assert not ranking.describes("Heuristic(lanes=16, stream=True)")
    assert not ranking.describes("a form from the future: rule")
    monkeypatch.setattr(ranking, "TOP_K", 1)
    # They take none of the places of the candidates the model ranks best (here the 16-lane
    # one), and with ranking off every candidate is timed.
    names = ["streamed: Heuristic(lanes=16, stream=True)", "Heuristic(lanes=8)",
             "Heuristic(lanes=16)", "streamed: Heuristic(lanes=16, stream=True), one core"]
    layer = _para(_conv(), "grad_input")
    assert ranking.timed(layer, names, host_model) == [0, 1, 2, 3]  # the fixture: ranking off
    monkeypatch.setenv(ranking.RANK_ENV, "1")
    assert ranking.timed(layer, names, host_model) == [0, 2, 3]
    conv = kernels.Conv3d(1, 64, 64, (2, 4, 4), (2, 4, 4), (3, 3, 3), (1, 1, 1), (1,) * 6,
                          (1, 1, 1), 1)
    assert kernels.streamed_applies(conv)
    rng = np.random.default_rng(5)
    x = rng.standard_normal(conv.x_shape).astype(np.float32)
    w = rng.standard_normal(conv.w_shape).astype(np.float32)
    dy = rng.standard_normal(conv.y_shape).astype(np.float32)
    geometry = dict(stride=[1] * 3, padding=[1] * 3, dilation=[1] * 3, transposed=False,
                    output_padding=[0] * 3, groups=1, output_mask=(True, False, False))
    ex = ops.prepare_convolution_backward(dy, x, w, bias_sizes=None, **geometry)
    selection = ex.kernels["grad_input"].metadata["para_dict"]["selection"]
    timed = list(selection["times_ms"])
    streamed = [n for n in timed if n.startswith("streamed: ")]
    assert streamed and all(not ranking.describes(n) for n in streamed), timed
    assert len([n for n in timed if ranking.describes(n)]) == 1, timed
    assert selection["ranked_out"], selection
    want = ref.convolution_backward(dy.astype(np.float64), x.astype(np.float64),
                                    w.astype(np.float64), **geometry)[0]
    np.testing.assert_allclose(ex(dy, x, w)[0], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_the_shipped_models_read_and_rank():
    """Every model shipped with the package reads (its format and features are this code's)
    and ranks a kernel's candidates on a host of its class."""
    from tbe_like._tvm import Target

    shipped = sorted(ranking.MODELS_DIR.glob("ranking_*.json"))
    assert shipped, "no ranking model is shipped"
    for path in shipped:
        saved = json.loads(path.read_text())
        assert saved["format"] == ranking.FORMAT and tuple(saved["features"]) == ranking.FEATURES
        assert path.name == f"ranking_{saved['mcpu']}.json"
        features = "+avx512f,+avx512bw,+avx512vl" if 512 in saved["vector_bits"] else "+avx2"
        target = Target({"kind": "llvm", "mcpu": saved["mcpu"], "num-cores": saved["cores"][0],
                         "mattr": features.split(",")})
        names = ["Heuristic(lanes=8)", "Heuristic(lanes=16)", "col: Heuristic(lanes=8)"]
        order = ranking.rank(_para(_conv(), "grad_weight"), names, target)
        assert order is not None and sorted(order) == [0, 1, 2]
        assert not any(n in saved["trained_on"] for n in ("validation", "validation.json"))


def test_a_benchmark_row_of_fewer_dimensions_is_its_3d_layer():
    """A 2D suite row (stride, pad and dilation given once for every axis) is described as the
    3D layer of one frame the operators compute, as a build's ``para_dict`` describes it."""
    row = {"gradient": "weight", "config": {
        "name": "2d", "n": 2, "cin": 16, "spatial": [9, 9], "cout": 32, "kernel": [3, 3],
        "stride": 2, "pad": 1, "dilation": 1, "groups": 1, "dtype": "float32"}}
    conv = kernels.Conv3d(2, 16, 32, (1, 9, 9), (1, 5, 5), (1, 3, 3), (1, 2, 2),
                          (0, 0, 1, 1, 1, 1), (1, 1, 1), 1)
    assert ranking.layer_features(row) == ranking.layer_features(_para(conv, "grad_weight"))
