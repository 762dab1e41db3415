import pytest

from xinference.model.llm.vllm.xavier.transport import (
    get_xavier_transport_backend,
    normalize_xavier_transport_backend,
)


@pytest.mark.parametrize("value, expected", [
    (None, "xavier"), ("", "xavier"), ("  ", "xavier"), ("xavier", "xavier"), ("auto", "xavier"),
    ("IPC", "ipc"), ("cuda_ipc", "ipc"), ("nixl", "nixl")])
def test_normalize(value, expected):
    assert normalize_xavier_transport_backend(value) == expected


@pytest.mark.parametrize("value", ["rdma", 3])
def test_bad_value_names_the_option(value):
    with pytest.raises(ValueError, match="^vllm_transfer_backend_type: "):
        normalize_xavier_transport_backend(value)


def test_from_config_either_key():
    assert get_xavier_transport_backend(None) == "xavier"
    assert get_xavier_transport_backend({"transfer_backend_type": "nixl"}) == "nixl"
    assert get_xavier_transport_backend({"vllm_transfer_backend_type": "ipc",
                                         "transfer_backend_type": "nixl"}) == "ipc"
