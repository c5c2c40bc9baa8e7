"""Where specserve keeps files it builds or converts: $SPECSERVE_CACHE_DIR, else ~/.cache/specserve."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("SPECSERVE_CACHE_DIR") or Path.home() / ".cache" / "specserve")
