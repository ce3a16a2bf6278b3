"""Extraction: the target's truncated backbone, batch planning, the engine, devices and one shard run end to end."""

from typing import TYPE_CHECKING

from hsx_dagster.core.public_api import lazy_exports

if TYPE_CHECKING:
    from hsx_dagster.core.extraction.backbone import (
        Backbone as Backbone,
        BackboneError as BackboneError,
        BackboneInfo as BackboneInfo,
        attention_support as attention_support,
        decoder_layers as decoder_layers,
        load_backbone as load_backbone,
        load_text_decoder as load_text_decoder,
        resolve_attn_implementation as resolve_attn_implementation,
        text_model_class as text_model_class,
    )
    from hsx_dagster.core.extraction.batch_run import run_batch as run_batch
    from hsx_dagster.core.extraction.batch_shape import (
        BUDGET_FRACTION as BUDGET_FRACTION,
        WINDOW as WINDOW,
        BatchShaper as BatchShaper,
    )
    from hsx_dagster.core.extraction.batch_shape_space import start_shape as start_shape
    from hsx_dagster.core.extraction.batch_shape_summary import (
        Shape as Shape,
        probe_table_markdown as probe_table_markdown,
        shape_label as shape_label,
    )
    from hsx_dagster.core.extraction.batching import (
        LengthOrder as LengthOrder,
        padding_efficiency as padding_efficiency,
        plan_batches as plan_batches,
    )
    from hsx_dagster.core.extraction.devices import (
        DeviceBusyError as DeviceBusyError,
        DeviceClaimError as DeviceClaimError,
        candidate_devices as candidate_devices,
        claim_device as claim_device,
        claim_scheduled_device as claim_scheduled_device,
        claimed_device as claimed_device,
        physical_gpu_id as physical_gpu_id,
    )
    from hsx_dagster.core.extraction.disk_reservations import (
        RESERVATIONS_DIR as RESERVATIONS_DIR,
        pending_writes as pending_writes,
        reserve as reserve,
    )
    from hsx_dagster.core.extraction.engine import (
        ExtractionReport as ExtractionReport,
        extract_shard as extract_shard,
    )
    from hsx_dagster.core.extraction.host_share import HostShare as HostShare, usable_cores as usable_cores
    from hsx_dagster.core.extraction.kernels import (
        INSTALL_HINT as INSTALL_HINT,
        KernelUse as KernelUse,
        describe_kernels as describe_kernels,
        fast_kernel_warning as fast_kernel_warning,
        kernel_packages_found as kernel_packages_found,
        kernels_in_use as kernels_in_use,
    )
    from hsx_dagster.core.extraction.progress import BatchCostModel as BatchCostModel, Progress as Progress
    from hsx_dagster.core.extraction.shard_run import (
        ShardJob as ShardJob,
        ShardResult as ShardResult,
        resolve_compute_dtype as resolve_compute_dtype,
        run_shard as run_shard,
    )
    from hsx_dagster.core.extraction.size_estimate import (
        InsufficientDiskError as InsufficientDiskError,
        StoredShape as StoredShape,
        check_free_disk as check_free_disk,
        estimate_by_dtype as estimate_by_dtype,
        estimate_bytes as estimate_bytes,
    )
    from hsx_dagster.core.extraction.timing import Lap as Lap, LapTimer as LapTimer

EXPORTS = {
    "backbone": [
        "Backbone",
        "BackboneError",
        "BackboneInfo",
        "attention_support",
        "decoder_layers",
        "load_backbone",
        "load_text_decoder",
        "resolve_attn_implementation",
        "text_model_class",
    ],
    "batch_shape": ["BUDGET_FRACTION", "BatchShaper", "WINDOW"],
    "batch_shape_space": ["start_shape"],
    "batch_shape_summary": ["Shape", "probe_table_markdown", "shape_label"],
    "batching": ["LengthOrder", "padding_efficiency", "plan_batches"],
    "devices": [
        "DeviceBusyError",
        "DeviceClaimError",
        "candidate_devices",
        "claim_device",
        "claim_scheduled_device",
        "claimed_device",
        "physical_gpu_id",
    ],
    "disk_reservations": ["RESERVATIONS_DIR", "pending_writes", "reserve"],
    "batch_run": ["run_batch"],
    "engine": ["ExtractionReport", "extract_shard"],
    "host_share": ["HostShare", "usable_cores"],
    "kernels": [
        "INSTALL_HINT",
        "KernelUse",
        "describe_kernels",
        "fast_kernel_warning",
        "kernel_packages_found",
        "kernels_in_use",
    ],
    "progress": ["BatchCostModel", "Progress"],
    "shard_run": ["ShardJob", "ShardResult", "resolve_compute_dtype", "run_shard"],
    "size_estimate": ["InsufficientDiskError", "StoredShape", "check_free_disk", "estimate_by_dtype", "estimate_bytes"],
    "timing": ["Lap", "LapTimer"],
}
if not TYPE_CHECKING:  # for mypy, the imports above are the package's names
    __all__, __getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
