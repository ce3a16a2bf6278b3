"""An export folder that a trainer never sees half-written, and that a re-run finishes.

Everything is written under ``.<name>.partial/`` beside the destination, each file atomically; the folder is renamed
to ``<name>`` once complete. A re-run with the same inputs keeps the files a crash left in the partial folder and
writes only the rest; with other inputs (another dataset, mapping or option) it starts that folder over. An older
complete export is replaced only once the new one is complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from hsx_dagster.core.storage.atomic import write_atomic
from hsx_dagster.core.storage.files import fsync_path

SPEC_FILE = ".hsx-export-spec.json"  # what the partial folder is being built from


class ExportFolder:
    def __init__(self, dest: Path, spec: dict[str, Any]) -> None:
        self.dest = Path(dest)
        self.partial = self.dest.with_name(f".{self.dest.name}.partial")
        self.spec = json.loads(json.dumps(spec, sort_keys=True))

    def complete(self) -> bool:
        """The destination is a complete export of the same inputs (nothing to do)."""
        return self._spec_of(self.dest) == self.spec

    def begin(self) -> Path:
        """The partial folder to write into: resumed when it was started from the same inputs, else fresh."""
        if self.partial.exists() and self._spec_of(self.partial) != self.spec:
            shutil.rmtree(self.partial)
        self.partial.mkdir(parents=True, exist_ok=True)
        if self._spec_of(self.partial) is None:
            write_atomic(self.partial / SPEC_FILE, json.dumps(self.spec, indent=2, sort_keys=True).encode())
        return self.partial

    def finish(self) -> Path:
        """Rename the partial folder into place (an older export is moved aside first, then deleted)."""
        old = self.dest.with_name(f".{self.dest.name}.old")
        if old.exists():
            shutil.rmtree(old)
        if self.dest.exists():
            os.replace(self.dest, old)
        os.replace(self.partial, self.dest)
        fsync_path(self.dest.parent)
        if old.exists():
            shutil.rmtree(old)
        return self.dest

    @staticmethod
    def _spec_of(folder: Path) -> dict[str, Any] | None:
        try:
            return json.loads((folder / SPEC_FILE).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return None
