"""Kernel tuning on a GPU: time the runtime's own kernels per shape and token bucket and store the
winners in the artifact (`kernels/<device>.json`).
"""
