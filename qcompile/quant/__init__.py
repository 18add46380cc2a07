"""Quantization schemes (typed values in a registry) and their math."""

from qcompile.quant.schemes import SCHEMES, QuantScheme, get_scheme

__all__ = ["SCHEMES", "QuantScheme", "get_scheme"]
