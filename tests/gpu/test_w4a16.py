"""The W4A16 fast path on the GPU: the W4A16 GEMM's production branch (hardware casts, tensor-core
dots, its default configs) at qwen3-8b's shapes against the reference math, eagerly and replayed in
a CUDA graph, with and without PDL; and an engine on a small w4a16 artifact against the reference
backend on the same GPU."""

from __future__ import annotations

import json

import pytest
import qruntime
import torch
from qruntime.kernels import pdl_supported
from qruntime.kernels.w4a16_gemm import default_config, sweep_configs, w4a16_gemm
from qruntime.ops import triton_ops
from qruntime.ops.functional import dequantize_int4

pytestmark = pytest.mark.gpu

QWEN3_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # (N, K): qkv, o, gate_up, down
GROUP = 128
# conftest's GPU_MODEL (head_dim 128, GQA 2): hidden 256 and intermediate 512 are whole groups of 128
W4A16_MODEL = {
    "hidden_size": 256,
    "head_dim": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
}


def _operands(m: int, n: int, k: int, device):
    w = torch.randint(-(1 << 31), 1 << 31, (n, k // 8), device=device, dtype=torch.int32)
    ws = (torch.rand(n, k // GROUP, device=device) * 0.01 + 0.005).to(torch.bfloat16)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    return x, w, ws


@pytest.mark.parametrize("m", [1, 16, 300])
@pytest.mark.parametrize("n,k", QWEN3_8B)
def test_kernel_matches_the_reference_at_qwen3_8b_shapes(cuda, m, n, k):
    """fp32 output against the reference's weight (exact in fp32) multiplied in fp32: two fp32 sums of
    the same K products differ by at most 2 K u sum|terms| (u = 2^-24), and over the output by about
    sqrt(K) u |ref| (H100: up to 1.2e-5 relative, at 300 tokens; a wrong weight gives 1e-2); the bf16 output is the fp32
    one rounded once (the same launches, the same sums), and PDL changes no bit."""
    x, w, ws = _operands(m, n, k, cuda)
    weight = dequantize_int4(w, ws, GROUP).float()
    ref = x.float() @ weight.T  # fp32 GEMM (TF32 is off for fp32 matmuls by default)
    bound = x.float().abs() @ weight.abs().T
    y32 = w4a16_gemm(x, w, ws, GROUP, out_dtype=torch.float32)
    assert ((y32 - ref).abs() <= 2 * k * 2**-24 * bound).all(), float(((y32 - ref).abs() / bound).max())
    # over the whole output the order's rounding errors add up like a random walk: ~sqrt(K) u |ref|
    assert (y32 - ref).norm() <= 1e-4 * ref.norm()
    y = w4a16_gemm(x, w, ws, GROUP)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y32.to(torch.bfloat16))
    if pdl_supported(cuda):
        assert torch.equal(w4a16_gemm(x, w, ws, GROUP, pdl=True), y)
    if m <= 16:  # one token: the GEMV; more: the 16-row tiles
        assert default_config(m, n, k, GROUP).block_m == (1 if m == 1 else 16)


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("n,k", QWEN3_8B)
def test_kernel_in_a_cuda_graph_gives_the_eager_bits(cuda, m, n, k):
    x, w, ws = _operands(m, n, k, cuda)
    pdl = pdl_supported(cuda)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        w4a16_gemm(x, w, ws, GROUP, pdl=pdl)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4a16_gemm(x, w, ws, GROUP, pdl=pdl)
    for _ in range(2):  # new inputs in the captured buffer each replay
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, w4a16_gemm(x, w, ws, GROUP))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zp", [False, True], ids=["symmetric", "zero-points"])
@pytest.mark.parametrize("n,k", QWEN3_8B)
def test_gemv_matches_the_reference_at_qwen3_8b_shapes(cuda, n, k, zp, dtype):
    """The one-token GEMV (bf16: the packed bf16x2 unpacking of _dequant_pairs_bf16; fp16: the
    fp32 one) in fp32 against the reference's weight multiplied in fp32, within the two-orders
    bound (a wrong code, scale or zero point is off by ~1e-2 of the output); bf16 output the fp32
    one rounded once; bf16's packed path against the fp32 unpacking (fast=False) to the same bound;
    the tuner's other GEMV candidates too (bf16, symmetric), and replayed in a CUDA graph (with PDL and its L2
    prefetch where the GPU has it) it gives the eager bits."""
    x, w, ws = _operands(1, n, k, cuda)
    x, ws = x.to(dtype), ws.to(dtype)
    wz = torch.randint(0, 16, (n, k // GROUP), device=cuda, dtype=torch.uint8) if zp else None
    weight = dequantize_int4(w, ws, GROUP, wz).float()
    ref = x.float() @ weight.T
    bound = 2 * k * 2**-24 * (x.float().abs() @ weight.abs().T)
    config = default_config(1, n, k, GROUP)
    assert config.block_m == 1
    gemvs = [c for c in sweep_configs(1, n, k, GROUP) if c.block_m == 1] if dtype == torch.bfloat16 and not zp else []
    for cfg in gemvs:  # the tuner's GEMV candidates (bf16, symmetric: each compile takes seconds)
        y32 = w4a16_gemm(x, w, ws, GROUP, cfg, out_dtype=torch.float32, wz=wz)
        assert ((y32 - ref).abs() <= bound).all(), (cfg, float(((y32 - ref).abs() / bound).max()))
    y32 = w4a16_gemm(x, w, ws, GROUP, config, out_dtype=torch.float32, wz=wz)
    slow = w4a16_gemm(x, w, ws, GROUP, config, out_dtype=torch.float32, wz=wz, fast=False)
    assert ((slow - ref).abs() <= bound).all() and ((y32 - slow).abs() <= 2 * bound).all()
    y = w4a16_gemm(x, w, ws, GROUP, config, wz=wz)
    assert y.dtype == dtype and torch.equal(y, y32.to(dtype))
    pdl = pdl_supported(cuda)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        w4a16_gemm(x, w, ws, GROUP, config, wz=wz, pdl=pdl, prefetch_k=1024)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4a16_gemm(x, w, ws, GROUP, config, wz=wz, pdl=pdl, prefetch_k=1024)
    for _ in range(2):  # new inputs in the captured buffer each replay
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, w4a16_gemm(x, w, ws, GROUP, config, wz=wz))


@pytest.mark.parametrize("m", [5, 16, 1024])
@pytest.mark.parametrize("n,k", QWEN3_8B)
def test_swapped_tiles_match_the_reference_at_qwen3_8b_shapes(cuda, m, n, k):
    """Every swapped-tile candidate of the tuner (swap_ab: w · xᵀ on the tensor cores, the weight
    the first operand) in fp32 within the two-orders bound of the reference."""
    x, w, ws = _operands(m, n, k, cuda)
    weight = dequantize_int4(w, ws, GROUP).float()
    ref = x.float() @ weight.T
    bound = 2 * k * 2**-24 * (x.float().abs() @ weight.abs().T)
    swapped = [c for c in sweep_configs(m, n, k, GROUP) if c.swap_ab]
    assert swapped
    for cfg in swapped:
        y32 = w4a16_gemm(x, w, ws, GROUP, cfg, out_dtype=torch.float32)
        assert ((y32 - ref).abs() <= bound).all(), (cfg, float(((y32 - ref).abs() / bound).max()))


@pytest.fixture(scope="module")
def w4a16_artifact(make_ckpt, compiled, cuda):
    """The GPU tier's small dense model in w4a16."""
    return compiled(make_ckpt("tiny", **W4A16_MODEL), "w4a16")


def test_engine_gives_the_reference_backends_tokens(w4a16_artifact, cuda, rng):
    """The fast engine (W4A16 kernels, CUDA graphs) against the reference backend (whole-weight
    dequantization, eager) on the same GPU: logits to bf16 noise, the same greedy tokens except at a
    near-tie of the reference's logits."""
    vocab = json.loads((w4a16_artifact / "manifest.json").read_text())["spec"]["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 37, 130, 1)]
    greedy = qruntime.SamplingParams(max_tokens=16, ignore_eos=True)
    kwargs = dict(device="cuda", max_num_seqs=8, kv_cache_memory=256 << 20)
    with qruntime.load(w4a16_artifact, **kwargs) as fast:
        linears = [n.op for n in fast.runner.plan.nodes if type(n.op) is triton_ops.W4A16Linear]
        assert linears and all(op.kernel is not None for op in linears)
        fast_tokens = [o.token_ids for o in fast.generate(prompts, greedy)]
        fast_logits = [fast.score(p) for p in prompts]
    with qruntime.load(w4a16_artifact, backend="reference", **kwargs) as ref:
        ref_tokens = [o.token_ids for o in ref.generate(prompts, greedy)]
        for prompt, got in zip(prompts, fast_logits, strict=True):
            want = ref.score(prompt)
            noise = (got - want).pow(2).mean() / want.pow(2).mean()
            assert float(noise) < 1e-3, float(noise)
        for prompt, mine, theirs in zip(prompts, fast_tokens, ref_tokens, strict=True):
            assert len(mine) == len(theirs) == 16
            i = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), None)
            if i is None:
                continue
            logits = ref.score([*prompt, *theirs[:i]])[-1]  # the reference's logits where the two part
            gap = float(logits[theirs[i]] - logits[mine[i]])
            assert gap <= 0.02 * float(logits.abs().max()), (i, gap)  # a near-tie, not a wrong GEMM
