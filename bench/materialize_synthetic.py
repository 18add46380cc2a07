"""Write a synthetic artifact's random weights into its files, so that it loads from disk like a
compiled artifact.

A synthetic artifact (`qcompile synth PRESET --artifact`) has sparse weight files and makes its
weights on the device at load, which a cold-start measurement cannot use. Building a real one for
qwen3-30b-a3b needs its 61 GB random checkpoint beside the 31 GB artifact: more than the lent
single-GPU machine's 64 GB disk. This instead writes each tensor's synthetic value (the one
`qruntime.load` would make, qruntime.synthetic.random_tensor, generated on --device) at its place in
the files, then records the files' sha256 in the manifest and drops its `synthetic` entry (written
beside and renamed). A run cut short leaves the artifact synthetic, its manifest unchanged; run it
again.

    python bench/materialize_synthetic.py ART [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from qruntime.synthetic import INT4_PACKED, INT4_SCALE, random_tensor
from tqdm import tqdm

from qcompile.compile.manifest import relist_files
from qcompile.io.safetensors_stream import read_header


def weight_files(art: Path, manifest: dict) -> list[str]:
    return sorted(rel for rel in manifest["files"] if rel.startswith("weights/") and rel.endswith(".safetensors"))


def materialize(art: Path, device: str = "cpu", progress: bool = True) -> int:
    """Write ART's synthetic weights to its files (see the module doc); returns the bytes written."""
    manifest = json.loads((art / "manifest.json").read_text())
    if not manifest.get("synthetic"):
        raise SystemExit(f"{art}: not a synthetic artifact (its manifest has no `synthetic` entry)")
    rels = weight_files(art, manifest)
    headers = {rel: read_header(art / rel)[0] for rel in rels}
    total = sum(e.nbytes for entries in headers.values() for e in entries.values())
    written = 0
    with tqdm(total=total, unit="B", unit_scale=True, desc="weights", disable=not progress) as bar:
        for rel in rels:
            entries = headers[rel]
            fd = os.open(art / rel, os.O_WRONLY)
            try:
                for name, entry in entries.items():
                    int4_scale = name.endswith(INT4_SCALE) and name[: -len(INT4_SCALE)] + INT4_PACKED in entries
                    value = random_tensor(name, list(entry.shape), entry.torch_dtype, torch.device(device), int4_scale)
                    data = memoryview(value.contiguous().view(torch.uint8).reshape(-1).cpu().numpy())
                    if len(data) != entry.nbytes:
                        raise ValueError(f"{art / rel}: {name} holds {entry.nbytes} bytes, its value {len(data)}")
                    while data:
                        data = data[os.pwrite(fd, data, entry.end - len(data)) :]
                    written += entry.nbytes
                    bar.update(entry.nbytes)
            finally:
                os.close(fd)
    del manifest["synthetic"]
    relist_files(art, manifest, rels)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--device", default="cpu", help="where the random values are made (cuda: faster)")
    args = parser.parse_args(argv)
    written = materialize(args.artifact, args.device)
    print(f"wrote {written / 1e9:.2f} GB of weights into {args.artifact}")


if __name__ == "__main__":
    main()
