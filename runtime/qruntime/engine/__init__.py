"""The engine: request state, paged KV-block allocation, and the continuous-batching scheduler."""
