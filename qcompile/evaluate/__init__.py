"""Accuracy of an artifact against a reference model on the same text: perplexity, KL, top-1."""
