"""The verbs of the `qruntime` command, one module each (serve is its own package, qruntime.serve);
`common` is what they share."""
