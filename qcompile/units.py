"""Human-readable numbers for CLI output (decimal units, as model cards and disks use)."""


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
