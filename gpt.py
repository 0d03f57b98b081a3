"""The GPT model: config, architecture, initialization, accounting.

1. GPTConfig + PRESETS: GPT-2's sizes (124M ... 1.5B), tiny ones for tests and
   CPU runs, and Llama-shaped ones. Field names follow Megatron-LM's flags.
2. Plug-in seams: `make_layernorm` builds every norm, CausalSelfAttention.attend
   picks the attention; another implementation is one more name in
   ATTENTION_IMPLS / LAYERNORM_IMPLS and one more branch there.
3. The model: by default GPT-2's (learned positions, pre-LayerNorm blocks,
   tanh-GELU MLP, LM head tied to wte); GPT.forward reads as nanoGPT's, its
   variants (KV cache, run_blocks, the fused loss) are branches. Each
   architecture option is decided in one place: rope (rope_angles/apply_rope),
   RMSNorm (make_layernorm), SwiGLU (MLP), grouped-query attention
   (CausalSelfAttention), no linear biases (the two modules' constructors),
   an untied head (GPT.head), q/k norms (CausalSelfAttention), a mixture of
   experts in the MLP's place (MoE; its parallel layers: expert_parallel.py).
4. GPT-2 initialization (`init_weights`).
5. Tensor parallelism (Megatron-style, see parallel.py): each layer is built
   and initialized as for tp=1, then sliced (shard_block; see GPT.__init__).
   Domino (domino_blocks) hides the TP all-reduces. A pipeline stage keeps the
   pieces pipeline.stage_model names (GPT(config, keep)).
6. Generation: the KV cache and `generate`.
7. Parameter/FLOP accounting (`count_parameters`, `flops_per_token`).
8. The checks of a GPTConfig (`check_config`).
Hugging Face GPT-2 and Llama import and export live in huggingface.py.

Vocabulary padding: the embedding has `padded_vocab_size` rows (50304 for
GPT-2's 50257 tokens, a multiple of 128: Megatron's --make-vocab-size-divisible-by)
for friendly matmul shapes and weight shapes independent of the parallel
layout. The extra rows are never produced by the tokenizer nor sampled.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import context
import expert_parallel
import fused_kernels
import fused_loss
import parallel
from launch import UsageError

# -----------------------------------------------------------------------------
# Config

ATTENTION_IMPLS = ("torch", "triton")  # "triton": fused_kernels.flash_attention (FlashAttention-2)
LAYERNORM_IMPLS = ("torch", "triton")  # "triton": fused_kernels.TritonLayerNorm (fused LayerNorm)
LOSS_IMPLS = ("fused", "full")         # "fused": fused_loss.FusedLinearCrossEntropy (head + loss in spans)
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


@dataclass
class GPTConfig:
    num_layers: int = 12
    hidden_size: int = 768
    num_attention_heads: int = 12
    ffn_hidden_size: int | None = None  # the MLP's width; None: 4 * hidden_size (SwiGLU: 8/3 of it, see below)
    max_position_embeddings: int = 1024
    vocab_size: int = 50257          # true tokenizer vocabulary
    padded_vocab_size: int = 50304   # embedding rows (>= vocab_size)
    hidden_dropout: float = 0.0      # embeddings and residual branches
    attention_dropout: float = 0.0   # attention probabilities
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    attention_impl: str = "torch"
    layernorm_impl: str = "torch"
    loss_impl: str = "fused"         # or "full": full logits, then the cross-entropy
    activation_checkpointing: bool = False
    # Tensor parallelism only (ignored at tp=1). Domino: split each micro-batch
    # into this many chunks and overlap one chunk's all-reduces with another's
    # compute (1 = off). Sequence parallelism: LayerNorms, dropouts and residual
    # adds run on T/tp of the tokens on each rank.
    domino_chunks: int = 1
    sequence_parallel: bool = False
    # Context parallelism only (ignored at cp=1): how attention reaches the
    # other CP ranks' tokens, "p2p" (ring) or "a2a" (all-to-all); context.py.
    cp_comm_type: str = "p2p"
    # Architecture options (Megatron's flags). The defaults are GPT-2; all of
    # them on (rope, RMSNorm, swiglu, untied, no bias, GQA) is Llama's shape.
    position_embedding_type: str = "learned_absolute"  # or "rope": rotary q, k; no wpe
    rotary_base: float = 10000.0       # RoPE's theta
    rotary_percent: float = 1.0        # fraction of each head's dims that rotate
    normalization: str = "LayerNorm"   # or "RMSNorm" (no mean, no bias)
    swiglu: bool = False               # MLP = proj(silu(gate(x)) * up(x)), each ffn wide
    untie_embeddings_and_output_weights: bool = False  # own LM head, not wte
    disable_bias_linear: bool = False  # no biases in the linear layers
    # key/value heads (G in shapes); fewer than the query heads is grouped-query
    # attention. None: one per query head
    num_query_groups: int | None = None
    qk_layernorm: bool = False         # each head's q and k normed before RoPE (Qwen3, OLMo 2)
    # Mixture of experts (MoE below; expert_parallel.py), Megatron's flags. How
    # many ranks share the experts is the layout's (parallel.initialize), not the model's.
    num_experts: int | None = None     # E experts in the MoE layers; None: every MLP dense
    moe_layer_freq: int | list = 1     # layer i is MoE if i % freq == 0; or one 0/1 per layer
    moe_ffn_hidden_size: int | None = None  # each expert's MLP width; None: ffn_hidden_size
    moe_router_topk: int = 2           # k experts per token
    moe_router_score_function: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    moe_router_pre_softmax: bool = False  # softmax over all E, then top-k (else top-k logits, then softmax)
    moe_shared_expert_intermediate_size: int | None = None  # an MLP every token runs, beside its k experts
    moe_shared_expert_gate: bool = False  # its output times sigmoid(x w) (Qwen2-MoE)
    moe_router_load_balancing_type: str = "aux_loss"  # or "seq_aux_loss", "none"
    moe_aux_loss_coeff: float = 0.0    # 0: no load-balancing loss
    moe_z_loss_coeff: float | None = None  # ST-MoE's router z-loss
    moe_router_enable_expert_bias: bool = False  # DeepSeek-V3's aux-loss-free balancing
    moe_router_bias_update_rate: float = 1e-3
    moe_expert_capacity_factor: float | None = None  # None: dropless
    moe_token_drop_policy: str = "probs"  # over capacity, keep the highest probs, or "position" (drop_tokens)
    moe_pad_expert_input_to_capacity: bool = False  # every expert gets exactly its capacity of tokens
    moe_grouped_gemm: bool = False     # a rank's experts in one grouped GEMM, not a loop
    moe_token_dispatcher_type: str = "allgather"  # or "alltoall": how tokens reach other ranks' experts

    def __post_init__(self):
        check_types(self)  # at the end of this file: before any value is used
        if self.ffn_hidden_size is None:  # under SwiGLU Megatron's: 3 matrices of about 4h's 2 in parameters
            self.ffn_hidden_size = int(8 * self.hidden_size / 3) // 64 * 64 if self.swiglu else 4 * self.hidden_size
            if self.ffn_hidden_size == 0:
                raise UsageError(f"SwiGLU's default MLP width, int(8h/3/64) x 64, is 0 at hidden_size "
                                 f"{self.hidden_size}: give --ffn-hidden-size")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        check_config(self)  # at the end of this file

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (the first ones), as Megatron counts them."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "GPTConfig":
        if name not in PRESETS:
            raise UsageError(f"unknown model preset {name!r}; valid presets: {list(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


# Llama's options; a Llama preset adds num_query_groups for GQA.
LLAMA_OPTIONS = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                     untie_embeddings_and_output_weights=True, disable_bias_linear=True)

PRESETS = {
    # GPT-2 family (Radford et al. 2019); all use 1024 positions.
    "124M": dict(num_layers=12, hidden_size=768, num_attention_heads=12),
    "350M": dict(num_layers=24, hidden_size=1024, num_attention_heads=16),
    "774M": dict(num_layers=36, hidden_size=1280, num_attention_heads=20),
    "1.5B": dict(num_layers=48, hidden_size=1600, num_attention_heads=25),
    # Small shapes: unit tests, and the default run on a laptop CPU.
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, max_position_embeddings=64),
    "cpu": dict(num_layers=4, hidden_size=256, num_attention_heads=4, max_position_embeddings=256),
    # Llama's shape (Touvron et al. 2023): every architecture option on.
    "llama-tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=176, max_position_embeddings=64, **LLAMA_OPTIONS),
    # GPT-2 124M's width and parameter count (125M): the untied head's 38.6M
    # are paid for with 8 layers instead of 12; SwiGLU's three matrices at
    # ffn 1920 cost about what GPT-2's two at 4 x 768 do.
    "llama-124M": dict(num_layers=8, hidden_size=768, num_attention_heads=12, num_query_groups=4,
                       ffn_hidden_size=1920, **LLAMA_OPTIONS),
}


def pad_vocab_size(vocab_size: int, multiple: int = 128) -> int:
    """Round up to a multiple (Megatron's --make-vocab-size-divisible-by)."""
    return ((vocab_size + multiple - 1) // multiple) * multiple


# -----------------------------------------------------------------------------
# Model


def make_layernorm(config: GPTConfig, hidden: int) -> nn.Module:
    """Every norm in the model: LayerNorm (weight and bias) or RMSNorm (weight only)."""
    rms = config.normalization == "RMSNorm"
    if config.layernorm_impl == "triton":
        norm = fused_kernels.TritonRMSNorm if rms else fused_kernels.TritonLayerNorm
    else:
        norm = nn.RMSNorm if rms else nn.LayerNorm
    return norm(hidden, eps=config.layernorm_epsilon)


def rope_angles(config: GPTConfig, position_ids):
    """RoPE's angles (Su et al., RoFormer), fp32: position p turns dim pair i by
    p * base^(-2i/R), R = config.rotary_dim. (T,) -> (T, R/2), (B, T) -> (B, 1, T, R/2)."""
    R = config.rotary_dim
    inv_freq = 1.0 / config.rotary_base ** (
        torch.arange(0, R, 2, device=position_ids.device).float() / R)  # (R/2,)
    angles = position_ids.float()[..., None] * inv_freq                  # (..., T, R/2)
    return angles if position_ids.dim() == 1 else angles[:, None]


def apply_rope(x, angles):
    """Rotate the first R dims of every head of x (B, nh, T, hd) by `angles`; dims
    past R pass through. Dim i pairs with dim i + R/2 (HF Llama's "rotate half"
    layout, so HF q/k weights need no permutation)."""
    R = 2 * angles.shape[-1]
    x1, x2, rest = x.split([R // 2, R // 2, x.shape[-1] - R], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rotated, rest], dim=-1)            # (B, nh, T, hd)


def make_dropout(p: float, per_rank: bool = False) -> nn.Module:
    """The model's dropouts: none at p = 0; per_rank (sequence parallelism)
    draws this rank's own masks, where the ranks hold other tokens."""
    if p == 0:
        return nn.Identity()
    drop = Dropout(p)
    drop.per_rank = per_rank and parallel.layout.tp_size > 1
    return drop


class Dropout(nn.Dropout):
    """nn.Dropout whose mask comes from this rank's own RNG stream when
    per_rank; otherwise the TP ranks hold replicated values and draw the same
    mask from the shared stream. See parallel.py, section 5."""
    per_rank = False

    def forward(self, x):
        if not self.training:
            return x
        # native_dropout keeps a 1-byte bool mask on every device, as
        # F.dropout does on CUDA only, so CPU measures GPU's activation memory.
        with parallel.per_rank_rng() if self.per_rank else contextlib.nullcontext():
            return torch.native_dropout(x, self.p, True)[0]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config, self.head_dim = config, config.head_dim
        H, bias = config.hidden_size, not config.disable_bias_linear
        kv = config.num_query_groups * config.head_dim  # K (and V) width: < H under GQA
        # One matmul for Q, K and V; output layout [Q | K | V], each head-major
        # (head 0's hd columns, then head 1's, ...), the same as HF's c_attn.
        self.qkv = nn.Linear(H, H + 2 * kv, bias=bias)
        self.proj = nn.Linear(H, H, bias=bias)
        parallel.mark(self.proj, residual_out=True)  # the scaled init, see init_weights
        self.resid_drop = make_dropout(config.hidden_dropout, per_rank=config.sequence_parallel)
        if config.qk_layernorm:  # over each head's hd dims, as Megatron's and Qwen3's
            self.q_norm, self.k_norm = (make_layernorm(config, config.head_dim) for _ in "qk")

    def forward(self, x, rope=None, cache=None, documents=None):
        y = self.attend(self.qkv(x), rope, cache, documents)  # (B, T, C/tp)
        return self.resid_drop(self.proj(y))                 # (B, T, C)

    def attend(self, qkv, rope=None, cache=None, documents=None):
        """Causal self-attention of the heads in qkv (B, T, (nh + 2G) * hd) -> (B, T, nh * hd).
        Under TP this rank's nh/tp query and G/tp key/value heads ([Q_r | K_r | V_r]). rope:
        rope_angles(...) or None; cache: KVCache.extend for this layer (generation);
        documents: (B, T) document ids (--reset-attention-mask)."""
        cfg, hd, tp = self.config, self.head_dim, parallel.layout.tp_size
        nh, G = cfg.num_attention_heads // tp, cfg.num_query_groups // tp  # the heads on this rank
        q, k, v = qkv.split([nh * hd, G * hd, G * hd], dim=2)
        q, k, v = q.unflatten(2, (nh, hd)), k.unflatten(2, (G, hd)), v.unflatten(2, (G, hd))  # (B, T, heads, hd)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T, hd), k and v (B, G, T, hd)
        if cfg.qk_layernorm:                             # before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        if cache is not None:
            k, v = cache(k, v)                           # (B, G, L + T, hd): the prefix's too
        prefix = k.shape[2] > q.shape[2]                 # new queries over a cached prefix
        spread = parallel.layout.cp_size > 1 and cache is None  # the other CP ranks' tokens too
        flash = cfg.attention_impl == "triton" and documents is None  # FlashAttention-2 (no dropout)
        # The textbook (nanoGPT's): causal softmax attention, scale 1/sqrt(hd); under GQA (G < nh)
        # query head h reads key/value head h // (nh/G); with documents, causal within each one.
        if not (prefix or spread or flash):
            p = cfg.attention_dropout if self.training else 0.0
            mask = None if documents is None else context.same_document(documents, documents, causal=True)
            # Each TP rank holds other heads: attention dropout draws this rank's own mask.
            with parallel.per_rank_rng() if p > 0 and tp > 1 else contextlib.nullcontext():
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None,
                                                   enable_gqa=G != nh)
        elif prefix:  # query i sees keys 0 .. L + i: the causal mask aligned bottom right, not top left
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=G != nh)
        elif spread:                                     # context.py: ring or all-to-all
            y = context.attention(q, k, v, cfg.cp_comm_type, cfg.attention_impl, documents)
        else:                                            # fused_kernels.py
            y = fused_kernels.flash_attention(q, k, v, causal=True)
        return y.transpose(1, 2).flatten(2)             # (B, T, nh * hd)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        bias, self.swiglu = not config.disable_bias_linear, config.swiglu
        # SwiGLU: fc's output is [gate | up], each ffn wide (under TP rank r holds [gate_r | up_r]).
        fc_out = 2 * config.ffn_hidden_size if config.swiglu else config.ffn_hidden_size
        self.fc = nn.Linear(config.hidden_size, fc_out, bias=bias)
        self.proj = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=bias)
        parallel.mark(self.proj, residual_out=True)
        self.drop = make_dropout(config.hidden_dropout, per_rank=config.sequence_parallel)

    def hidden(self, x, *chunk):
        """(B, T, C) -> (B, T, F), or (B, T, F/tp) under TP."""
        h = self.fc(x, *chunk)
        if self.swiglu:  # Shazeer, "GLU Variants Improve Transformer"
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        # GPT-2 uses the tanh approximation of GELU (HF calls it "gelu_new").
        return F.gelu(h, approximate="tanh")

    def forward(self, x):
        return self.drop(self.proj(self.hidden(x)))    # (B, T, C)


def is_moe_layer(config: GPTConfig, layer: int) -> bool:
    """Whether layer `layer` (from 0) has experts: Megatron's --moe-layer-freq, an
    interval (layers 0, freq, 2 freq, ...) or a pattern, one 0 or 1 per layer."""
    freq = config.moe_layer_freq
    return config.num_experts is not None and (layer % freq == 0 if isinstance(freq, int) else freq[layer] == 1)


class AuxLoss(torch.autograd.Function):
    """Megatron's way for a loss computed inside the model to join backward
    without being returned: forward passes x through; backward passes x's
    gradient on and gives `loss` the gradient `scale`, as if scale * loss had
    been added to the loss backward starts from (scale: that loss's own factor)."""

    @staticmethod
    def forward(ctx, x, loss, scale):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad):
        loss, = ctx.saved_tensors
        return grad, torch.ones_like(loss) * ctx.scale, None


def topk_routing(logits, config: GPTConfig, expert_bias=None):
    """logits (N, E) fp32 -> probs (N, E), k non-zeros a row, and routing_map (N, E)
    bool, the k chosen. softmax: the softmax of the k largest logits (the full
    softmax's top k, renormalized), or with pre_softmax the full softmax's top k
    as they are; sigmoid: the k largest sigmoids, summing to 1 if k > 1 (the
    expert bias, aux-loss-free balancing, picks the k but does not weigh them)."""
    k = config.moe_router_topk
    if config.moe_router_score_function == "sigmoid":
        scores = torch.sigmoid(logits)                                        # (N, E)
        chosen = torch.topk(scores if expert_bias is None else scores + expert_bias, k, dim=-1).indices
        top = scores.gather(1, chosen)                                        # (N, k)
        top = top / (top.sum(-1, keepdim=True) + 1e-20) if k > 1 else top
    elif config.moe_router_pre_softmax:
        top, chosen = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)    # (N, k) each
    else:
        top, chosen = torch.topk(logits, k, dim=-1)
        top = torch.softmax(top, dim=-1)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)
    return torch.zeros_like(logits).scatter(1, chosen, top), routing_map


def drop_tokens(probs, routing_map, config: GPTConfig):
    """Expert capacity (GShard, Switch): expert e takes at most ceil(k N / E x
    capacity_factor) of the N tokens; past it, those of highest prob stay
    ("probs"), or ("position") those torch.topk picks among its chosen tokens,
    as megatron-core's apply_router_token_dropping (documented as the earliest
    tokens; on a CPU not always). With padding, the map marks exactly
    `capacity` tokens per expert (the extra ones weighted 0): fixed shapes."""
    N, E = probs.shape
    capacity = math.ceil(N * config.moe_router_topk / E * config.moe_expert_capacity_factor)
    if capacity > N:  # room for every token
        keep = torch.ones_like(routing_map)
    else:
        by = probs if config.moe_token_drop_policy == "probs" else routing_map.int()
        kept = torch.topk(by, capacity, dim=0, sorted=False).indices          # (capacity, E)
        keep = torch.zeros_like(routing_map).scatter(0, kept, True)
    routing_map = keep if config.moe_pad_expert_input_to_capacity else routing_map & keep
    return probs * routing_map, routing_map


def load_balancing_loss(scores, chosen, k: int):
    """Switch's loss over groups of T tokens, scores and chosen (S, T, E) -> the
    mean over groups of E / (k T^2) sum_e (sum_t scores) (sum_t chosen): 1 when
    both spread evenly, E at worst. One group: aux_loss; one per sequence: seq_aux_loss.
    Under CP each rank holds 1/cp of every group's tokens: the sums are the CP group's (Megatron's);
    under expert TP 1 (SP) each TP rank 1/tp more: the sums are TP x CP's."""
    T, E = scores.shape[-2:]
    sums = torch.stack([scores.sum(-2), chosen.sum(-2)])                    # (2, S, E)
    split = parallel.layout.cp_size * parallel.layout.routing_tp_size  # the ranks holding parts of a sequence
    if split > 1:
        sums, T = expert_parallel.sum_over_sequence(sums), T * split
    return (sums[0] * sums[1]).sum(-1).mean() * E / (k * T * T)


class Experts(nn.Module):
    """The E expert MLPs (GELU or SwiGLU, moe_ffn_hidden_size = F wide), their
    weights stacked as Hugging Face's Mixtral stores them: fc (E, fc_out, C),
    proj (E, C, F), biases (E, fc_out) and (E, C) unless disabled. Under expert
    parallelism this rank holds E_local of them, from expert `first` on; under tensor
    parallelism each expert split as the dense MLP (shard_experts), and each TP
    rank adds 1/tp of the proj bias: g sums the partial outputs (whole under expert TP 1)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        H, Fe, El = config.hidden_size, config.moe_ffn_hidden_size, config.num_experts // parallel.layout.ep_size
        self.num_experts, self.first, self.swiglu = config.num_experts, parallel.layout.ep_rank * El, config.swiglu
        fc_out = 2 * Fe if config.swiglu else Fe  # SwiGLU: [gate | up], as MLP.fc
        self.fc = nn.Parameter(torch.empty(El, fc_out, H))
        self.proj = nn.Parameter(torch.empty(El, H, Fe))
        bias = not config.disable_bias_linear
        self.fc_bias = nn.Parameter(torch.zeros(El, fc_out)) if bias else None
        self.proj_bias = nn.Parameter(torch.zeros(El, H)) if bias else None
        for p in self.parameters():  # this rank's alone: expert_parallel.reduce_expert_grads
            parallel.mark(p, expert_parallel=True)

    def forward(self, e: int, x):
        """This rank's expert e's MLP: (n, C) -> (n, C)."""
        bias = (None, None) if self.fc_bias is None else (self.fc_bias[e], self.proj_bias[e] / parallel.layout.etp_size)
        return F.linear(self.activation(F.linear(x, self.fc[e], bias[0])), self.proj[e], bias[1])

    def activation(self, h):
        """MLP.hidden's activation, on fc's output: (n, fc_out) -> (n, F)."""
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(h, approximate="tanh")

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        """GPT-2's init: fc ~ N(0, std), proj ~ N(0, out_std), biases 0; drawn
        for all E experts, so each rank keeps the same numbers at any EP."""
        for w, s in ((self.fc, std), (self.proj, out_std)):
            w.copy_(w.new_empty(self.num_experts, *w.shape[1:]).normal_(0.0, s)[self.first:self.first + len(w)])
        for b in (self.fc_bias, self.proj_bias):
            if b is not None:
                b.zero_()


class MoE(nn.Module):
    """A mixture of experts in the MLP's place (Shazeer et al. 2017; Switch,
    Mixtral): a router scores the E experts for each token, and the token's
    output is the sum of its k best experts' MLPs, weighted by the router's probs:

        probs, routing_map = top-k(score(x W_router))    (N, E) each, k chosen a row
        y = sum over e chosen of probs[:, e] * MLP_e(x)  (+ a shared expert's MLP(x))

    forward is the plain loop over the experts; expert_parallel.py computes the
    same sum over the tokens sorted by expert, with the experts spread over
    ranks, and with the grouped GEMM."""

    aux_loss_scale = 1.0  # the factor of the LM loss that backward starts from (AuxLoss; set_aux_loss_scale)

    def __init__(self, config: GPTConfig):
        super().__init__()
        expert_parallel.check_layout(config)
        self.config, H, E = config, config.hidden_size, config.num_experts
        self.router = nn.Linear(H, E, bias=False)  # run in fp32: which experts a token gets is sensitive
        self.experts = Experts(config)
        self.shared_expert = self.shared_expert_gate = None
        if config.moe_shared_expert_intermediate_size:  # its dropout is the MoE's
            self.shared_expert = MLP(dataclasses.replace(
                config, ffn_hidden_size=config.moe_shared_expert_intermediate_size, hidden_dropout=0.0))
            if config.moe_shared_expert_gate:
                self.shared_expert_gate = nn.Linear(H, 1, bias=False)
        if config.moe_router_enable_expert_bias:  # fp32; tokens counted over a step (update_expert_bias)
            self.register_buffer("expert_bias", torch.zeros(E))
            self.register_buffer("tokens_per_expert", torch.zeros(E), persistent=False)
        else:
            self.expert_bias = None
        self.stats = {}  # name -> the sum of its values since the loop last read them (record)
        self.drop = make_dropout(config.hidden_dropout, per_rank=config.sequence_parallel)
        self.sequence_parallel = config.sequence_parallel and parallel.layout.tp_size > 1

    def forward(self, x):
        """(B, T, C) -> (B, T, C). Under TP the experts split as the dense MLP, and the
        whole mixture is its f ... g region: every rank routes all the TP group's
        tokens (under SP gathered (B, T/tp, C) -> (B, T, C), and reduce-scattered
        back), so routing, capacity and the aux losses see TP = 1's tokens. Under expert
        TP 1 (experts whole on each TP rank, SP) each rank routes its own (B, T/tp, C)."""
        sp = self.sequence_parallel
        if parallel.layout.whole_experts:
            y = self.mixture(x)                                             # (B, T/tp, C)
        else:
            y = self.mixture((parallel.gather_from_sequence_parallel_region if sp else
                              parallel.copy_to_tensor_parallel_region)(x))  # (B, T, C), partial sums under TP
            y = (parallel.reduce_scatter_to_sequence_parallel_region if sp else
                 parallel.reduce_from_tensor_parallel_region)(y)            # x's shape
        if self.shared_expert is not None:  # a dense MLP beside the experts (TP as MLP's, shard_block)
            shared = self.shared_expert(x)
            y = y + (shared if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * shared)
        return self.drop(y)

    def mixture(self, x):
        """The routed experts' weighted sum: (B, T, C) -> (B, T, C)."""
        h = x.flatten(0, 1)                                        # (N, C)
        probs, routing_map = self.route(h, x.shape[0])             # (N, E) each
        if parallel.layout.ep_size > 1 or self.config.moe_grouped_gemm:
            y = expert_parallel.experts(self.experts, h, probs, routing_map, self.config)
        else:
            y = torch.zeros_like(h)
            for e in range(self.config.num_experts):
                tokens = routing_map[:, e].nonzero().squeeze(1)    # (n_e,) the tokens expert e takes
                out = self.experts(e, h[tokens]) * probs[tokens, e, None]  # (n_e, C)
                y.index_add_(0, tokens, out.to(y.dtype))
        return y.view_as(x)

    def route(self, h, B: int):
        """h (N, C), B sequences of N/B tokens -> probs (N, E) fp32 and routing_map
        (N, E) bool; in training the auxiliary losses join backward and the
        forward's figures are recorded (record)."""
        cfg = self.config
        with torch.autocast(h.device.type, enabled=False):
            logits = F.linear(h.float(), self.router.weight.float())  # (N, E)
        probs, chosen = topk_routing(logits, cfg, self.expert_bias)
        routing_map = chosen
        if cfg.moe_expert_capacity_factor is not None:
            probs, routing_map = drop_tokens(probs, chosen, cfg)
        if self.training and torch.is_grad_enabled():
            probs, losses = self.add_aux_losses(probs, logits, B)
            if not parallel.recomputing:  # once a forward, not again where recomputation reruns it
                self.record(losses, chosen, routing_map)
        return probs, routing_map

    def add_aux_losses(self, probs, logits, B: int):
        """Attach the load-balancing loss (aux_loss over the N tokens, seq_aux_loss
        per sequence) and the z-loss to probs' backward, each times its
        coefficient -> (probs, {name: loss}), the losses without coefficients."""
        cfg, k, E = self.config, self.config.moe_router_topk, logits.shape[1]
        losses = {}
        kind = cfg.moe_router_load_balancing_type
        if kind != "none" and cfg.moe_aux_loss_coeff > 0:  # over every expert's score, not the chosen k's
            scores = torch.softmax(logits, dim=-1) if cfg.moe_router_score_function == "softmax" else \
                torch.sigmoid(logits) / (torch.sigmoid(logits).sum(-1, keepdim=True) + 1e-20)
            chosen = torch.zeros_like(scores).scatter(1, torch.topk(scores, k, dim=-1).indices, 1.0)
            S = B if kind == "seq_aux_loss" else 1
            name = "seq_load_balancing_loss" if kind == "seq_aux_loss" else "load_balancing_loss"
            losses[name] = (load_balancing_loss(scores.view(S, -1, E), chosen.view(S, -1, E), k), cfg.moe_aux_loss_coeff)
        if cfg.moe_z_loss_coeff:  # ST-MoE: keeps the logits small
            losses["z_loss"] = (torch.logsumexp(logits, dim=-1).square().mean(), cfg.moe_z_loss_coeff)
        if losses:
            # under TP a router's gradient is each rank's share, summed over TP (shard_experts; SP's): 1/tp each
            probs = AuxLoss.apply(probs, sum(coeff * loss for loss, coeff in losses.values()),
                                  self.aux_loss_scale / parallel.layout.tp_size)
        return probs, {name: loss for name, (loss, _) in losses.items()}

    def record(self, losses: dict, chosen, routing_map) -> None:
        """Add a training forward's figures to `stats` (train_ops.moe_figures reads them): each auxiliary loss,
        the tokens per expert chosen, those dropped, one forward; count the tokens for the expert bias."""
        figures = {**losses, "tokens": chosen.sum(0).float(), "dropped": (chosen & ~routing_map).sum().float(),
                   "forwards": torch.ones((), device=chosen.device)}
        for name, value in figures.items():
            self.stats[name] = self.stats.get(name, 0.0) + value.detach()
        if self.expert_bias is not None:
            # a new tensor: with += torch 2.13's compiled step at TP x DP returned this buffer as its loss
            self.tokens_per_expert = self.tokens_per_expert + routing_map.sum(0)


def moe_layers(model: nn.Module) -> dict:
    """The model's mixtures of experts, by layer number ("blocks.3.mlp": 3)."""
    return {int(n.split(".")[1]): m for n, m in model.named_modules() if isinstance(m, MoE)}


@torch.no_grad()
def update_expert_biases(layers, group=None) -> None:
    """DeepSeek-V3's aux-loss-free balancing, after each optimizer step: each expert's bias moves by the
    update rate toward the mean load (up if it took fewer tokens, down if more), from the tokens counted
    over the step on every rank of `group` (whose tokens differ), every MoE layer's in one all-reduce."""
    layers = [layer for layer in layers if layer.expert_bias is not None]
    if not layers:
        return
    counts = torch.stack([layer.tokens_per_expert for layer in layers])  # (L, E)
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(counts, group=group)
    for layer, count in zip(layers, counts):
        layer.expert_bias += torch.sign(count.mean() - count) * layer.config.moe_router_bias_update_rate
        layer.tokens_per_expert.zero_()


def set_aux_loss_scale(layers, batch: dict, micro_batches: int, scale=None) -> None:
    """Before a micro-batch's forward: the MoE `layers`' auxiliary losses will join backward with the factor
    its LM loss carries there (AuxLoss): 1/m of m micro-batches, the fp16 loss `scale` (or None); not CP's
    weight, the loss mask's share (the losses count every token, CP's whole sequences through the CP sums).
    A new tensor each time: a backward still to come keeps its own."""
    factor = torch.full((), 1 / micro_batches, device=batch["tokens"].device)
    factor = scale(factor) if scale else factor
    for layer in layers:
        layer.aux_loss_scale = factor


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x));
    the MLP is a mixture of experts on the MoE layers (is_moe_layer)."""

    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.ln_1 = make_layernorm(config, config.hidden_size)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_layernorm(config, config.hidden_size)
        self.mlp = MoE(config) if is_moe_layer(config, layer) else MLP(config)

    def forward(self, x, rope=None, cache=None, documents=None):
        if not getattr(self.ln_2, "fuses_residual_add", False):
            x = x + self.attn(self.ln_1(x), rope, cache, documents)  # (B, T, C)
            return x + self.mlp(self.ln_2(x))
        # fused_kernels.TritonLayerNorm: the residual add and ln_2 in one kernel
        x, h = add_and_norm(self.ln_2, x, self.attn(self.ln_1(x), rope, cache, documents))
        return x + self.mlp(h)


def add_and_norm(ln: nn.Module, x, branch):
    """(x + branch, ln(x + branch)); branch=None: (x, ln(x)). With
    layernorm_impl='triton' both run in one kernel (fused_kernels.add_layer_norm),
    saving a write and a read of the residual stream, forward and backward
    (Block.forward and Domino's sublayers)."""
    if branch is None:
        return x, ln(x)
    if getattr(ln, "fuses_residual_add", False):  # fused_kernels.TritonLayerNorm
        return ln(x, residual=branch)
    x = x + branch
    return x, ln(x)


def domino_blocks(blocks: nn.ModuleList, x, n_chunks: int, rope=None, documents=None):
    """The block stack with Domino overlap (the schedule: parallel.domino),
    (B, T, C) -> (B, T, C): the maths of running the blocks in turn (with
    dropout the masks are drawn in another order). The micro-batch splits along
    the batch into n_chunks (uneven is fine); each block is two sublayers,
    attention and MLP. Per-sample RoPE angles and document ids split with the batch.
    A mixture of experts is no sublayer: the chunks rejoin for it, so its routing,
    capacity and aux losses see the micro-batch's tokens, as without Domino."""
    per_sample = rope is not None and rope.dim() == 4  # (B, 1, T, R/2)
    ropes = rope.tensor_split(n_chunks, dim=0) if per_sample else [rope] * n_chunks
    docs = documents.tensor_split(n_chunks, dim=0) if documents is not None else [None] * n_chunks
    sp, sublayers = next(iter(blocks)).attn.qkv.sequence_parallel, []
    for b in blocks:
        sublayers.append(parallel.Sublayer(
            b.ln_1, lambda h, d, i, b=b: b.attn.attend(b.attn.qkv(h, d), ropes[i], documents=docs[i]),
            b.attn.proj, b.attn.resid_drop))
        if isinstance(b.mlp, MoE):  # the overlapped stack so far, then the experts on the whole x
            x = torch.cat(parallel.domino(sublayers, x.tensor_split(n_chunks, dim=0), add_and_norm, sp), dim=0)
            x, h = add_and_norm(b.ln_2, x, None)
            x, sublayers = x + b.mlp(h), []
        else:
            sublayers.append(parallel.Sublayer(b.ln_2, lambda h, d, i, b=b: b.mlp.hidden(h, d),
                                               b.mlp.proj, b.mlp.drop))
    if not sublayers:
        return x
    return torch.cat(parallel.domino(sublayers, x.tensor_split(n_chunks, dim=0), add_and_norm, sp), dim=0)


def tensor_parallel_piece(name: str, piece: nn.Module, cfg: GPTConfig) -> nn.Module:
    """This rank's tensor-parallel slice of one of GPT's pieces (the layout
    under shard_block); the piece itself at tp=1."""
    if parallel.layout.tp_size == 1:
        return piece
    if name == "wte":
        return parallel.VocabParallelEmbedding.from_embedding(piece, sequence_parallel=cfg.sequence_parallel)
    if name == "output_layer":  # vocab-parallel like wte: rank r owns the logits of its vocab rows
        return parallel.ColumnParallelLinear.from_linear(piece)
    if name.startswith("blocks."):
        shard_block(piece, cfg)
    return piece


def shard_block(block: Block, cfg: GPTConfig) -> None:
    """Swap a block's big matmuls for Megatron's parallel layers, each keeping
    this rank's slice of the full weight just initialized. The model's layout
    (tensor_parallel_piece swaps wte and output_layer):

        wte          VocabParallelEmbedding (vocab rows split; tied head)
        attn.qkv     ColumnParallelLinear, in blocks: rank r gets [Q_r|K_r|V_r]
        attn.proj    RowParallelLinear
        mlp.fc       ColumnParallelLinear (SwiGLU: 2 blocks, [gate_r|up_r])
        mlp.proj     RowParallelLinear
        mlp (MoE)    its experts split as mlp.fc and mlp.proj (shard_experts; whole at expert TP 1); its
                     shared expert, a dense MLP, as mlp.fc and mlp.proj
        output_layer ColumnParallelLinear (untied head; vocab rows split)
        norms, wpe, row-parallel biases: replicated

    With sequence_parallel the column-parallel layers all-gather their input's
    tokens and the row-parallel ones reduce-scatter their output. Parameter
    names are unchanged, so full_state_dict() has tp=1's keys."""
    sp = cfg.sequence_parallel
    Row = parallel.RowParallelLinear
    # Domino's column layers leave dX's reduction in flight, for another chunk to hide
    Column = parallel.DominoColumnParallelLinear if cfg.domino_chunks > 1 else parallel.ColumnParallelLinear
    kv = cfg.num_query_groups * cfg.head_dim
    # GQA: K and V are narrower than Q, so the three blocks are named by size
    qkv_blocks = 3 if kv == cfg.hidden_size else (cfg.hidden_size, kv, kv)
    block.attn.qkv = Column.from_linear(block.attn.qkv, blocks=qkv_blocks, sequence_parallel=sp)
    block.attn.proj = Row.from_linear(block.attn.proj, sequence_parallel=sp)
    if isinstance(block.mlp, MoE) and not parallel.layout.whole_experts:
        shard_experts(block.mlp, cfg)
    for mlp in [block.mlp.shared_expert] if isinstance(block.mlp, MoE) else [block.mlp]:
        if mlp is not None:
            mlp.fc = Column.from_linear(mlp.fc, blocks=2 if cfg.swiglu else 1, sequence_parallel=sp)
            mlp.proj = Row.from_linear(mlp.proj, sequence_parallel=sp)


def shard_experts(moe: MoE, cfg: GPTConfig) -> None:
    """A MoE's experts split as the dense MLP's fc and proj (Megatron's expert TP =
    TP): the stacked fc (and its bias) along fc_out, [gate_r | up_r] under SwiGLU,
    proj along its input, F. Inside the f ... g region (MoE.forward) the router and
    the proj bias are replicated and get each rank's share of their gradient:
    summed over TP by a hook (under SP, sum_sequence_parallel_grads's)."""
    lay, ex, gate_up = parallel.layout, moe.experts, 2 if cfg.swiglu else 1
    for name, dim, blocks in (("fc", 1, gate_up), ("fc_bias", 1, gate_up), ("proj", 2, 1)):
        full = getattr(ex, name)  # (E_local, fc_out, C), (E_local, fc_out), (E_local, C, F)
        if full is not None:
            shard = nn.Parameter(parallel.shard_tensor(full.detach(), dim, lay.tp_rank, lay.tp_size, blocks))
            parallel.mark(shard, expert_parallel=True, tensor_model_parallel=True, partition_dim=dim,
                          partition_blocks=blocks)
            setattr(ex, name, shard)
    for p in (moe.router.weight, ex.proj_bias) if not cfg.sequence_parallel else ():
        if p is not None:
            p.register_hook(parallel.all_reduce)


def init_weights(module: nn.Module, config: GPTConfig) -> None:
    """GPT-2 initialization of `module` and its submodules, in place: Linear and
    Embedding weights ~ N(0, std), biases 0, norm weights 1. Linears marked
    `residual_out` write into the residual stream, two per layer, so their std
    is scaled by 1/sqrt(2 * num_layers) to keep its variance from growing with depth."""
    std = config.init_method_std
    for m in module.modules():
        if isinstance(m, nn.Linear):
            residual = getattr(m, "residual_out", False)
            nn.init.normal_(m.weight, mean=0.0,
                            std=std / math.sqrt(2 * config.num_layers) if residual else std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=std)
        elif isinstance(m, Experts):  # the stacked weights of a MoE's experts
            m.init_weights(std, std / math.sqrt(2 * config.num_layers))
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.RMSNorm):
            nn.init.ones_(m.weight)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, keep: Callable[[str], bool] = lambda piece: True):
        """Every piece of the whole model is built and initialized in one order
        (_pieces), as on one device, so every layout starts from the same
        weights, and cut to this rank's tensor-parallel slice before the next
        is built: a rank never holds more than its slices plus one full layer.
        keep(piece): whether this module keeps it (all, but on a pipeline
        stage: pipeline.stage_model); the others are dropped, their random
        numbers drawn."""
        super().__init__()
        self.config = config
        # How blocks are recomputed under activation checkpointing; train.py
        # swaps in DeepSpeed's (which can partition saved inputs across TP ranks).
        self.checkpoint_fn = functools.partial(checkpoint, use_reentrant=False)
        parallel.check_layout(config)
        self.tensor_parallel = parallel.layout.tp_size > 1
        self.sequence_parallel = self.tensor_parallel and config.sequence_parallel  # off while generating
        self.domino = self.tensor_parallel and config.domino_chunks > 1
        self.drop = make_dropout(config.hidden_dropout, per_rank=config.sequence_parallel)
        for name, make in self._pieces():
            piece = self._build(make)
            if keep(name):
                self._keep(name, tensor_parallel_piece(name, piece, config))
        if self.sequence_parallel:  # norms and biases see T/tp tokens: sum their grads
            parallel.sum_sequence_parallel_grads(self)

    def _pieces(self):
        """(name, constructor) of every piece of the whole model, in init order."""
        c = self.config
        yield "wte", lambda: nn.Embedding(c.padded_vocab_size, c.hidden_size)
        if c.position_embedding_type == "learned_absolute":  # rope: positions act in attention
            yield "wpe", lambda: nn.Embedding(c.max_position_embeddings, c.hidden_size)
        for i in range(c.num_layers):
            yield f"blocks.{i}", lambda i=i: Block(c, i)
        yield "ln_f", lambda: make_layernorm(c, c.hidden_size)
        if c.untie_embeddings_and_output_weights:  # else the head is wte (see GPT.head)
            yield "output_layer", lambda: nn.Linear(c.hidden_size, c.padded_vocab_size, bias=False)

    def _keep(self, name: str, piece: nn.Module) -> None:
        kind, _, layer = name.partition(".")
        if kind == "blocks":
            # Registered as it comes, so named_modules() walks the pieces in
            # init order (zero.build_model_zero3 re-initializes in that order).
            if "blocks" not in self._modules:  # blocks.5 on the stage of layers 4-7: the whole model's keys
                self.blocks = nn.ModuleList()
            self.blocks.add_module(layer, piece)
            return
        setattr(self, name, piece)

    def _build(self, make: Callable[[], nn.Module]) -> nn.Module:
        """make() a piece and give it GPT-2's init. Only init_weights draws random
        numbers (the constructors' default init runs on a forked, discarded RNG),
        so the weights depend on the seed and the order of the pieces alone: the
        same for every tp, and when DeepSpeed's zero.Init re-runs init_weights."""
        with torch.random.fork_rng(devices=[]):
            module = make()
        init_weights(module, self.config)
        return module

    # -- forward --------------------------------------------------------------

    def forward(self, input_ids, position_ids=None, labels=None, loss_mask=None, kv_cache=None, document_ids=None):
        """input_ids (B, T) long -> logits (B, T, padded_vocab) or, with labels,
        the loss (see head). The ids are the caller's to check (train.check_batches,
        on the host). kv_cache (generate): a KVCache holding the positions
        before input_ids, which it extends. document_ids (B, T) long
        (--reset-attention-mask): a token attends only to its own document's
        tokens, those of equal id (data._document_starts). Under context
        parallelism (context.py) input_ids are this rank's share of each
        sequence, position_ids their places in it. Under sequence parallelism
        the blocks hold this rank's T/tp tokens. A pipeline stage runs the
        same pieces (embed, blocks, head), a model chunk at a time: pipeline.Stage."""
        T = input_ids.shape[1]
        start = kv_cache.length if kv_cache is not None else 0  # positions already in the cache
        if start + T > self.config.max_position_embeddings:
            raise UsageError(f"sequence length {start + T} exceeds max_position_embeddings "
                             f"({self.config.max_position_embeddings}); use a shorter --seq-length or a "
                             f"model with more positions")
        if position_ids is None:
            position_ids = torch.arange(start, start + T, device=input_ids.device)  # (T,) broadcasts over B
        x, rope = self.embed(input_ids, position_ids)               # (B, T[/tp], C)
        if kv_cache is None and not (self.domino or self.config.activation_checkpointing):
            for block in self.blocks:
                x = block(x, rope, documents=document_ids)          # (B, T[/tp], C)
        elif kv_cache is None:  # the same blocks, run otherwise (Domino, recomputation)
            x = self.run_blocks(x, rope, self.blocks, document_ids)
        else:  # generation: each layer reads and extends its cache
            for i, block in enumerate(self.blocks):
                x = block(x, rope, functools.partial(kv_cache.extend, i))
            kv_cache.length += T
        return self.head(x, labels, loss_mask)

    def embed(self, input_ids, position_ids):
        """Token (+ learned position) embeddings, dropout -> (x, RoPE angles or None).
        Under sequence parallelism x is this rank's (B, T/tp, C), so are its positions."""
        x = self.wte(input_ids)                                      # (B, T[/tp], C)
        if self.config.position_embedding_type == "rope":  # in attention, which sees all T
            return self.drop(x), rope_angles(self.config, position_ids)  # (T, R/2) or (B, 1, T, R/2)
        if self.sequence_parallel:
            s, r = position_ids.shape[-1] // parallel.layout.tp_size, parallel.layout.tp_rank
            position_ids = position_ids[..., r * s:(r + 1) * s]     # this rank's tokens
        return self.drop(x + self.wpe(position_ids)), None

    def run_blocks(self, x, rope, blocks, documents=None):
        """`blocks` in turn on x (B, T[/tp], C), under what changes how they run,
        not what they compute: Domino's overlap of TP all-reduces (domino_blocks)
        and activation checkpointing (each block recomputed in backward)."""
        n_chunks = min(self.config.domino_chunks, x.shape[0])
        if self.domino and n_chunks > 1:
            return domino_blocks(blocks, x, n_chunks, rope, documents)
        recompute = self.config.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in blocks:
            # The RoPE angles and documents ride in a closure, not as inputs:
            # DeepSpeed's --partition-activations would split every input.
            run = functools.partial(block, rope=rope, documents=documents)
            x = parallel.checkpoint_with_rng(self.checkpoint_fn, run, x) if recompute else run(x)
        return x

    def head(self, x, labels=None, loss_mask=None):
        """The final norm and the LM head: (B, T[/tp], C) -> logits (B, T,
        V_padded) or, with labels, the mean cross-entropy over the tokens
        loss_mask keeps (all without one; a label has no ignore value), fp32.
        loss_impl "fused" (the default) computes it without holding the logits whole
        (fused_loss.FusedLinearCrossEntropy). Under tensor parallelism each rank
        holds V/tp rows of the weight (Megatron's vocab-parallel head): h
        enters through f (under sequence parallelism it is all-gathered, and
        the backward reduce-scatter does f's sum), the logits are all-gathered
        and the loss's log-sum-exp is combined over the ranks."""
        h = self.ln_f(x)                                             # (B, T[/tp], C)
        tp = self.tensor_parallel
        if tp:
            h = (parallel.gather_from_sequence_parallel_region if self.sequence_parallel
                 else parallel.copy_to_tensor_parallel_region)(h)    # (B, T, C)
        # (V_padded[/tp], C): the LM head's own, or the token embedding's (tied)
        weight = self.output_layer.weight if self.config.untie_embeddings_and_output_weights else self.wte.weight
        if labels is None or self.config.loss_impl == "full":
            logits = F.linear(h, weight)                             # (B, T, V_padded[/tp])
            if labels is None:
                return parallel.gather_from_tensor_parallel_region(logits) if tp else logits
            if not tp:
                token_loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
            else:  # each rank holds V/tp of every row's logits
                token_loss = parallel.vocab_parallel_cross_entropy(logits, labels).flatten()  # (B*T,)
            if loss_mask is None:
                return token_loss.mean()
            mask = loss_mask.flatten().float()
            return (token_loss * mask).sum() / mask.sum().clamp(min=1.0)  # a fully masked batch: 0, not NaN
        return fused_loss.FusedLinearCrossEntropy.apply(h, weight, labels, loss_mask, torch.is_grad_enabled())

    # -- bookkeeping ------------------------------------------------------------

    def full_state_dict(self) -> dict:
        """The unsharded state dict that checkpoints store (a collective: every TP
        rank must call it), so checkpoints do not depend on the layout."""
        return parallel.full_state_dict(self)

    def load_full_state_dict(self, sd: dict) -> None:
        """Inverse of full_state_dict (strict): each rank keeps its slice, and a
        pipeline stage its own pieces of the whole model's state dict (a key of
        no piece, as a layer too many, is left for the strict load to report)."""
        mine = {name for name, _ in self.named_modules()}
        others = tuple(f"{name}." for name, _ in self._pieces() if name not in mine)  # another stage's
        parallel.load_full_state_dict(self, {k: v for k, v in sd.items() if not k.startswith(others)})


def weighted_loss(loss: torch.Tensor, batch: dict) -> torch.Tensor:
    """A micro-batch's loss as a step counts it (the one place for CP's weight): the model's, or
    times context.split_batch's loss_weight, this CP rank's share of the full sequences' mean."""
    return loss * batch["loss_weight"] if "loss_weight" in batch else loss


# -----------------------------------------------------------------------------
# Generation: a KV cache, top-k / top-p filtering, generate()
#
#     ids = generate(model, prompt_ids, max_new_tokens=100, temperature=0.8, top_k=50)

class KVCache:
    """The keys and values of every position generate() has run, per layer, so
    each new token costs one position, not a re-run of the prefix. Buffers
    (B, G_local, max_len, hd) per layer are allocated at the first call."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0    # positions cached, in every layer (GPT.forward advances it)
        self.buffers = {}  # layer -> (K, V)

    def extend(self, layer: int, k, v):
        """Write k, v (B, G, T, hd) at positions length .. length + T - 1 of
        `layer`; return the keys and values of positions 0 .. length + T - 1."""
        if layer not in self.buffers:
            B, G, _, hd = k.shape
            self.buffers[layer] = tuple(t.new_empty(B, G, self.max_len, hd) for t in (k, v))
        K, V = self.buffers[layer]
        end = self.length + k.shape[2]
        K[:, :, self.length:end] = k
        V[:, :, self.length:end] = v
        return K[:, :, :end], V[:, :, :end]                # (B, G, end, hd) each


@torch.no_grad()
def generate(model: GPT, input_ids, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None,
             eos_token_id: int | None = None, generator: torch.Generator | None = None,
             use_cache: bool = True):
    """Autoregressively extend input_ids (B, T) by up to max_new_tokens, in eval
    mode; temperature 0 is greedy; only ids < vocab_size are produced. Rows
    that emitted eos_token_id keep emitting it, and generation stops once all
    have. Once the sequence outgrows the model's positions, each step re-runs
    the last max_position_embeddings tokens without the cache (the window
    slides, so cached keys would sit at the wrong positions)."""
    if temperature < 0:
        raise UsageError(f"temperature must be >= 0, got {temperature}")
    was_training = model.training
    model.eval()
    max_pos = model.config.max_position_embeddings
    try:
        # A sequence growing one token at a time cannot be split over the TP ranks.
        with parallel.sequence_parallel_off(model):
            ids, unseen = input_ids, input_ids  # unseen: the tokens the cache does not hold yet
            cache = KVCache(max_pos) if use_cache else None
            finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
            for _ in range(max_new_tokens):
                if cache is not None and cache.length + unseen.shape[1] <= max_pos:
                    logits = model(unseen, kv_cache=cache)
                else:
                    cache = None
                    logits = model(ids[:, -max_pos:])                  # crop to the model's window
                logits = logits[:, -1, :model.config.vocab_size].float()  # (B, V) no pad ids
                if temperature == 0:
                    next_id = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
                else:
                    logits = filter_logits(logits / temperature, top_k, top_p)
                    probs = F.softmax(logits, dim=-1)
                    next_id = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
                if eos_token_id is not None:
                    next_id = next_id.masked_fill(finished[:, None], eos_token_id)
                    finished |= next_id[:, 0] == eos_token_id
                ids, unseen = torch.cat([ids, next_id], dim=1), next_id
                if eos_token_id is not None and bool(finished.all()):
                    break
        return ids
    finally:
        model.train(was_training)


def filter_logits(logits, top_k: int | None = None, top_p: float | None = None):
    """Set logits (B, V) outside the top-k / nucleus (top-p) set to -inf: top_p
    keeps the smallest set of most likely tokens whose probability reaches top_p."""
    if top_k is not None:
        if top_k < 1:
            raise UsageError(f"top_k must be >= 1, got {top_k}")
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise UsageError(f"top_p must be in (0, 1], got {top_p}")
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
        probs = F.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
        # The top token's mass_before is 0 < top_p, so it always survives.
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


# -----------------------------------------------------------------------------
# Parameter and FLOP accounting (analytic, so no model needs to be built)


def count_parameters(config: GPTConfig, exclude_embeddings: bool = False, active: bool = False) -> int:
    """The full model's parameters (a tied head once), from the config alone;
    exclude_embeddings drops wte, wpe and output_layer (Kaplan's N); active
    counts k of a MoE layer's E experts, those a token runs through."""
    H, Fh, L = config.hidden_size, config.ffn_hidden_size, config.num_layers
    b = 0 if config.disable_bias_linear else 1          # a bias per output feature
    norm = H if config.normalization == "RMSNorm" else 2 * H
    qkv = H + 2 * config.num_query_groups * config.head_dim  # GQA: narrower K and V
    def mlp(width: int) -> int:              # fc (SwiGLU: gate and up), proj
        return (H + b) * (2 * width if config.swiglu else width) + (width + b) * H
    per_layer = (2 * norm                    # ln_1, ln_2
                 + (H + b) * (qkv + H))      # qkv, attn.proj
    if config.qk_layernorm:                  # q_norm, k_norm over a head's dims
        per_layer += 2 * norm // H * config.head_dim
    n = L * per_layer + norm           # + ln_f
    E, k, shared = config.num_experts, config.moe_router_topk, config.moe_shared_expert_intermediate_size
    for layer in range(L):
        if not is_moe_layer(config, layer):
            n += mlp(Fh)
        else:                          # the router, E experts (k active), a shared expert and its gate
            n += H * E + (k if active else E) * mlp(config.moe_ffn_hidden_size)
            n += mlp(shared) + H * config.moe_shared_expert_gate if shared else 0
    if not exclude_embeddings:
        heads = 2 if config.untie_embeddings_and_output_weights else 1  # wte (+ output_layer)
        positions = config.max_position_embeddings if config.position_embedding_type != "rope" else 0
        n += (heads * config.padded_vocab_size + positions) * H
    return n


def flops_per_token(config: GPTConfig, seq_length: int) -> int:
    """Training FLOPs per token (forward + backward):

        6 * N  +  12 * num_layers * hidden_size * seq_length

    N = non-embedding parameters (of a MoE, those active) + hidden_size * padded_vocab_size: each weight
    costs 2 FLOPs forward and 4 backward; the LM head (tied or not) is one real
    matmul, embedding lookups are free. The second term is attention's Q K^T
    and P V: 2 * 2 * T * H forward per layer, times 3 with backward. The causal
    half is not subtracted (the PaLM / nanoGPT convention), so MFU compares."""
    H, L = config.hidden_size, config.num_layers
    n = count_parameters(config, exclude_embeddings=True, active=True) + H * config.padded_vocab_size
    return 6 * n + 12 * L * H * seq_length


# -----------------------------------------------------------------------------
# The checks of a GPTConfig (its __post_init__ runs them), before any model is built


# What each annotated type of a field admits. A config comes from flags, or from a file
# (a checkpoint's model_config, a Hugging Face config.json) that may hold anything: True
# is no size, and NaN or inf no epsilon or RoPE base (a model of them computes NaN).
ADMITS = {"int": ("an int", lambda v: isinstance(v, int) and not isinstance(v, bool)),
          "float": ("a finite number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                    and abs(v) <= sys.float_info.max),
          "bool": ("true or false", lambda v: isinstance(v, bool)),
          "str": ("a string", lambda v: isinstance(v, str)),
          "list": ("a list", lambda v: isinstance(v, (list, tuple))),
          "None": ("none", lambda v: v is None)}


def wanted_type(name: str, value) -> str | None:
    """What GPTConfig's field `name` admits by its annotation ("int | None": "an int or
    none"), where `value` is not one of those; else None."""
    kinds = GPTConfig.__dataclass_fields__[name].type.split(" | ")
    return None if any(ADMITS[kind][1](value) for kind in kinds) else " or ".join(ADMITS[k][0] for k in kinds)


def check_types(config: GPTConfig) -> None:
    """Every field of the type its annotation gives (ADMITS)."""
    for name in GPTConfig.__dataclass_fields__:
        if wanted := wanted_type(name, getattr(config, name)):
            raise UsageError(f"GPTConfig.{name} must be {wanted}, got {getattr(config, name)!r}")


def check_config(config: GPTConfig) -> None:
    """Sizes, probabilities, names, and the architecture options (Megatron's flags)."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings", "vocab_size",
                 "padded_vocab_size"):
        value = getattr(config, name)
        if value <= 0:
            raise UsageError(f"GPTConfig.{name} must be a positive int, got {value!r}")
    if config.hidden_size % config.num_attention_heads != 0:
        raise UsageError(f"hidden_size ({config.hidden_size}) must be divisible by num_attention_heads "
                         f"({config.num_attention_heads}); pick a head count that divides it")
    if config.ffn_hidden_size <= 0:
        raise UsageError(f"ffn_hidden_size must be positive or None, got {config.ffn_hidden_size}")
    if config.padded_vocab_size < config.vocab_size:
        raise UsageError(f"padded_vocab_size ({config.padded_vocab_size}) must be >= vocab_size ({config.vocab_size}); "
                         f"use e.g. pad_vocab_size({config.vocab_size}) = {pad_vocab_size(config.vocab_size)}")
    for name in ("hidden_dropout", "attention_dropout"):
        p = getattr(config, name)
        if not 0.0 <= p < 1.0:
            raise UsageError(f"{name} must be in [0, 1), got {p}")
    if config.domino_chunks < 1:
        raise UsageError(f"domino_chunks must be an int >= 1 (1 = off), got {config.domino_chunks!r}")
    if config.layernorm_epsilon <= 0 or config.init_method_std <= 0:
        raise UsageError("layernorm_epsilon and init_method_std must be > 0")
    for name, choices, flag in (("attention_impl", ATTENTION_IMPLS, ""), ("loss_impl", LOSS_IMPLS, ""),
                                ("layernorm_impl", LAYERNORM_IMPLS, ""),
                                ("position_embedding_type", POSITION_EMBEDDING_TYPES, " (--position-embedding-type)"),
                                ("normalization", NORMALIZATIONS, " (--normalization)")):
        if getattr(config, name) not in choices:
            raise UsageError(f"unknown {name} {getattr(config, name)!r}{flag}; choose one of {list(choices)}")
    if config.rotary_base <= 0:
        raise UsageError(f"rotary_base must be > 0 (--rotary-base), got {config.rotary_base}")
    if not 0.0 < config.rotary_percent <= 1.0:
        raise UsageError(f"rotary_percent must lie in (0, 1] (--rotary-percent), got {config.rotary_percent}")
    if config.position_embedding_type == "rope" and (config.rotary_dim == 0 or config.rotary_dim % 2):
        raise UsageError(f"RoPE rotates pairs of dims, but --rotary-percent {config.rotary_percent} "
                         f"of head dim {config.head_dim} is {config.rotary_dim}: pick a "
                         f"--rotary-percent that gives an even number of dims")
    groups = config.num_query_groups
    if groups <= 0 or config.num_attention_heads % groups:
        raise UsageError(f"num_query_groups ({groups!r}, --num-query-groups) must be a positive "
                         f"int that divides num_attention_heads ({config.num_attention_heads})")
    if config.attention_impl == "triton":
        if config.head_dim not in fused_kernels.SUPPORTED_HEAD_DIMS:
            raise UsageError(f"attention_impl='triton' supports head dims "
                             f"{fused_kernels.SUPPORTED_HEAD_DIMS}, not {config.head_dim}; change "
                             f"hidden_size/num_attention_heads or use attention_impl='torch'")
        if config.attention_dropout > 0:
            raise UsageError("attention_impl='triton' has no attention dropout; set "
                             "attention_dropout=0 or use attention_impl='torch'")
    if config.num_experts is not None:
        check_moe_config(config)


MOE_CHOICES = {"moe_router_score_function": ("softmax", "sigmoid"),
               "moe_router_load_balancing_type": ("aux_loss", "seq_aux_loss", "none"),
               "moe_token_drop_policy": ("probs", "position"),
               "moe_token_dispatcher_type": ("allgather", "alltoall")}


def check_moe_config(config: GPTConfig) -> None:
    """The mixture of experts' options: one line each, naming the flag and the fix."""
    E, k, freq = config.num_experts, config.moe_router_topk, config.moe_layer_freq
    if not isinstance(E, int) or E < 1:
        raise UsageError(f"--num-experts must be a positive int (or unset: a dense model), got {E!r}")
    if not isinstance(k, int) or not 1 <= k <= E:
        raise UsageError(f"--moe-router-topk must be an int from 1 to --num-experts ({E}), got {k!r}")
    if not (isinstance(freq, int) and freq >= 1 or isinstance(freq, (list, tuple)) and len(freq) == config.num_layers
            and set(freq) <= {0, 1}):
        raise UsageError(f"--moe-layer-freq must be an int >= 1 or a list of {config.num_layers} zeros and ones "
                         f"(one per layer), got {freq!r}")
    for name, choices in MOE_CHOICES.items():
        if getattr(config, name) not in choices:
            raise UsageError(f"unknown --{name.replace('_', '-')} {getattr(config, name)!r}; choose one of {list(choices)}")
    for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        value = getattr(config, name)
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise UsageError(f"--{name.replace('_', '-')} must be a positive int, got {value!r}")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
        if (getattr(config, name) or 0) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(config, name)}")
    if k == 1 and config.moe_router_score_function == "softmax" and not config.moe_router_pre_softmax:
        raise UsageError("--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax (a softmax over "
                         "one logit is 1, and its gradient 0)")
    if config.moe_router_enable_expert_bias and config.moe_router_score_function != "sigmoid":
        raise UsageError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
    if config.moe_expert_capacity_factor is not None and not config.moe_expert_capacity_factor > 0:
        raise UsageError(f"--moe-expert-capacity-factor must be > 0 (or unset: dropless), "
                         f"got {config.moe_expert_capacity_factor}")
    if config.moe_pad_expert_input_to_capacity and config.moe_expert_capacity_factor is None:
        raise UsageError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    if config.moe_shared_expert_gate and not config.moe_shared_expert_intermediate_size:
        raise UsageError("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")
    if config.moe_grouped_gemm and (config.hidden_size % 8 or config.moe_ffn_hidden_size % 8):
        raise UsageError(f"--moe-grouped-gemm needs --hidden-size ({config.hidden_size}) and --moe-ffn-hidden-size "
                         f"({config.moe_ffn_hidden_size}) divisible by 8 (grouped_mm's 16-byte rows)")


def claimed_shapes(config: GPTConfig, where: str) -> dict[str, tuple[int, ...]]:
    """Every state-dict shape of the whole model (tp = 1, every stage) that `config`
    describes, from a model on the meta device: no memory, whatever it claims. A
    file's config (`where`, for the one line of a claim that no machine holds, or
    that overflows torch's sizes) is held to its tensors' shapes by these."""
    if count_parameters(config) > 2 ** 50:
        raise UsageError(f"{where} describes a model of {count_parameters(config):.3g} parameters, more than "
                         f"any machine holds")
    whole, parallel.layout = parallel.layout, parallel.Layout(initialized=True)
    try:
        with torch.device("meta"):
            return {key: tuple(t.shape) for key, t in GPT(config).state_dict().items()}
    finally:
        parallel.layout = whole
