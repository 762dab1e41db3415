"""The worker half of the connector without a data plane (its KV caches could not be
shared): every load it is handed is reported failed AND finished, so vLLM recomputes the
blocks and no request waits for a load that never comes."""

import numpy as np

from xinference.model.llm.vllm.xavier.planning.load_batch import BlockLoad, LoadBatch
from xinference.model.llm.vllm.xavier.planning.step_meta import StepMeta
from xinference.model.llm.vllm.xavier.vllm_side.actor_bridge import ActorBridge
from xinference.model.llm.vllm.xavier.vllm_side.connector_worker import XavierConnectorWorker

from .kvfixtures import opts


def test_loads_without_a_data_plane_are_failed_and_finished_once():
    worker = XavierConnectorWorker(opts(), ActorBridge.shared(), [["l0"]], 8)
    assert worker.plane is None
    batch = LoadBatch.from_requests([("a", [BlockLoad(0, 1, 2, 0, 5, 3)]), ("b", [])])
    worker.fail_loads(StepMeta(batch, failed_dests=(6,)))
    assert worker.finished_loads() == (None, {"a", "b"})
    assert worker.take_load_errors() == {3, 6}
    assert worker.finished_loads() == (None, None) and worker.take_load_errors() == set()
    worker.start_loads(StepMeta(LoadBatch(("c",), np.zeros(2, np.int64),
                                          np.zeros((0, 8), np.int64))))
    assert worker.finished_loads() == (None, {"c"})


def test_a_change_of_local_publication_reaches_the_plane_even_with_no_rows():
    """The scheduler's ``in_place_local`` changes in a step with no newly full block: the
    plane still hears of it (its publisher switches in order), once; a step that changes
    nothing and has no rows is not passed on."""
    worker = XavierConnectorWorker(opts(), ActorBridge.shared(), [["l0"]], 8)
    calls = []

    class Plane:
        def publish_in_place(self, rows, local=False):
            calls.append((tuple(rows), local))

    worker.plane = Plane()
    row = (0, 12345, 3, 1)
    worker.export(StepMeta(in_place=(row,)))
    worker.export(StepMeta(in_place_local=True))  # the whole launch: no rows this step
    worker.export(StepMeta(in_place_local=True))  # nothing new
    worker.export(StepMeta(in_place=(row,), in_place_local=True))
    worker.export(StepMeta())  # back: a replica of another host joined
    assert calls == [((row,), False), ((), True), ((row,), True), ((), False)]
