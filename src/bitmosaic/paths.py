"""Where bitmosaic keeps what it can recompute: ``$BITMOSAIC_CACHE``, else ``~/.cache/bitmosaic``."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_cache_root"]


def default_cache_root() -> Path:
    """``$BITMOSAIC_CACHE``, else ``~/.cache/bitmosaic``."""
    return Path(os.environ.get("BITMOSAIC_CACHE") or Path.home() / ".cache" / "bitmosaic")
