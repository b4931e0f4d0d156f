"""The compiled-kernel cache (``tbe_like.cache``): keys, memory and disk hits, rebuilds of damaged
entries, failed builds and concurrent builders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tbe_like import cache as kc
from tbe_like import dsl, layout, tvm
from tbe_like._tvm import Target
from tbe_like.kernel import target_json
from tbe_like.target import host_target
from tbe_like.testing import reference as ref

# A tiny weight gradient: x and dy (1, 1, 1, 3, 3, 16) float16, a 1x1x1 kernel -> dw (1, 1, 16, 16)
X_SHAPE = DY_SHAPE = (1, 1, 1, 3, 3, 16)
OP = "tiny_dw"
FIELDS = {"x": list(X_SHAPE), "dy": list(DY_SHAPE), "dtype": "float16", "filter_size":
          [16, 1, 16, 1, 1]}


class Builder:
    """A build function that compiles the tiny kernel and counts its calls."""

    def __init__(self, delay: float = 0.0, fail_after_writing: bool = False):
        self.calls: list[tuple[Path, str]] = []
        self.delay = delay
        self.fail_after_writing = fail_after_writing

    def __call__(self, output_dir: Path, kernel_name: str) -> None:
        self.calls.append((output_dir, kernel_name))
        time.sleep(self.delay)
        if self.fail_after_writing:  # an interrupted build: a partial library, then an error
            (output_dir / f"{kernel_name}.so").write_bytes(b"\x7fELF partial")
            raise KeyboardInterrupt("build interrupted")
        x = tvm.placeholder(X_SHAPE, name="x", dtype="float16")
        dy = tvm.placeholder(DY_SHAPE, name="dy", dtype="float16")
        res = dsl.conv3d_backprop_filter(x, dy, FIELDS["filter_size"],
                                         {"strides": [1, 1, 1], "pads": [0] * 6})
        dsl.build(dsl.auto_schedule(res), {"name": kernel_name, "tensor_list": [x, dy, res],
                                           "output_dir": str(output_dir)})


@pytest.fixture(scope="module")
def target():
    return host_target()


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    """An empty cache folder named by $TBE_LIKE_CACHE_DIR."""
    folder = tmp_path / "cache"
    monkeypatch.setenv(kc.ENV_VAR, str(folder))
    return folder


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 16, 1, 3, 3)).astype(np.float16)
    dy = rng.standard_normal((1, 16, 1, 3, 3)).astype(np.float16)
    expected = ref.conv3d_backprop_filter(x, dy, (1, 1, 1), (1, 1, 1), (0,) * 6, (1, 1, 1))
    return layout.to_ndc1hwc0(x), layout.to_ndc1hwc0(dy), layout.to_fractal_z_3d(
        expected).reshape(1, 1, 16, 16)


def check_runs(kernel, data):
    np.testing.assert_allclose(kernel(data[0], data[1]), data[2], rtol=0, atol=1e-5)


def entry(folder: Path, target, suffix: str) -> Path:
    return folder / f"{kc.KernelCache(folder).kernel_name(OP, FIELDS, target)}{suffix}"


def replace_file(path: Path, data: bytes) -> None:
    """Give ``path`` new contents through a new inode: the old library may be mapped in this
    process, and truncating a mapped library in place would crash it (SIGBUS)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- keys and folder


def test_cache_dir_from_env_xdg_and_home(tmp_path, monkeypatch):
    monkeypatch.setenv(kc.ENV_VAR, str(tmp_path / "explicit"))
    assert kc.cache_dir() == tmp_path / "explicit" and (tmp_path / "explicit").is_dir()
    monkeypatch.delenv(kc.ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kc.cache_dir() == tmp_path / "xdg" / "tbe_like"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kc.cache_dir() == tmp_path / "home" / ".cache" / "tbe_like"


def test_key_is_canonical(target):
    tj = target_json(target)
    key = kc.cache_key(OP, FIELDS, tj)
    assert len(key) == kc.KEY_HEX_CHARS and int(key, 16) >= 0
    # Key order, tuples versus lists and NumPy scalars do not matter.
    same = {k: (tuple(v) if isinstance(v, list) else v) for k, v in reversed(FIELDS.items())}
    same["x"] = tuple(np.int64(s) for s in X_SHAPE)
    assert kc.cache_key(OP, same, tj) == key


@pytest.mark.parametrize("change", ["op", "fields", "nested-field", "target", "tvm", "tbe_like",
                                    "code"])
def test_key_changes_with_every_input(change, target, monkeypatch):
    tj = target_json(target)
    key = kc.cache_key(OP, FIELDS, tj)
    op, fields = OP, dict(FIELDS)
    if change == "op":
        op = "other_op"
    elif change == "fields":
        fields["dtype"] = "float32"
    elif change == "nested-field":
        fields["x"] = [1, 1, 1, 3, 4, 16]
    elif change == "target":
        tj = target_json(Target({"kind": "llvm", "mcpu": "x86-64"}))
    elif change == "tvm":
        monkeypatch.setattr(kc, "TVM_VERSION", "0.0.0")
    elif change == "code":
        monkeypatch.setattr(kc, "_code_fingerprint", "0" * 64)
    else:
        monkeypatch.setattr("tbe_like.__version__", "9.9.9")
    assert kc.cache_key(op, fields, tj) != key


@pytest.mark.parametrize(("op", "fields", "error", "match"), [
    ("../evil", FIELDS, ValueError, "op must be an identifier"),
    ("a" * 180, FIELDS, ValueError, "op must be an identifier"),
    (3, FIELDS, TypeError, "op must be a string"),
    (OP, {"x": object()}, TypeError, r"fields\['x'\] must be built of"),
    (OP, {"x": float("nan")}, TypeError, r"fields\['x'\] must be built of"),
    (OP, {1: 2}, TypeError, "fields keys must be strings"),
], ids=["path", "too-long", "not-str", "object", "nan", "int-key"])
def test_bad_key_inputs(op, fields, error, match):
    with pytest.raises(error, match=match):
        kc.cache_key(op, fields, {"kind": "llvm"})


# ----------------------------------------------------------------------------- hits and builds


def test_second_call_does_not_build(cache_env, target, data):
    cache, build = kc.KernelCache(), Builder()
    first = cache.get(OP, FIELDS, target, build)
    second = cache.get(OP, FIELDS, target, build)
    assert second is first
    assert len(build.calls) == 1 and cache.stats == {"memory_hits": 1, "disk_hits": 0,
                                                     "builds": 1}
    name = cache.kernel_name(OP, FIELDS, target)
    assert first.name == name and first.path == cache_env / f"{name}.so"
    assert sorted(p.name for p in cache_env.iterdir() if not p.name.startswith(".")) == [
        f"{name}.json", f"{name}.so"]
    assert not list(cache_env.glob(".build-*")), "the temporary build folder was left behind"
    check_runs(first, data)


def test_fresh_cache_loads_from_disk(cache_env, target, data):
    kc.KernelCache().get(OP, FIELDS, target, Builder())
    fresh, build = kc.KernelCache(), Builder()  # what a new process would have
    kernel = fresh.get(OP, FIELDS, target, build)
    assert build.calls == [] and fresh.stats == {"memory_hits": 0, "disk_hits": 1, "builds": 0}
    check_runs(kernel, data)


def test_other_fields_build_another_kernel(cache_env, target):
    cache, build = kc.KernelCache(), Builder()
    a = cache.get(OP, FIELDS, target, build)
    b = cache.get(OP, {**FIELDS, "variant": 2}, target, build)
    assert a is not b and a.name != b.name and cache.builds == 2


def test_default_cache_follows_the_environment(cache_env, target):
    kernel = kc.default_cache.get(OP, FIELDS, target, Builder())
    assert kernel.path.parent == cache_env


@pytest.mark.parametrize("damage", ["truncated-so", "missing-so", "foreign-so", "corrupt-json",
                                    "empty-json", "missing-json", "other-name-json"])
def test_damaged_entry_is_rebuilt(damage, cache_env, target, data):
    kc.KernelCache().get(OP, FIELDS, target, Builder())
    so, js = entry(cache_env, target, ".so"), entry(cache_env, target, ".json")
    if damage == "truncated-so":
        replace_file(so, so.read_bytes()[: so.stat().st_size // 2])
    elif damage == "missing-so":
        so.unlink()
    elif damage == "foreign-so":
        replace_file(so, b"not a library")
    elif damage == "corrupt-json":
        replace_file(js, js.read_bytes()[:40])
    elif damage == "empty-json":
        replace_file(js, b"")
    elif damage == "missing-json":
        js.unlink()
    else:  # a valid kernel description of another name under this one's file name
        meta = json.loads(js.read_text())
        meta["kernel_name"], meta["library"] = "other", "other.so"
        replace_file(js, json.dumps(meta).encode())
    fresh, build = kc.KernelCache(), Builder()
    kernel = fresh.get(OP, FIELDS, target, build)
    assert len(build.calls) == 1 and fresh.stats["builds"] == 1
    check_runs(kernel, data)
    # The rebuilt entry is whole again: a third instance loads it without building.
    third = kc.KernelCache()
    check_runs(third.get(OP, FIELDS, target, Builder()), data)
    assert third.stats["disk_hits"] == 1


@pytest.mark.parametrize("builder", [Builder(fail_after_writing=True), lambda out, name: None],
                         ids=["interrupted", "writes-nothing"])
def test_failed_build_leaves_no_kernel(builder, cache_env, target):
    cache = kc.KernelCache()
    with pytest.raises((KeyboardInterrupt, RuntimeError)):
        cache.get(OP, FIELDS, target, builder)
    assert [p for p in cache_env.iterdir() if not p.name.endswith(".lock")] == []
    assert cache.stats["builds"] == 0
    # The next call builds normally.
    build = Builder()
    cache.get(OP, FIELDS, target, build)
    assert len(build.calls) == 1


def test_concurrent_builders_build_once(cache_env, target, data):
    """Two caches (as two processes would) ask for the same key at once: the file lock lets
    one build while the other waits, then loads what the first wrote."""
    build = Builder(delay=0.5)
    caches = [kc.KernelCache(), kc.KernelCache()]
    kernels, errors = [None, None], []

    def run(i):
        try:
            kernels[i] = caches[i].get(OP, FIELDS, target, build)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(build.calls) == 1
    assert sorted(c.stats["builds"] for c in caches) == [0, 1]
    for k in kernels:
        check_runs(k, data)


# ----------------------------------------------------------------------------- other processes

CHILD = """
import json, sys
sys.path.insert(0, sys.argv[2])
from test_cache import FIELDS, OP, Builder
from tbe_like import cache as kc
from tbe_like.target import host_target
cache = kc.KernelCache()
cache.get(OP, FIELDS, host_target(), Builder(delay=float(sys.argv[1])))
print(json.dumps(cache.stats))
"""


def run_children(cache_dir: Path, count: int, delay: float) -> list[dict]:
    env = {**os.environ, kc.ENV_VAR: str(cache_dir)}
    tests = str(Path(__file__).parent)
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(delay), tests], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(count)]
    stats = []
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err
        stats.append(json.loads(out.strip().splitlines()[-1]))
    return stats


@pytest.mark.slow
def test_processes_share_the_disk_cache(cache_env, request):
    """Two processes started together build the kernel once; a later process only loads it."""
    # Three interpreters importing TVM take ~20 s on 2 cores; nothing deselects `slow` by default.
    if "slow" not in request.config.getoption("markexpr", ""):
        pytest.skip("starts three Python processes; run with -m slow")
    together = run_children(cache_env, 2, delay=1.0)
    assert sorted(s["builds"] for s in together) == [0, 1]
    assert sorted(s["disk_hits"] for s in together) == [0, 1]
    (later,) = run_children(cache_env, 1, delay=0.0)
    assert later == {"memory_hits": 0, "disk_hits": 1, "builds": 0}


def test_code_fingerprint_covers_compute_and_schedules(tmp_path):
    """The key follows the code that writes kernels: the fingerprint hashes the sources of the
    compute and of the schedule rules, so an edited rule cannot hand out a kernel cached by the
    old one."""
    import importlib
    import shutil

    fingerprint = kc.code_fingerprint()
    assert len(fingerprint) == 64 and kc.code_fingerprint() == fingerprint
    copies = {}
    for name in kc._CODE_PACKAGES:
        root = Path(importlib.import_module(name).__file__).resolve().parent
        copies[name] = tmp_path / name
        shutil.copytree(root, copies[name], ignore=shutil.ignore_patterns("__pycache__"))
    assert kc.hash_sources(copies) == fingerprint
    rule = copies["tbe_like.schedules"] / "llvm" / "conv3d_backprop_input.py"
    rule.write_text(rule.read_text() + "\n# edited\n")
    assert kc.hash_sources(copies) != fingerprint
