"""docs/architecture.md's import layers cannot drift from the code, and the layers contract holds what it promises.

The doc's `import-graph` block (right under its layer diagram) is compared with pyproject.toml's layers
contract, with the top-level packages in the tree, and with the import graph grimp (import-linter's) builds.
The contract itself is run by `lint-imports` on a small fake tree, so that a service importing the directory
server is shown to break it, whatever the module's name.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()
PYPROJECT_TEXT = (ROOT / "pyproject.toml").read_text()
LINTER: dict[str, Any] = tomllib.loads(PYPROJECT_TEXT)["tool"]["importlinter"]
LAYERS_CONTRACT = next(c for c in LINTER["contracts"] if c["type"] == "layers")
LINT_IMPORTS = Path(sys.prefix) / "bin" / "lint-imports"


def _fenced(info: str) -> tuple[str, str]:
    """(the block whose info string is `info`, the fenced block just before it) of docs/architecture.md."""
    blocks = re.findall(r"^```([^\n]*)\n(.*?)^```$", DOC, re.M | re.S)
    for i, (tag, body) in enumerate(blocks):
        if tag.strip() == info:
            assert i > 0, f"no diagram above the `{info}` block"
            return body, blocks[i - 1][1]
    raise AssertionError(f"docs/architecture.md has no ```{info} block")


def _normalized(layer: str) -> str:
    return " | ".join(p.strip() for p in layer.split("|"))


def _doc_graph() -> tuple[list[str], dict[str, set[str]]]:
    """The doc's layers (top first, as the contract spells them) and its arrows, importer -> imported."""
    block, _ = _fenced("text import-graph")
    layers: list[str] = []
    arrows: dict[str, set[str]] = {}
    for line in filter(None, map(str.strip, block.splitlines())):
        if line.startswith("layer "):
            layers.append(_normalized(line.removeprefix("layer ")))
        else:
            importer, _, imported = line.partition("->")
            assert imported, f"unreadable line in the import-graph block: {line!r}"
            arrows.setdefault(importer.strip(), set()).update(imported.split())
    return layers, arrows


def _packages(layers: list[str]) -> set[str]:
    return {p.strip() for layer in layers for p in layer.split("|")}


def _tree_packages() -> set[str]:
    """The repository's top-level packages: folders with an __init__.py (tests/ and the venv have none)."""
    return {p.parent.name for p in ROOT.glob("*/__init__.py") if not p.parent.name.startswith(".")}


def test_the_docs_layers_are_the_contracts() -> None:
    layers, _ = _doc_graph()
    assert layers == [_normalized(layer) for layer in LAYERS_CONTRACT["layers"]], (
        "docs/architecture.md's `layer` lines differ from pyproject.toml's layers contract"
    )


def test_the_doc_names_every_package_in_the_tree_and_no_other() -> None:
    layers, _ = _doc_graph()
    _, diagram = _fenced("text import-graph")
    tree = _tree_packages()
    assert _packages(layers) == tree, f"doc {sorted(_packages(layers))} vs tree {sorted(tree)}"
    assert set(LINTER["root_packages"]) == tree, "pyproject.toml's root_packages differ from the tree's packages"
    missing = sorted(p for p in tree if not re.search(rf"\b{p}\b", diagram))
    assert not missing, f"the layer diagram does not show {missing}"


def test_the_docs_arrows_are_the_imports_between_packages() -> None:
    """Both ways: an import the diagram lacks fails, and so does an arrow for an import there is not."""
    _, arrows = _doc_graph()
    packages = sorted(_tree_packages())
    graph = grimp.build_graph(*packages, include_external_packages=True, cache_dir=None)
    real = {
        (a, b)
        for a in packages
        for b in packages
        if a != b and graph.direct_import_exists(importer=a, imported=b, as_packages=True)
    }
    drawn = {(a, b) for a, targets in arrows.items() for b in targets}
    assert real - drawn == set(), f"imports the diagram lacks: {sorted(real - drawn)}"
    assert drawn - real == set(), f"arrows for imports that do not exist: {sorted(drawn - real)}"


def test_the_docs_arrows_only_point_down_the_layers() -> None:
    layers, arrows = _doc_graph()
    rank = {p: i for i, layer in enumerate(layers) for p in _packages([layer])}
    upward = sorted((a, b) for a, targets in arrows.items() for b in targets if rank[b] <= rank[a])
    assert not upward, f"arrows the layers contract forbids (up or sideways): {upward}"


def test_the_doc_quotes_every_contract_by_its_name() -> None:
    prose = " ".join(DOC.split())
    for contract in LINTER["contracts"]:
        assert f'"{contract["name"]}"' in prose, f"docs/architecture.md does not name the contract {contract['name']!r}"


# The layers contract, run on a fake tree ------------------------------------------------------------------


def _linter_section() -> str:
    """pyproject.toml's `[tool.importlinter]` section as written there, up to the next table that is not its own."""
    m = re.search(r"^\[tool\.importlinter\]\n.*?(?=^\[(?!\[?tool\.importlinter\b)|\Z)", PYPROJECT_TEXT, re.M | re.S)
    assert m, "pyproject.toml has no [tool.importlinter] section"
    assert tomllib.loads(m.group(0))["tool"]["importlinter"] == LINTER, "the copied section is not the whole config"
    return m.group(0)


def _named_modules() -> set[str]:
    """Every module below a package of the project that a contract names: import-linter refuses a config naming a missing one.

    The external ones (pysyncobj, numba, vllm, torch) are left out of the fake tree: nothing in it imports them,
    so grimp's graph has no such package, and a forbidden contract on a package outside the graph is kept.
    """
    names: set[str] = set()
    for c in LINTER["contracts"]:
        names.update(c.get("source_modules", []), c.get("forbidden_modules", []))
    return {n for n in names if "." in n and n.split(".")[0] in LINTER["root_packages"]}


def _ignored_imports() -> dict[str, str]:
    """The modules the contracts' `ignore_imports` name, each importing what is ignored there (an ignore that
    matches no import is an error)."""
    sources: dict[str, str] = {}
    for c in LINTER["contracts"]:
        for rule in c.get("ignore_imports", []):
            importer, _, imported = (x.strip() for x in rule.partition("->"))
            path = importer.replace(".", "/") + ".py"
            sources[path] = sources.get(path, "") + f"import {imported}\n"
    return sources


def _fake_tree(root: Path, extra: dict[str, str]) -> None:
    """The packages with one module each, the modules the contracts name (the ignored imports in them),
    directory/api.py and `extra`."""
    modules = {f"{p}/__init__.py": "" for p in LINTER["root_packages"]}
    modules.update({f"{p}/core.py": "" for p in LINTER["root_packages"]})
    modules.update({n.replace(".", "/") + ".py": "" for n in _named_modules()})
    modules.update(_ignored_imports())
    modules["directory/api.py"] = ""
    modules.update(extra)
    for rel, text in modules.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(text)
    (root / "pyproject.toml").write_text(_linter_section())


def _lint(root: Path) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, " ".join((proc.stdout + proc.stderr).split())  # rich wraps long contract names


def test_the_fake_tree_keeps_every_contract(tmp_path: Path) -> None:
    _fake_tree(tmp_path, {})
    rc, out = _lint(tmp_path)
    assert rc == 0, out
    assert f"Contracts: {len(LINTER['contracts'])} kept, 0 broken." in out, out


@pytest.mark.parametrize(
    ("path", "source", "chain"),
    [
        ("gateway/bad.py", "import directory.api\n", "gateway.bad -> directory.api"),
        # A module no list has ever named, in a new subpackage, importing the server another way.
        ("gateway/routing/new_policy.py", "from directory import api\n", "gateway.routing.new_policy -> directory.api"),
        ("worker_stub/shortcut.py", "import gateway.core\n", "worker_stub.shortcut -> gateway.core"),
        ("kvproto/upward.py", "import directory.api\n", "kvproto.upward -> directory.api"),
        # The library never imports the tools: they plug in through entry points.
        ("kvdir/bench_shortcut.py", "import kvtools.core\n", "kvdir.bench_shortcut -> kvtools.core"),
    ],
)
def test_an_import_against_the_layers_breaks_the_layers_contract(tmp_path: Path, path: str, source: str, chain: str) -> None:
    _fake_tree(tmp_path, {path: source})
    rc, out = _lint(tmp_path)
    assert rc != 0, out
    assert f"{LAYERS_CONTRACT['name']} BROKEN" in out, out
    assert chain in out, out  # the fake tree's module, not the repository's, was analysed
    others = [c["name"] for c in LINTER["contracts"] if c is not LAYERS_CONTRACT]
    assert all(f"{name} KEPT" in out for name in others), out


def test_a_new_adapter_module_importing_vllm_breaks_the_vllm_contract(tmp_path: Path) -> None:
    """Only the connector is exempt (its `ignore_imports`): a module nobody listed is governed too."""
    _fake_tree(tmp_path, {"adapters/new_events.py": "import vllm\n"})
    rc, out = _lint(tmp_path)
    vllm_contract = next(c["name"] for c in LINTER["contracts"] if "vllm" in c.get("forbidden_modules", []))
    assert rc != 0 and f"{vllm_contract} BROKEN" in out and "adapters.new_events -> vllm" in out, out
