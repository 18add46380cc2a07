"""Triton kernels of the GPU fast path, one per file, each checked against its torch reference in
qruntime.ops.functional (CI runs them under TRITON_INTERPRET=1 at small shapes). Importing a kernel
module imports triton; the reference path never does."""
