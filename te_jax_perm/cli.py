"""Running a command-line tool with absl flags."""
from __future__ import annotations

import sys
from typing import Callable

from absl import app, flags

_HELP = ("--help", "--helpshort", "--helpfull", "-?")


def run(main: Callable[[list[str]], int | None]) -> None:
    """``absl.app.run(main)``, exiting with ``main``'s return value; asking for help
    (``--helpshort`` and the like) exits 0, not absl's 1, unless a flag beside it is bad."""
    asked_help = any(a in _HELP for a in sys.argv[1:])
    flags_ok = not asked_help or _flags_parse([a for a in sys.argv if a not in _HELP])
    try:
        app.run(lambda argv: sys.exit(main(argv)))
    except SystemExit as e:
        if e.code == 1 and asked_help and flags_ok:
            sys.exit(0)
        raise


def _flags_parse(argv: list[str]) -> bool:
    """Whether every flag given in ``argv`` is known and takes its value (a missing required
    flag does not count: asking for help is how one learns about it)."""
    for arg in argv[1:]:
        if not arg.startswith("--"):
            continue
        name, given, value = arg[2:].partition("=")
        if name not in flags.FLAGS:
            if name.startswith("no") and name[2:] in flags.FLAGS and flags.FLAGS[name[2:]].boolean:
                continue
            return False
        if given:
            try:
                flags.FLAGS[name].parser.parse(value)   # the parser alone: nothing is set yet
            except (flags.Error, ValueError):
                return False
    return True
