"""``python -m hsx_dagster.core.export.speculators_train <speculators arguments>``: speculators' CLI with the ``hsx``
hidden-states backend registered (speculators discovers no plugins; the registry is read when its CLI imports)."""

from __future__ import annotations

import hsx_dagster.core.export.hs_backend  # noqa: F401  (registers --hidden-states-backend hsx)


def main() -> None:
    from speculators.__main__ import app

    app()


if __name__ == "__main__":
    main()
