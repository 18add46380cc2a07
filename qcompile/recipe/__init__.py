"""Recipes: what a compile makes of a checkpoint. Ours are YAML files (`schema`), llm-compressor's are
translated (`llm_compressor`); the ignore list and the compressed-tensors config follow from them.
"""
