"""``python -m ntk_service``: the ``ntk-service`` command line (``ntk_service.cli``), for environments without
the console script on PATH (a notebook's kernel, ``python -m`` in a container)."""

from __future__ import annotations

from ntk_service.cli import main

if __name__ == "__main__":
    main()
