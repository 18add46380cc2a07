"""The GPU fast path: op classes that run Triton kernels (or cuBLASLt where the tuner chose it).

Each subclasses its reference op and keeps the reference semantics (docs/OPS.md); a case a kernel
does not cover (group-wise or per-tensor quantization: group_size != 0; CPU tensors) falls back to
the reference implementation.
Kernels are imported when an op is bound, so the reference path never imports triton.

FP8 activations are quantized to the artifact's target's format (OpEnv.fp8): float8_e4m3fnuz for
amd-gfx942, whose weights are stored as e4m3fnuz with doubled scales (qruntime.target), so every
product equals the nvidia-sm90 artifact's; a reference fallback's e4m3fn codes are transcoded to it
(to_e4m3fnuz: the same values). The GEMMs and the fused MoE read the format from the weights.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from qruntime.ops import attention, collective, moe, quant
from qruntime.ops import functional as fn
from qruntime.ops.base import OpBindError
from qruntime.target import to_e4m3fnuz

# torch's fused attention backends in the order tried (the first that takes the inputs runs)
SDPA_BACKENDS = (
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)


def in_target_format(env, quantized: tuple) -> tuple:
    """(xq, xs, *rest) of a reference quantization (e4m3fn) in the target's FP8 format env.fp8: as
    they are for e4m3fn, else to_e4m3fnuz's codes and doubled scales (xq * xs unchanged)."""
    if env.fp8 == torch.float8_e4m3fn:
        return quantized
    return (*to_e4m3fnuz(quantized[0], quantized[1]), *quantized[2:])


class DynamicQuant(quant.DynamicQuant):
    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        from qruntime.kernels.dynamic_quant import DeferredQuant, dynamic_quant

        self.kernel = dynamic_quant if self.a["group_size"] == 0 else None
        self.deferred = DeferredQuant
        # the PTPCLinear after this node quantizes one token's row itself (fold_dynamic_quant)
        self.defer = False

    def __call__(self, step, x):
        if self.kernel is None:
            return in_target_format(self.env, super().__call__(step, x))
        if self.defer and x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1:
            row = self.deferred(x, self.env.pdl, self.env.fp8)
            return row, row  # (xq, xs): the reader takes both as the one row
        return self.kernel(x, pdl=self.env.pdl, fp8=self.env.fp8)


class AddRMSNorm(quant.AddRMSNorm):
    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        from qruntime.kernels.add_rmsnorm_quant import DeferredRMSNorm, add_rmsnorm

        self.kernel = add_rmsnorm
        self.deferred = DeferredRMSNorm
        # the fused MoE after this node normalizes one token's row in its routing launch (fold_router_norm)
        self.defer = False

    def __call__(self, step, x, residual, w):
        if self.defer and (row := self.deferred.of(x, residual, w, self.a["epsilon"], self.env.pdl)):
            return row, row.residual_out
        return self.kernel(x, residual, w, self.a["epsilon"], pdl=self.env.pdl)


class AddRMSNormQuant(quant.AddRMSNormQuant):
    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        from qruntime.kernels.add_rmsnorm_quant import add_rmsnorm_quant

        self.kernel = add_rmsnorm_quant if self.a["group_size"] == 0 else None

    def __call__(self, step, x, residual, w):
        if self.kernel is None:
            return in_target_format(self.env, super().__call__(step, x, residual, w))
        return self.kernel(x, residual, w, self.a["epsilon"], pdl=self.env.pdl, fp8=self.env.fp8)


class SiluMulQuant(quant.SiluMulQuant):
    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        from qruntime.kernels.silu_mul_quant import silu_mul_quant

        self.kernel = silu_mul_quant if self.a["group_size"] == 0 else None

    def __call__(self, step, gate_up):
        if self.kernel is None:
            return in_target_format(self.env, super().__call__(step, gate_up))
        return self.kernel(gate_up, pdl=self.env.pdl, fp8=self.env.fp8)


class SiluMul(quant.SiluMul):
    """The unquantized SiLU-mul of a weight-only recipe (W4A16) in one launch."""

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        from qruntime.kernels.silu_mul_quant import silu_mul

        self.kernel = silu_mul

    def __call__(self, step, gate_up):
        return self.kernel(gate_up, pdl=self.env.pdl)


class PTPCLinear(quant.PTPCLinear):
    """FP8 GEMM by the backend tuned for (N, K) at the step's token count: our Triton kernel
    (with its tuned block/split config) or torch._scaled_mm (cuBLASLt)."""

    # with PDL: bytes of each weight row a Triton GEMM program asks L2 for before its wait (H100,
    # qwen3-8b batch-1 graph: 3.79 -> 3.74 ms; bench/results/launch_ab_qwen3-8b_f15e1f4_h100.json)
    prefetch_k = 1024

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        from qruntime.kernels.dynamic_quant import DeferredQuant
        from qruntime.kernels.fp8_gemm import GemmConfig, default_config, ptpc_fp8_gemm, ptpc_fp8_gemv_quant

        self.gemm, self.config_from, self.default = ptpc_fp8_gemm, GemmConfig.from_dict, default_config
        self.gemv_quant, self.deferred = ptpc_fp8_gemv_quant, DeferredQuant
        w, ws = (consts + (None,) * 4)[2:4]
        if w is None or ws is None:
            raise OpBindError("PTPCLinear's weight and scale must be graph initializers")
        self.n, self.k = w.shape
        self.key = f"PTPCLinear:{self.n}x{self.k}"
        self.ws_row = ws.float().reshape(1, -1).contiguous()  # [1, N] for cuBLASLt's rowwise scaling
        self.plans: dict[int, tuple[str, object]] = {}  # tokens -> (backend, config), filled on first use
        # the node after this one reads its output as split-K partials (fold_split_k_reductions)
        self.defer_reduce = False

    def _plan(self, m: int) -> tuple[str, object]:
        if m not in self.plans:
            tuned = self.env.kernels.lookup(self.key, m) if self.env.kernels is not None else None
            if tuned is not None and self.defer_reduce and "folded" in tuned:
                tuned = tuned["folded"]  # timed without the reduction launch, which the next kernel absorbs
            if tuned is not None and tuned.get("backend") == "cublaslt":
                self.plans[m] = ("cublaslt", None)
            elif tuned is not None:
                self.plans[m] = ("triton", self.config_from(tuned))
            else:
                self.plans[m] = ("triton", self.default(m, self.n, self.k))
        return self.plans[m]

    def __call__(self, step, xq, xs, w, ws):
        if isinstance(xq, self.deferred):  # one token's row, its DynamicQuant folded in (fold_dynamic_quant)
            backend, config = self._plan(1)
            if backend == "triton" and config.block_m == 1:
                return self.gemv_quant(
                    xq.x, w, ws, self.env.dtype, config, pdl=self.env.pdl, prefetch_k=self.prefetch_k
                )  # quantizes to w's format, the target's
            xq, xs = xq.quantize()  # the tuned kernel is not the GEMV: quantize in a launch first
        backend, config = self._plan(xq.shape[0])
        if backend == "cublaslt":
            return torch._scaled_mm(xq, w.T, scale_a=xs, scale_b=self.ws_row, out_dtype=self.env.dtype)
        return self.gemm(
            xq,
            xs,
            w,
            ws,
            out_dtype=self.env.dtype,
            config=config,
            pdl=self.env.pdl,
            prefetch_k=self.prefetch_k,
            defer_reduce=self.defer_reduce,
        )


class W4A16Linear(quant.W4A16Linear):
    """int4 weight-only GEMM (kernels/w4a16_gemm.py: the weight unpacked in registers, never
    dequantized in memory; one token by default a GEMV) with the config tuned for (N, K) at the
    step's token count, else its heuristic. The reference op runs where the kernel cannot: a CPU
    device without Triton's interpreter, a compute dtype other than bf16 / fp16, a weight that is
    not a graph initializer, or a group size no K tile fits."""

    # with PDL: bytes of each packed weight row a GEMV program asks L2 for before its wait (a weight
    # of at most 4 MB, a rank's slice, whole). 0 until an A/B on a GPU: the GEMV's defaults were
    # timed without it, and an up-front prefetch of whole rows measured slower (w4a16_gemm.default_gemv)
    prefetch_k = 0

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        from qruntime.kernels import kernel_runs_on
        from qruntime.kernels.w4a16_gemm import W4A16Config, default_config, supports_group, w4a16_gemm

        self.config_from, self.default = W4A16Config.from_dict, default_config
        w = (consts + (None, None))[1]
        group = self.a["group_size"]
        runs = kernel_runs_on(env.device) and env.dtype in (torch.bfloat16, torch.float16) and supports_group(group)
        self.kernel = w4a16_gemm if runs and w is not None else None
        self.n, self.k = (w.shape[0], w.shape[1] * 8) if w is not None else (0, 0)
        self.key = f"W4A16Linear:{self.n}x{self.k}"
        self.configs: dict[int, object] = {}  # tokens -> W4A16Config, filled on first use

    def _config(self, m: int):
        if m not in self.configs:
            tuned = self.env.kernels.lookup(self.key, m) if self.env.kernels is not None else None
            config = self.config_from(tuned) if tuned is not None else None
            if config is None or not config.fits(self.a["group_size"]):
                config = self.default(m, self.n, self.k, self.a["group_size"])
            self.configs[m] = config
        return self.configs[m]

    def __call__(self, step, x, w, ws, wz=None):
        if self.kernel is None or x.dtype != self.env.dtype:
            return super().__call__(step, x, w, ws, wz)
        config = self._config(x.shape[0])
        return self.kernel(x, w, ws, self.a["group_size"], config, pdl=self.env.pdl, wz=wz, prefetch_k=self.prefetch_k)


class MoE(moe.MoE):
    """The fused Triton MoE on a device Triton runs on, with the config tuned for the layer's shape at
    the step's token count, else its heuristic; a single token's router GEMV runs inside its routing
    launch. Its shapes depend on T only and it never syncs with the host, so the op is capturable
    then. Two kinds of experts run fused:
    - PTPC FP8 with per-token activations (linear PTPCLinear, group_size 0): kernels/fused_moe.py,
      table key fused_moe.table_key;
    - W4A16 (linear W4A16Linear: packed int4, group scales, optional zero points), a bf16 / fp16
      model: kernels/fused_moe_w4a16.py, table key fused_moe_w4a16.table_key (the int4 layout in it).
    Anything else (Gemm, BlockFP8Linear, FP8 group_size != 0, int4 groups no K tile fits, an fp32
    model, a CPU device without Triton's interpreter) runs the reference op."""

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        from qruntime.kernels import fused_moe, fused_moe_w4a16, kernel_runs_on
        from qruntime.kernels.add_rmsnorm_quant import DeferredRMSNorm
        from qruntime.kernels.w4a16_gemm import supports_group

        self.deferred_rms = DeferredRMSNorm
        self.kernel = self.counter = None
        linear, group = self.a["linear"], self.a["group_size"]
        self.int4 = linear == "W4A16Linear"
        runs = kernel_runs_on(env.device)
        if self.int4:
            runs = runs and env.dtype in (torch.bfloat16, torch.float16) and supports_group(group) and group % 8 == 0
        else:
            runs = runs and linear == "PTPCLinear" and group == 0
        module = fused_moe_w4a16 if self.int4 else fused_moe
        if runs:
            self.kernel = fused_moe_w4a16.fused_moe_w4a16 if self.int4 else fused_moe.fused_moe
            self.capturable = True  # the reference's routing-dependent host loop is gone
            # a single token's router runs in its routing launch, whose last program counts here
            self.counter = torch.zeros(1, dtype=torch.int32, device=env.device)
        self.config_from, self.default = fused_moe.config_from_dict, module.default_config
        self.configs: dict[int, object] = {}  # tokens -> MoEConfig | MoEGemvConfig, filled on first use
        # the node after this one adds each token's expert rows itself (fold_split_k_reductions)
        self.defer_combine = False
        self.expert_counts: torch.Tensor | None = None  # [E] int64: set it to count tokens per expert (benches)

    def table_key(self, w13: torch.Tensor, zero_points: bool) -> str:
        """The kernel-table key of this layer's experts (w13 as bound: int4 packs 8 columns a word)."""
        from qruntime.kernels import fused_moe, fused_moe_w4a16

        num_experts, inter2, cols = w13.shape
        if self.int4:
            return fused_moe_w4a16.table_key(
                num_experts, inter2, cols * 8, self.a["top_k"], self.a["group_size"], zero_points
            )
        return fused_moe.table_key(num_experts, inter2, cols, self.a["top_k"])

    def _config(self, tokens: int, w13: torch.Tensor, zero_points: bool = False):
        if tokens not in self.configs:
            key = self.table_key(w13, zero_points)
            tuned = self.env.kernels.lookup(key, tokens) if self.env.kernels is not None else None
            if tuned is not None:
                self.configs[tokens] = self.config_from(tuned)
            else:
                num_experts, inter2, cols = w13.shape
                hidden = cols * 8 if self.int4 else cols
                self.configs[tokens] = self.default(tokens, num_experts, inter2 // 2, hidden, self.a["top_k"])
        return self.configs[tokens]

    def __call__(self, step, x, router_w, w13, w13_scale, w2, w2_scale, *zero_points):
        if isinstance(x, self.deferred_rms):  # one token's row, its AddRMSNorm folded in (fold_router_norm)
            if not self.int4 and self.expert_counts is None and router_w.dtype == x.x.dtype:
                top_k, norm = self.a["top_k"], bool(self.a["norm_topk_prob"])
                return self.kernel(
                    x.x, None, w13, w13_scale, w2, w2_scale, top_k, norm, self._config(1, w13, False),
                    (router_w, self.counter, x.rms_args()), **self._launch,
                )  # fmt: skip
            x = x.normalize()
        if self.kernel is None or (self.int4 and x.dtype != self.env.dtype):
            return super().__call__(step, x, router_w, w13, w13_scale, w2, w2_scale, *zero_points)
        top_k, norm = self.a["top_k"], bool(self.a["norm_topk_prob"])
        w13_zp, w2_zp = (tuple(zero_points) + (None, None))[:2]
        config = self._config(x.shape[0], w13, w13_zp is not None)
        extra = {}  # int4 experts: the group size, zero points, the target's FP8 format (fused_moe reads its weights')
        if self.int4:
            extra = {"group_size": self.a["group_size"], "w13_zp": w13_zp, "w2_zp": w2_zp, "fp8": self.env.fp8}
        if x.shape[0] == 1 and self.expert_counts is None and router_w.dtype == x.dtype:
            return self.kernel(
                x, None, w13, w13_scale, w2, w2_scale, top_k, norm, config, (router_w, self.counter),
                **self._launch, **extra,
            )  # fmt: skip
        logits = F.linear(x, router_w)  # [T, E]
        if self.expert_counts is not None:  # the expert load report: same routing, counted (eager steps only)
            _, ids = fn.moe_routing(logits, top_k, norm)
            self.expert_counts += torch.bincount(ids.flatten(), minlength=self.expert_counts.numel())
        return self.kernel(x, logits, w13, w13_scale, w2, w2_scale, top_k, norm, config, **self._launch, **extra)

    @property
    def _launch(self) -> dict[str, bool]:
        return {"pdl": self.env.pdl, "defer_combine": self.defer_combine}


class QKNormRoPEKVWrite(attention.QKNormRoPEKVWrite):
    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        from qruntime.kernels.qknorm_rope_kvwrite import qknorm_rope_kvwrite

        self.kernel = qknorm_rope_kvwrite

    def __call__(self, step, qkv, q_norm_w, k_norm_w, positions, slots):
        a, cache = self.a, step.kv_cache
        q = self.kernel(
            qkv,
            q_norm_w,
            k_norm_w,
            positions,
            slots,
            cache.k[a["layer"]],
            cache.v[a["layer"]],
            num_heads=a["num_heads"],
            num_kv_heads=a["num_kv_heads"],
            head_dim=a["head_dim"],
            eps=a["epsilon"],
            theta=a["theta"],
            layout=cache.spec.layout,
            block_size=a["block_size"],
            k_scale=a["k_scale"],
            v_scale=a["v_scale"],
            pdl=self.env.pdl,
            mrope_section=self.mrope_section,
        )
        return q, q.new_empty(0, dtype=torch.uint8)


class PagedAttention(attention.PagedAttention):
    """Decode-only steps: the split-context decode kernel. Other steps split by rows: the sequences of
    q_len 1 (decodes beside prefill chunks) go to the decode kernel too, which writes their rows of
    the step's output; the others, if each is a fresh prompt (no cached prefix) of at least
    SDPA_MIN_TOKENS, to torch's fused attention on each prompt's K/V read back from the cache,
    cuDNN's kernel first (H100, 8000 tokens, 32/8 heads: cuDNN 872 µs, FlashAttention-2 1646 µs, our
    prefill kernel ~1970 µs: bench/results/sdpa_backends.json and fastpath_check.json), else to the
    varlen prefill kernel, which reads cached prefixes from the paged pools. The prefill kernel would
    spend a whole query tile per q head on a decode row: H100, qwen3-8b, 36 layers, 64 decodes at
    context 192 beside 16 prompts of 128 took 4.29 ms of GPU time that way, 2.31 ms split, the parts
    alone 0.81 + 1.34 ms (bench/results/mixed_attention_h100.json)."""

    capturable = True
    launches_from_bounds = True
    SDPA_MIN_TOKENS = 512

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        from qruntime.kernels.paged_decode_attention import paged_decode_attention, paged_kv
        from qruntime.kernels.paged_prefill_attention import paged_prefill_attention

        self.decode, self.prefill, self.paged_kv = paged_decode_attention, paged_prefill_attention, paged_kv
        self._checked = None  # (k_pool, v_pool, q dtype, their PagedKV): the pools' checks, done once

    def __call__(self, step, q, ready, block_tables, context_lens, query_start_loc):
        a, cache, meta = self.a, step.kv_cache, step.attn
        common = dict(
            layout=cache.spec.layout,
            block_size=a["block_size"],
            scale=a["scale"],
            k_scale=a["k_scale"],
            v_scale=a["v_scale"],
            num_kv_heads=a["num_kv_heads"],
        )
        pdl = self.env.pdl
        pools = (cache.k[a["layer"]], cache.v[a["layer"]])
        if meta.bounds_only:  # a captured mixed step (engine/mixed_graphs.py): grids from the buffers' sizes
            kv = self._pools_checked(q, pools, common)
            args = (q, *pools, block_tables, context_lens, query_start_loc)
            out = self.prefill(*args, max_q_len=q.shape[0], work=meta.work, kv=kv, pdl=pdl, **common)
            bound = min(block_tables.shape[0], q.shape[0])
            kwargs = dict(query_start_loc=query_start_loc, num_decodes=bound, work=meta.work, out=out)
            self.decode(*args[:5], max_context_len=meta.max_context_len, kv=kv, pdl=pdl, **kwargs, **common)
            return out
        if meta.decode_only:
            kv = self._pools_checked(q, pools, common)
            return self.decode(
                q, *pools, block_tables, context_lens, max_context_len=meta.max_context_len, kv=kv, pdl=pdl, **common
            )
        q_lens = list(map(operator.sub, meta.query_start[1:], meta.query_start[:-1]))
        num_decodes = q_lens.count(1)  # host ints only: no sync, no index tensor (the kernels scan)
        longest = meta.max_q_len or max(q_lens, default=0)  # metadata built without max_q_len: 0
        if self._sdpa_prefill_wanted(meta, q_lens):
            out = self._sdpa_prefill(step, q, q_lens)
        else:
            num_prefills = len(q_lens) - num_decodes if num_decodes else None  # None: no decode rows to skip
            args = (q, *pools, block_tables, context_lens, query_start_loc)
            kv = self._pools_checked(q, pools, common)
            out = self.prefill(*args, max_q_len=longest, num_prefills=num_prefills, kv=kv, pdl=pdl, **common)
        if num_decodes:
            args = (q, *pools, block_tables, context_lens)
            kwargs = dict(query_start_loc=query_start_loc, num_decodes=num_decodes, out=out, **common)
            kv = self._pools_checked(q, pools, common)
            self.decode(*args, max_context_len=meta.max_context_len, kv=kv, pdl=pdl, **kwargs)
        return out

    def _pools_checked(self, q, pools, common):
        """paged_kv of this layer's pools, computed again only when they or q's dtype change (never, in
        an engine): per call, those checks took more host time than the rest of a kernel call."""
        checked = self._checked
        if checked is None or checked[0] is not pools[0] or checked[1] is not pools[1] or checked[2] != q.dtype:
            kv = self.paged_kv(
                common["layout"], q, *pools, block_size=common["block_size"],
                num_kv_heads=common["num_kv_heads"], k_scale=common["k_scale"], v_scale=common["v_scale"],
            )  # fmt: skip
            self._checked = checked = (*pools, q.dtype, kv)
        return checked[3]

    def bounds_work_size(self, tokens: int, seqs: int) -> int:
        from qruntime.kernels.paged_prefill_attention import work_size

        return work_size(tokens, seqs)

    def bounds_work(self, meta, tokens: int, seqs: int):
        """The prefill kernel's tiles and the decode kernel's rows (kernels/paged_prefill_attention.py)."""
        from qruntime.kernels.paged_prefill_attention import bounds_work

        return bounds_work(meta.query_start, meta.context_lens, tokens, seqs)

    def prefers_eager(self, meta) -> bool:
        """Fresh prompts of SDPA_MIN_TOKENS or more: cuDNN's attention, which only an eager step runs."""
        return self._sdpa_prefill_wanted(meta, list(map(operator.sub, meta.query_start[1:], meta.query_start[:-1])))

    def _sdpa_prefill_wanted(self, meta, q_lens: list[int]) -> bool:
        """Some sequence is a prompt, and every one that is not a decode is a whole prompt (no cached
        prefix) of SDPA_MIN_TOKENS or more."""
        return max(q_lens, default=0) >= self.SDPA_MIN_TOKENS and all(
            ctx == n >= self.SDPA_MIN_TOKENS for ctx, n in zip(meta.context_lens, q_lens, strict=True) if n != 1
        )

    def _sdpa_prefill(self, step, q, q_lens: list[int]):
        """The rows of the prompts (q_len != 1); decode rows are left for the decode kernel."""
        a, meta = self.a, step.attn
        out = torch.empty(q.shape[0], a["num_heads"] * a["head_dim"], dtype=q.dtype, device=q.device)
        for b in (b for b, n in enumerate(q_lens) if n != 1):
            start, end = meta.query_start[b], meta.query_start[b + 1]
            k, v = step.kv_cache.gather(a["layer"], meta.cache_slots[b], a["k_scale"], a["v_scale"], q.dtype)
            with sdpa_kernel(list(SDPA_BACKENDS), set_priority=True):
                o = torch.nn.functional.scaled_dot_product_attention(
                    q[start:end].transpose(0, 1)[None],
                    k.transpose(0, 1)[None],
                    v.transpose(0, 1)[None],
                    is_causal=True,
                    scale=a["scale"],
                    enable_gqa=True,
                )  # [1, nh, T, d]
            out[start:end] = o[0].transpose(0, 1).reshape(end - start, -1)
        return out


# the kernels that add up a deferred output themselves (kernels/deferred_sum.py), by its maker
SPLIT_K_READERS = (AddRMSNorm, AddRMSNormQuant, SiluMulQuant, QKNormRoPEKVWrite)
# None: the MoE's combine stays a launch of its own. Folded into the next norm it cost a step
# 0.01-0.02 ms more (H100, qwen3-30b-a3b batch 1, 3.093 -> 3.105-3.113 ms: the norm is one program
# per token; bench/results/launch_ab_qwen3-30b-a3b_moe_c95e7ce_h100.json). (AddRMSNorm,
# AddRMSNormQuant) turns it on.
PAIR_ROWS_READERS: tuple[type, ...] = ()


def _readers(plan) -> dict[str, list[int]]:
    """Activation name -> the indices of the plan's nodes that read it."""
    readers: dict[str, list[int]] = {}
    for index, node in enumerate(plan.nodes):
        for name in node.inputs:
            readers.setdefault(name, []).append(index)
    return readers


def fold_split_k_reductions(plan) -> int:
    """Let each Triton GEMM (and fused MoE) whose output only the next node reads, a kernel that can
    add it up (SPLIT_K_READERS; PAIR_ROWS_READERS for the MoE; as bound: not their all-reduce
    forms), hand it the slices of that output: a split-K launch's partials (fp8_gemm.SplitKPartials)
    instead of launching the reduction, the MoE's weighted expert rows (moe_combine.PairRows)
    instead of launching the combine. That kernel adds them as the saved launch would, to the same
    bits. The two nodes are adjacent, so no piecewise-graph boundary falls between them. Returns
    the ops changed."""
    readers = _readers(plan)
    folded = 0
    for index, (node, reader) in enumerate(zip(plan.nodes, plan.nodes[1:], strict=False)):
        out = node.outputs[0]
        if not (
            getattr(reader.op, "kernel", None) is not None
            and reader.inputs[0] == out
            and readers.get(out) == [index + 1]
            and out != plan.output
        ):
            continue
        if type(node.op) is PTPCLinear and type(reader.op) in SPLIT_K_READERS:
            node.op.defer_reduce = True
            folded += 1
        elif type(node.op) is MoE and node.op.kernel is not None and type(reader.op) in PAIR_ROWS_READERS:
            node.op.defer_combine = True
            folded += 1
    return folded


def _quantized_inputs(plan, kind: type, readers: dict[str, list[int]]):
    """(index, node) of each Triton `kind` node (its kernel bound) whose first two outputs, an FP8
    row and its scale, only the next node reads, a PTPCLinear taking them as its input."""
    for index, (node, reader) in enumerate(zip(plan.nodes, plan.nodes[1:], strict=False)):
        outs = tuple(node.outputs[:2])
        if (
            type(node.op) is kind
            and node.op.kernel is not None
            and type(reader.op) is PTPCLinear
            and tuple(reader.inputs[:2]) == outs
            and all(readers.get(out) == [index + 1] and out != plan.output for out in outs)
        ):
            yield index, node


def fold_dynamic_quant(plan) -> int:
    """Let each Triton DynamicQuant (per-token) whose two outputs only the next node reads, a
    PTPCLinear (o_proj after attention), hand it one token's unquantized row (DeferredQuant) at
    batch-1 decode: where that GEMM runs the GEMV, the GEMV quantizes the row as it reads it
    (fp8_gemm.ptpc_fp8_gemv_quant: the same codes and scale, so the same bits), saving the
    quantization's launch; otherwise the GEMM quantizes it in that launch first. Returns the ops changed."""
    folded = 0
    for _, node in _quantized_inputs(plan, DynamicQuant, _readers(plan)):
        node.op.defer = True
        folded += 1
    return folded


def fold_router_norm(plan) -> int:
    """Let each Triton AddRMSNorm whose y only the next node reads, a fused FP8 MoE, hand it one
    token's x, residual and norm weight (DeferredRMSNorm) at batch-1 decode: its routing launch,
    whose every program reads the whole row for the router GEMV anyway, normalizes it
    (moe_routing.moe_router_one's rms; program 0 writes residual_out), saving the norm's launch. On
    by default: about 1 us a MoE layer saved (H200, qwen3-30b-a3b without PDL: the routing launch
    5.3 -> 6.1 us for a 1.8 us norm launch). Not the all-reduce form. Returns the norms changed."""
    readers = _readers(plan)
    folded = 0
    for index, (node, reader) in enumerate(zip(plan.nodes, plan.nodes[1:], strict=False)):
        y = node.outputs[0]
        if (  # the norm before a fused FP8 MoE: its one-token routing launch normalizes the row
            type(node.op) is AddRMSNorm
            and type(reader.op) is MoE
            and reader.op.kernel is not None
            and not reader.op.int4
            and reader.inputs[0] == y
            and readers.get(y) == [index + 1]
            and y != plan.output
        ):
            node.op.defer = True
            folded += 1
    return folded


FAST_OPS = (
    DynamicQuant,
    AddRMSNorm,
    AddRMSNormQuant,
    SiluMul,
    SiluMulQuant,
    PTPCLinear,
    W4A16Linear,
    MoE,
    QKNormRoPEKVWrite,
    PagedAttention,
)


class AllReduce(collective.AllReduce):
    """The sum over the ranks, reduced in place: x is the rank's partial sum, which nothing else reads.
    Decode-sized messages take the custom kernel over peer memory (OpEnv.all_reduce), others NCCL."""

    def __call__(self, step, x):
        if self.env.all_reduce is not None:
            return self.env.all_reduce.all_reduce(x, pdl=self.env.pdl)
        torch.distributed.all_reduce(x, group=self.env.tp_group)
        return x


def _fused_all_reduce(env, x, residual, w, eps: float, quant: bool):
    """The one-kernel all-reduce + AddRMSNorm[Quant], or None when the message takes NCCL (also when
    it would quantize to another FP8 than e4m3fn: the peer-memory kernels write e4m3fn only)."""
    if env.all_reduce is None or (quant and env.fp8 != torch.float8_e4m3fn):
        return None
    return env.all_reduce.all_reduce_add_rmsnorm(x, residual, w, eps, quant, pdl=env.pdl)


class AllReduceAddRMSNorm(AddRMSNorm):
    """One kernel sums x over the ranks through peer memory and normalizes (decode-sized messages);
    otherwise all-reduce x in place (the rank's partial sum, read by nothing else), then AddRMSNorm's kernel."""

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        collective.check_group(env)

    def __call__(self, step, x, residual, w):
        fused = _fused_all_reduce(self.env, x, residual, w, self.a["epsilon"], quant=False)
        if fused is not None:
            return fused
        torch.distributed.all_reduce(x, group=self.env.tp_group)
        return super().__call__(step, x, residual, w)


class AllReduceAddRMSNormQuant(AddRMSNormQuant):
    """As AllReduceAddRMSNorm, with per-token quantization (other group sizes: NCCL, then the reference)."""

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        collective.check_group(env)

    def __call__(self, step, x, residual, w):
        if self.kernel is not None:
            fused = _fused_all_reduce(self.env, x, residual, w, self.a["epsilon"], quant=True)
            if fused is not None:
                return fused
        torch.distributed.all_reduce(x, group=self.env.tp_group)
        return super().__call__(step, x, residual, w)


FAST_COLLECTIVE_OPS = (AllReduce, AllReduceAddRMSNorm, AllReduceAddRMSNormQuant)
