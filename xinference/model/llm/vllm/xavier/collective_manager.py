"""Rank registry and rank 0 of Xinference's Xavier contract (supervisor / worker pools).

Imported by Xinference's supervisor at every start: xoscar only, no torch,
no vLLM.  This module currently fixes the contract surface (class names,
uids, constructor arguments); world distribution and recovery are issue #6
and are not implemented yet.
"""

from __future__ import annotations

from typing import Any, Dict

import xoscar as xo


class Rank0ModelActor(xo.StatelessActor):
    """Rank 0: a thin coordinator in a GPU-less subpool (uid ``"<model_uid>-rank0"``)."""

    @classmethod
    def default_uid(cls) -> str:
        return "rank0-model-actor"

    def __init__(self, xavier_config: Dict[str, Any]) -> None:
        super().__init__()
        self._xavier_config = dict(xavier_config)


class CollectiveManager(xo.StatelessActor):
    """Rank registry of one Xavier model (uid ``f"{default_uid()}-{model_uid}"``)."""

    @classmethod
    def default_uid(cls) -> str:
        return "xavier-collective-manager"

    def __init__(self, model_uid: str) -> None:
        super().__init__()
        self._model_uid = model_uid
