"""The source checkpoint: config.json as a ModelSpec, its Hugging Face tensor names, shard headers and
the sizes held to them. Everything downstream reads the checkpoint through these modules.
"""
