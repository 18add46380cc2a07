"""Benchmarks of a speculating engine: qruntime.benchmark.measure reports each run's acceptance rate and
tokens per verification (its own counts, not the engine's totals), a plain engine's rows have neither,
and `qcompile bench --speculative` adds them as columns (a bad SPEC: click's usage error, its reason)."""

from __future__ import annotations

import pytest
import qruntime
from click.testing import CliRunner
from qruntime.benchmark import measure
from test_speculative_cli import SPEC, bad_specs

from qcompile.cli import main as qcompile_main


@pytest.fixture(scope="module")
def art(compiled, tiny_ckpt):
    return compiled(tiny_ckpt, "bf16")


def test_bench_reports_acceptance_when_speculating(art, rng):
    engine = qruntime.load(art, "cpu", dtype="float32", num_kv_blocks=64, speculative=SPEC)
    # random weights' greedy output mostly cycles, so lookup finds drafts; a workload whose output does
    # not drafts nothing (torch seed 1751923573, rng seed 198808840): up to 8 rows, until a row drafts
    # with an earlier one's totals behind it
    for _ in range(8):  # each row counts its own run: a later row's are the engine's totals' difference
        before = engine.speculative_stats
        row = measure(engine, rng.randrange(8, 24), rng.randrange(16, 32), 2, seed=rng.randrange(1 << 30))
        after = engine.speculative_stats
        drafted, verifications = after.drafted - before.drafted, after.verifications - before.verifications
        rate = (after.accepted - before.accepted) / drafted if drafted else 0.0
        per_verification = (after.emitted - before.emitted) / verifications if verifications else 0.0
        assert (row["acceptance_rate"], row["tokens_per_verification"]) == pytest.approx((rate, per_verification))
        if verifications and before.verifications:  # two rows, the second with the first's totals behind it
            break
    assert engine.speculative_stats.verifications > 0
    plain = measure(qruntime.load(art, "cpu", num_kv_blocks=64), 8, 4, 1)
    assert "acceptance_rate" not in plain and "tokens_per_verification" not in plain

    runner = CliRunner()
    args = ["bench", str(art), "--input-len", "9", "--output-len", "12", "--batch", "1,2", "--device", "cpu"]
    table = runner.invoke(qcompile_main, [*args, "--speculative", SPEC])
    assert table.exit_code == 0, table.output
    header, *rows = table.output.splitlines()[1:]
    assert header.split()[-2:] == ["accepted", "tok/verify"] and len(rows) == 2
    spec, message = rng.choice(bad_specs(rng))
    refused = runner.invoke(qcompile_main, [*args, "--speculative", spec])
    assert refused.exit_code == 2 and "Invalid value for '--speculative'" in refused.output
    assert message.split(" (")[0] in " ".join(refused.output.split()), refused.output
