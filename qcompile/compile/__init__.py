"""The compile stage: the pipeline (`pipeline`) turns a checkpoint and a recipe into an artifact through
tensor jobs, their plan, the streamed writer, TP sharding, the KV-cache contract and the manifest.
"""
