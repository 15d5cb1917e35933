"""The layout rules, checked on the source: core imports nothing above it, every op is a package
of one file set whose references and declarations import no API, one module orders kernel
arguments, one reads the output-init rule, plug-ins register through core.hooks, no module
imports another's private names, only core/env.py reads the environment, and the library's
environment variables reject values they do not know."""
import ast
import dataclasses
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from te_jax_perm.core import bind_call, configure, env, hooks
from te_jax_perm.core.kernel_args import kernel_arguments, signature
from tests.conftest import KERNEL_BACKEND
from tests.example_kernels import gather_rows

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "te_jax_perm"


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path))


def _imported_modules(tree):
    """Every ``te_jax_perm...`` module a file imports, at top level or inside functions."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


def test_core_imports_nothing_above_it():
    bad = []
    for rel, tree in _modules():
        if not rel.startswith("te_jax_perm/core/"):
            continue
        for mod in _imported_modules(tree):
            if mod.startswith("te_jax_perm") and not (mod == "te_jax_perm.core" or mod.startswith("te_jax_perm.core.")):
                bad.append(f"{rel} imports {mod}")
    assert not bad, "\n".join(bad)


# What each op package of te_jax_perm/ops/ holds: the public functions with their VJPs, the
# kernel declarations, the pure-JAX references. Kernel sources live in te_jax_perm/kernels/.
OP_FILES = {"__init__.py", "api.py", "decl.py", "reference.py"}
# Within and across ops, imports go api -> decl -> reference, never back.
_IMPORTS_NO = {"reference": ("decl", "api"), "decl": ("api",)}


def _op_packages():
    return sorted(p for p in (PKG / "ops").iterdir() if (p / "__init__.py").exists())


def test_every_op_package_has_the_same_files():
    packages = _op_packages()
    assert {p.name for p in packages} >= {"permute", "row_id_map", "chunk_sort", "grouped_gemm"}
    bad = [f"te_jax_perm/ops/{p.name}/ holds {sorted(f.name for f in p.glob('*.py'))}; expected {sorted(OP_FILES)}"
           for p in packages
           if {f.name for f in p.glob("*.py")} != OP_FILES or any(d.is_dir() for d in p.glob("[!_]*"))]
    assert not bad, "\n".join(bad)


def test_op_references_and_declarations_import_no_api():
    ops = {p.name for p in _op_packages()}
    bad = []
    for rel, tree in _modules():
        parts = rel.split("/")
        if len(parts) != 4 or parts[1] != "ops" or parts[2] not in ops:
            continue
        kind = parts[3][:-3]
        for mod in _imported_modules(tree):
            tail = mod.split(".")
            if (len(tail) >= 4 and tail[:2] == ["te_jax_perm", "ops"] and tail[2] in ops
                    and tail[3] in _IMPORTS_NO.get(kind, ())):
                bad.append(f"{rel} imports {mod}")
    assert not bad, "\n".join(bad)


def _attribute_uses(tree, names):
    # Read off anything but a name imported from outside the library (Gluon's ``mbarrier.init``
    # is no launch fact).
    foreign = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and not (node.module or "").startswith(_OURS) for a in node.names}
    return [(node.attr, node.lineno) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and node.attr in names and not (isinstance(node.value, ast.Name) and node.value.id in foreign)]


# attribute -> the only modules that may read it
_OWNERS = {
    # The kernel's parameter list and the runtime scalars: whoever reads them can assemble
    # an argument list, which only core/kernel_args.py may do (launch.py builds the scalars).
    "arg_names": {"te_jax_perm/core/kernel_args.py"},
    "scalars": {"te_jax_perm/core/kernel_args.py", "te_jax_perm/core/launch.py"},
    # Output.init: what a preallocated buffer starts as, read by the alias plan only.
    "init": {"te_jax_perm/core/aliasing.py", "te_jax_perm/core/declaration.py"},
}


@pytest.mark.parametrize("attr", sorted(_OWNERS))
def test_one_module_reads_each_launch_fact(attr):
    bad = [f"{rel}:{line} reads .{attr}" for rel, tree in _modules() if rel not in _OWNERS[attr]
           for _, line in _attribute_uses(tree, {attr})]
    assert not bad, "\n".join(bad)


_OURS = ("te_jax_perm", "tests", "benchmarks", "examples")


def _private_accesses(rel: str, tree: ast.AST):
    """``alias._name`` (read, or patched with ``setattr(alias, "_name", ...)``) where ``alias``
    names one of our modules or something imported from one."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(_OURS):
            aliases.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            aliases.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith(_OURS))
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            name = (node.value.id, node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute))
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "setattr" and len(node.args) >= 2
              and isinstance(node.args[0], ast.Name) and node.args[0].id in aliases
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            name = (node.args[0].id, node.args[1].value)
        if name and name[1].startswith("_") and not name[1].startswith("__"):
            yield f"{rel}:{node.lineno} {'.'.join(name)}"


def test_no_module_touches_another_modules_privates():
    """Plug-ins go through core.hooks, tests and tools through public names: nobody reaches
    into (or patches) a private name of another of our modules."""
    files = [p for d in _OURS for p in sorted((ROOT / d).rglob("*.py"))]
    bad = [line for p in files
           for line in _private_accesses(p.relative_to(ROOT).as_posix(), ast.parse(p.read_text(), str(p)))]
    assert not bad, "\n".join(bad)


def test_private_access_check_sees_reads_and_patches():
    src = ("from te_jax_perm.core import triton_backend as tb\nimport jax\n"
           "tb._lib\nmonkeypatch.setattr(tb, '_lib', 1)\njax._src\ntb.public\n")
    assert list(_private_accesses("tests/x.py", ast.parse(src))) == ["tests/x.py:3 tb._lib", "tests/x.py:4 tb._lib"]


def _private_imports(rel: str, source: str):
    """``from m import _name`` in file ``rel`` where ``_name`` is another module's private
    name (a private module of the importer's package, or of a package enclosing it, is that
    package's business)."""
    own = pathlib.PurePosixPath(rel).parent.as_posix().replace("/", ".")
    for node in ast.walk(ast.parse(source, rel)):
        if not isinstance(node, ast.ImportFrom) or not node.module or node.level:
            continue
        for a in node.names:
            private = a.name.startswith("_") and not a.name.startswith("__")
            enclosing = own == node.module or own.startswith(node.module + ".")
            if private and not (enclosing and (ROOT / node.module.replace(".", "/") / f"{a.name}.py").exists()):
                yield f"{rel}:{node.lineno} from {node.module} import {a.name}"


def test_no_module_imports_another_modules_private_names():
    """What one module takes from another is public: a leading underscore means "only here"."""
    files = [p for d in ("te_jax_perm", "tests", "benchmarks", "examples") for p in sorted((ROOT / d).rglob("*.py"))]
    bad = [line for p in files for line in _private_imports(p.relative_to(ROOT).as_posix(), p.read_text())]
    assert not bad, "\n".join(bad)


def test_private_import_check_sees_one():
    src = ("from te_jax_perm import _checks\nfrom te_jax_perm.ops.permute.api import _helper, segments\n"
           "from te_jax_perm.ops import _bits\n")
    assert list(_private_imports("te_jax_perm/ops/permute/api.py", src)) == [
        "te_jax_perm/ops/permute/api.py:2 from te_jax_perm.ops.permute.api import _helper"]
    # The package's private modules are its own modules' business, a subpackage's are not a sibling's.
    assert list(_private_imports("te_jax_perm/parallel/ep_moe.py", src)) == [
        "te_jax_perm/parallel/ep_moe.py:2 from te_jax_perm.ops.permute.api import _helper",
        "te_jax_perm/parallel/ep_moe.py:3 from te_jax_perm.ops import _bits"]
    assert list(_private_imports("benchmarks/peer.py", src))[0].endswith("import _checks")


def _environment_reads(tree):
    """Lines that read one environment variable: ``os.environ.get(..)``, ``os.environ[..]``,
    ``.. in os.environ``, ``os.getenv(..)`` (passing the whole environment on is no read)."""
    def is_environ(node):
        return isinstance(node, ast.Attribute) and node.attr == "environ"
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                node.func.attr == "getenv" or (node.func.attr == "get" and is_environ(node.func.value))):
            yield node.lineno
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            yield node.lineno
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            yield node.lineno


def test_environment_variables_are_read_in_core_env_only():
    bad = [f"{rel}:{line}" for rel, tree in _modules() if rel != "te_jax_perm/core/env.py"
           for line in _environment_reads(tree)]
    assert not bad, "\n".join(bad)
    seen = ast.parse("import os\na = os.environ.get('X')\nb = os.environ['Y']\nc = 'Z' in os.environ\n"
                     "d = os.getenv('W')\ne = dict(os.environ, Q='1')\n")
    assert list(_environment_reads(seen)) == [2, 3, 4, 5]


# -- the launch and its argument order -------------------------------------------------------
def _gather_launch(config=None):
    avals = [jax.ShapeDtypeStruct((7, 33), np.float32), jax.ShapeDtypeStruct((5,), np.int32)]
    call = bind_call(gather_rows.decl, avals, {}, "interpret")
    return configure(call, config or gather_rows.decl.default_config(call.dims, call.params))


def test_launch_is_derived_once_and_frozen():
    launch = _gather_launch()
    assert dict(launch.dims) == {"N": 7, "H": 33, "R": 5}
    assert [tuple(a.shape) for a in launch.out_avals] == [(5, 33)]
    assert launch.grid == (5,) and launch.grid3 == (5, 1, 1)
    assert dict(launch.scalars) == {"H": 33} and dict(launch.constexprs) == {"BLOCK_H": 64}
    with pytest.raises(dataclasses.FrozenInstanceError):
        launch.grid = (1,)
    with pytest.raises(TypeError):
        launch.dims["H"] = 1
    # The same call is bound once, whoever asks (abstract eval, lowering, tuner).
    again = bind_call(gather_rows.decl, [jax.ShapeDtypeStruct((7, 33), np.float32),
                                         jax.ShapeDtypeStruct((5,), np.int32)], {}, "interpret")
    assert again is launch.call


def test_kernel_arguments_follow_the_kernel_signature_by_name():
    launch = _gather_launch()
    args = kernel_arguments(launch, ["SRC", "IDX"], ["OUT0"], ["OUT1"])
    assert [(a.name, a.role, a.source, a.value) for a in args] == [
        ("src_ptr", "operand", "src", "SRC"), ("idx_ptr", "operand", "idx", "IDX"), ("H", "scalar", "H", 33),
        ("out_prealloc_ptr", "prealloc", "out.prealloc", "OUT0"), ("out_ptr", "output", "out", "OUT1")]
    assert signature(launch) == {"src_ptr": "*fp32", "idx_ptr": "*i32", "H": "i32", "out_prealloc_ptr": "*fp32",
                                 "out_ptr": "*fp32", "BLOCK_H": "constexpr"}
    with pytest.raises(TypeError, match="1 operands"):
        kernel_arguments(launch, ["SRC"], ["OUT0"], ["OUT1"])


# -- plug-ins -------------------------------------------------------------------------------
def test_resolver_and_call_observers_plug_in_through_hooks(on_cpu):
    import jax.numpy as jnp
    from te_jax_perm.core import Config
    seen = []
    forced = Config.make(BLOCK_H=16, num_warps=2)
    src, idx = jnp.ones((4, 40), jnp.float32), jnp.zeros((3,), jnp.int32)
    with hooks.observe_calls(seen.append), hooks.using_config_resolver(lambda call: forced):
        jax.jit(lambda s, i: gather_rows(s, i, backend="interpret")).lower(src, idx)
    assert [c.decl.name for c in seen] == ["example_gather_rows"] and dict(seen[0].dims)["H"] == 40
    from te_jax_perm.autotune.tuner import resolve_call
    assert hooks.set_config_resolver(resolve_call) is resolve_call  # restored: installed at package import


def test_jit_lowers_again_under_another_config_resolver(on_cpu):
    # The installed resolver is in jit's cache key: a function lowered under one resolver
    # and called under another is lowered again, with the other's configs.
    import jax.numpy as jnp
    import numpy as np
    from te_jax_perm.core import Config
    src = jnp.asarray(np.random.default_rng(0).standard_normal((4, 40)), jnp.float32)
    idx = jnp.asarray([3, 0, 2], jnp.int32)
    f = jax.jit(lambda s, i: gather_rows(s, i, backend="interpret")[0])
    asked = []

    def resolver(name, block_h):
        return lambda call: (asked.append(name), Config.make(BLOCK_H=block_h))[1]

    for name, block_h in (("a", 16), ("b", 64), ("a", 16)):
        with hooks.using_config_resolver(resolver(name, block_h)):
            np.testing.assert_array_equal(np.asarray(f(src, idx)), np.asarray(src)[np.asarray(idx)])
    assert asked == ["a", "b", "a"], f"resolvers asked {asked}; each new resolver must be asked when f is called"


def _run(code, **env_vars):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TE_JAX_PERM_")}
    environ.update(env_vars, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code], env=environ, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("var", [env.AUTOTUNE, env.BACKEND, env.SANITIZE])
@pytest.mark.parametrize("value", [" 1", "2", "y"])
def test_unknown_environment_values_are_errors(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(env.EnvironmentValueError, match=rf"{var}='{value}' is not a value it accepts; use one of"):
        env.check_all()


def test_unknown_environment_value_fails_the_import():
    out = _run("import te_jax_perm", TE_JAX_PERM_AUTOTUNE="y")
    assert out.returncode != 0
    assert "TE_JAX_PERM_AUTOTUNE='y' is not a value it accepts; use one of 1, true, yes, on, 0" in out.stderr


def test_known_environment_values(monkeypatch):
    for value, want in [("1", True), ("TRUE", True), ("off", False), ("", False)]:
        monkeypatch.setenv(env.AUTOTUNE, value)
        assert env.autotune() is want
    monkeypatch.setenv(env.SANITIZE, "1")
    assert env.sanitize() == "collect"
    monkeypatch.setenv(env.BACKEND, "xla")
    assert env.backend() == "xla"


def test_cached_tuning_is_used_without_opting_in(tmp_path):
    """A process that neither sets TE_JAX_PERM_AUTOTUNE nor imports the autotuner still
    uses what an earlier process tuned."""
    tune = ("import numpy as np\n"
            "from te_jax_perm import autotune\n"
            "from tests.example_kernels import gather_rows\n"
            f"r = autotune.tune(gather_rows.decl, [((6, 40), np.float32), ((4,), np.int32)], {{}}, '{KERNEL_BACKEND}')\n"
            "print('BEST', r.best)\n")
    first = _run(tune, TE_JAX_PERM_AUTOTUNE_CACHE=str(tmp_path))
    assert first.returncode == 0 and "BEST Config" in first.stdout, first.stderr
    best = first.stdout.split("BEST ")[1].strip()
    use = ("import sys, jax, jax.numpy as jnp\n"
           "import te_jax_perm\n"
           "from te_jax_perm.core import hooks\n"
           "from tests.example_kernels import gather_rows\n"
           "picked = []\n"
           "with hooks.observe_calls(lambda call: picked.append(hooks.resolve_config(call))):\n"
           f"    jax.jit(lambda s, i: gather_rows(s, i, backend='{KERNEL_BACKEND}')).lower(jnp.ones((6, 40)),"
           " jnp.zeros((4,), jnp.int32))\n"
           "print('PICKED', picked[0])\n"
           "print('TUNES', sys.modules['te_jax_perm.autotune.tuner'].stats['tunes'])\n")
    second = _run(use, TE_JAX_PERM_AUTOTUNE_CACHE=str(tmp_path))
    assert second.returncode == 0, second.stderr
    assert f"PICKED {best}" in second.stdout and "TUNES 0" in second.stdout, second.stdout + second.stderr


def test_dir_lists_the_public_names_before_any_is_loaded():
    """``dir(te_jax_perm)`` (and a REPL's completion) shows the public API, which is loaded
    lazily: in a fresh process none of it is in the namespace yet."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "import te_jax_perm; print(' '.join(dir(te_jax_perm)))"],
                         capture_output=True, text=True, timeout=300, check=True).stdout.split()
    import te_jax_perm
    assert out == sorted(te_jax_perm.__all__) and "token_dispatch" in out and "importlib" not in out


def test_every_public_op_takes_backend_by_keyword_only():
    """One way to pass ``backend=``: keyword-only in every public function that takes it."""
    import inspect

    import te_jax_perm
    takes = {}
    for name in te_jax_perm.__all__:
        obj = getattr(te_jax_perm, name)
        if inspect.isfunction(obj) and "backend" in inspect.signature(obj).parameters:
            takes[name] = inspect.signature(obj).parameters["backend"].kind
    assert {"token_dispatch", "permute_with_mask_map", "sort_chunks_by_map", "make_chunk_sort_map",
            "grouped_matmul"} <= set(takes)
    assert {n: k for n, k in takes.items() if k is not inspect.Parameter.KEYWORD_ONLY} == {}
    # ... and a positional one fails naming the keyword-only parameters (``_checks.keyword_only``).
    assert [n for n in takes if not hasattr(getattr(te_jax_perm, n), "__wrapped__")] == []
