"""`python -m qruntime run` / `qcompile run`: streamed text, timings, --json, --chat, --stop, and
user errors as one `error:` line with exit code 1 (130 on Ctrl-C)."""

import io
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys

import pytest
import qruntime
from click.testing import CliRunner
from qruntime.cli import main
from qruntime.commands.run import RunOptions, run

from qcompile.cli import main as qcompile_main

WORDS = ("the", "model", "runs", "fast", "and", "then", "stops", "here", "tokens", "cache", "hello", "world")
SUMMARY = re.compile(
    r"^prompt (\d+) tokens, output (\d+) tokens \| TTFT ([\d.]+) ms, TPOT ([\d.]+) ms, ([\d.]+) tokens/s \| "
    r"finish: (\w+)"
)
JSON_FIELDS = {
    "text", "token_ids", "finish_reason", "stop_reason", "error", "ttft_s", "tpot_s", "tokens_per_s",
    "prompt_tokens", "output_tokens", "device", "dtype",
}  # fmt: skip


def random_prompt(words: int = 6) -> str:
    return " ".join(random.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def art(compiled, tiny_ckpt):
    return compiled(tiny_ckpt, "ptpc-fp8")


@pytest.fixture(scope="module")
def engine(art):
    """The reference: the same artifact run through the Python API (greedy is deterministic)."""
    return qruntime.load(art, "cpu", num_kv_blocks=64)


def greedy(engine, prompt, max_tokens, **kw):
    params = qruntime.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)
    return engine.generate(prompt, params)[0]


def run_json(capsys, *args):
    assert main(["run", *map(str, args), "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # --json prints the object and nothing else
    return json.loads(captured.out)


def test_cli_module_imports_neither_compiler_nor_click_nor_torch():
    code = (
        "import sys, qruntime.cli; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('qcompile', 'click', 'torch')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_module_subprocess_prints_text_then_timings(art, engine):
    prompt = random_prompt()
    expected = greedy(engine, prompt, 4)
    result = subprocess.run(
        [sys.executable, "-m", "qruntime", "run", str(art), prompt, "--max-tokens", "4", "--ignore-eos"],
        capture_output=True,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
    )  # bytes: text mode would turn a generated "\r" into "\n"
    stdout, stderr = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 0, stderr
    assert stdout == expected.text + "\n"
    load_line, summary = stderr.splitlines()
    assert load_line.startswith(f"loaded {art} in ")
    assert re.search(
        r" s \(imports [\d.]+, setup [\d.]+, weights [\d.]+, plan [\d.]+, kernels [\d.]+, cache and graphs [\d.]+, rest [\d.]+\): ",
        load_line,
    )
    assert "device cpu, dtype bfloat16, kv cache nhd bf16, " in load_line
    match = SUMMARY.match(summary)
    assert match, summary
    assert int(match[1]) == len(expected.prompt_token_ids) and int(match[2]) == 4 and match[6] == "length"
    assert all(float(match[i]) > 0 for i in (3, 4, 5))


def test_run_streams_token_by_token(art, engine):
    """The text reaches `out` delta by delta as the engine streams it; --no-stream writes it once."""
    prompt = random_prompt()
    deltas = [d.text for d in engine.stream(prompt, qruntime.SamplingParams(max_tokens=6, ignore_eos=True)) if d.text]
    assert len(deltas) > 1

    class Writes(io.StringIO):
        def __init__(self):
            super().__init__()
            self.writes = []

        def write(self, text):
            if text:
                self.writes.append(text)
            return super().write(text)

    out, err = Writes(), io.StringIO()
    record = run(RunOptions(str(art), prompt, max_tokens=6, ignore_eos=True), out, err)
    assert out.writes == [*deltas, "\n"]
    assert record["text"] == "".join(deltas) and record["output_tokens"] == 6
    assert err.getvalue().startswith(f"loaded {art}") and SUMMARY.match(err.getvalue().splitlines()[-1])

    out = Writes()
    run(RunOptions(str(art), prompt, max_tokens=6, ignore_eos=True, no_stream=True), out, io.StringIO())
    assert out.writes == ["".join(deltas), "\n"]


def test_json_fields_agree(art, engine, capsys):
    prompt = random_prompt()
    expected = greedy(engine, prompt, 5)
    record = run_json(capsys, art, prompt, "--max-tokens", 5, "--ignore-eos")
    assert set(record) == JSON_FIELDS
    assert record["token_ids"] == list(expected.token_ids) and record["text"] == expected.text
    assert record["output_tokens"] == len(record["token_ids"]) == 5
    assert record["prompt_tokens"] == len(expected.prompt_token_ids)
    assert record["finish_reason"] == "length" and record["stop_reason"] is None
    assert record["device"] == "cpu" and record["dtype"] == "bfloat16"
    assert record["ttft_s"] > 0 and record["tpot_s"] > 0
    # tokens/s counts the whole request, prefill included: e2e = ttft + (n - 1) * tpot
    assert math.isclose(record["tokens_per_s"], 5 / (record["ttft_s"] + 4 * record["tpot_s"]), rel_tol=1e-9)


def test_sampling_options_reach_the_engine(art, engine, capsys):
    prompt, seed = random_prompt(), random.randrange(2**31)
    params = qruntime.SamplingParams(max_tokens=6, temperature=0.9, top_k=20, top_p=0.8, seed=seed, ignore_eos=True)
    expected = engine.generate(prompt, params)[0]
    record = run_json(
        capsys, art, prompt, "--max-tokens", 6, "--temperature", 0.9, "--top-k", 20, "--top-p", 0.8,
        "--seed", seed, "--ignore-eos", "--dtype", "bfloat16", "--device", "cpu", "--verify",
    )  # fmt: skip
    assert record["token_ids"] == list(expected.token_ids)


def test_chat(art, engine, capsys):
    message = random_prompt()
    messages = [{"role": "user", "content": message}]
    expected = engine.chat(messages, qruntime.SamplingParams(max_tokens=4, ignore_eos=True))[0]
    record = run_json(capsys, art, message, "--chat", "--max-tokens", 4, "--ignore-eos")
    assert record["prompt_tokens"] == len(engine.tokenizer.encode_chat(messages)) == len(expected.prompt_token_ids)
    assert record["prompt_tokens"] > len(engine.tokenizer.encode(message))  # the template wrapped the message
    assert record["token_ids"] == list(expected.token_ids)


def test_stop_strings(art, engine, capsys):
    prompt = random_prompt()
    full = greedy(engine, prompt, 16).text
    # a two-character stop string first seen at `cut`, not at the very start
    starts = [
        i
        for i in range(1, len(full) - 1)
        if full[i : i + 2].isprintable() and "\ufffd" not in full[i : i + 2] and full.find(full[i : i + 2]) == i
    ]
    assert starts, f"no stop string candidate in {full!r}"
    cut = random.choice(starts)
    stop = full[cut : cut + 2]
    # --stop=TEXT: a stop string may begin with "-", which argparse takes for an option after a space
    record = run_json(
        capsys, art, prompt, "--max-tokens", 16, "--ignore-eos", "--stop", "<never seen>", f"--stop={stop}"
    )
    assert record["text"] == full[:cut], (full, stop)
    assert record["finish_reason"] == "stop" and record["stop_reason"] == stop
    assert record["output_tokens"] == len(record["token_ids"]) <= 16

    assert main(["run", str(art), prompt, "--max-tokens", "16", "--ignore-eos", f"--stop={stop}"]) == 0
    captured = capsys.readouterr()
    assert captured.out == full[:cut] + "\n"
    assert captured.err.splitlines()[-1].endswith(f"finish: stop ({stop!r})")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-tokens", "0"], "--max-tokens must be ≥ 1 (got 0)"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1] (got 1.5)"),
        (["--dtype", "int8"], "dtype 'int8' is not one of ['bf16', 'bfloat16', 'float16', 'float32']"),
        (["--device", "gpu"], "device 'gpu' is not a torch device"),
        (["--max-model-len", "999999"], "max_model_len 999999 must be in 2..4096 (the model's context)"),
    ],
)
def test_bad_options_are_one_line_errors(art, capsys, args, message):
    assert main(["run", str(art), random_prompt(), *args]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: ")
    assert message in captured.err


def test_bad_artifacts_are_one_line_errors(art, tmp_path, capsys):
    assert main(["run", str(tmp_path / "nowhere"), "hi"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"error: {tmp_path / 'nowhere'}: artifact directory not found\n"

    # load's multi-line "does not match its manifest" message comes out as one line
    broken = tmp_path / "broken"
    shutil.copytree(art, broken)
    shard = next((broken / "weights").glob("*.safetensors"))
    shard.unlink()
    assert main(["run", str(broken), "hi"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"the artifact does not match its manifest: weights/{shard.name}: missing" in err


def test_prompt_longer_than_max_model_len(art, capsys):
    prompt = " ".join(random.choice(WORDS) for _ in range(40))
    assert main(["run", str(art), prompt, "--max-model-len", "16"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    loaded, error = captured.err.splitlines()
    assert "max_model_len 16" in loaded
    assert re.fullmatch(
        r"error: prompt is \d+ tokens but the context is 16 tokens \(max_model_len\): "
        r"at most 15 prompt tokens leave room to generate",
        error,
    )


def test_usage_errors_and_help(capsys):
    assert main(["run"]) == 2
    assert "the following arguments are required: ART, PROMPT" in capsys.readouterr().err
    assert main(["run", "--help"]) == 0
    help_text = capsys.readouterr().out
    for flag in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--stop", "--ignore-eos", "--chat"):
        assert flag in help_text
    for flag in ("--device", "--dtype", "--verify", "--max-model-len", "--no-stream", "--json"):
        assert flag in help_text


def test_a_request_the_engine_fails_is_a_one_line_error(art, capsys, monkeypatch):
    import qruntime.engine.engine as engine_module
    from qruntime.engine.sampled_tokens import SampledTokens

    def nan_logits(logits, params, generators, *rest):
        # what the sampler says of NaN logits: the argmax, and a NaN maximum
        return SampledTokens(logits.argmax(-1), logits.new_full((len(params),), float("nan")))

    monkeypatch.setattr(engine_module, "sample_on_device", nan_logits)
    assert main(["run", str(art), random_prompt(), "--max-tokens", "4"]) == 1
    err = capsys.readouterr().err
    assert "finish: error" in err and "error: generation failed after 0 tokens: the model produced non-finite" in err
    assert main(["run", str(art), random_prompt(), "--max-tokens", "4", "--json"]) == 1
    record = json.loads(capsys.readouterr().out)
    assert record["finish_reason"] == "error" and "non-finite" in record["error"]


def test_ctrl_c_exits_130(art, capsys, monkeypatch):
    class Interrupted(io.StringIO):
        def write(self, text):
            raise KeyboardInterrupt

    monkeypatch.setattr(sys, "stdout", Interrupted())  # Ctrl-C while the first token is printed
    assert main(["run", str(art), random_prompt(), "--max-tokens", "8"]) == 130
    assert capsys.readouterr().err.endswith("\ninterrupted\n")


def test_qcompile_run(art, engine):
    prompt = random_prompt()
    expected = greedy(engine, prompt, 3)
    result = CliRunner().invoke(qcompile_main, ["run", str(art), prompt, "--max-tokens", "3", "--ignore-eos", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["token_ids"] == list(expected.token_ids) and record["output_tokens"] == 3

    result = CliRunner().invoke(qcompile_main, ["run", str(art), prompt, "--max-tokens", "3", "--ignore-eos"])
    assert result.exit_code == 0, result.output
    assert result.stdout_bytes.decode() == expected.text + "\n"  # .stdout would turn "\r\n" into "\n"
    assert SUMMARY.match(result.stderr.splitlines()[-1])

    result = CliRunner().invoke(qcompile_main, ["run", str(art), prompt, "--max-tokens", "0"])
    assert result.exit_code == 1
    assert result.stderr == "error: --max-tokens must be ≥ 1 (got 0)\n"


@pytest.mark.parametrize("no_stream", [False, True])
def test_text_on_a_terminal_is_shown_not_acted_on(art, monkeypatch, no_stream):
    """Escape sequences and bidi overrides the model writes are escaped on a terminal, and written as
    they are to a pipe (and in --json)."""
    import dataclasses

    from qruntime.engine.engine import Engine
    from qruntime.terminal import for_terminal

    hostile = random.choice(["\x1b[2J", "\x1b]0;title\x07", "\u202e", "\r\x08"])
    stream = Engine.stream

    def with_hostile_text(self, *args, **kwargs):  # as if the model had written it before each piece
        text = ""
        for delta in stream(self, *args, **kwargs):
            text += hostile + delta.text
            output = delta.output and dataclasses.replace(delta.output, text=text)
            yield dataclasses.replace(delta, text=hostile + delta.text, output=output)

    monkeypatch.setattr(Engine, "stream", with_hostile_text)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    prompt = random_prompt()
    options = RunOptions(str(art), prompt, max_tokens=4, ignore_eos=True, no_stream=no_stream)
    terminal, pipe = Terminal(), io.StringIO()
    record = run(options, terminal, io.StringIO())
    run(options, pipe, io.StringIO())
    assert hostile in record["text"] and hostile in pipe.getvalue()
    shown = terminal.getvalue()
    assert hostile not in shown and for_terminal(hostile) in shown and for_terminal(hostile) != hostile
    assert not any(ch in shown for ch in "\x1b\x07\u202e\r\x08")
