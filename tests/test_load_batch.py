import numpy as np
import pytest

from xinference.model.llm.vllm.xavier.planning.load_batch import (
    COLUMNS,
    BlockLoad,
    LoadBatch,
    LoadBatchError,
    empty_batch,
)


def test_from_requests_round_trip():
    b = LoadBatch.from_requests([
        ("a", [BlockLoad(0, 11, 1, 0, 5, 7), BlockLoad(0, 12, 1, 0, 6, 8)]),
        ("b", []),
        ("c", [BlockLoad(1, 13, 2, 1, 0, 9, 4, 77)]),
    ])
    assert b.table.dtype == np.int64 and b.table.shape == (3, len(COLUMNS))
    assert b.offsets.tolist() == [0, 2, 2, 3]
    assert b.row_request_index().tolist() == [0, 0, 2]
    # the identity the directory promised (generation, incarnation) travels with the row
    assert b.rows_of("c").tolist() == [[1, 13, 2, 1, 0, 9, 4, 77]]
    assert b.rows_of("a")[:, 6:].tolist() == [[0, 0], [0, 0]]
    assert [s.request_ids for s in b.split()] == [("a",), ("b",), ("c",)]
    again = LoadBatch.concat(b.split())
    assert again.request_ids == b.request_ids
    assert np.array_equal(again.table, b.table) and np.array_equal(again.offsets, b.offsets)
    assert not b.table.flags.writeable


@pytest.mark.parametrize("col", range(len(COLUMNS)))
def test_negative_value_named(col):
    row = [0, 1, 1, 0, 1, 1, 1, 1]
    row[col] = -1
    with pytest.raises(LoadBatchError, match=f"^{COLUMNS[col]}: negative"):
        LoadBatch(("r",), np.array([0, 1]), np.array([row]))


def test_bad_inputs_named():
    with pytest.raises(LoadBatchError, match="^tier: unknown tier 7"):
        LoadBatch(("r",), np.array([0, 1]), np.array([[0, 1, 1, 7, 1, 1, 1, 1]]))
    with pytest.raises(LoadBatchError, match="^table: expected 8 columns"):
        LoadBatch(("r",), np.array([0, 1]), np.array([[0, 1, 1]]))
    with pytest.raises(LoadBatchError, match="^table: expected 8 columns"):  # no identity
        LoadBatch(("r",), np.array([0, 1]), np.array([[0, 1, 1, 0, 1, 1]]))
    with pytest.raises(LoadBatchError, match="^table: expected integer dtype"):
        LoadBatch(("r",), np.array([0, 1]), np.array([[0.0, 1, 1, 0, 1, 1, 1, 1]]))
    with pytest.raises(LoadBatchError, match="^offsets: expected 2 entries"):
        LoadBatch(("r",), np.array([0, 1, 1]), np.array([[0, 1, 1, 0, 1, 1, 1, 1]]))
    with pytest.raises(LoadBatchError, match="^offsets: must start at 0"):
        LoadBatch(("r", "s"), np.array([0, 2, 1]), np.array([[0, 1, 1, 0, 1, 1, 1, 1]]))
    with pytest.raises(LoadBatchError, match="^request_ids: duplicate"):
        LoadBatch(("r", "r"), np.array([0, 0, 0]), np.zeros((0, 8), np.int64))
    with pytest.raises(LoadBatchError, match="^table: value does not fit"):
        LoadBatch(("r",), np.array([0, 1]),
                  np.array([[0, 2**63, 1, 0, 1, 1, 1, 1]], dtype=np.uint64))


def test_empty():
    b = empty_batch()
    assert b.num_requests == 0 and b.num_rows == 0


def two_request_batch():
    return LoadBatch.from_requests([
        ("a", [BlockLoad(0, 1, 1, 0, 10, 100), BlockLoad(0, 2, 2, 0, 11, 101)]),
        ("b", [BlockLoad(0, 3, 2, 1, 12, 102)]),
    ])


def test_without_rows_keeps_requests_and_offsets_consistent():
    b = two_request_batch()
    out = b.without_rows(np.array([False, True, False]))
    assert out is not None and out.request_ids == ("a", "b")
    assert out.offsets.tolist() == [0, 1, 2] and out.table[:, 5].tolist() == [100, 102]
    assert b.without_rows(np.zeros(3, bool)) is b
    assert b.without_rows(np.ones(3, bool)) is None
