"""Shipping an artifact: a verified folder or hub repo with model card and runtime wheel (`publication`),
and the compressed-tensors export that vLLM, SGLang and transformers load (`export`, `unfuse`).
"""
