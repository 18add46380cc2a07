"""One module per CLI verb; each defines a click command named `command`."""
