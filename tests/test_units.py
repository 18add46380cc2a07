"""Sizes given on the command line (`--max-shard-size`)."""

import pytest

from qcompile.units import parse_bytes


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("20kB", 20_000),
        ("1.5 GB", 1_500_000_000),
        ("2GiB", 2 * 2**30),
        ("512mib", 512 * 2**20),
        ("1000", 1000),
        ("7B", 7),
    ],
)
def test_parse_bytes(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["", "GB", "5XB", "-1GB", "0", "0.1B", "5 G B"])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError, match="size|byte"):
        parse_bytes(text)
