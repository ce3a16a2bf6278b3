"""Every use of transformers' private API, in one place: the seam an upgrade of transformers is checked at.

transformers says which attention implementations a model class runs only in underscored class
flags, and which one a loaded model uses only in ``config._attn_implementation``; neither has a
public accessor. The extraction reads them here (through `AttentionFlags` and
`attn_implementation_in_use`), before any weight loads, to pick the fastest implementation that
works and to report the one in use.

Hybrid models (Gated DeltaNet, Mamba) route their linear-attention and convolution functions through
``use_kernel_func_from_hub_with_fallback``: when the modeling module is imported it tries the outside
package (flash-linear-attention's ``fla``, ``causal_conv1d``, ``mamba_ssm``) and keeps its function, else
transformers' own PyTorch function; at each call, inputs on a device the package does not support go to
the PyTorch function. Which one was kept lives only in the wrapper's closure; `kernel_fallbacks` reads it.

`CHECKED_ON` lists the transformers releases these were checked on; hsx_dagster_tests/test_seams.py
fails naming this module when another release is installed (and checks the flags' meaning on real
model classes), so an upgrade is a conscious act: re-read the uses below against the new release,
then add its version. Imports nothing from transformers itself: the caller hands over the class or
the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

CHECKED_ON = ("5.25.0",)


@dataclass(frozen=True)
class AttentionFlags:
    """What a model class says it supports: sdpa, flash-attention, and which flash variants only."""

    name: str  # the class's name, for messages
    sdpa: bool
    flash: bool
    flash_variants: tuple[str, ...] | None = None  # None: every flash-attention variant the class supports

    @classmethod
    def of(cls, model_class: type) -> AttentionFlags:
        variants = getattr(model_class, "_compatible_flash_implementations", None)
        return cls(
            name=model_class.__name__,
            sdpa=bool(getattr(model_class, "_supports_sdpa", False)),
            flash=bool(getattr(model_class, "_supports_flash_attn", False)),
            flash_variants=tuple(variants) if variants is not None else None,
        )


def attn_implementation_in_use(model: Any) -> str | None:
    """The attention implementation a loaded model (or its config) runs, as transformers resolved it."""
    config = getattr(model, "config", model)
    return getattr(config, "_attn_implementation", None)


@dataclass(frozen=True)
class KernelFallback:
    """One function of a modeling module that transformers routes to an outside package's kernel when it can."""

    name: str  # the modeling module's attribute, e.g. torch_chunk_gated_delta_rule
    package: str  # the import name transformers tried, e.g. fla
    implementation: Callable  # what it kept when the module was imported: the package's function, or torch_function
    torch_function: Callable  # transformers' own PyTorch reference
    devices: tuple[str, ...] | None  # device types the package's function takes (None: every one)

    @property
    def imported(self) -> bool:
        """Whether transformers found the package's function (it was importable when the modeling module loaded)."""
        return self.implementation is not self.torch_function

    def runs(self, device_type: str) -> Callable:
        """What a call with inputs on ``device_type`` runs (the wrapper's own rule)."""
        if self.imported and (self.devices is None or device_type in self.devices):
            return self.implementation
        return self.torch_function


def _fallback_closure(function: Any) -> dict[str, Any] | None:
    """The closure of transformers' fallback wrapper, found through the ``kernels`` package's module wrapper
    (an nn.Module whose ``forward`` closes over ``func``) when that package is installed."""
    if isinstance(function, type) or not callable(function):
        return None
    for _ in range(4):
        if hasattr(function, "forward") and not hasattr(function, "__code__"):
            function = type(function).forward
        code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None)
        if code is None or not cells:
            return None
        closure = dict(zip(code.co_freevars, (cell.cell_contents for cell in cells)))
        if {"implementation", "torch_function", "package"} <= closure.keys():
            return closure
        function = closure.get("func")
    return None


def kernel_fallbacks(module: ModuleType) -> list[KernelFallback]:
    """Every function of a modeling module that transformers routes through its kernel fallback, in name order."""
    found = []
    for name in sorted(vars(module)):
        closure = _fallback_closure(vars(module)[name])
        if closure is not None:
            devices = closure.get("supported_devices")
            found.append(
                KernelFallback(
                    name=name,
                    package=str(closure["package"]),
                    implementation=closure["implementation"],
                    torch_function=closure["torch_function"],
                    devices=tuple(devices) if devices is not None else None,
                )
            )
    return found


def package_distribution(package: str) -> str:
    """The pip name of a kernel package transformers imports (fla -> flash-linear-attention)."""
    from transformers.integrations import hub_kernels

    names = getattr(hub_kernels, "_PACKAGE_TO_DISTRIBUTION", {})
    return str(names.get(package, package.replace("_", "-")))


def use_attn_implementation(config: Any, name: str) -> None:
    """Make the layers built from ``config`` run attention ``name`` (e.g. "eager"): a config has no public setter,
    only the private ``_attn_implementation`` its attention modules read at each forward."""
    config._attn_implementation = name
