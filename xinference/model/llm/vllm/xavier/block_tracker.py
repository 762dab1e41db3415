"""The block directory actor (supervisor pool).

Imported by Xinference's supervisor at every start: xoscar only, no torch,
no vLLM.  This module currently fixes the contract surface that Xinference
3.5.0 core relies on (class name, ``default_uid()``, no-argument constructor);
the directory itself (register / query with leases / purge a rank) is issue
#4 and is not implemented yet.
"""

from __future__ import annotations

import xoscar as xo


class VLLMBlockTracker(xo.StatelessActor):
    """Block hash -> (rank, tier, slot) directory of one Xavier model.

    Created by the supervisor with uid ``f"{default_uid()}-{model_uid}"`` and
    no constructor arguments.
    """

    @classmethod
    def default_uid(cls) -> str:
        return "vllm-block-tracker-actor"

    def __init__(self) -> None:
        super().__init__()
