"""Qwen3-VL's text decoder in plain torch as the VL graph tests feed it: random requests with image rows,
the graph inputs of a step over them, and the logits qruntime.vision.reference_text computes for them."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import torch
from graph_reference import make_step
from qruntime.vision.positions import MRopeConfig, mrope_cos_sin
from qruntime.vision.reference_config import MoeConfig, TextConfig
from qruntime.vision.reference_text import decode_layers

from qcompile.source.spec import ModelSpec

BLOCK, MAX_BLOCKS = 4, 4
# per sequence: the tokens each step adds (a prefill in two chunks, then one decode token)
CHUNKS = ((6, 4, 1), (3, 2, 1), (5, 3, 1))


@dataclasses.dataclass(frozen=True)
class Sequence:
    """One request: token ids, M-RoPE positions [3, n], which rows are image tokens, and the rows' image
    embeddings [n, H] and DeepStack features [D, n, H] (read at the image rows only)."""

    ids: torch.Tensor
    positions: torch.Tensor
    image: torch.Tensor  # bool [n]
    embeds: torch.Tensor
    features: torch.Tensor


def sequences(spec: ModelSpec, rng: random.Random) -> list[Sequence]:
    """Random sequences; the first has image rows in both prefill chunks, the second none at all."""
    assert spec.vision is not None
    hidden, depth = spec.hidden_size, spec.vision.deepstack_layers
    out = []
    for b, chunks in enumerate(CHUNKS):
        n = sum(chunks)
        image = torch.tensor([b != 1 and i < n - 1 and rng.random() < 0.5 for i in range(n)])
        if b == 0:
            image[1] = image[chunks[0] + 1] = True
        text = torch.arange(n) + rng.randrange(8)
        positions = torch.stack([text, text, text])  # a text token's three positions are equal
        grid = torch.tensor([[rng.randrange(40) for _ in range(n)] for _ in range(3)])
        positions = torch.where(image, grid, positions)  # an image token's (t, h, w) differ
        out.append(
            Sequence(
                ids=torch.tensor([rng.randrange(spec.vocab_size) for _ in range(n)]),
                positions=positions,
                image=image,
                embeds=torch.randn(n, hidden),
                features=torch.randn(depth, n, hidden),
            )
        )
    return out


def feeds_of(spec: ModelSpec, seqs: list[Sequence], starts: list[int], ends: list[int]) -> dict[str, torch.Tensor]:
    """The step that adds tokens starts[b]:ends[b] of every sequence: make_step's inputs with positions
    [3, T], and vision_rows / vision_embeds for the step's image rows, ascending."""
    feeds = make_step(
        [s.ids[a:e].tolist() for s, a, e in zip(seqs, starts, ends, strict=True)], starts, BLOCK, MAX_BLOCKS
    )
    feeds["positions"] = torch.cat([s.positions[:, a:e] for s, a, e in zip(seqs, starts, ends, strict=True)], 1)
    image = torch.cat([s.image[a:e] for s, a, e in zip(seqs, starts, ends, strict=True)])
    rows = torch.cat(
        [
            torch.cat([s.embeds[a:e, None], s.features[:, a:e].transpose(0, 1)], 1)
            for s, a, e in zip(seqs, starts, ends, strict=True)
        ]
    )  # [T, 1 + D, H]
    feeds["vision_rows"] = torch.nonzero(image).reshape(-1, 1)
    feeds["vision_embeds"] = rows[image].flatten(1).to(getattr(torch, spec.dtype))
    return feeds


def reference_weights(spec: ModelSpec, sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint under reference_text's names: no `model.` prefix, a sparse layer's experts stacked
    as Qwen3-VL-MoE stores them (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    w = {name.removeprefix("model."): t.float() for name, t in sources.items()}
    for i in range(spec.num_hidden_layers):
        if spec.is_sparse_layer(i):
            p = f"layers.{i}.mlp.experts."
            experts = range(spec.moe.num_experts)  # type: ignore[union-attr]
            w[p + "gate_up_proj"] = torch.stack(
                [torch.cat([w[f"{p}{e}.gate_proj.weight"], w[f"{p}{e}.up_proj.weight"]]) for e in experts]
            )
            w[p + "down_proj"] = torch.stack([w[f"{p}{e}.down_proj.weight"] for e in experts])
    return w


def text_config(spec: ModelSpec) -> TextConfig:
    moe = spec.moe
    return TextConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
        rms_norm_eps=spec.rms_norm_eps,
        moe=None
        if moe is None
        else MoeConfig(
            moe.num_experts,
            moe.num_experts_per_tok,
            moe.moe_intermediate_size,
            moe.decoder_sparse_step,
            tuple(moe.mlp_only_layers),
        ),
    )


def torch_logits(spec: ModelSpec, w: dict[str, torch.Tensor], seq: Sequence, end: int) -> torch.Tensor:
    """Qwen3-VL's logits of token end-1 of `seq`, computed over its tokens 0 .. end-1."""
    assert spec.vision is not None
    image = seq.image[:end]
    x = w["embed_tokens.weight"][seq.ids[:end]]
    x = x.index_put((image,), seq.embeds[:end][image])
    rope = MRopeConfig(spec.head_dim, spec.rope_theta, spec.vision.mrope_section)
    cos, sin = mrope_cos_sin(seq.positions[:, :end], rope)
    deepstack = [f[:end][image] for f in seq.features]
    normed = decode_layers(w, text_config(spec), x, cos, sin, image, deepstack)
    return normed[-1] @ w["lm_head.weight"].T


def assert_steps(
    run: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    spec: ModelSpec,
    seqs: list[Sequence],
    w: dict[str, torch.Tensor],
) -> None:
    """Run the steps of CHUNKS over `seqs` with `run` (graph inputs -> logits [B, V]); each step's logits
    must be torch_logits' within 1e-5 relative (of the step's largest logit)."""
    starts = [0] * len(seqs)
    for step in range(len(CHUNKS[0])):
        ends = [a + chunks[step] for a, chunks in zip(starts, CHUNKS, strict=True)]
        got = run(feeds_of(spec, seqs, starts, ends))
        want = torch.stack([torch_logits(spec, w, s, e) for s, e in zip(seqs, ends, strict=True)])
        scale = float(want.abs().max())
        torch.testing.assert_close(
            got, want, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, step=step: f"step {step}: {m}"
        )
        starts = ends
