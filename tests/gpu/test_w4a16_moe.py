"""The fused W4A16 MoE on the GPU (kernels/fused_moe_w4a16.py through the triton backend's MoE op):
its production branch (hardware casts, tensor-core dots, default configs) at qwen3-30b-a3b's
expert shapes (128 experts, top 8, hidden 2048, moe_intermediate 768, int4 groups of 128) against
the reference op on the same GPU, eagerly, with PDL, and replayed in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from qruntime.kernels import fused_moe_w4a16, pdl_supported
from qruntime.ops import moe, triton_ops
from qruntime.ops.base import OpEnv

pytestmark = pytest.mark.gpu

EXPERTS, TOP_K, HIDDEN, INTER, GROUP = 128, 8, 2048, 768, 128


def _experts(device, zero_point: bool) -> tuple[torch.Tensor, ...]:
    out, zps = [], []
    for rows, cols in ((2 * INTER, HIDDEN), (HIDDEN, INTER)):
        out.append(torch.randint(-(1 << 31), 1 << 31, (EXPERTS, rows, cols // 8), device=device, dtype=torch.int32))
        out.append((torch.rand(EXPERTS, rows, cols // GROUP, device=device) * 0.01 + 0.005).to(torch.bfloat16))
        zps.append(torch.randint(0, 16, (EXPERTS, rows, cols // GROUP), device=device, dtype=torch.uint8))
    return (*out, *zps) if zero_point else tuple(out)


def _ops(device, pdl: bool = False):
    attrs = {"num_experts": EXPERTS, "top_k": TOP_K, "norm_topk_prob": True, "linear": "W4A16Linear"}
    attrs["group_size"] = GROUP
    ref = moe.MoE(attrs, OpEnv(torch.bfloat16, device, None))
    fast = triton_ops.MoE(attrs, OpEnv(torch.bfloat16, device, None, pdl=pdl))
    assert fast.kernel is fused_moe_w4a16.fused_moe_w4a16 and fast.capturable
    return ref, fast


def _tokens_and_router(tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, H] and router rows under which each token's 8th logit beats its 9th by more than
    bf16 rounding (at a near-tie the kernel's and torch's logits may pick different experts): the
    rows of x at a near-tie are drawn again (one router for all tokens rarely has no near-tie: at 8
    tokens about 1 in 500 did, on an H200)."""
    router_w = torch.randn(EXPERTS, HIDDEN, device=device, dtype=torch.bfloat16) * 0.05
    x = torch.randn(tokens, HIDDEN, device=device, dtype=torch.bfloat16)
    for _ in range(100):
        top = (x.float() @ router_w.float().T).topk(TOP_K + 1, -1).values
        tie = ~(top[:, TOP_K - 1] - top[:, TOP_K] > 2**-6 * top.abs().amax(-1))
        if not bool(tie.any()):
            return x, router_w
        x[tie] = torch.randn(int(tie.sum()), HIDDEN, device=device, dtype=torch.bfloat16)
    raise AssertionError("tokens still at a near-tie after 100 draws")


def _token_sqnr_db(ref: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    ref, y = ref.float(), y.float()
    return 10 * torch.log10(ref.pow(2).mean(-1) / (ref - y).pow(2).mean(-1).clamp(min=1e-30))


@pytest.mark.parametrize("zero_point", [False, True], ids=["symmetric", "zero-points"])
@pytest.mark.parametrize("tokens", [1, 8, 256])
def test_fused_w4a16_moe_matches_the_reference_op_at_qwen3_30b_a3b_shapes(cuda, rng, tokens, zero_point):
    """The same roundings at the same points; cuBLAS and the kernel sum in other orders, and the
    reference adds the 8 weighted rows in bf16 (the kernel in fp32): ~2^-9 relative, ~50 dB. A wrong
    nibble, group scale or zero point gives ~0 dB. PDL changes no bit."""
    weights = _experts(cuda, zero_point)
    x, router_w = _tokens_and_router(tokens, cuda)
    ref_op, fast_op = _ops(cuda)
    ref = ref_op(None, x, router_w, *weights)
    y = fast_op(None, x, router_w, *weights)
    assert y.shape == (tokens, HIDDEN) and y.dtype == torch.bfloat16
    rows = _token_sqnr_db(ref, y)
    assert bool((rows > 40).all()), rows
    assert float(rows.mean()) > 45, rows
    if pdl_supported(cuda):
        _, pdl_op = _ops(cuda, pdl=True)
        assert torch.equal(pdl_op(None, x, router_w, *weights), y)


@pytest.mark.parametrize("tokens", [1, 8, 256])
def test_fused_w4a16_moe_in_a_cuda_graph_gives_the_eager_bits(cuda, rng, tokens):
    torch.manual_seed(rng.randrange(1 << 31))  # the rng fixture prints its seed
    weights = _experts(cuda, zero_point=tokens == 8)
    x = torch.randn(tokens, HIDDEN, device=cuda, dtype=torch.bfloat16)
    router_w = torch.randn(EXPERTS, HIDDEN, device=cuda, dtype=torch.bfloat16) * 0.05
    _, op = _ops(cuda, pdl=pdl_supported(cuda))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        op(None, x, router_w, *weights)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(None, x, router_w, *weights)
    for _ in range(2):  # new tokens (and so new experts) in the captured buffer each replay
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, op(None, x, router_w, *weights))
