"""Steps run once at load so a server's first mixed batches do not stop to build kernels.

The captured graphs compile every kernel they hold, but attention runs eagerly in steps with prefill
(piecewise_graphs.py) and picks its kernels and their compiled variants from the step's mix: decode
rows beside prompts, fresh prompts long enough for fused attention, chunks after a cached prefix,
one prompt or several. Each first meeting used to cost a Triton compile in the middle of serving
(H100, qwen3-8b: 8 clients' first mixed steps stalled ~3 s, TTFT p90 3.1 s). These steps meet each
kind once, on the scratch block alone (every block-table entry is the scratch block, so their KV
writes land there and their reads see only it): no sequence's KV is touched.
"""

from __future__ import annotations

from qruntime.engine.step_chunk import StepChunk

PREFILL_TILE_PROBES = (9, 24, 48, 100)  # longest chunks of each prefill tile below 256 rows


def warm_up_steps(
    block_size: int, scratch_block: int, max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int
) -> list[list[StepChunk]]:
    """Mixed and prefill steps of the kinds a served batch has, each within the engine's limits."""

    def chunk(start: int, tokens: int) -> StepChunk | None:
        tokens = min(tokens, max_model_len - start)
        if start < 0 or tokens < 1:
            return None
        blocks = -(-(start + tokens) // block_size)
        return StepChunk((1,) * tokens, start, (scratch_block,) * blocks)

    def decodes(count: int, context: int) -> list[StepChunk | None]:
        return [chunk(min(context, max_model_len) - 1, 1) for _ in range(count)]

    budget = max_num_batched_tokens
    long_prompt = min(600, budget - 4, max_model_len - 1)  # past PagedAttention.SDPA_MIN_TOKENS (512)
    steps = [
        [*decodes(3, 40), chunk(0, 17)],  # decodes beside a short fresh prompt
        [*decodes(2, 300), chunk(0, 96), chunk(48, 64)],  # beside a fresh prompt and a chunk after a prefix
        [*decodes(5, max_model_len // 2), chunk(32, min(256, budget - 8))],  # long contexts: many partitions
        [chunk(0, min(130, budget)), chunk(0, 7)],  # prompts alone
        [chunk(16, min(200, budget))],  # a chunk after a prefix, alone
        [*decodes(2, 64), chunk(0, long_prompt)],  # a fresh long prompt: fused attention beside decodes
        [chunk(0, long_prompt)],
    ]
    # the prefill kernel's row tile follows the step's longest chunk (16, 32, 64, 128 rows, then the
    # config's): each tile alone and beside decodes (the 32-client level of serve_bench met the
    # 64-row one first mid-serving, a Triton compile there)
    for q_len in PREFILL_TILE_PROBES:
        steps += [[chunk(0, q_len)], [*decodes(2, 80), chunk(8, q_len)]]
    # the decode kernel of a mixed step splits each context less as the decodes grow, down to one
    # partition (another variant: it writes its rows directly) once they fill the GPU alone: the
    # most decodes a step can hold beside a prompt meet it (the 64-client level of serve_bench
    # built it mid-serving, with more than 32 decodes beside a prompt on an H100)
    steps.append([*decodes(min(max_num_seqs - 1, budget - 17), 40), chunk(0, 17)])
    out = []
    for step in steps:
        step = [c for c in step if c is not None]
        if step and sum(c.num_tokens for c in step) <= budget and len(step) <= max_num_seqs:
            out.append(step)
    return out
