"""`qruntime serve` on the command line: its help, the import cost `qruntime run` keeps, and user
errors (a missing `serve` extra, a bad artifact, a busy port) as one `error:` line and exit 1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from qruntime.cli import main


@pytest.fixture(scope="module")
def art(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "ptpc-fp8")


def test_help_lists_the_options(capsys):
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--host",
        "--port",
        "--max-waiting",
        "--max-num-seqs",
        "--device",
        "--backend",
        "--served-model-name",
        "--shutdown-timeout",
        "--api-key",
        "--max-body-bytes",
        "--header-timeout",
        "--body-timeout",
        "--limit-concurrency",
        "--no-prefix-cache",
        "--max-images-per-request",
        "--max-image-bytes",
    ):
        assert flag in out, flag
    assert main(["--help"]) == 0 and "serve" in capsys.readouterr().out


def test_the_cli_imports_no_server_framework():
    code = (
        "import sys, qruntime.cli; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('starlette', 'uvicorn', 'prometheus_client', 'torch')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("missing", ["uvicorn", "starlette", "prometheus_client"])
def test_a_missing_extra_names_the_install_command(monkeypatch, capsys, art, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` now raises ImportError
    assert main(["serve", str(art)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: `qruntime serve` needs the serve extra: pip install 'qcompile-runtime[serve]'")
    assert missing in err and len(err.strip().splitlines()) == 1


def test_user_errors_are_one_line(tmp_path, art, capsys):
    def serve(*args):
        command = [sys.executable, "-m", "qruntime", "serve", *map(str, args)]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    result = serve(tmp_path / "nothing-here")
    assert result.returncode == 1 and result.stderr.startswith("error: ") and "nothing-here" in result.stderr
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        result = serve(art, "--port", port)
    assert result.returncode == 1 and f"error: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "loaded" not in result.stderr  # the port is bound before the model loads, not after
    result = serve(art, "--max-waiting", 0)
    assert result.returncode == 1 and "error: --max-waiting must be >= 1" in result.stderr
    # the other limits in this process (a subprocess each cost seconds of imports): the same main();
    # a busy port makes a missed check fail at once instead of serving
    with socket.create_server(("127.0.0.1", 0)) as busy:
        for flag in (
            "--max-body-bytes",
            "--header-timeout",
            "--body-timeout",
            "--limit-concurrency",
            "--max-images-per-request",
            "--max-image-bytes",
        ):
            code = main(["serve", str(art), flag, "0", "--port", str(busy.getsockname()[1])])
            assert code == 1 and f"error: {flag} must be > 0" in capsys.readouterr().err


def test_the_api_key_comes_from_the_flag_or_the_environment(art, monkeypatch):
    """A real `qruntime serve` process: the key from QRUNTIME_API_KEY guards /v1/*, and --api-key wins."""
    import httpx
    from serve_harness import ServerProcess

    env_key, flag_key = "env-" + os.urandom(8).hex(), "flag-" + os.urandom(8).hex()
    monkeypatch.setenv("QRUNTIME_API_KEY", env_key)

    def status(server, key=None):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        return httpx.get(f"{server.url}/v1/models", headers=headers, timeout=30).status_code

    with ServerProcess(art, "--threads", "1") as server:
        assert "API key required" in server.stderr
        assert (status(server), status(server, env_key)) == (401, 200)
    with ServerProcess(art, "--threads", "1", "--api-key", flag_key) as server:
        assert (status(server, env_key), status(server, flag_key)) == (401, 200)


def test_qcompile_serve_is_the_same_server(art):
    """`qcompile serve` hands its arguments to the runtime's parser: the same help, the same user
    errors, and a server that answers and stops gracefully on SIGTERM (exit 0)."""
    import httpx
    from serve_harness import ServerProcess

    def cli(*args):
        command = [sys.executable, "-m", "qcompile", "serve", *map(str, args)]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    help_text = cli("--help")
    assert help_text.returncode == 0 and help_text.stdout.startswith("usage: qcompile serve")
    assert all(flag in help_text.stdout for flag in ("--max-num-seqs", "--api-key", "--limit-concurrency"))
    result = cli(art, "--max-waiting", 0)
    assert result.returncode == 1 and result.stderr.startswith("error: --max-waiting must be >= 1")
    assert len(result.stderr.strip().splitlines()) == 1
    assert cli().returncode == 2  # ART missing: a usage error, as argparse reports it
    with ServerProcess(art, "--threads", "1", "--served-model-name", "tiny", cli="qcompile") as server:
        models = httpx.get(f"{server.url}/v1/models", timeout=30).json()
        reply = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": "tiny", "prompt": "Hello", "max_tokens": 3, "ignore_eos": True},
            timeout=60,
        ).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        assert reply["usage"]["completion_tokens"] == 3 and reply["choices"][0]["finish_reason"] == "length"
        assert server.stop() == 0


def test_both_commands_print_their_version():
    import qruntime

    for cli, expected in (("qruntime", f"qruntime {qruntime.__version__}"), ("qcompile", "qcompile ")):
        result = subprocess.run([sys.executable, "-m", cli, "--version"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and result.stdout.startswith(expected), (cli, result.stdout, result.stderr)
    from importlib.metadata import version

    qcompile_line = subprocess.run(
        [sys.executable, "-m", "qcompile", "--version"], capture_output=True, text=True, timeout=60
    ).stdout.strip()
    assert qcompile_line == f"qcompile {version('qcompile')} (qruntime {qruntime.__version__})"
    assert qruntime.__version__ == version("qcompile-runtime")
