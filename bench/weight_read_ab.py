"""How fast the weight reader (qruntime/weight_reader.py) moves an artifact's weights from a warm page
cache to the GPU at other settings than its defaults: readers (threads reading at once), buffers (the
pinned ring) and chunk bytes. Reads every external initializer of graph.onnx into GPU tensors as a
load does (weights.load_initializers), after one pass that puts the files in the page cache; each
setting is timed `--repeats` times and its best kept. The pinned ring's allocation is inside the
time, as in a load.

    python bench/weight_read_ab.py ART --settings 4x8x32,8x16x32,12x16x32,8x16x64 --out bench/results/weight_read_ab_<gpu>.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import onnx  # noqa: E402
import torch  # noqa: E402
from compile_bench import gpu_report_header  # noqa: E402
from qruntime.artifact import read_manifest  # noqa: E402
from qruntime.weight_reader import Extent, read_extents  # noqa: E402
from qruntime.weights import ONNX_TO_TORCH, external_extent  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--settings", default="4x8x32,8x16x32", help="READERSxBUFFERSxCHUNK_MIB, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    root = args.artifact
    manifest = read_manifest(root)
    graph = onnx.load(str(root / "graph.onnx"), load_external_data=False).graph
    extents, out = [], {}
    for init in graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL:
            continue
        dtype = ONNX_TO_TORCH[init.data_type]
        path, offset, length = external_extent(root, init, dtype, manifest["files"])
        out[init.name] = torch.empty(length, dtype=torch.uint8, device="cuda")
        extents.append(Extent(init.name, path, offset, length))
    total = sum(e.length for e in extents)
    for path in {e.path for e in extents}:  # the page cache warm
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
    report = gpu_report_header("weight_read_ab")
    report.update(artifact=str(root), bytes=total, repeats=args.repeats, rows=[])
    for setting in args.settings.split(","):
        readers, buffers, chunk_mib = (int(x) for x in setting.split("x"))
        times = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            read_extents(extents, out, chunk_bytes=chunk_mib << 20, readers=readers, buffers=buffers)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        row = {"readers": readers, "buffers": buffers, "chunk_mib": chunk_mib, "best_s": round(min(times), 3)}
        row["gb_s"] = round(total / min(times) / 1e9, 2)
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
