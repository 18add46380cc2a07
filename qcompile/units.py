"""Human-readable numbers for CLI output (decimal units, as model cards and disks use)."""

import re


def human_count(n: int) -> str:
    """1720000000 -> '1.72B'."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def human_bytes(nbytes: int) -> str:
    """3440000000 -> '3.44 GB'."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BYTE_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'5GB' -> 5000000000, '512MiB' -> 536870912, '1000' -> 1000 (decimal units as Hugging Face's
    max_shard_size, binary with an i); raises ValueError for anything else or less than one byte."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BYTE_UNITS:
        raise ValueError(f"{text!r} is not a size like 5GB, 500MB, 2GiB or a number of bytes")
    size = int(float(match.group(1)) * _BYTE_UNITS[unit])
    if size < 1:
        raise ValueError(f"{text!r} is less than one byte")
    return size
