"""The layers of the package: the core imports nothing of the transformers integration and
no transformers, and the integration is reached only through ``posenc_torch._installed``.

Each core module is imported in a fresh interpreter (the import of the package itself
included), which then must not hold ``transformers`` or ``posenc_torch.hf``; a plain
position-id call with an explicit convention loads neither either.  The sources are also
read: no core module names the integration or transformers in an import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import posenc_torch

PACKAGE = Path(posenc_torch.__file__).parent
CORE = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
CORE_SOURCES = [PACKAGE / "__init__.py", *(PACKAGE / f"{m}.py" for m in CORE)]


def test_the_core_is_every_top_level_module():
    assert {"rope", "positions", "packing", "ops", "_checks", "_tables", "_installed",
            "sinusoidal"} <= set(CORE)
    assert (PACKAGE / "hf" / "__init__.py").is_file() and not (PACKAGE / "hf.py").exists()


LOADED = ("import sys, {module}; "
          "bad = [m for m in ('transformers', 'posenc_torch.hf') if m in sys.modules]; "
          "assert not bad, bad")


@pytest.mark.parametrize("module", ["posenc_torch", *(f"posenc_torch.{m}" for m in CORE)])
def test_importing_a_core_module_loads_no_transformers(module):
    subprocess.run([sys.executable, "-c", LOADED.format(module=module)], check=True,
                   cwd=Path(__file__).parent, timeout=300)


CALL = """
import sys, torch, posenc_torch
ids = torch.tensor([[1, 151652, 151655, 151655, 151655, 151655, 151653, 2]])
posenc_torch.compute_mrope_position_ids(
    ids, torch.tensor([[1, 4, 4]]), model="qwen2_vl", convention="5.17",
    mm_token_type_ids=(ids == 151655).long())
posenc_torch.apply_rotary_pos_emb(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8),
                                  torch.randn(1, 3, 8), torch.randn(1, 3, 8))
bad = [m for m in ('transformers', 'posenc_torch.hf') if m in sys.modules]
assert not bad, bad
"""


def test_a_core_call_with_an_explicit_convention_loads_no_transformers():
    subprocess.run([sys.executable, "-c", CALL], check=True, cwd=Path(__file__).parent,
                   timeout=300)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ("." * node.level) + (node.module or "")
            names |= {base} | {f"{base}.{a.name}" if node.module else f"{base}{a.name}"
                               for a in node.names}
    return names


@pytest.mark.parametrize("path", CORE_SOURCES, ids=lambda p: p.name)
def test_no_core_source_imports_the_integration(path):
    bad = {n for n in _imports(path)
           if n.split(".")[0] == "transformers" or n in (".hf", "posenc_torch.hf")
           or n.startswith((".hf.", "posenc_torch.hf."))}
    assert not bad, (path.name, bad)
    # the hook names its provider modules as strings: only there may the integration appear
    if path.name != "_installed.py":
        assert "posenc_torch.hf" not in path.read_text().replace("``posenc_torch.hf", "")


def test_the_integration_does_not_import_itself_in_a_circle():
    """Each module of posenc_torch.hf imports, from the package, only modules listed
    before it in this order (the layering inside the wing)."""
    order = ["_transformers", "_digests", "_handle", "_table", "_rotary",
             "_rope_index", "_packing_guard", "_vision_utils", "_tower_methods_457",
             "_qk_attention", "_patch", "__init__"]
    wing = PACKAGE / "hf"
    assert sorted(p.stem for p in wing.glob("*.py")) == sorted(order)
    for i, name in enumerate(order):
        imported = {n.lstrip(".").split(".")[0] for n in _imports(wing / f"{name}.py")
                    if n.startswith(".") and not n.startswith("..")}
        imported.discard("")
        assert imported <= set(order[:i]), (name, imported - set(order[:i]))


def test_the_run_time_integration_holds_no_tracer():
    """What patch() runs imports neither the verify command (the tracer, the samples) nor
    torch's tracing machinery: ``python -m posenc_torch.hf.verify`` alone reads code that
    way."""
    wing = PACKAGE / "hf"
    for path in wing.glob("*.py"):
        names = _imports(path)
        assert not {n for n in names if n.lstrip(".").startswith("verify")
                    or n.startswith(("torch._dynamo", "torch.fx", "torch._subclasses",
                                     "torch.utils._sympy", "sympy"))}, path.name


IMPORT_COST = """
import sys, time
start = time.perf_counter()
import torch
torch_seconds = time.perf_counter() - start
import posenc_torch
loaded = [m for m in sys.modules if m.startswith(("torch._dynamo", "torch.fx.experimental.symbolic",
                                                  "sympy", "transformers"))]
assert not loaded, loaded
print(torch_seconds, time.perf_counter() - start - torch_seconds)
"""


def test_import_posenc_torch_loads_no_compiler_machinery():
    """``import posenc_torch`` loads neither torch._dynamo nor sympy (nor transformers);
    the marker it sets in their place is the one torch.compiler.assume_constant_result
    sets."""
    subprocess.run([sys.executable, "-c", IMPORT_COST], check=True, cwd=Path(__file__).parent,
                   timeout=300)
    import torch

    marked = torch.compiler.assume_constant_result(lambda: 0)
    from posenc_torch import _conventions

    assert {k for k in vars(marked)} == {"_dynamo_marked_constant"}
    assert _conventions._installed_convention._dynamo_marked_constant is True
