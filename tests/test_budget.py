import pytest

from xinference.model.llm.vllm.xavier.planning.budget import parse_bytes, validate_budget


@pytest.mark.parametrize("value, expected", [
    (1024, 1024), ("1024", 1024), ("256MiB", 256 * 2**20), ("256 mib", 256 * 2**20),
    ("1.5GiB", 3 * 2**29), ("2G", 2 * 2**30), ("10KB", 10_000), ("1e6", 10**6), ("0", 0),
])
def test_parse(value, expected):
    assert parse_bytes("xavier_gpu_budget", value) == expected


@pytest.mark.parametrize("value, pattern", [
    ("lots", "is not a size"), ("-5MiB", "is not a size"), (-5, "non-negative"),
    ("5 parsecs", "unknown unit 'parsecs'"), (True, "expected a size"), (None, "expected a size"),
    (float("nan"), "non-negative"),
])
def test_parse_errors_name_the_option(value, pattern):
    with pytest.raises(ValueError, match=f"^xavier_gpu_budget: .*{pattern}"):
        parse_bytes("xavier_gpu_budget", value)


def test_validate():
    assert validate_budget("opt", "1MiB", 1000) == 1_048_000  # whole blocks
    assert validate_budget("opt", 0, 1000, allow_zero=True) == 0
    with pytest.raises(ValueError, match=r"^opt: '100' \(100 bytes\) is smaller than one KV"):
        validate_budget("opt", "100", 1000)
    with pytest.raises(ValueError, match=r"^opt: '2GiB' .* exceeds the 1000000 bytes available"):
        validate_budget("opt", "2GiB", 1000, available_bytes=1_000_000)
