"""Where a running shard stands: what the extraction loop hands its progress callback.

The ETA is weighted by tokens, not samples: batches are cut longest first, so the first samples
carry far more tokens than the last, and a per-sample rate would overstate the time left several
times over at the start of a shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hsx_dagster.core.units import format_bytes, format_count, format_duration, format_rate, format_share


@dataclass(frozen=True)
class Progress:
    shard: str
    samples_done: int  # by this run
    samples_total: int  # this run's pending samples
    tokens_done: int
    tokens_total: int
    bytes_written: int  # committed to chunks so far by this run
    elapsed_s: float
    forward_s: float  # of elapsed_s, in the model's forward pass (measured batches)
    device: str
    samples_resumed: int = 0  # committed by earlier runs

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def forward_share(self) -> float:
        return min(self.forward_s / self.elapsed_s, 1.0) if self.elapsed_s > 0 else 0.0

    @property
    def fraction(self) -> float:
        """Share of this run's tokens done."""
        return self.tokens_done / self.tokens_total if self.tokens_total else 1.0

    @property
    def eta_s(self) -> float:
        rate = self.tokens_per_s
        return (self.tokens_total - self.tokens_done) / rate if rate > 0 else math.inf

    def line(self) -> str:
        """One complete sentence for the run log."""
        return (
            f"{self.shard}: {format_count(self.samples_done)} of {format_count(self.samples_total)} samples and "
            f"{format_share(self.fraction)} of the tokens done in {format_duration(self.elapsed_s)}, "
            f"{format_rate(self.tokens_per_s, 'tokens')}, {format_share(self.forward_share)} of the time in the "
            f"forward pass, {format_bytes(self.bytes_written)} committed; about {format_duration(self.eta_s)} left."
        )

    def metadata(self) -> dict[str, str]:
        """The figures as people read them, one entry per quantity (Dagster metadata, the report)."""
        entries = {
            "progress": f"{format_share(self.fraction)} of tokens",
            "samples": f"{format_count(self.samples_done)} of {format_count(self.samples_total)}",
            "tokens": f"{format_count(self.tokens_done)} of {format_count(self.tokens_total)}",
            "committed": format_bytes(self.bytes_written),
            "throughput": format_rate(self.tokens_per_s, "tokens"),
            "forward share": format_share(self.forward_share),
            "elapsed": format_duration(self.elapsed_s),
            "time left": format_duration(self.eta_s),
            "device": self.device,
        }
        if self.samples_resumed:
            entries["resumed"] = f"{format_count(self.samples_resumed)} samples committed by earlier runs"
        return entries
