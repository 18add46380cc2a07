"""spec_train.py's training text beyond the standard library: installed packages' Python sources.

The stdlib files examples/train_small_qwen3.py trains on are ~2.0M tokens of the bench's tokenizer,
while the bench plan's target sees ~35M training tokens (17 epochs): at 568c92f on an H200 it
memorized them (final train loss 0.089) and neither generalized nor copied (held-out perplexity 100),
which left the speculative-decoding bench nothing to measure. site_texts adds up to a given number of
characters of site-packages sources (the GPU machine has ~388 MB of them), leaving out test
directories, files named after a held-out module, and files that carry the held-out modules' text.
"""

from __future__ import annotations

import os
import random
import site
import sys
import sysconfig
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import train_small_qwen3 as trainer  # noqa: E402 -- examples/ is scripts, not a package

SKIP_DIRS = trainer.TEST_DIRS | {"testing", "__pycache__"}
SITE_DIR_NAMES = frozenset({"site-packages", "dist-packages"})
MIN_FILE_BYTES = 200  # stubs and empty __init__.py files teach nothing
MAX_FILE_BYTES = 1_000_000  # generated tables and vendored blobs
COPY_LINE_CHARS = 40  # a held-out line this long (stripped) is the module's own text, not an idiom
COPY_LINES = 5  # a file with this many distinct such lines carries held-out text: skipped


def site_roots() -> list[Path]:
    """Where this Python installs packages: site.getsitepackages(), then sysconfig's purelib and platlib."""
    paths = sysconfig.get_paths()
    return [Path(p) for p in (*site.getsitepackages(), paths["purelib"], paths["platlib"])]


def usable_roots(roots: Iterable[Path], stdlib: Path) -> list[Path]:
    """The existing directories among roots, once each (by real path), in order. None may hold the
    stdlib (a root that is the stdlib root or above it), and one inside the stdlib root must be its
    site-packages (or dist-packages) directory: a non-venv Python installs packages there, while any
    other directory there is the stdlib's own (whose held-out modules must never be trained on)."""
    stdlib = Path(os.path.realpath(stdlib))
    kept: list[Path] = []
    for root in roots:
        real = Path(os.path.realpath(root))
        if not real.is_dir() or real in kept or real == stdlib or real in stdlib.parents:
            continue
        if real.is_relative_to(stdlib) and real.relative_to(stdlib).parts[0] not in SITE_DIR_NAMES:
            continue
        kept.append(real)
    return kept


def heldout_lines(sources: Iterable[str]) -> frozenset[str]:
    """The held-out modules' stripped lines of at least COPY_LINE_CHARS characters."""
    return frozenset(s for text in sources for line in text.splitlines() if len(s := line.strip()) >= COPY_LINE_CHARS)


def copied_lines(text: str, heldout: frozenset[str]) -> int:
    """How many distinct held-out lines (heldout_lines) the text has."""
    return len(heldout.intersection(line.strip() for line in text.splitlines()))


def site_files(roots: Sequence[Path]) -> tuple[list[Path], int]:
    """The .py files under roots worth training on, sorted by root then path, each once (by real
    path): none in a test directory (SKIP_DIRS), named after a held-out module, or of fewer than
    MIN_FILE_BYTES or more than MAX_FILE_BYTES bytes. And how many were left out for their name."""
    heldout_names = {f"{name}.py" for name in trainer.HELDOUT_MODULES}
    files, seen, named = [], set(), 0
    for root in roots:
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
            for name in sorted(n for n in names if n.endswith(".py")):
                path = Path(folder, name)
                if name in heldout_names:
                    named += 1
                    continue
                try:
                    real, size = os.path.realpath(path), path.stat().st_size
                except OSError:  # a dangling link
                    continue
                if MIN_FILE_BYTES <= size <= MAX_FILE_BYTES and real not in seen:
                    seen.add(real)
                    files.append(path)
    return files, named


def site_texts(
    limit_chars: int, heldout_sources: Sequence[str], roots: Sequence[Path] | None = None, seed: int = 0
) -> tuple[list[str], dict[str, Any]]:
    """Whole site-packages files (site_files under roots, default site_roots()), shuffled by `seed`
    so that any prefix spans many packages, read (utf-8, undecodable bytes replaced, as the stdlib's)
    in that order until the next file would take the total past limit_chars: the total never exceeds
    it and no file is cut. A file with COPY_LINES of the held-out sources' long lines is skipped.
    Returns the texts and a record of the roots, files, characters, skips and seconds taken."""
    record: dict[str, Any] = {"limit_chars": limit_chars, "seed": seed, "files": 0, "chars": 0}
    if limit_chars <= 0:
        return [], record
    start = time.perf_counter()
    given = site_roots() if roots is None else list(roots)
    found = usable_roots(given, trainer.stdlib_root())
    files, named = site_files(found)
    record["roots"] = [str(r) for r in found]
    if not files:
        raise RuntimeError(
            f"no site-packages Python files to train on under {[str(r) for r in given]} "
            f"(usable roots: {record['roots']}); --site-chars 0 trains on the stdlib only"
        )
    random.Random(seed).shuffle(files)
    heldout = heldout_lines(heldout_sources)
    texts, taken, copies, total = [], [], [], 0
    for path in files:
        text = trainer._read(path)
        if copied_lines(text, heldout) >= COPY_LINES:
            copies.append(str(path))
            continue
        if total + len(text) > limit_chars:
            break
        texts.append(text)
        taken.append(path)
        total += len(text)
    packages = {next(p.relative_to(r).parts[0] for r in found if p.is_relative_to(r)) for p in taken}
    record.update(
        files=len(texts),
        chars=total,
        candidates=len(files),
        packages=len(packages),
        skipped_heldout_names=named,
        skipped_copies=len(copies),
        copies=copies,
        read_s=round(time.perf_counter() - start, 1),
    )
    return texts, record
