"""The README's code blocks work as written.

* ```python blocks run in the order they appear, in one namespace and a fresh working directory
  with a private kernel cache: the blocks that use torch on their own (skipped without torch),
  the one that builds for CUDA after the DSL example (skipped without nvcc; it needs no GPU),
  the others together. A block that assigns ``dw`` must give the DSL example's weight gradient.
* ```bash blocks and inline ``python ...`` commands name files, extras, options and markers that
  exist (nothing is run), and the test command is the one ``.ci/run`` runs.
* Every repository path and relative link in README.md and docs/*.md exists.
"""

from __future__ import annotations

import re
import shlex
import shutil
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
USES_TORCH = re.compile(r"^\s*(import torch\b|from tbe_like import torch\b)", re.M)
USES_CUDA = re.compile(r"""target=["']cuda["']|["']kind["']: *["']cuda["']""")
ASSIGNS_DW = re.compile(r"^dw = ", re.M)
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"(?:tbe_like|schedules|tests|examples|benchmarks|docs|\.ci)/[\w./-]*")
CI_MARK = "# The README's test command:"


def fenced(path: Path, languages: set[str]) -> list[tuple[int, str]]:
    """(line of the opening fence, code) of each block in one of ``languages``."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text)
            if m.group(1) in languages]


def python_blocks() -> list[tuple[int, str]]:
    return fenced(README, {"python"})


def run_block(line: int, code: str, namespace: dict) -> None:
    """Execute one block; tracebacks give README.md's own line numbers."""
    exec(compile("\n" * line + code, str(README), "exec"), namespace)
    if ASSIGNS_DW.search(code):
        check_dsl_example(namespace, line)


def check_dsl_example(ns: dict, line: int) -> None:
    """``dw`` is the weight gradient of the README's DSL example (its strides, pads and 2x3x3
    kernel, groups 1) of ``x_6hd`` and ``dy_6hd``, against the NumPy reference."""
    from tbe_like import layout
    from tbe_like.testing import reference

    x = layout.from_ndc1hwc0(ns["x_6hd"], ns["x_6hd"].shape[2] * 16)
    dy = layout.from_ndc1hwc0(ns["dy_6hd"], ns["dy_6hd"].shape[2] * 16)
    want = reference.conv3d_backprop_filter(x, dy, (2, 3, 3), (2, 2, 2), (0, 0, 0, 1, 0, 1),
                                            (1, 1, 1), groups=1)
    want = layout.to_fractal_z_3d(want, groups=1).reshape(ns["dw"].shape)
    err = np.abs(ns["dw"].astype(np.float64) - want).max()
    assert err <= 1e-4 * np.abs(want).max(), f"README.md:{line}: dw is off by {err}"


@pytest.fixture
def readme_dir(tmp_path, monkeypatch) -> Path:
    """A fresh working directory (kernel_meta/ goes there) and kernel cache."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("TBE_LIKE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TBE_LIKE_MEASURE", "0")  # the rules' untimed choice: no timing here
    return work


def test_the_readme_has_python_blocks_of_every_kind():
    codes = [code for _, code in python_blocks()]
    assert any(USES_TORCH.search(c) for c in codes)
    assert any(USES_CUDA.search(c) for c in codes)
    assert any("dsl.build(" in c for c in codes) and any("load_kernel(" in c for c in codes)


def test_python_blocks_run_in_order(readme_dir):
    namespace: dict = {"__name__": "__readme__"}
    ran = 0
    for line, code in python_blocks():
        if not USES_TORCH.search(code) and not USES_CUDA.search(code):
            run_block(line, code, namespace)
            ran += 1
    assert ran >= 3
    assert sorted(p.name for p in (readme_dir / "kernel_meta").iterdir()) == [
        "dw_seed.json", "dw_seed.so"]


def test_torch_blocks_run(readme_dir):
    pytest.importorskip("torch")
    namespace: dict = {"__name__": "__readme__"}
    torch_blocks = [(line, code) for line, code in python_blocks() if USES_TORCH.search(code)]
    assert torch_blocks
    for line, code in torch_blocks:
        run_block(line, code, namespace)


def test_cuda_block_builds_after_the_dsl_example(readme_dir):
    """Building for CUDA needs nvcc, not a GPU; the kernel runs only where one is present."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    blocks = python_blocks()
    namespace: dict = {"__name__": "__readme__"}
    run_block(*blocks[0], namespace)
    cuda_blocks = [(line, code) for line, code in blocks[1:] if USES_CUDA.search(code)]
    assert cuda_blocks
    for line, code in cuda_blocks:
        run_block(line, code, namespace)
    assert namespace["kernel"].target_kind == "cuda"


# ---- commands: checked, not run --------------------------------------------------------------


def commands(text: str) -> list[list[str]]:
    """The commands of a shell text: continuations joined, comments dropped, split at ``&&``."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        words: list[str] = []
        for word in [*shlex.split(line, comments=True), "&&"]:
            if word in ("&&", "&"):  # "&": a command started in the background
                if words:
                    out.append(words)
                words = []
            else:
                words.append(word)
    return out


def readme_commands() -> list[list[str]]:
    bash = "\n".join(code for _, code in fenced(README, {"bash", "sh", "shell"}))
    inline = [span for span in INLINE_CODE.findall(FENCE.sub("", README.read_text()))
              if span.startswith("python ")]
    return commands(bash + "\n" + "\n".join(inline))


def extras() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^(\w+) = \[", section, re.M))


def markers() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    return set(re.findall(r'^\s*"(\w+): ', text.split("markers = [", 1)[1], re.M))


def check_command(words: list[str], monkeypatch) -> None:
    if words[0] == "tbe-like":  # the console script: python -m tbe_like
        words = ["python", "-m", "tbe_like", *words[1:]]
    assert words[0] == "python", f"{words}: only python and tbe-like commands are expected"
    args = words[1:]
    if args[:3] == ["-m", "pip", "install"]:
        assert args[3] == "-e", words
        spec = re.fullmatch(r"\.(?:\[([\w,]+)\])?", args[4])
        assert spec, words
        assert set((spec.group(1) or "").split(",")) - {""} <= extras(), words
    elif args[:2] == ["-m", "pytest"]:
        for flag, value in pairwise(args[2:]):
            if flag == "-m":
                assert set(re.findall(r"\w+", value)) - {"not", "and", "or"} <= markers(), words
            if flag == "-n":
                assert value == "auto", words
    elif args[:2] in (["-m", "tvm.exec.rpc_tracker"], ["-m", "tvm.exec.rpc_server"]):
        assert set(args[2::2]) <= {"--host", "--port", "--port-end", "--tracker", "--key"}, words
    elif args[:2] == ["-m", "tbe_like"]:
        from tbe_like import cli

        if len(args) == 3:  # the command named in prose, without its arguments
            with pytest.raises(SystemExit) as done:
                cli.main([args[2], "--help"])
            assert done.value.code == 0, words
            return
        from tbe_like import bench

        parsed = []  # what tune and bench would run with: parsed, not run
        monkeypatch.setattr(cli, "_tune", lambda a: parsed.append(a) or 0)
        monkeypatch.setattr(bench, "_main", lambda a: parsed.append(a) or 0)
        assert cli.main(args[2:]) == 0 and parsed, words
    else:
        script = ROOT / args[0]
        assert args[0].endswith(".py") and script.is_file(), f"{words}: no such script"
        source = script.read_text()
        # A script that is a module's front (benchmarks/bench_cpu.py: tbe_like.bench) has
        # that module's options.
        for module in re.findall(r"^from (tbe_like\.\w+) import .*\bmain\b", source, re.M):
            source += (ROOT / (module.replace(".", "/") + ".py")).read_text()
        for flag in args[1:]:
            if flag.startswith("--"):
                assert f'"{flag}"' in source, f"{words}: {args[0]} has no option {flag}"


def test_readme_commands_name_what_exists(monkeypatch):
    found = readme_commands()
    assert any(w[:2] == ["python", "examples/conv3d_backprop_filter.py"] for w in found)
    for words in found:
        check_command(words, monkeypatch)


def test_the_readme_test_command_is_what_ci_runs():
    """.ci/run runs the line after its CI_MARK comment: the README's test command, with pip's
    ``-q`` (quiet) added."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    ran = [[w for w in words if w != "-q"] for words in commands(ci[ci.index(CI_MARK) + 1])]
    for _, code in fenced(README, {"bash"}):
        for line in code.splitlines():
            if not line.startswith("#") and commands(line) == ran:
                return
    pytest.fail(f"README.md has no bash line running {ran} (what .ci/run runs)")


# ---- paths and links ----------------------------------------------------------------------


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown page."""
    text = FENCE.sub("", path.read_text())
    heads = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_paths_and_links_exist(page):
    text = FENCE.sub("", page.read_text())
    for span in INLINE_CODE.findall(text):
        if REPO_PATH.fullmatch(span):
            assert (ROOT / span).exists(), f"{page.name}: `{span}` does not exist"
    for target in LINK.findall(text):
        if re.match(r"\w+://", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (page.parent / file).resolve() if file else page
        assert linked.exists(), f"{page.name}: link {target} has no file"
        if anchor:
            assert anchor in anchors(linked), f"{page.name}: link {target} has no heading"
