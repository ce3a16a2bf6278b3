"""Extraction: the target's truncated backbone, batch planning, the engine, devices and one shard run end to end."""

from typing import TYPE_CHECKING

from hsx_dagster.core.public_api import lazy_exports

if TYPE_CHECKING:
    from hsx_dagster.core.extraction.backbone import (
        Backbone as Backbone,
    )
    from hsx_dagster.core.extraction.backbone import (
        BackboneError as BackboneError,
    )
    from hsx_dagster.core.extraction.backbone import (
        BackboneInfo as BackboneInfo,
    )
    from hsx_dagster.core.extraction.backbone import (
        attention_support as attention_support,
    )
    from hsx_dagster.core.extraction.backbone import (
        decoder_layers as decoder_layers,
    )
    from hsx_dagster.core.extraction.backbone import (
        load_backbone as load_backbone,
    )
    from hsx_dagster.core.extraction.backbone import (
        load_text_decoder as load_text_decoder,
    )
    from hsx_dagster.core.extraction.backbone import (
        resolve_attn_implementation as resolve_attn_implementation,
    )
    from hsx_dagster.core.extraction.backbone import (
        text_model_class as text_model_class,
    )
    from hsx_dagster.core.extraction.batch_shape import (
        BUDGET_FRACTION as BUDGET_FRACTION,
    )
    from hsx_dagster.core.extraction.batch_shape import (
        WINDOW as WINDOW,
    )
    from hsx_dagster.core.extraction.batch_shape import (
        BatchShaper as BatchShaper,
    )
    from hsx_dagster.core.extraction.batch_shape_space import start_shape as start_shape
    from hsx_dagster.core.extraction.batch_shape_summary import (
        Shape as Shape,
    )
    from hsx_dagster.core.extraction.batch_shape_summary import (
        probe_table_markdown as probe_table_markdown,
    )
    from hsx_dagster.core.extraction.batch_shape_summary import (
        shape_label as shape_label,
    )
    from hsx_dagster.core.extraction.batching import (
        LengthOrder as LengthOrder,
    )
    from hsx_dagster.core.extraction.batching import (
        padding_efficiency as padding_efficiency,
    )
    from hsx_dagster.core.extraction.batching import (
        plan_batches as plan_batches,
    )
    from hsx_dagster.core.extraction.devices import (
        DeviceBusyError as DeviceBusyError,
    )
    from hsx_dagster.core.extraction.devices import (
        DeviceClaimError as DeviceClaimError,
    )
    from hsx_dagster.core.extraction.devices import (
        candidate_devices as candidate_devices,
    )
    from hsx_dagster.core.extraction.devices import (
        claim_device as claim_device,
    )
    from hsx_dagster.core.extraction.devices import (
        claim_scheduled_device as claim_scheduled_device,
    )
    from hsx_dagster.core.extraction.devices import (
        claimed_device as claimed_device,
    )
    from hsx_dagster.core.extraction.devices import (
        physical_gpu_id as physical_gpu_id,
    )
    from hsx_dagster.core.extraction.disk_reservations import (
        RESERVATIONS_DIR as RESERVATIONS_DIR,
    )
    from hsx_dagster.core.extraction.disk_reservations import (
        pending_writes as pending_writes,
    )
    from hsx_dagster.core.extraction.disk_reservations import (
        reserve as reserve,
    )
    from hsx_dagster.core.extraction.engine import (
        ExtractionReport as ExtractionReport,
    )
    from hsx_dagster.core.extraction.engine import (
        extract_shard as extract_shard,
    )
    from hsx_dagster.core.extraction.engine import (
        run_batch as run_batch,
    )
    from hsx_dagster.core.extraction.host_share import HostShare as HostShare
    from hsx_dagster.core.extraction.host_share import usable_cores as usable_cores
    from hsx_dagster.core.extraction.kernels import (
        INSTALL_HINT as INSTALL_HINT,
    )
    from hsx_dagster.core.extraction.kernels import (
        KernelUse as KernelUse,
    )
    from hsx_dagster.core.extraction.kernels import (
        describe_kernels as describe_kernels,
    )
    from hsx_dagster.core.extraction.kernels import (
        fast_kernel_warning as fast_kernel_warning,
    )
    from hsx_dagster.core.extraction.kernels import (
        kernel_packages_found as kernel_packages_found,
    )
    from hsx_dagster.core.extraction.kernels import (
        kernels_in_use as kernels_in_use,
    )
    from hsx_dagster.core.extraction.progress import BatchCostModel as BatchCostModel
    from hsx_dagster.core.extraction.progress import Progress as Progress
    from hsx_dagster.core.extraction.shard_run import (
        ShardJob as ShardJob,
    )
    from hsx_dagster.core.extraction.shard_run import (
        ShardResult as ShardResult,
    )
    from hsx_dagster.core.extraction.shard_run import (
        resolve_compute_dtype as resolve_compute_dtype,
    )
    from hsx_dagster.core.extraction.shard_run import (
        run_shard as run_shard,
    )
    from hsx_dagster.core.extraction.size_estimate import (
        InsufficientDiskError as InsufficientDiskError,
    )
    from hsx_dagster.core.extraction.size_estimate import (
        StoredShape as StoredShape,
    )
    from hsx_dagster.core.extraction.size_estimate import (
        check_free_disk as check_free_disk,
    )
    from hsx_dagster.core.extraction.size_estimate import (
        estimate_by_dtype as estimate_by_dtype,
    )
    from hsx_dagster.core.extraction.size_estimate import (
        estimate_bytes as estimate_bytes,
    )
    from hsx_dagster.core.extraction.timing import Lap as Lap
    from hsx_dagster.core.extraction.timing import LapTimer as LapTimer

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
    "engine": ["ExtractionReport", "extract_shard", "run_batch"],
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
