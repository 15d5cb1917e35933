"""Running a command-line tool with absl flags."""
from __future__ import annotations

import sys
from typing import Callable

from absl import app

_HELP = ("--help", "--helpshort", "--helpfull", "-?")


def run(main: Callable[[list[str]], int | None]) -> None:
    """``absl.app.run(main)``, exiting with ``main``'s return value; asking for help
    (``--helpshort`` and the like) exits 0, not absl's 1, since nothing failed."""
    try:
        app.run(lambda argv: sys.exit(main(argv)))
    except SystemExit as e:
        if e.code == 1 and any(a in _HELP for a in sys.argv[1:]):
            sys.exit(0)
        raise
