"""The one way benchmarks write their JSON results."""
from __future__ import annotations

import json
import os
from typing import Any


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """``obj`` as indented JSON at ``path``, atomically: written beside it, then renamed over
    it, so a run cut off at its time limit leaves the previous complete file, never half a new one."""
    tmp = os.fspath(path) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
