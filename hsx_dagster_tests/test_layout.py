"""The layering the design relies on: the core imports no Dagster, its subpackages import only those below
them (storage, then inputs, extraction, and dataset / regenerate / export on top), and the trainer's one import
(`from hsx_dagster import DrafterDataset`) loads the reader alone, refusing data it cannot read."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hsx_dagster import DrafterDataset
from hsx_dagster.core.dataset.reader import DatasetError
from hsx_dagster.core.storage.format import DRAFTER_FORMAT, DRAFTER_VERSION, MANIFEST_FILE
from hsx_dagster_tests.code_size import in_progress, oversized

PACKAGE = Path(__file__).resolve().parents[1] / "hsx_dagster"


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


# Each core subpackage imports only those of a lower rank (and the core's top-level modules: settings, layers,
# model_info, choices, ...): storage knows no inputs, inputs no extraction, extraction no dataset, and the three
# on top never each other.
CORE_RANKS = {"storage": 0, "inputs": 1, "extraction": 2, "dataset": 3, "regenerate": 3, "export": 4}


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
