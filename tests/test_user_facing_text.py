"""What a user reads names only files in this repository and nothing about how it was made.

Scans the README, BUILD.md, docs/, the benchmark results' README, the library's, examples'
and benchmarks' sources (their comments, docstrings and log messages), and the ``--help`` of
the two command-line tools for
* paths (``dir/file.ext``, or a bare ``name.md``) that exist neither from the repository
  root nor beside the file that names them (nor, in the library, from the package root), and
* phrases that point outside the repository or at how the project was run (notes files,
  issue numbers, the machines it was developed on, what the code used to do).
"""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PACKAGE = "te_jax_perm"
TEXT_FILES = ("README.md", "BUILD.md", "docs/*.md", "benchmarks/results/README.md", "examples/*.py",
              "benchmarks/*.py", f"{PACKAGE}/**/*.py")
HELP_COMMANDS = (("te_jax_perm.autotune", "--help"), ("benchmarks.peer", "--help"))

_EXT = r"(?:py|md|sh|json|png|txt|log|toml|cfg|ya?ml|whl)"
# dir/.../file.ext, not inside a longer path, URL, $VAR/..., ~/... or /abs/... .
_PATH = re.compile(r"(?<![\w./$~:-])((?:[\w.-]+/)+[\w.-]+\." + _EXT + r")(?![\w/])")
_BARE_MD = re.compile(r"(?<![\w./$~:-])([\w-]+\.md)(?![\w/])")
_URL = re.compile(r"\b\w+://\S+")
# An upper-case first component is a placeholder the user picks (OUT/bench.json, DIR/...).
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*/")

BANNED = {
    r"lessons\.md|shapes\.md|perf\.md|style\.md|shared/": "a file outside the repository",
    r"\bissues? #?\d+|\bthe issue'?s?\b": "an issue of the project's tracker",
    r"\blent\b|final_session|device session": "the machines the project was developed on",
    r"\bpreviously\b|\bno longer\b|\bused to be\b|\bsince (?:19|20)\d\d\b": "the project's history, not why",
}


def _texts() -> list[tuple[str, str]]:
    out = []
    for pattern in TEXT_FILES:
        for path in sorted(glob.glob(os.path.join(ROOT, pattern), recursive=True)):
            with open(path, encoding="utf-8") as f:
                out.append((os.path.relpath(path, ROOT), f.read()))
    return out


def _help_texts() -> list[tuple[str, str]]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu")
    out = []
    for module, flag in HELP_COMMANDS:
        p = subprocess.run([sys.executable, "-m", module, flag], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, f"python3 -m {module} {flag} failed:\n{p.stderr[-2000:]}"
        out.append((f"`python3 -m {module} {flag}`", p.stdout))
    return out


def missing_paths(name: str, text: str) -> list[str]:
    """``name:line: path`` for each path in ``text`` that exists neither from the root nor beside ``name``
    (nor from the package root, for a library module: ``core/launch.py``)."""
    here = os.path.dirname(os.path.join(ROOT, name)) if os.path.exists(os.path.join(ROOT, name)) else ROOT
    bases = (ROOT, here) + ((os.path.join(ROOT, PACKAGE),) if name.startswith(PACKAGE + "/") else ())
    bad = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = _URL.sub("", line)
        for path in dict.fromkeys(m.group(1) for rx in (_PATH, _BARE_MD) for m in rx.finditer(line)):
            if _PLACEHOLDER.match(path):
                continue
            if not any(os.path.exists(os.path.join(base, path)) for base in bases):
                bad.append(f"{name}:{lineno}: {path}")
    return bad


def banned_phrases(name: str, text: str) -> list[str]:
    bad = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for pattern, why in BANNED.items():
            for m in re.finditer(pattern, line, re.IGNORECASE):
                bad.append(f"{name}:{lineno}: {m.group(0)!r} ({why}): {line.strip()[:120]}")
    return bad


def test_the_scan_finds_what_it_should():
    # A path that exists, one that does not, a placeholder, a URL, and the banned phrases.
    assert missing_paths("README.md", "see `tests/conftest.py` and BUILD.md") == []
    assert missing_paths("README.md", "see `notes/plan.md`, then lessons.md") == [
        "README.md:1: notes/plan.md", "README.md:1: lessons.md"]
    assert missing_paths("README.md", "writes OUT/bench.json; https://example.org/a/b.md; ~/x/y.py") == []
    assert missing_paths("benchmarks/results/README.md", "`bench.png` and `summary.txt`, `results/none.json`") == [
        "benchmarks/results/README.md:1: results/none.json"]
    found = banned_phrases("x", "as in shared/shapes.md (issue 6), on the lent GPU machine")
    assert len(found) == 4, found   # shapes.md, shared/, issue 6, lent
    assert len(banned_phrases("x", "previously 8 warps; no longer padded, since 2024")) == 3
    assert banned_phrases("x", "the map is used to find rows; since T > 0") == []
    assert missing_paths("te_jax_perm/core/primitive.py", "rules in core/sharding.py") == []
    assert missing_paths("README.md", "rules in core/sharding.py") == ["README.md:1: core/sharding.py"]


@pytest.fixture(scope="module")
def user_facing() -> list[tuple[str, str]]:
    texts = _texts() + _help_texts()
    names = {n for n, _ in texts}
    assert {"README.md", "BUILD.md", "docs/sanitizer.md", "benchmarks/peer.py", "te_jax_perm/core/primitive.py"} \
        <= names, names
    return texts


def test_user_facing_text_names_only_files_in_the_repository(user_facing):
    bad = [b for name, text in user_facing for b in missing_paths(name, text)]
    assert not bad, "references to files that are not in the repository:\n" + "\n".join(bad)


def test_user_facing_text_does_not_point_outside_the_repository(user_facing):
    bad = [b for name, text in user_facing for b in banned_phrases(name, text)]
    assert not bad, "user-facing text that points outside the repository:\n" + "\n".join(bad)


def test_build_md_shows_the_test_line_ci_runs():
    # .ci/run runs the line two lines below the README's <!-- test-line --> marker.
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read().splitlines()
    line = readme[readme.index("<!-- test-line -->") + 2].strip()
    assert line.startswith("python3 -m pip install") and "pytest" in line, line
    with open(os.path.join(ROOT, "BUILD.md"), encoding="utf-8") as f:
        assert line in [ln.strip() for ln in f.read().splitlines()], f"BUILD.md does not show {line!r}"
