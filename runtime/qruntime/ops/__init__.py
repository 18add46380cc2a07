"""Op implementations bound to graph.onnx nodes; the registry is in qruntime.ops.registry."""
