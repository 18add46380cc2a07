"""A mistyped path costs no torch import: `qcompile compile / run / inspect / verify` and `qruntime run`
report a missing path, a file where a directory belongs, or an -o that exists (without --force) as one
`error:` line naming the path, exit code 1, before torch (seconds of imports) is loaded."""

from __future__ import annotations

from cli_child import run_in_child


def test_path_errors_come_before_torch(tiny_ckpt, tmp_path, rng):
    def fresh(stem: str):
        return tmp_path / f"{stem}-{rng.randrange(1 << 30)}"  # names differ each run (the seed is printed)

    missing, a_file, existing, out = fresh("missing"), fresh("a file"), fresh("existing"), fresh("new")
    a_file.write_text("not a directory")
    existing.mkdir()
    not_a_checkpoint = f"{a_file}: not a directory; a checkpoint is a directory holding config.json and *.safetensors"
    not_an_artifact = f"{a_file}: not a directory; an artifact is the directory `qcompile compile` writes"
    cases = {
        ("qcompile", "compile", missing, "-o", out): f"{missing}: checkpoint directory not found",
        ("qcompile", "compile", missing, "-o", out, "--tune"): f"{missing}: checkpoint directory not found",
        ("qcompile", "compile", a_file, "-o", out): not_a_checkpoint,
        ("qcompile", "compile", tiny_ckpt, "-o", existing): f"{existing}: already exists; pass --force to replace it",
        ("qcompile", "compile", tiny_ckpt, "-o", a_file, "--force"): (
            f"{a_file}: exists and is not a directory; refusing to replace it"
        ),
        ("qcompile", "run", missing, "hi"): f"{missing}: artifact directory not found",
        ("qcompile", "run", a_file, "hi"): not_an_artifact,
        ("qcompile", "inspect", missing): f"{missing}: artifact directory not found",
        ("qcompile", "inspect", a_file): not_an_artifact,
        ("qcompile", "verify", missing): f"{missing}: artifact directory not found",
        ("qcompile", "verify", a_file): not_an_artifact,
        ("qruntime", "run", missing, "hi"): f"{missing}: artifact directory not found",
        ("qruntime", "run", a_file, "hi"): not_an_artifact,
    }
    outcomes = run_in_child([(cli, args) for cli, *args in cases])
    for (call, message), outcome in zip(cases.items(), outcomes, strict=True):
        shown = " ".join(map(str, call))
        assert not outcome.torch, f"`{shown}` imported torch before its error"
        assert outcome.code == 1, (shown, outcome)
        assert outcome.err == f"error: {message}\n", (shown, outcome)
        assert outcome.out == "", (shown, outcome)
    assert not out.exists() and a_file.read_text() == "not a directory" and not any(existing.iterdir())
