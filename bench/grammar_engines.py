"""Issue-18 measurement: the grammar engines for structured output, llguidance (what the runtime
uses) against xgrammar, on the host CPU, with a Qwen3-sized vocabulary.

The tokenizer is the one `qcompile synth PRESET` ships (byte-level BPE laid out as Qwen3's: 151,669
tokens for qwen3-8b; its merges are trained offline on the standard library, the rest are reserved
placeholders). For a typical JSON schema (an object of strings, an integer, a boolean, an array of
strings and a nested object), each engine:
  - compiles the schema (cold: a new compiler each time) and builds a matcher;
  - follows a valid document of the schema token by token: the mask of the next token's allowed
    tokens (a 32-bit-word bitmask, the layout both fill), then the token accepted — the work the
    engine's host does per constrained row and step. Every token must be allowed by the mask.

    python bench/grammar_engines.py --out bench/results/grammar_engines.json

xgrammar is not a dependency of the runtime: install it beside this script to compare
(`pip install xgrammar`); without it only llguidance is measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from compile_bench import report_header

from qcompile.synth.presets import get_preset
from qcompile.synth.tokenizer import TokenizerLayout, build_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city", "zip"],
        },
    },
    "required": ["name", "age", "email", "active", "tags", "address"],
}
DOCUMENT = {
    "name": "Margaret Hamilton of the Apollo guidance software team",
    "age": 38,
    "email": "margaret.hamilton@example.org",
    "active": True,
    "tags": ["software engineering", "apollo", "priority scheduling", "asynchronous executive", "1969"],
    "address": {"street": "75 Vassar Street, Building 20", "city": "Cambridge, Massachusetts", "zip": "02139"},
}


def _bits(mask: torch.Tensor, token: int) -> bool:
    return bool((int(mask.view(-1)[token // 32]) >> (token % 32)) & 1)


def llguidance_run(tokenizer_json: str, vocab: int, eos: int, tokens: list[int], repeats: int) -> dict:
    import llguidance
    import llguidance.torch as ltorch

    start = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    tokenizer_s = time.perf_counter() - start
    compile_s, per_token = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
        )
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_s.append(time.perf_counter() - start)
        mask = ltorch.allocate_token_bitmask(1, vocab)
        for token in tokens:
            start = time.perf_counter()
            ltorch.fill_next_token_bitmask(matcher, mask, 0)
            per_token.append(time.perf_counter() - start)
            if not _bits(mask, token) or not matcher.consume_token(token):
                raise AssertionError(f"llguidance refused token {token}: {matcher.get_error()}")
    return _summary(
        "llguidance",
        llguidance.__version__ if hasattr(llguidance, "__version__") else "",
        tokenizer_s,
        compile_s,
        per_token,
    )


def xgrammar_run(vocab_list: list[str], vocab: int, eos: int, tokens: list[int], repeats: int) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo(vocab_list, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=[eos])
    tokenizer_s = time.perf_counter() - start
    compile_s, per_token = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
            json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
        )
        matcher = xgr.GrammarMatcher(compiled)
        compile_s.append(time.perf_counter() - start)
        mask = xgr.allocate_token_bitmask(1, vocab)
        for token in tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            per_token.append(time.perf_counter() - start)
            if not _bits(mask, token) or not matcher.accept_token(token):
                raise AssertionError(f"xgrammar refused token {token}")
    return _summary("xgrammar", getattr(xgr, "__version__", ""), tokenizer_s, compile_s, per_token)


def _summary(engine: str, version: str, tokenizer_s: float, compile_s: list[float], per_token: list[float]) -> dict:
    ordered = sorted(per_token)
    row = {
        "engine": engine,
        "version": version,
        "tokenizer_build_ms": round(tokenizer_s * 1e3, 2),
        "compile_ms_median": round(statistics.median(compile_s) * 1e3, 3),
        "mask_us_mean": round(statistics.fmean(per_token) * 1e6, 1),
        "mask_us_p50": round(ordered[len(ordered) // 2] * 1e6, 1),
        "mask_us_p99": round(ordered[int(len(ordered) * 0.99)] * 1e6, 1),
        "masks": len(per_token),
    }
    row["batch64_ms_per_step"] = round(row["mask_us_mean"] * 64 / 1e3, 2)  # the engine fills rows one by one
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-8b")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    config = get_preset(args.preset).config()
    tokenizer = build_tokenizer(TokenizerLayout.from_config(config))
    vocab, eos = config["vocab_size"], config["eos_token_id"]
    text = json.dumps(DOCUMENT, separators=(",", ":"))
    tokens = tokenizer.encode(text, add_special_tokens=False).ids + [eos]
    by_id = {i: t for t, i in tokenizer.get_vocab(with_added_tokens=True).items()}
    vocab_list = [by_id.get(i, "") for i in range(vocab)]
    report = report_header("grammar_engines")
    if torch.cuda.is_available():  # a CPU measurement; the machine's GPU says which host it was
        report["machine"]["gpu"] = torch.cuda.get_device_name()
    report.update(
        preset=args.preset, vocab_size=vocab, tokenizer_tokens=tokenizer.get_vocab_size(), schema=SCHEMA,
        document_tokens=len(tokens), rows=[],
    )  # fmt: skip
    report["rows"].append(llguidance_run(tokenizer.to_str(), vocab, eos, tokens, args.repeats))
    try:
        report["rows"].append(xgrammar_run(vocab_list, vocab, eos, tokens, args.repeats))
    except ImportError as exc:
        print(f"xgrammar not measured: {exc}")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
