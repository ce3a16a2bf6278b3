"""Whether a shard's chunk files are written with O_DIRECT (atomic.py), from `extraction.direct_io`.

A buffered write copies every byte into the page cache and has the kernel write it back later; a direct write hands
the staging ring's pages to the disk, so the host copies nothing (measured: docs/benchmarks.md#direct-writes).
``on`` asks for it everywhere (a file system that refuses it, tmpfs for one, gets buffered writes, and the run's
metadata says so); ``off`` never; ``auto`` on the local block file systems where it was measured to pay (ext4, xfs),
buffered on the others (network, FUSE and overlay file systems, and btrfs, whose checksummed direct writes are a
path of their own).
"""

from __future__ import annotations

import typing
from pathlib import Path

from hsx_dagster.core.settings.choices import DirectIo
from hsx_dagster.core.storage.atomic import O_DIRECT

DIRECT_IO_CHOICES: tuple[str, ...] = typing.get_args(DirectIo)
DIRECT_FILESYSTEMS = ("ext4", "xfs")
MOUNTINFO = Path("/proc/self/mountinfo")


def filesystem_type(path: Path) -> str:
    """The type of the file system ``path`` is on (the longest mount point holding it), "unknown" where Linux's
    mount table cannot be read."""
    target = Path(path).resolve()
    best, kind = "", "unknown"
    try:
        lines = MOUNTINFO.read_text(encoding="utf-8").splitlines()
    except OSError:
        return kind
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        mount_point = fields[4].replace("\\040", " ")
        kind_here = fields[fields.index("-") + 1]
        inside = target == Path(mount_point) or Path(mount_point) in target.parents
        if inside and len(mount_point) >= len(best):
            best, kind = mount_point, kind_here
    return kind


def choose_direct(setting: str, folder: Path) -> tuple[bool, str]:
    """Whether to ask for direct writes into ``folder``, and why in words (for the run's metadata)."""
    if setting not in DIRECT_IO_CHOICES:
        raise ValueError(f"extraction.direct_io must be one of {DIRECT_IO_CHOICES}, not {setting!r}")
    if not O_DIRECT:
        return False, "buffered (no O_DIRECT on this platform)"
    if setting == "off":
        return False, "buffered (direct_io: off)"
    if setting == "on":
        return True, "direct (direct_io: on)"
    kind = filesystem_type(folder)
    if kind in DIRECT_FILESYSTEMS:
        return True, f"direct (direct_io: auto, {kind})"
    return False, f"buffered (direct_io: auto, {kind}: direct writes are used on {', '.join(DIRECT_FILESYSTEMS)})"
