"""Every ```python block of README.md and docs/*.md runs as written, so none can rot.

A document's blocks run in order, in one namespace (a page reads top to bottom), from a file
of their own (Triton reads a kernel's source from its file). A block that needs a CUDA GPU
says so with the line ``<!-- needs: gpu -->`` right above its opening fence; on a machine
without one it is skipped. Tuning results go to a private cache.
"""
import pathlib
import re
import runpy

import pytest

from tests.conftest import ON_GPU

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
GPU_MARK = "<!-- needs: gpu -->"
_BLOCK = re.compile(r"^(?P<mark><!-- needs: gpu -->\n)?```python\n(?P<code>.*?)^```$", re.M | re.S)


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """``(line, code, needs_gpu)`` of each ```python block, in order."""
    return [(text.count("\n", 0, m.start("code")) + 1, m.group("code"), bool(m.group("mark")))
            for m in _BLOCK.finditer(text)]


def _script(doc: pathlib.Path) -> str:
    """The document's runnable blocks as one file, each at its own line in the document
    (so a traceback's line number is the document's)."""
    lines: list[str] = []
    for line, code, needs_gpu in python_blocks(doc.read_text()):
        if needs_gpu and not ON_GPU:
            continue
        lines += [""] * (line - 1 - len(lines)) + code.splitlines()
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_code_blocks_run(doc, tmp_path, monkeypatch, on_cpu):
    script = _script(doc)
    if not script.strip():
        pytest.skip(f"{doc.name} has no block that runs here")
    monkeypatch.setenv("TE_JAX_PERM_AUTOTUNE_CACHE", str(tmp_path / "tuning"))
    # The blocks run on the CPU device, also on a GPU machine: with the CPU's default backend.
    monkeypatch.setenv("TE_JAX_PERM_BACKEND", "xla")
    path = tmp_path / (doc.stem.replace("-", "_") + "_blocks.py")
    path.write_text(script)
    runpy.run_path(str(path), run_name="__docs__")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_python_block_is_extracted(doc):
    """No block is passed over unseen: every fence opens a ```python block (which runs) or a
    plain one (a diagram or printed output), never another language or an indented fence,
    and every ```python line opens a block the extraction finds."""
    text = doc.read_text()
    fences = re.findall(r"^[ \t]*```+(.*)$", text, re.M)
    assert set(fences) <= {"python", ""}, sorted(set(fences))
    assert not re.search(r"^[ \t]+```", text, re.M)
    assert len(python_blocks(text)) == text.count("\n```python\n") + text.startswith("```python\n")


def test_block_extraction_honours_the_gpu_mark():
    text = "x\n```python\na = 1\n```\n\n" + GPU_MARK + "\n```python\nb = 2\n```\n```sh\nc\n```\n"
    assert python_blocks(text) == [(3, "a = 1\n", False), (8, "b = 2\n", True)]



def _call_tree_names(text: str) -> list[tuple[str, str]]:
    """``(name, file)`` for each function a line of architecture.md's call tree names
    together with the one file it lives in: each ``name(``, and the rules ``a, b`` of a
    ``custom_vjp (a, b)``."""
    tree = text[text.index("## How a call reaches the kernel"):]
    tree = tree[tree.index("```\n") + 4:]
    tree = tree[:tree.index("```")]
    found = []
    for line in tree.splitlines():
        paths = re.findall(r"te_jax_perm/[\w/]+\.py", line)
        if len(paths) != 1:
            continue
        code = line[:line.index(paths[0])] + line[line.index(paths[0]) + len(paths[0]):]
        names = re.findall(r"([A-Za-z_]\w*)\(", code)
        names += [n for pair in re.findall(r"custom_vjp \((\w+), (\w+)\)", code) for n in pair]
        found += [(n, paths[0]) for n in names]
    return found


def test_architecture_call_tree_names_functions_that_exist():
    names = _call_tree_names((ROOT / "docs" / "architecture.md").read_text())
    assert len(names) >= 15, names
    missing = [f"{n} in {path}" for n, path in names
               if not re.search(rf"^\s*(def {n}\(|class {n}\b|{n} = )", (ROOT / path).read_text(), re.M)]
    assert not missing, missing


def test_call_tree_check_sees_a_stale_name():
    text = "## How a call reaches the kernel\n```\nfoo(x)   te_jax_perm/core/launch.py\n```\n"
    assert _call_tree_names(text) == [("foo", "te_jax_perm/core/launch.py")]


def test_architecture_names_every_op_package_and_module():
    """The op-package table and the paragraph beside it name every package and module of
    ``te_jax_perm/ops``: a new one is documented where a reader looks for it."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    ops = ROOT / "te_jax_perm" / "ops"
    packages = [p.name for p in ops.iterdir() if (p / "__init__.py").exists()]
    modules = [p.name for p in ops.glob("*.py") if p.name != "__init__.py"]
    assert len(packages) >= 5 and modules
    missing = [f"te_jax_perm/ops/{p}/" for p in packages if f"`te_jax_perm/ops/{p}/`" not in text]
    missing += [m for m in modules if f"`{m}`" not in text and f"`te_jax_perm/ops/{m}`" not in text]
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_readme_op_table_names_every_public_op():
    """Every public op (a function of the package taking ``backend``) has a row of
    the README's op table, where a user looks an op up."""
    import inspect
    import re

    import te_jax_perm
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `")]
    ops = [n for n in te_jax_perm.__all__ if inspect.isfunction(getattr(te_jax_perm, n))
           and "backend" in inspect.signature(getattr(te_jax_perm, n)).parameters]
    assert len(ops) >= 8
    missing = [n for n in ops if not any(re.match(rf"\| (`[\w, `]*)?`{n}[`(]", r) for r in rows)]
    assert not missing, f"README.md's op table has no row for: {missing}"
