"""lm-evaluation-harness on an artifact (qruntime/harness.py): three local tasks — multiple choice
(loglikelihood), generation (generate_until) and perplexity (loglikelihood_rolling) — end to end on
CPU through lm_eval.simple_evaluate and through `python -m qruntime.harness`, and each request type
against the engine it wraps."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import qruntime
import torch
from lm_eval.api.instance import Instance  # the test extra installs lm_eval; the runtime does not need it
from qruntime.harness import QRuntimeLM

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "under",
    "mat",
    "log",
    "red",
    "blue",
    "big",
    "small",
    "one",
    "two",
]


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """A task folder: qr_choice (4 choices), qr_gen (generate until a newline), qr_rolling (perplexity)."""
    rng = random.Random()
    root = tmp_path_factory.mktemp("tasks")
    rows = {
        "choice": [
            {
                "question": _sentence(rng, 6),
                "choices": [_sentence(rng, 2) for _ in range(4)],
                "answer": rng.randrange(4),
            }
            for _ in range(6)
        ],
        "gen": [{"prompt": _sentence(rng, 5), "target": _sentence(rng, 2)} for _ in range(4)],
        "rolling": [{"text": _sentence(rng, rng.randrange(20, 60))} for _ in range(3)],
    }
    for name, data in rows.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    common = "dataset_path: json\ntest_split: test\n"

    def files(name: str) -> str:
        return f"dataset_kwargs:\n  data_files:\n    test: {root / f'{name}.jsonl'}\n"

    (root / "qr_choice.yaml").write_text(
        f"task: qr_choice\n{common}{files('choice')}output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    (root / "qr_gen.yaml").write_text(
        f"task: qr_gen\n{common}{files('gen')}output_type: generate_until\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 6\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    (root / "qr_rolling.yaml").write_text(
        f"task: qr_rolling\n{common}{files('rolling')}output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )
    return root


@pytest.fixture(scope="module")
def artifact(tiny_ckpt, compiled) -> Path:
    return compiled(tiny_ckpt, "bf16")


def test_simple_evaluate_runs_the_three_request_types(artifact, tasks, monkeypatch):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model = QRuntimeLM(artifact=str(artifact), device="cpu", dtype="float32", max_model_len=48)
    out = simple_evaluate(
        model=model, tasks=["qr_choice", "qr_gen", "qr_rolling"], task_manager=TaskManager(include_path=str(tasks))
    )
    results = out["results"]
    assert 0.0 <= results["qr_choice"]["acc,none"] <= 1.0
    assert 0.0 <= results["qr_gen"]["exact_match,none"] <= 1.0
    assert (
        math.isfinite(results["qr_rolling"]["word_perplexity,none"]) and results["qr_rolling"]["bits_per_byte,none"] > 0
    )


def test_each_request_type_is_the_engine_s_own_numbers(artifact):
    rng = random.Random()
    model = QRuntimeLM(artifact=str(artifact), device="cpu", dtype="float32", max_model_len=32)
    engine, tok = model.engine, model.tokenizer
    # loglikelihood: the continuation's tokens after the context's, summed from one forward pass
    context, continuation = _sentence(rng, 5), " " + _sentence(rng, 3)
    whole = tok.encode(context + continuation, add_special_tokens=False)
    split = len(tok.encode(context, add_special_tokens=False))
    logprobs = torch.log_softmax(engine.score(whole[:-1]).float(), -1)
    want = sum(float(logprobs[i - 1, whole[i]]) for i in range(split, len(whole)))
    greedy = all(int(logprobs[i - 1].argmax()) == whole[i] for i in range(split, len(whole)))
    ((got, got_greedy),) = model.loglikelihood([Instance("loglikelihood", {}, (context + " ", continuation[1:]), 0)])
    assert got == pytest.approx(want, rel=1e-6) and got_greedy == greedy
    # loglikelihood_rolling: a text longer than the model's 32 tokens, every token scored once
    text = _sentence(rng, 70)
    ids = tok.encode(text, add_special_tokens=False)
    scored = []
    original = model._score
    model._score = lambda c, t: scored.extend(t) or original(c, t)
    (total,) = model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert scored == ids and len(ids) > 32 and total < 0
    # generate_until: greedy, cut at the stop string
    prompt = _sentence(rng, 4)
    (text_out,) = model.generate_until(
        [Instance("generate_until", {}, (prompt, {"until": ["cat"], "max_gen_toks": 8, "do_sample": False}), 0)]
    )
    plain = engine.generate(tok.encode(prompt, add_special_tokens=False), qruntime.SamplingParams(max_tokens=8))
    assert text_out == plain[0].text.split("cat")[0]


def test_the_command_line_sets_the_model_and_runs_a_task(artifact, tasks, tmp_path):
    out = tmp_path / "results"
    args = ["--model_args", f"artifact={artifact},device=cpu,dtype=float32,max_model_len=48"]
    args += ["--tasks", "qr_choice", "--include_path", str(tasks), "--output_path", str(out)]
    env = {**os.environ, **OFFLINE}
    done = subprocess.run(
        [sys.executable, "-m", "qruntime.harness", *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "qr_choice" in done.stdout and "acc" in done.stdout
    refused = subprocess.run(
        [sys.executable, "-m", "qruntime.harness", "--model", "hf", *args], env=env, capture_output=True, text=True
    )
    assert refused.returncode != 0 and "sets --model qruntime itself" in refused.stderr
