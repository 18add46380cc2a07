"""`qruntime serve` flags that only change how the engine is loaded reach qruntime.load."""

from __future__ import annotations

import argparse
import io

import pytest
import qruntime
from qruntime.serve import server
from qruntime.serve.options import add_serve_parser, serve_options_from


def test_serve_takes_prologue_folds_as_an_opt_in_and_hands_them_to_load(monkeypatch):
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="verb"))
    parse = lambda *argv: serve_options_from(vars(parser.parse_args(["serve", "ART", *argv])))  # noqa: E731
    assert parse().prologue_folds is False
    seen: list[dict] = []

    def load(**kwargs):
        seen.append(kwargs)
        raise ValueError("not loaded in this test")

    monkeypatch.setattr(qruntime, "load", load)
    for argv, want in (((), False), (("--prologue-folds",), True)):
        options = parse("--engine", "thread", "--port", "0", *argv)
        with pytest.raises(server.RunError, match="not loaded in this test"):
            server.serve(options, io.StringIO())
        assert seen[-1]["prologue_folds"] is want
