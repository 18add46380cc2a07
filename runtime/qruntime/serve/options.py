"""`qruntime serve`'s options: one frozen dataclass and its argparse subcommand (cheap to import:
`qruntime --help` needs neither torch nor the server framework)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from qruntime.commands.common import ARTIFACT_HELP, SPECULATIVE_HELP

API_KEY_ENV = "QRUNTIME_API_KEY"  # --api-key's default, so the key need not show in the process list


@dataclass(frozen=True)
class ServeOptions:
    """One server: what to load, how to size the engine, where to listen."""

    artifact: str
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    max_waiting: int = 256
    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int | None = None
    device: str | None = None
    dtype: str | None = None
    backend: str = "auto"
    prefix_cache: bool = True
    graph_capture: str = "first-use"
    launch_pacing: bool = False
    speculative: str | None = None
    threads: int | None = None
    engine: str = "process"
    verify: bool = False
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    log_format: str = "text"
    reasoning_parser: str | None = None
    api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = 4 << 20
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    limit_concurrency: int = 1024
    http: str = "auto"
    max_images_per_request: int = 16
    max_image_bytes: int = 16 << 20

    @property
    def model_name(self) -> str:
        """The id clients send as `model`: --served-model-name, else ART as given."""
        return self.served_model_name or self.artifact.rstrip("/") or self.artifact


def add_serve_parser(verbs: Any) -> None:
    """Add the `serve` verb to the CLI's subparsers."""
    sub = verbs.add_parser(
        "serve",
        help="Serve an artifact over an OpenAI-compatible HTTP API (needs the `serve` extra).",
        description="Serve the artifact ART over HTTP: POST /v1/completions and /v1/chat/completions (streamed "
        "with stream=true), GET /v1/models, /health and /metrics (Prometheus). Requests from all clients are "
        "batched together; SIGINT / SIGTERM stop accepting, let running requests finish for --shutdown-timeout "
        "seconds, then abort the rest. Needs `pip install 'qcompile-runtime[serve]'`.",
    )
    sub.add_argument("artifact", metavar="ART", help=ARTIFACT_HELP)
    add = sub.add_argument
    add("--host", default="127.0.0.1", help="Address to listen on (default 127.0.0.1; 0.0.0.0 for every interface).")
    add("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one, printed when ready).")
    add(
        "--served-model-name",
        metavar="NAME",
        help="The model id clients send and /v1/models lists (default ART as given).",
    )
    add(
        "--max-waiting",
        type=int,
        default=256,
        metavar="N",
        help="Sequences that may wait for admission; past it, 429 with Retry-After (default 256).",
    )
    add("--max-num-seqs", type=int, default=64, metavar="N", help="Sequences running at once in a batch (default 64).")
    add(
        "--max-model-len",
        type=int,
        metavar="LEN",
        help="Context length in tokens, prompt + output (default the model's, capped by the KV cache).",
    )
    add(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        metavar="N",
        help="Token budget of one step; longer prefills are chunked (default 2048).",
    )
    add(
        "--num-kv-blocks",
        type=int,
        metavar="N",
        help="KV-cache blocks (default: what the GPU has free / up to 512 MiB on CPU).",
    )
    add("--device", help="Torch device: cpu, cuda, cuda:1 ... (default cuda when available, else cpu).")
    add("--dtype", help="Compute dtype: bfloat16, float16 or float32 (default the model's).")
    add(
        "--backend",
        default="auto",
        choices=("auto", "reference", "triton"),
        help="Op backend (default auto: triton on CUDA, reference elsewhere).",
    )
    add(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        default=None,
        help="Turn automatic prefix caching off: by default the KV of full blocks is kept after a request ends "
        "and reused by requests whose prompts start with the same tokens (/metrics reports the hit rate).",
    )
    add(
        "--graph-capture",
        choices=("first-use", "load"),
        default=None,
        help="When the CUDA graphs are captured: first-use (default) captures none at start-up, so /health turns "
        "ready seconds sooner, and each one at the first step that needs it or while the server is idle (largest "
        "first); load captures all of them before the server is ready, so that no request waits for one.",
    )
    add(
        "--launch-pacing",
        dest="launch_pacing",
        action="store_true",
        default=None,
        help="Hold each step's launch until shortly before the step on the GPU ends (by the step times the engine "
        "measures), so that requests arriving meanwhile join it rather than the step after. Off by default: on "
        "an H200 it gave the first token sooner in one shared-prefix run of two, and later at 64 clients in both "
        "(docs/performance.md).",
    )
    add(
        "--speculative",
        metavar="SPEC",
        help=SPECULATIVE_HELP + " While on, the engine schedules synchronously, and requests with penalties, "
        "logit_bias, logprobs, structured output, a thinking cap or min_tokens not yet reached decode without "
        "drafts; /metrics reports the qruntime_spec_decode_* counts.",
    )
    add(
        "--threads",
        type=int,
        metavar="N",
        help="CPU threads of torch's ops (default torch's: one per core); on a shared CPU, fewer can be faster.",
    )
    add(
        "--engine",
        default="process",
        choices=("process", "thread"),
        help="Where the engine runs: in a process of its own (default), so that the HTTP side's Python work "
        "never holds up a step's, or on a thread of the server process (one process; for debugging and profiling).",
    )
    add(
        "--reasoning-parser",
        choices=("qwen3",),
        help="qwen3: chat replies return their <think>...</think> block apart from the answer, as "
        "`reasoning_content` (streamed as deltas too), as vLLM's parser of that name (default: the reply whole).",
    )
    add("--verify", action="store_true", help="Check every file's sha256 against the manifest before loading.")
    add(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="On SIGINT/SIGTERM, seconds running requests get to finish before they are aborted (default 30).",
    )
    add(
        "--api-key",
        metavar="KEY",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"Require `Authorization: Bearer KEY` on every /v1/* route (401 otherwise); /health and /metrics stay "
        f"open. Default: the {API_KEY_ENV} environment variable, else no key.",
    )
    add(
        "--max-body-bytes",
        type=int,
        default=4 << 20,
        metavar="N",
        help="Largest request body; a larger one is refused with 413 before it is read whole (default 4 MiB).",
    )
    add(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="Seconds a connection gets to send a request's headers, from connecting or from its last response; "
        "then it is closed (default 10).",
    )
    add(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="Seconds a request's body gets to arrive after its headers; then 408 (default 30).",
    )
    add(
        "--limit-concurrency",
        type=int,
        default=1024,
        metavar="N",
        help="Most open connections and requests at once; past it, new requests get 503 (default 1024).",
    )
    add(
        "--http",
        default="auto",
        choices=("auto", "httptools", "h11"),
        help="HTTP protocol implementation: httptools (C parser, the fast one) or h11 (pure Python); "
        "default auto: httptools when installed.",
    )
    add(
        "--max-images-per-request",
        type=int,
        default=16,
        metavar="N",
        help="Qwen3-VL models: most images one chat request may carry, as image_url parts with data URLs "
        "(data:image/png;base64,...; remote URLs and local files are refused); more is a 400 (default 16). "
        "A text-only model refuses every image.",
    )
    add(
        "--max-image-bytes",
        type=int,
        default=16 << 20,
        metavar="N",
        help="Qwen3-VL models: largest image, encoded (a data URL's base64 counted as the bytes it decodes to); "
        "larger is a 400 (default 16 MiB). The whole body stays within --max-body-bytes: raise it to send large "
        "images.",
    )
    add(
        "--log-format",
        default="text",
        choices=("text", "json"),
        help="Every log line (access lines, start-up and shutdown included) goes to stderr in this format: "
        "text (default) or json, one object a line (time, level, logger, message, an access line's fields).",
    )
    add(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="Server log level (default info: one line per request).",
    )


def serve_options_from(values: dict[str, Any]) -> ServeOptions:
    """ServeOptions from parsed values keyed by field name (None = not given: the default)."""
    names = {f.name for f in fields(ServeOptions)}
    return ServeOptions(**{k: v for k, v in values.items() if k in names and v is not None})
