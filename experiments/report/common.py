"""Number formatting the live experiments' sections share (:mod:`experiments.report.live_table1` and the
live fairness and validation sections, which reach it as ``experiments.live.common.fmt``)."""
from __future__ import annotations

import math


def fmt(x: float, digits: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"
