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
    path = tmp_path / (doc.stem.replace("-", "_") + "_blocks.py")
    path.write_text(script)
    runpy.run_path(str(path), run_name="__docs__")


def test_block_extraction_honours_the_gpu_mark():
    text = "x\n```python\na = 1\n```\n\n" + GPU_MARK + "\n```python\nb = 2\n```\n```sh\nc\n```\n"
    assert python_blocks(text) == [(3, "a = 1\n", False), (8, "b = 2\n", True)]

