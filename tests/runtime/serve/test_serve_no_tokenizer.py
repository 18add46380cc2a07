"""An artifact compiled with --no-tokenizer (manifest "tokenizer": false) loads and runs token-id
prompts, as vLLM's skip_tokenizer_init: the same tokens as the artifact with a tokenizer, empty text,
EOS from generation_config.json; text prompts, chat and stop strings are clear errors, in the engine
and over HTTP."""

from __future__ import annotations

import shutil

import httpx
import pytest
import qruntime
from qruntime import InvalidRequest, SamplingParams
from qruntime.serve.app import build_app
from qruntime.tokenizer import TokenIdsOnly
from serve_harness import ThreadedServer

from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.recipe.schema import load_recipe

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


@pytest.fixture(scope="module")
def artifacts(tiny_ckpt, compiled, tmp_path_factory):
    """(the artifact without a tokenizer, the same checkpoint's artifact with one)."""
    root = tmp_path_factory.mktemp("no-tokenizer")
    bare = root / "ckpt"
    shutil.copytree(tiny_ckpt, bare)
    for name in TOKENIZER_FILES:
        (bare / name).unlink(missing_ok=True)
    out = root / "art"
    compile_checkpoint(prepare(bare, load_recipe("ptpc-fp8"), tokenizer=False), out, workers=2, progress=False)
    return out, compiled(tiny_ckpt, "ptpc-fp8")


def test_token_id_prompts_run_as_with_a_tokenizer(artifacts, rng):
    bare, full = artifacts
    engine = qruntime.load(bare, "cpu", num_kv_blocks=64)
    reference = qruntime.load(full, "cpu", num_kv_blocks=64)
    assert isinstance(engine.tokenizer, TokenIdsOnly) and not engine.tokenizer.has_text
    assert engine.tokenizer.eos_token_ids == reference.tokenizer.eos_token_ids != frozenset()
    prompts = [[rng.randrange(engine.vocab_size) for _ in range(rng.randrange(2, 20))] for _ in range(3)]
    params = SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=(rng.randrange(engine.vocab_size),))
    got, expected = engine.generate(prompts, params), reference.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert all(o.text == "" for o in got)


def test_text_chat_and_stop_strings_are_clear_errors(artifacts):
    engine = qruntime.load(artifacts[0], "cpu", num_kv_blocks=64)
    with pytest.raises(InvalidRequest, match="has no tokenizer .compiled with --no-tokenizer.*token ids"):
        engine.generate("hello", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequest, match="no chat template"):
        engine.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidRequest, match="stop strings need the artifact's tokenizer"):
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, stop=["x"]))
    assert not engine.has_unfinished() and engine.scheduler.block_manager.num_used_blocks == 0


def test_served_token_ids_work_and_text_is_a_400(artifacts, rng):
    engine = qruntime.load(artifacts[0], "cpu", num_kv_blocks=64, max_model_len=128)
    with ThreadedServer(build_app(engine, model_name="bare")) as server, httpx.Client(base_url=server.url) as client:
        prompt = [rng.randrange(engine.vocab_size) for _ in range(5)]
        body = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == ""
        for path, body, param in (
            ("/v1/completions", {"prompt": "hello"}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ):
            response = client.post(path, json=body)
            assert response.status_code == 400 and response.json()["error"]["param"] == param
            assert "--no-tokenizer" in response.json()["error"]["message"]
        response = client.post("/v1/completions", json={"prompt": prompt, "stop": ["x"]})
        assert response.status_code == 400 and "stop_token_ids" in response.json()["error"]["message"]
        assert client.get("/health").status_code == 200
