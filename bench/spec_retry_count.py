"""Issue-19 count: what a draft that is never right costs a speculating engine, in verifications and
synchronous steps (counts, the same on any host: the adaptive draft length's pauses decide them).

One engine per batch on ARTIFACT, speculative="prompt-lookup" with its proposer replaced by one whose
k drafts are never the model's next tokens (the last token plus 1, 2, ...; a model that predicts
exactly that gets them accepted, which the report shows as `accepted`), then one greedy generate()
of --max-tokens tokens a request (EOS ignored). Each step's `drafting` flag is recorded as the
engine launches it: a drafting step is synchronous, the others run ahead asynchronously.

    python bench/spec_retry_count.py ART --device cpu --out bench/results/spec_retry_count_<commit>_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from compile_bench import report_header


class NeverRight:
    """k drafts continuing the last token by +1, +2, ... (mod the vocabulary)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def propose(self, token_ids, k, request=None) -> tuple[int, ...]:
        return tuple((token_ids[-1] + 1 + i) % self.vocab for i in range(k))

    def forget(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass


def count(artifact: Path, device: str, batch: int, max_tokens: int, num_tokens: int) -> dict:
    import qruntime
    import torch
    from qruntime import SamplingParams, SpeculativeConfig

    dtype = torch.float32 if device == "cpu" else None
    engine = qruntime.load(artifact, device=device, dtype=dtype, speculative=SpeculativeConfig(num_tokens=num_tokens))
    try:
        engine.speculator.proposer = NeverRight(engine.vocab_size)
        launches, launch = [], engine._launch

        def spy(previous, read_previous=False, drafting=False):
            launches.append(drafting)
            return launch(previous, read_previous, drafting)

        engine._launch = spy
        prompts = [[(7 * b + i) % 100 + 3 for i in range(16)] for b in range(batch)]
        engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        stats = engine.speculative_stats
        return {
            "batch": batch, "tokens_per_request": max_tokens, "verifications": stats.verifications,
            "drafted": stats.drafted, "accepted": stats.accepted, "steps": len(launches),
            "synchronous_steps": sum(launches),
        }  # fmt: skip
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-tokens", type=int, default=4, help="the speculative config's k")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches takes comma-separated integers, got {args.batches!r}")
    if not batches or min(batches) < 1 or args.max_tokens < 1:
        parser.error("--batches and --max-tokens must be positive")
    report = report_header("spec_retry_count")
    report.update(artifact=str(args.artifact), device=args.device, num_tokens=args.num_tokens, rows=[])
    for batch in batches:
        report["rows"].append(count(args.artifact, args.device, batch, args.max_tokens, args.num_tokens))
        print(json.dumps(report["rows"][-1]), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
