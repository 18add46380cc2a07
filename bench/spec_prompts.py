"""spec_bench.py's prompts, from held-out text: the standard library modules that
examples/train_small_qwen3.py never trains on (HELDOUT_MODULES), read whole from a stdlib directory.

  free  each prompt is the start of a held-out module (then its next window, past the last module);
  edit  a held-out function, EDIT_MARKER, and the function's first line: a base LM continues by
        copying the function, so the output repeats much of the prompt.
"""

from __future__ import annotations

import ast
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import train_small_qwen3 as trainer  # noqa: E402 -- examples/ is scripts, not a package

EDIT_MARKER = "\n# the same function again, with the variable renamed:\n"
TASKS = ("free", "edit")


def heldout_sources(root: Path) -> list[str]:
    """The whole source of each held-out module found under root, in HELDOUT_MODULES' order."""
    paths = [root / f"{name}.py" for name in trainer.HELDOUT_MODULES]
    sources = [p.read_bytes().decode("utf-8", errors="replace") for p in paths if p.is_file()]
    if not sources:
        raise SystemExit(f"{root}: none of the held-out modules {trainer.HELDOUT_MODULES}")
    return sources


def free_prompts(
    encode: Callable[[str], list[int]], sources: Sequence[str], count: int, length: int
) -> list[list[int]]:
    """`count` prompts of `length` tokens: the start of each module, then (past the last module) the
    next `length` tokens of each, and so on."""
    ids = [encode(text) for text in sources]
    prompts = []
    for i in range(count):
        module, window = ids[i % len(ids)], i // len(ids)
        prompt = module[window * length : (window + 1) * length]
        if len(prompt) < length:
            raise SystemExit(f"held-out modules too short for {count} prompts of {length} tokens")
        prompts.append(prompt)
    return prompts


def functions(source: str) -> list[str]:
    """Every function (methods and nested ones too) of a module, dedented, in source order."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    return [
        textwrap.dedent("\n".join(lines[n.lineno - 1 : n.end_lineno])) for n in sorted(nodes, key=lambda n: n.lineno)
    ]


@dataclass(frozen=True)
class EditPrompt:
    """prompt: "<function>" EDIT_MARKER then the function's first line; copy: the tokens that copy
    the rest of the function (what a model that repeats it faithfully generates)."""

    prompt: list[int]
    copy: list[int]


def edit_prompts(
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    sources: Sequence[str],
    count: int,
    max_tokens: int,
    longest: int,
) -> list[EditPrompt]:
    """`count` edit prompts of functions of at most `longest` tokens with at least max_tokens after
    their first line (the whole output can be a copy); taken a module at a time, round robin, so a
    batch mixes modules. The second copy is cut at a token boundary of the function's own tokens
    (the tokens covering its first line): the prompt ends as a copy would be tokenized, not at a
    boundary the model has rarely seen (before a newline merged with what follows)."""
    per_module = []
    for source in sources:
        found = []
        for code in functions(source):
            ids = encode(code)
            first = code.split("\n", 1)[0]
            cut = next(m for m in range(1, len(ids) + 1) if len(decode(ids[:m])) >= len(first))
            if len(ids) <= longest and len(ids) - cut >= max_tokens:
                found.append(EditPrompt(encode(code + EDIT_MARKER) + ids[:cut], ids[cut:]))
        per_module.append(found)
    prompts = []
    for rank in range(max(map(len, per_module), default=0)):
        prompts += [found[rank] for found in per_module if rank < len(found)]
    if len(prompts) < count:
        raise SystemExit(
            f"only {len(prompts)} held-out functions have {max_tokens} to {longest} tokens; {count} prompts asked"
        )
    return prompts[:count]


def build_tasks(
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    root: Path,
    tasks: Sequence[str],
    count: int,
    prompt_tokens: int,
    max_tokens: int,
) -> tuple[dict[str, list[list[int]]], list[EditPrompt]]:
    """Each task's `count` prompts (token ids), and the edit task's prompts with their copies."""
    sources = heldout_sources(root)
    prompts: dict[str, list[list[int]]] = {}
    edits: list[EditPrompt] = []
    if "free" in tasks:
        prompts["free"] = free_prompts(encode, sources, count, prompt_tokens)
    if "edit" in tasks:
        edits = edit_prompts(encode, decode, sources, count, max_tokens, longest=4 * max_tokens + 64)
        prompts["edit"] = [e.prompt for e in edits]
    return prompts, edits
