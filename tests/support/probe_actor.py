"""An actor that reports, from inside its (sub)pool process, what the overlay serves."""

from __future__ import annotations

import os
import sys
from typing import Dict

import xoscar as xo


class OverlayProbeActor(xo.StatelessActor):
    def where(self) -> Dict[str, object]:
        import xinference.model.llm.vllm.xavier as xavier
        import xinference.model.llm.vllm.xavier.transport as transport

        return {"pid": os.getpid(), "package": xavier.__file__, "transport": transport.__file__,
                "fork": getattr(xavier, "XAVIER_FORK", False),
                "overlay_active": any(getattr(f, "__name__", "") == "XavierOverlayFinder"
                                      for f in sys.meta_path)}
