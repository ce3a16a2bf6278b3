"""The layering the design relies on: the core imports no Dagster, its subpackages import only those below
them (storage, then inputs, extraction, and dataset / regenerate / export on top), and the trainer's one import
(`from hsx_dagster import DrafterDataset`) loads the reader alone, refusing data it cannot read."""

import ast
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hsx_dagster import DrafterDataset
from hsx_dagster.core.dataset import DatasetError
from hsx_dagster.core.storage import DRAFTER_FORMAT, DRAFTER_VERSION, MANIFEST_FILE
from hsx_dagster_tests.support.code_size import in_progress, oversized
from hsx_dagster_tests.support.paths import REPO

PACKAGE = REPO / "hsx_dagster"


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_nothing_under_the_core_imports_dagster():
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            m for m in imported_modules(path) if m.split(".")[0].startswith("dagster")
        )
        for path in sorted((PACKAGE / "core").rglob("*.py"))
    }
    assert {file: modules for file, modules in offenders.items() if modules} == {}
    assert len(offenders) > 20  # the walk found the core's modules


# Each core subpackage imports only those of a lower rank (and the core's loose modules: units, shard keys, ...):
# the model facts know no settings, the settings no storage, storage no inputs, inputs no extraction, extraction
# no dataset, and the three on top never each other.
CORE_RANKS = {
    "model": 0,
    "settings": 1,
    "storage": 2,
    "inputs": 3,
    "extraction": 4,
    "dataset": 5,
    "regenerate": 5,
    "export": 6,
}


def test_core_subpackages_import_only_those_below_them():
    subpackages = sorted(path.name for path in (PACKAGE / "core").iterdir() if (path / "__init__.py").is_file())
    assert set(subpackages) <= set(CORE_RANKS), f"place the new core subpackage(s) in CORE_RANKS: {subpackages}"
    upward = []
    for name in subpackages:
        for path in sorted((PACKAGE / "core" / name).rglob("*.py")):
            for module in imported_modules(path):
                target = module.split(".")[2] if module.startswith("hsx_dagster.core.") else None
                if target in CORE_RANKS and target != name and CORE_RANKS[target] >= CORE_RANKS[name]:
                    upward.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert upward == []
    assert len(subpackages) >= 5  # the walk found storage, inputs, extraction, dataset, regenerate


@pytest.mark.parametrize("name", sorted(CORE_RANKS))
def test_each_core_subpackage_declares_its_public_api_and_every_name_resolves(name):
    package = importlib.import_module(f"hsx_dagster.core.{name}")
    declared = {export: module for module, names in package.EXPORTS.items() for export in names}
    assert sorted(package.__all__) == sorted(declared)
    # what mypy sees (the TYPE_CHECKING imports) is what runs (EXPORTS)
    typed = {
        alias.asname or alias.name: node.module.rsplit(".", 1)[-1]
        for node in ast.walk(ast.parse((PACKAGE / "core" / name / "__init__.py").read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(f"hsx_dagster.core.{name}.")
        for alias in node.names
    }
    assert typed == declared
    for export, module in declared.items():
        assert getattr(package, export) is getattr(importlib.import_module(f"{package.__name__}.{module}"), export)


def test_at_most_six_modules_sit_loose_at_the_top_of_the_core():
    loose = sorted(path.stem for path in (PACKAGE / "core").glob("*.py") if path.stem != "__init__")
    assert 0 < len(loose) <= 6, loose


def outside_the_core() -> list[Path]:
    """The Dagster layer, the demo and the CLIs, the benchmarks, and the tests other than the core's unit tests
    (which test a subpackage's modules one by one)."""
    tests = REPO / "hsx_dagster_tests"
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        + sorted((REPO / "benchmarks").rglob("*.py"))
        + sorted(tests.rglob("*.py"))
        if not path.is_relative_to(PACKAGE / "core") and not path.is_relative_to(tests / "unit")
    ]


# Modules another program imports by name, which no subpackage can offer lazily.
ENTRY_MODULES = {
    "hsx_dagster.core.export.hs_backend": "speculators' `hsx` backend: needs hs_connectors, their env only"
}
# Files that also run an earlier checkout's code, whose subpackages had no public API yet.
EARLIER_CHECKOUTS = {"benchmarks/shared/host_path_work.py": "the host-path benchmark's --previous contestant"}


def test_outside_the_core_code_imports_only_the_subpackages_public_api():
    past = [
        f"{path.relative_to(REPO)} imports {module}"
        for path in outside_the_core()
        if str(path.relative_to(REPO)) not in EARLIER_CHECKOUTS
        for module in imported_modules(path)
        if module.startswith("hsx_dagster.core.")
        and module.split(".")[2] in CORE_RANKS
        and module.count(".") > 2
        and module not in ENTRY_MODULES
    ]
    assert past == []
    assert len(outside_the_core()) > 50  # the walk found the Dagster layer, the benchmarks and the tests


def test_the_tests_mirror_the_source_in_tiers():
    tests = REPO / "hsx_dagster_tests"
    loose = sorted(path.name for path in tests.glob("*.py"))
    assert loose == ["__init__.py", "conftest.py", "test_layout.py", "test_seams.py"]
    core = {path.name for path in (PACKAGE / "core").iterdir() if (path / "__init__.py").is_file()}
    assert {path.name for path in (tests / "unit").iterdir() if (path / "__init__.py").is_file()} == core


def test_no_test_imports_the_benchmarks():
    """A test reaches a benchmark through its command line (a subprocess), as a user runs it; code that both need
    lives in the package."""
    tests = sorted((REPO / "hsx_dagster_tests").rglob("*.py"))
    offenders = [
        f"{path.relative_to(REPO)} imports {module}"
        for path in tests
        for module in sorted(imported_modules(path))
        if module.split(".")[0] == "benchmarks"
    ]
    assert offenders == []
    assert len(tests) > 40  # the walk found the tests, the trainer tests among them


def test_no_module_over_450_lines_and_no_function_over_80_without_a_reason():
    found = [item for item in oversized() if not item.reason and not in_progress(item.path)]
    assert [str(item) for item in found] == []


@pytest.mark.slow  # a subprocess that imports torch (the quick loop checks the core's imports statically)
def test_the_reader_import_loads_no_dagster_transformers_jinja2_or_pydantic():
    code = (
        "import sys; from hsx_dagster import DrafterDataset; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'dagster', 'transformers', 'jinja2', 'pydantic', "
        "'pydantic_settings', 'yaml'}))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"


@pytest.mark.parametrize(
    "manifest, message",
    [
        ({"format": "something-else", "format_version": 1}, "format is 'something-else', not 'hsx-drafter-dataset'"),
        ({"format": DRAFTER_FORMAT, "format_version": DRAFTER_VERSION + 1}, "newer than this hsx-dagster reads"),
        ({"format": DRAFTER_FORMAT}, "format_version None is newer than this hsx-dagster reads"),
    ],
)
def test_the_reader_refuses_another_format_or_a_newer_version(tmp_path, manifest, message):
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=message):
        DrafterDataset(tmp_path)


def test_the_reader_names_a_manifest_that_is_not_json(tmp_path):
    (tmp_path / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(DatasetError, match=f"{MANIFEST_FILE}: not valid JSON"):
        DrafterDataset(tmp_path)


def test_the_readme_is_short_and_its_layout_names_the_tree_as_it_is():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode()) < 10_000
    layout = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([\w./-]+(?:/|\.py))`", layout))
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    paths = set(tracked) | {str(Path(path).parent) + "/" for path in tracked}
    assert sorted(name for name in named if not any(path.endswith(name) for path in paths)) == []  # nothing stale
    folders = [
        f"{path.name}/"
        for parent in ("hsx_dagster/core", "hsx_dagster/defs", "hsx_dagster_tests", "benchmarks")
        for path in sorted((REPO / parent).iterdir())
        if (path / "__init__.py").is_file()
    ]
    assert [folder for folder in folders if folder not in named] == []  # nothing missing


def load_time_imports(path: Path) -> set[str]:
    """The package's modules that importing the module at ``path`` imports at once: its module-level imports, not
    those inside functions or under TYPE_CHECKING; a name from a core subpackage counts as the module its EXPORTS
    name."""
    found = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                exports = CORE_EXPORTS.get(node.module, {})
                target = f"{node.module}.{exports[alias.name]}" if alias.name in exports else node.module
                found.add(target)
                found.add(f"{node.module}.{alias.name}")  # a submodule, where it is one
    return found


CORE_EXPORTS = {
    f"hsx_dagster.core.{name}": {
        export: module
        for module, names in importlib.import_module(f"hsx_dagster.core.{name}").EXPORTS.items()
        for export in names
    }
    for name in CORE_RANKS
}


def test_no_import_cycle_in_the_package():
    modules = {
        ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): path
        for path in sorted(PACKAGE.rglob("*.py"))
    }
    graph = {name: sorted(load_time_imports(path) & set(modules)) for name, path in modules.items()}
    cycles, state = [], dict.fromkeys(graph, 0)  # 0 unseen, 1 on the current path, 2 done

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for target in graph[name]:
            if state[target] == 1:
                cycles.append(" -> ".join([*trail[trail.index(target) :], target]))
            elif state[target] == 0:
                visit(target, [*trail, target])
        state[name] = 2

    for name in graph:
        if state[name] == 0:
            visit(name, [name])
    assert cycles == []
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the walk found the package and its imports
