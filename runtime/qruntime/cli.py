"""The `qruntime` command (`python -m qruntime`): argparse over the verbs in qruntime.commands
(run, pull) and qruntime.serve; each verb's options and work live in its own module.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from qruntime import __version__
from qruntime.commands.common import ARTIFACT_HELP, EXIT_ERROR, EXIT_INTERRUPTED, RunError
from qruntime.commands.pull import PULL_OUTPUT_HELP, PULL_REVISION_HELP, pull
from qruntime.commands.run import OPTIONS, PROMPT_HELP, options_from, run
from qruntime.serve import main as serve
from qruntime.serve.options import add_serve_parser, serve_options_from


def build_parser(prog: str = "qruntime") -> argparse.ArgumentParser:
    """The parser of every verb; `prog` names the command in usage lines (`qcompile serve` reuses it)."""
    parser = argparse.ArgumentParser(prog=prog, description="Run qcompile artifacts with the qruntime engine.")
    parser.add_argument("--version", action="version", version=f"qruntime {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    sub = verbs.add_parser(
        "run",
        help="Generate text from an artifact (streamed), then print timings.",
        description="Generate text for PROMPT from the artifact ART: the text streams to stdout, the load line and "
        "a summary (token counts, TTFT, TPOT, tokens/s, finish reason) go to stderr. "
        "Errors print one line and exit 1; Ctrl-C exits 130.",
    )
    sub.add_argument("artifact", metavar="ART", help=ARTIFACT_HELP)
    sub.add_argument("prompt", metavar="PROMPT", help=PROMPT_HELP)
    for o in OPTIONS:
        if o.type is None:
            sub.add_argument(o.flag, dest=o.dest, action="store_true", help=o.help)
        else:
            action = "append" if o.repeat else "store"
            sub.add_argument(o.flag, dest=o.dest, type=o.type, action=action, metavar=o.metavar, help=o.help)
    sub = verbs.add_parser(
        "pull",
        help="Download an artifact from the Hugging Face Hub and verify every file.",
        description="Download the artifact URL (hf://namespace/name[@revision]) and check every file against "
        "the sha256 in its manifest; with -o it appears at DIR only once it has verified. The token is "
        "huggingface_hub's (HF_TOKEN or `hf auth login`), needed for private repos only.",
    )
    sub.add_argument("url", metavar="URL", help="hf://namespace/name[@revision]")
    sub.add_argument("-o", "--output", metavar="DIR", help=PULL_OUTPUT_HELP)
    sub.add_argument("--revision", metavar="REV", help=PULL_REVISION_HELP)
    sub.add_argument("-q", "--quiet", action="store_true", help="No progress bars.")
    add_serve_parser(verbs)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "qruntime") -> int:
    """`qruntime run ...` / `qruntime pull ...`; returns the exit code (0, 1 for an error, 130 on Ctrl-C, 2 for bad usage)."""
    try:
        args = build_parser(prog).parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse has already printed
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    for stream in (sys.stdout, sys.stderr):  # generated text may hold characters the terminal cannot show
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    try:
        if args.verb == "pull":
            print(pull(args.url, args.output, args.revision, args.quiet))
        elif args.verb == "serve":
            serve(serve_options_from(vars(args)))
        else:
            run(options_from(vars(args)))
    except RunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0
