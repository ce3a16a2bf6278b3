"""Sweeps in two speeds. The values named as quick run in the quick loop (`make test-quick`), each one
standing for what its kind exercises; every other value is marked slow and runs in the whole suite
(`make test`, CI) with the same assertions. Corpus-wide checks sweep a density the same way: every
sample in the whole suite, every n-th sample (each form the corpus has, which a test asserts) in the
quick loop."""

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest

SPARSE = 8  # the quick loop's density: every 8th sample of a corpus


def sweep(values: Iterable, quick: Sequence) -> list:
    """``values`` as parameters, those not in ``quick`` marked slow; a tuple is the values of several names."""
    values = list(values)
    unknown = [value for value in quick if value not in values]
    if unknown:
        raise ValueError(f"quick values {unknown} are not in the sweep {values}")
    slow = pytest.mark.slow
    return [
        value if value in quick else pytest.param(*value if isinstance(value, tuple) else (value,), marks=slow)
        for value in values
    ]


def densities(sparse: int = SPARSE):
    """``every`` as a parameter: 1 (every sample, whole suite) and ``sparse`` (the quick loop)."""
    return pytest.mark.parametrize("every", sweep([1, sparse], quick=[sparse]), ids=density_id)


def density_id(every: int) -> str:
    return "every-sample" if every == 1 else f"every-{every}th-sample"


def every_nth(paths: Sequence[Path], every: int, folder: Path) -> list[Path]:
    """``paths`` with every ``every``-th record kept (JSONL lines, JSON array items), same names and formats."""
    if every == 1:
        return list(paths)
    folder.mkdir(parents=True, exist_ok=True)
    kept = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        if text.lstrip().startswith("["):
            subset = json.dumps(json.loads(text)[::every], ensure_ascii=False)
        else:
            subset = "".join(line + "\n" for line in text.splitlines()[::every])
        (folder / path.name).write_text(subset, encoding="utf-8")
        kept.append(folder / path.name)
    return kept
