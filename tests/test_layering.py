"""Imports run one way (docs/architecture.md): a module imports its own layer or those below, never one above;
``policy`` and ``engine`` never import each other, nor ``trainer`` and ``inference``; no module imports a program;
no module of ``data`` imports ``compose``, ``policy``, ``engine`` or ``trainer``;
models never import ``torch.distributed`` or ``slurmvla.collectives``. Read from the source with ``ast``, so an import inside a function counts as much as
one at the top; code under ``if __name__ == "__main__":`` does not (a library may hand its old ``python -m``
path over to the program that moved up).

The configuration is one package, ``slurmvla.config`` (layer 1): the root ``Config`` in its ``__init__`` and one
schema module per group's owner (``slurmvla.config.data``, ``.engine``, ``.policy``, ``.serve``, ``.rollout``).
A policy folder's ``config`` (``slurmvla/policy/<name>/config.py``) is a schema module too, layer 1 where it lives;
``config`` / ``compose`` import it by the string its registry entry holds (``PolicyEntry.schema``, through
``registry.import_target``), which this reader does not see. So a schema module imports only layers 0-1, no torch,
transformers or numpy, and never the root ``slurmvla.config`` (which composes it); any module may import one (the
sibling and data rules are about code, not options); and composing a config, which imports every schema module and
the package ``__init__`` that importing a policy folder's runs, is checked to import no torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "slurmvla"

# (layer, module prefixes); a module belongs to the layer of its longest matching prefix. The package's own
# ``__init__`` is matched exactly: as a prefix it would place every new module, unread, at the bottom.
LAYERS = (
    (0, ("slurmvla.registry", "slurmvla.errors", "slurmvla.cli", "slurmvla.garbage_collector", "slurmvla.collectives",
         "slurmvla.droid_features", "slurmvla.parameters", "slurmvla.seeding", "slurmvla.units", "slurmvla.formats",
         "slurmvla.launch")),
    (1, ("slurmvla.config", "slurmvla.validators", "slurmvla.compose")),  # and every schema module: is_schema
    (2, ("slurmvla.data", "slurmvla.optim", "slurmvla.logger")),
    (3, ("slurmvla.policy", "slurmvla.engine")),
    (4, ("slurmvla.checkpoint", "slurmvla.validation", "slurmvla.sim", "slurmvla.planner")),
    (5, ("slurmvla.trainer", "slurmvla.inference")),
    (6, PROGRAMS := ("slurmvla.train", "slurmvla.serve", "slurmvla.evaluate", "slurmvla.export", "slurmvla.profile",
                     "slurmvla.inspect", "slurmvla.check", "slurmvla.rollout",
                     "slurmvla.plan", "slurmvla.table", "slurmvla.eval_array")),
)
# Siblings in one layer that must not import each other (the engine reads a policy through the contract only;
# the trainer gets the closed loop handed in by ``train``).
SIBLINGS = (("slurmvla.policy", "slurmvla.engine"), ("slurmvla.trainer", "slurmvla.inference"))
# The data layer reads the configuration's schemas (``config``), never the application's composition (Hydra:
# ``compose``), a model, an engine or the trainer: it loads for a tool that has none of them.
DATA, NOT_FOR_DATA = "slurmvla.data", ("slurmvla.compose", "slurmvla.policy", "slurmvla.engine", "slurmvla.trainer")
# A schema module (``slurmvla/config/<owner>.py``, ``slurmvla/policy/<name>/config.py``): layer 1, held to layers
# 0-1 and no heavy package; never importing the root ``config``, which composes it.
ROOT_CONFIG, HEAVY = "slurmvla.config", ("torch", "transformers", "numpy")
# Models are pure functions of their batch: no module of the policy package may know that ranks exist.
MODELS = "slurmvla.policy"
RANK_AWARE = ("torch.distributed", "slurmvla.collectives")


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def is_schema(module: str) -> bool:
    parts = module.split(".")
    in_config = module.startswith(ROOT_CONFIG + ".")
    return in_config or (len(parts) > 3 and parts[:2] == ["slurmvla", "policy"] and parts[-1] == "config")


def layer_of(module: str) -> int | None:
    if module == "slurmvla":
        return 0
    if is_schema(module):
        return 1
    matches = [(len(p), layer) for layer, prefixes in LAYERS for p in prefixes if _within(module, p)]
    return max(matches)[1] if matches else None


def _is_main_guard(node: ast.If) -> bool:
    test = node.test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and \
        any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def imports(source: str, module: str, is_package: bool = False, known: set[str] = frozenset()) -> list[str]:
    """Every module ``module``'s source imports, in order, outside ``if __name__ == "__main__":``.
    ``from a import b`` names ``a.b`` when that is a module in ``known``, else ``a``; ``torch.distributed``
    reached as an attribute of ``torch`` counts as an import of it."""
    found: list[str] = []
    package = module.split(".") if is_package else module.split(".")[:-1]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_main_guard(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            for a in node.names:
                sub = f"{target}.{a.name}"
                found.append(sub if sub in known or sub == "torch.distributed" else target)
        elif isinstance(node, ast.Attribute):
            name = _dotted(node)
            if name is not None and _within(name, "torch.distributed"):
                found.append("torch.distributed")
                return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """``module -> imported`` for every import that breaks a rule, over ``{module: (source, is_package)}``."""
    known = set(sources)
    out = []
    for module, (source, is_package) in sorted(sources.items()):
        mine = layer_of(module)
        if mine is None:
            out.append(f"{module}: in no layer (place it in docs/architecture.md and LAYERS)")
            continue
        for imported in dict.fromkeys(imports(source, module, is_package, known)):
            if _within(module, MODELS) and any(_within(imported, r) for r in RANK_AWARE):
                out.append(f"{module} -> {imported} (a model module must not know that ranks exist)")
            if is_schema(module) and any(_within(imported, h) for h in HEAVY):
                out.append(f"{module} -> {imported} (a schema module imports no {', '.join(HEAVY)}: composing a "
                           "config reads it)")
            if not _within(imported, "slurmvla"):
                continue
            if is_schema(module) and imported == ROOT_CONFIG:
                out.append(f"{module} -> {imported} (a schema module never imports {ROOT_CONFIG}, which composes it: "
                           "import from the owner's config module or slurmvla.validators)")
            theirs = layer_of(imported)
            if theirs is not None and theirs > mine:
                out.append(f"{module} -> {imported} (layer {mine} imports layer {theirs})")
            if is_schema(imported):
                continue  # options, not code: any module may read them
            if _within(module, DATA) and any(_within(imported, m) for m in NOT_FOR_DATA):
                out.append(f"{module} -> {imported} (the data layer never imports {', '.join(NOT_FOR_DATA)})")
            for a, b in SIBLINGS:
                if (_within(module, a) and _within(imported, b)) or (_within(module, b) and _within(imported, a)):
                    out.append(f"{module} -> {imported} (siblings: {a} and {b} never import each other)")
            program = next((p for p in PROGRAMS if _within(imported, p)), None)
            if program is not None and not _within(module, program):
                out.append(f"{module} -> {imported} (a program: no module imports one; shared code goes in a "
                           "library, e.g. slurmvla.inference)")
    return out


def package_sources() -> dict[str, tuple[str, bool]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        out[module] = (path.read_text(), is_package)
    return out


def plugin_sources() -> dict[str, tuple[str, bool]]:
    """The modules of the packages installed plug-ins add policy folders from (``registry.plugin_packages``): their
    schema modules are held to the same rules."""
    from slurmvla.registry import POLICY_PLUGINS, plugin_packages

    out = {}
    for package in plugin_packages(POLICY_PLUGINS):
        for root in map(Path, package.__path__):
            for path in sorted(root.rglob("*.py")):
                parts = (package.__name__, *path.relative_to(root).with_suffix("").parts)
                is_package = parts[-1] == "__init__"
                out[".".join(parts[:-1] if is_package else parts)] = (path.read_text(), is_package)
    return out


def schema_modules(sources: dict[str, tuple[str, bool]]) -> dict[str, str]:
    """Every schema module -> what reads it: the packages' and the policy folders' ``config`` modules, and the module
    of each registered policy's schema (a plug-in's may be named otherwise)."""
    from slurmvla.registry import POLICIES

    found = {m: "composed by slurmvla.config" if m.startswith(ROOT_CONFIG) else "a policy folder's schema"
             for m in sources if is_schema(m)}
    for name in POLICIES:
        found[POLICIES.get(name).schema.partition(":")[0]] = f"the schema of policy {name}: config imports it by name"
    return found


def test_schema_modules_import_only_what_configuration_may():
    sources = {**package_sources(), **plugin_sources()}
    schemas = schema_modules(sources)
    assert {f"slurmvla.config.{p}" for p in ("data", "engine", "serve", "policy", "rollout")} | \
        {"slurmvla.policy.pi0.config", "slurmvla.policy.flow_vla.config"} <= set(schemas)
    found = []
    for module, reader in sorted(schemas.items()):
        source, is_package = sources[module]
        for imported in dict.fromkeys(imports(source, module, is_package, set(sources))):
            heavy = any(_within(imported, m) for m in HEAVY)
            if heavy or imported == ROOT_CONFIG or (_within(imported, "slurmvla") and (layer_of(imported) or 0) > 1):
                found.append(f"{module} -> {imported} ({reader})")
    assert not found, "\n".join(found)


def test_composing_a_config_imports_no_torch():
    """Validating a config (a launcher's dry run, a saved config re-read) costs no torch import: every schema module,
    and ``slurmvla.policy``'s ``__init__`` that importing a policy folder's runs, stay light."""
    modules = sorted(schema_modules(package_sources()))
    code = ("import importlib, sys\nfrom slurmvla.compose import compose\nfrom slurmvla.registry import POLICIES\n"
            "for option in ('tiny', 'pi0', 'pi05_tiny', 'keypoints'):\n    compose([f'policy={option}'])\n"
            "for name in POLICIES:\n    POLICIES.get(name).load_schema()\n"
            f"for module in {modules!r}:\n    importlib.import_module(module)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout[-2000:] + out.stderr[-2000:]


def test_the_thin_programs_answer_help_before_torch_loads():
    """``--help`` (and a usage error, which argparse answers at the same point) of the programs that are only a
    command line over the library: the library, and torch with it, loads after the arguments are read."""
    code = ("import runpy, sys\nfor m in ('slurmvla.serve', 'slurmvla.plan', 'slurmvla.inspect', 'slurmvla.train', "
            "'slurmvla.rollout'):\n    sys.argv = [m, '--help']\n    try:\n"
            "        runpy.run_module(m, run_name='__main__')\n    except SystemExit:\n        pass\n"
            "    print('LOADED', m, sorted(x for x in sys.modules if x.split('.')[0] == 'torch')[:1])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = [line for line in out.stdout.splitlines() if line.startswith("LOADED")]
    assert len(loaded) == 5 and all(line.endswith("[]") for line in loaded), "\n".join(loaded) + out.stderr[-2000:]


def test_no_library_imports_a_layer_above_it_and_models_know_nothing_of_ranks():
    found = violations(package_sources())
    assert not found, "imports against docs/architecture.md:\n" + "\n".join(found)


@pytest.mark.parametrize("module, source, words", [
    ("slurmvla.data.x", "def f():\n    from slurmvla.trainer import Trainer\n",
     "slurmvla.data.x -> slurmvla.trainer (layer 2 imports layer 5)"),
    ("slurmvla.config", "from .data import spec\n", "slurmvla.config -> slurmvla.data.spec (layer 1 imports layer 2)"),
    ("slurmvla.config.data", "from slurmvla.data.spec import SampleSpec\n",
     "slurmvla.config.data -> slurmvla.data.spec (layer 1 imports layer 2)"),
    ("slurmvla.config.engine", "import torch\n", "slurmvla.config.engine -> torch (a schema module imports no"),
    ("slurmvla.config.rollout", "from slurmvla.config import check_choice\n",
     "slurmvla.config.rollout -> slurmvla.config (a schema module never imports"),
    ("slurmvla.data.x", "from slurmvla.compose import compose\n", "slurmvla.data.x -> slurmvla.compose (the data layer"),
    ("slurmvla.data.x", "def f():\n    from slurmvla.policy import build_policy\n",
     "slurmvla.data.x -> slurmvla.policy (the data layer"),
    ("slurmvla.policy.x", "import slurmvla.engine.base\n", "slurmvla.policy.x -> slurmvla.engine.base (siblings"),
    ("slurmvla.engine.x", "from slurmvla import policy\n", "slurmvla.engine.x -> slurmvla.policy (siblings"),
    ("slurmvla.policy.x", "from torch import distributed as dist\n", "slurmvla.policy.x -> torch.distributed (a model"),
    ("slurmvla.policy.x", "import torch\ndef f():\n    return torch.distributed.get_rank()\n",
     "slurmvla.policy.x -> torch.distributed (a model"),
    ("slurmvla.policy.x", "from slurmvla.collectives import agree\n",
     "slurmvla.policy.x -> slurmvla.collectives (a model"),
    ("slurmvla.newthing", "import os\n", "slurmvla.newthing: in no layer"),
    ("slurmvla.rollout", "def f():\n    from slurmvla.serve import build_server\n",
     "slurmvla.rollout -> slurmvla.serve (a program"),
    ("slurmvla.evaluate", "from slurmvla import export\n", "slurmvla.evaluate -> slurmvla.export (a program"),
    ("slurmvla.inference.x", "from slurmvla.trainer import Trainer\n", "slurmvla.inference.x -> slurmvla.trainer (siblings"),
])
def test_the_checker_fails_a_violating_source(module, source, words):
    known = {"slurmvla.data.spec", "slurmvla.engine.base", "slurmvla.policy", "slurmvla.trainer", "slurmvla.export"}
    sources = {module: (source, False), **{k: ("", False) for k in known}}
    found = violations(sources)
    assert any(words in v for v in found), found


def test_no_data_module_imports_the_composition_a_model_an_engine_or_the_trainer():
    """``python -m slurmvla.data.synthetic`` and the loaders run without Hydra's composition or a model."""
    found = [v for v in violations(package_sources()) if "(the data layer" in v]
    assert not found, "the data layer importing what it must not:\n" + "\n".join(found)


def test_no_program_imports_another_program():
    """Programs share code through libraries (``slurmvla.inference``), never through each other's modules."""
    found = [v for v in violations(package_sources()) if "(a program" in v]
    assert not found, "programs importing programs:\n" + "\n".join(found)


def test_the_checker_passes_downward_imports_and_main_guards():
    source = ("from slurmvla.config import Config\nfrom slurmvla.data.spec import SampleSpec\n"
              "if __name__ == '__main__':\n    from slurmvla.check import main\n    main()\n")
    assert violations({"slurmvla.policy.x": (source, False)}) == []
    # A program hands over to itself (its own submodules) freely; a library's __main__ block may name a program.
    assert violations({"slurmvla.serve": ("from slurmvla.inference.build import build_server\n", False)}) == []
    # The root config composes the packages' schema modules, and any module reads one (a sibling's, the data layer
    # a policy's): they are options, layer 1.
    schemas = {"slurmvla.config.policy": ("from slurmvla.validators import check_choice\nfrom slurmvla.config.data import "
                                          "NORMALIZATIONS\n", False), "slurmvla.config.data": ("", False),
               "slurmvla.config.engine": ("", False)}
    assert violations({**schemas, "slurmvla.config": ("from slurmvla.config.data import DataConfig\n"
                                                      "from slurmvla.config import engine\n", False),
                       "slurmvla.engine.x": ("from slurmvla.config.policy import PolicyConfig\n", False),
                       "slurmvla.data.x": ("from slurmvla.config.policy import PolicyConfig\n", False)}) == []
