"""Which kernels a hybrid target's linear-attention layers run, and a warning, before the model loads, when
a GPU would run them on transformers' PyTorch reference path.

Hybrid targets (Qwen3.5/3.6 and Qwen3-Next with Gated DeltaNet layers, transformers' Mamba hybrids) call
their linear-attention and causal-convolution functions through transformers' kernel fallback: the outside
package's kernels (flash-linear-attention's ``fla``, ``causal_conv1d``, ``mamba_ssm``) when transformers could
import them as the modeling module loaded and the inputs are on a device they support, else transformers' own
PyTorch reference, which is correct but runs the chunked delta rule as a loop of small PyTorch ops: on a GPU
many times slower than the Triton kernels, and it would keep the GPU waiting. On a CPU the reference is the
only path. `pip install --no-build-isolation -e '.[gpu]'` brings the kernels (pyproject.toml's ``gpu`` extra).

`kernels_in_use` says what a loaded model runs on its device (for the shard's metadata, the run log and the
report); `fast_kernel_warning` decides the warning from the device type and what transformers found, so it is
tested without a GPU. The private parts of transformers are read in `hsx_dagster.core.model.transformers_internals`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

import torch

from hsx_dagster.core.model.transformers_internals import KernelFallback, kernel_fallbacks, package_distribution

# What each kernel package does for the model, in words; a package not listed is named as it is.
ROLES = {"fla": "linear attention", "causal_conv1d": "causal conv1d", "mamba_ssm": "Mamba scan"}
INSTALL_HINT = (
    "pip install --no-build-isolation {packages}  (in a checkout: pip install --no-build-isolation -e '.[gpu]')"
)


@dataclass(frozen=True)
class KernelUse:
    """What one kernel package's functions run for a loaded model on its device."""

    role: str  # linear attention, causal conv1d, ...
    distribution: str  # its pip name
    fast: bool  # the package's kernels run (False: transformers' PyTorch reference path)
    functions: tuple[str, ...]  # module.name of every function that runs
    why: str  # why the reference path runs ("" when fast)

    def summary(self) -> str:
        """``flash-linear-attention (chunk_gated_delta_rule, ...)`` or ``PyTorch reference path (...; why)``."""
        runs = ", ".join(name.rsplit(".", 1)[-1] for name in self.functions)
        if self.fast:
            return f"{self.distribution} ({runs})"
        return f"PyTorch reference path ({runs}; {self.why})"

    def describe(self) -> str:
        return f"{self.role}: {self.summary()}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "functions": list(self.functions)}


def _modules(model_or_classes: torch.nn.Module | Iterable[type]) -> list[ModuleType]:
    """The transformers modules that define ``model``'s classes (or the given classes), each once."""
    if isinstance(model_or_classes, torch.nn.Module):
        classes: Iterable[type] = (type(module) for module in model_or_classes.modules())
    else:
        classes = model_or_classes
    names = dict.fromkeys(c.__module__ for c in classes if c.__module__.startswith("transformers."))
    return [sys.modules[name] for name in names if name in sys.modules]


def fallbacks_by_package(model_or_classes: torch.nn.Module | Iterable[type]) -> dict[str, list[KernelFallback]]:
    """Every kernel-fallback function of the modeling code, grouped by the package it wants."""
    grouped: dict[str, list[KernelFallback]] = {}
    for module in _modules(model_or_classes):
        for fallback in kernel_fallbacks(module):
            grouped.setdefault(fallback.package, []).append(fallback)
    return grouped


def _role_order(item: tuple[str, Any]) -> tuple[int, str]:
    """Linear attention first, then the convolution, then anything else by name."""
    order = list(ROLES)
    return (order.index(item[0]) if item[0] in order else len(order), item[0])


def _name(function: Any) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


def kernels_in_use(model: torch.nn.Module, device: torch.device | str) -> tuple[KernelUse, ...]:
    """For every kernel package ``model``'s code can use: what its functions run with inputs on ``device``
    (empty for a model with no such function: a dense transformer)."""
    device_type = torch.device(device).type
    uses = []
    for package, fallbacks in sorted(fallbacks_by_package(model).items(), key=_role_order):
        running = [fallback.runs(device_type) for fallback in fallbacks]
        fast = all(f.imported and run is f.implementation for run, f in zip(running, fallbacks))
        distribution = package_distribution(package)
        if fast:
            why = ""
        elif device_type == "cpu":
            why = "the only path on a CPU"
        elif not all(fallback.imported for fallback in fallbacks):
            why = f"{distribution} is not installed"
        else:
            why = f"{distribution} does not run on {device_type}"
        uses.append(KernelUse(ROLES.get(package, package), distribution, fast, tuple(map(_name, running)), why))
    return tuple(uses)


def describe_kernels(attention: str, uses: Iterable[KernelUse]) -> str:
    """One line: the attention implementation, then what each kernel package runs."""
    return "; ".join([f"attention: {attention}", *(use.describe() for use in uses)])


def kernels_record(attention: str, uses: Iterable[KernelUse]) -> dict[str, Any]:
    """The same, for complete.json's ``last_run``."""
    return {"attention": attention, "linear_attention": [use.to_dict() for use in uses]}


def fast_kernel_warning(device_type: str, found: Mapping[str, bool], model: str = "the target") -> str | None:
    """The warning for a run on ``device_type`` of a model whose code can use the kernel packages in ``found``
    (package -> whether transformers imported it), or None when nothing is missing. Only CUDA is warned about:
    on a CPU the PyTorch path is the only one, and other devices have their own kernels or none."""
    if device_type != "cuda":
        return None
    missing = sorted(package_distribution(package) for package, imported in found.items() if not imported)
    if not missing:
        return None
    roles = ", ".join(sorted({ROLES.get(p, p) for p, imported in found.items() if not imported}))
    return (
        f"{model} has layers whose {roles} would run on transformers' PyTorch reference path on this GPU, "
        f"correct but many times slower than their kernels, because {', '.join(missing)} "
        f"{'is' if len(missing) == 1 else 'are'} not importable here. Install them next to the CUDA build of "
        f"torch, then start the run again: {INSTALL_HINT.format(packages=' '.join(missing))}"
    )


def kernel_packages_found(model_class: type) -> dict[str, bool]:
    """For the modeling code of ``model_class`` (before any weight loads): each kernel package it can use and
    whether transformers imported it."""
    return {
        package: all(f.imported for f in fallbacks)
        for package, fallbacks in fallbacks_by_package([model_class]).items()
    }
