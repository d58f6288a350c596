"""A transformer block (attention + MoE) split into pipeline stages, and a small model of such
blocks staged for the dual pipeline (commlib.training.pipeline).

Legend: B batch, S sequence, H hidden, T tokens (B * S), V vocabulary.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from commlib.training.moe.config import MoEConfig
from commlib.training.moe.experts import linear
from commlib.training.moe.layer import MoELayer
from commlib.training.pipeline import CombineStage, ComputeStage, DispatchStage, StagedModule


_HAS_RMS_NORM = hasattr(F, "rms_norm")   # torch >= 2.4


class RMSNorm(nn.Module):
    """RMS normalization over the last dimension with a learned scale ([H] float32 weight)."""

    def __init__(self, hidden: int, eps: float = 1e-6, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, device=device))
        self.eps = eps

    def forward(self, x):
        """x * rsqrt(mean(x^2) + eps) * weight over the last dimension.

        torch's rms_norm where it exists and x has the weight's dtype: on GPUs one fused kernel
        each way instead of pow, mean, rsqrt and two multiplies that each pass over x (on CPU it
        decomposes into about the same ops). With mixed dtypes it would return x's dtype where the
        formula promotes, and it has no fused kernel then, so the formula stays. float32: equal up
        to the order of the mean's sum. bf16: it computes in float32 and rounds once, where the
        formula rounds every intermediate to bf16 (closer to the exact value, not bit-equal).
        """
        if _HAS_RMS_NORM and x.dtype == self.weight.dtype:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Causal multi-head self-attention (SDPA), x: [B, S, H]; heads of ``head_dim`` (default H / heads)."""

    def __init__(self, hidden: int, num_heads: int, device=None, dtype=None, head_dim: Optional[int] = None) -> None:
        super().__init__()
        if head_dim is None:
            if hidden % num_heads != 0:
                raise ValueError(f"Attention: num_heads ({num_heads}) must divide hidden ({hidden})")
            head_dim = hidden // num_heads
        self.num_heads, self.head_dim = num_heads, head_dim
        inner = num_heads * head_dim
        self.qkv = nn.Linear(hidden, 3 * inner, bias=False, device=device, dtype=dtype)
        self.out = nn.Linear(inner, hidden, bias=False, device=device, dtype=dtype)

    def forward(self, x_BSH):
        """x_BSH [B, S, H] in the projections' dtype -> [B, S, H] in that dtype."""
        B, S, _ = x_BSH.shape
        # linear(): the projections' weight gradients can be deferred by the dual pipeline (wgrad)
        q, k, v = linear(x_BSH, self.qkv.weight).view(B, S, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return linear(o.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim), self.out.weight)


class MoEBlock(nn.Module):
    """h = h + attn(norm1(h)); h = h + moe(norm2(h)). h: [B, S, H].

    ``num_heads=0``: no attention (and no norm1): h = h + moe(norm2(h)), a MoE layer alone (the
    overlap benchmark uses it to bring compute down to the communication's size).

    Pipeline stages (commlib.training.pipeline.stages), carry keys in brackets:
      attn     compute  [h] -> [h, x_wire, topk_idx, topk_weights, shared | x_norm]
      dispatch comm     [x_wire, topk_idx, topk_weights] -> [recv_x, recv_topk_idx, recv_topk_weights, counts, handle]
      experts  compute  [recv_*, counts, (x_norm)] -> [y, shared]
      combine  comm     [y, handle] -> [combined]
      finish   compute  [h, combined, shared] -> [h]   (merged into the next block's attn stage)

    The shared experts run in the attn stage (``MoEConfig.shared_stage="attn"``, the default; the
    carry holds their output instead of x_norm) or in the experts stage ("experts"). Results are
    the same bit for bit; only the pairing with the other micro-batch's communication changes:
    with two micro-batches each (compute, comm) pair costs its longer step, and the attention step
    is the shorter compute step beside a dispatch or combine in V3-like layers.
    """

    def __init__(self, cfg: MoEConfig, num_heads: int, buffer=None, num_ranks: Optional[int] = None,
                 full_init: bool = True, device=None, attn_dtype=None, head_dim: Optional[int] = None) -> None:
        super().__init__()
        if num_heads < 0:
            raise ValueError(f"MoEBlock: num_heads must be >= 0 (0 = no attention), got {num_heads}")
        self.norm1 = RMSNorm(cfg.hidden, device=device) if num_heads > 0 else None
        self.attn = (Attention(cfg.hidden, num_heads, device=device, dtype=attn_dtype, head_dim=head_dim)
                     if num_heads > 0 else None)
        self.norm2 = RMSNorm(cfg.hidden, device=device)
        self.moe = MoELayer(cfg, buffer=buffer, num_ranks=num_ranks, full_init=full_init, device=device)

    def forward(self, h_BSH: torch.Tensor) -> torch.Tensor:
        h_BSH, x = self._attention(h_BSH)
        return h_BSH + self.moe(x).view_as(h_BSH)

    def _attention(self, h_BSH):
        if self.attn is not None:
            a = self.attn(self.norm1(h_BSH).to(self.attn.qkv.weight.dtype)).to(h_BSH.dtype)
            h_BSH = h_BSH + a
        return h_BSH, self.norm2(h_BSH).flatten(0, 1)

    def forward_chunks(self, hs: list) -> list:
        """Single-process block on every virtual rank's sequences (see MoELayer.forward_chunks)."""
        pairs = [self._attention(h) for h in hs]
        moe_out = self.moe.forward_chunks([x for _, x in pairs])
        return [h + y.view_as(h) for (h, _), y in zip(pairs, moe_out)]

    # --- stages ---
    def stage_attn(self, carry: dict) -> dict:
        h, x_norm = self._attention(carry["h"])
        x_wire, topk_idx, topk_weights = self.moe.route(x_norm)
        out = {"h": h, "x_wire": x_wire, "topk_idx": topk_idx, "topk_weights": topk_weights}
        if self.moe.cfg.shared_stage == "attn":
            shared = self.moe.shared_compute(x_norm)
            if shared is not None:
                out["shared"] = shared
        else:
            out["x_norm"] = x_norm
        return out

    def stage_experts(self, carry: dict) -> dict:
        out = {k: v for k, v in carry.items()
               if k not in ("recv_x", "recv_topk_idx", "recv_topk_weights", "counts", "x_norm")}
        # The rows come from DispatchStage (layout from topk_idx, no padding): each has a local expert.
        out["y"] = self.moe.expert_compute(carry["recv_x"], carry["recv_topk_idx"], carry["recv_topk_weights"],
                                           carry["counts"], rows_have_local_expert=True)
        if "x_norm" in carry:  # shared_stage == "experts"
            shared = self.moe.shared_compute(carry["x_norm"])
            if shared is not None:
                out["shared"] = shared
        return out

    @staticmethod
    def stage_finish(carry: dict) -> dict:
        h = carry["h"]
        moe_out = MoELayer.finish(carry["combined"], carry.get("shared"), h.dtype).view_as(h)
        return {"h": h + moe_out}


# ------------------------------------------------------------------------------------------------
# A model: optional embedding, MoE blocks, optional head; staged for the dual pipeline
# ------------------------------------------------------------------------------------------------

class MoEModel(StagedModule):
    """[embedding] -> num_layers x MoEBlock -> [final norm + LM head].

    With ``vocab_size`` the input is token ids [B, S] int64 and the output logits [B, S, V] (a
    whole small LM); without, input and output are hidden states [B, S, H] (one DualPipe chunk).
    With a Buffer (expert parallelism) ``forward`` runs the staged chain (commlib.training.pipeline), so the
    dual-pipeline schedules can interleave two micro-batches; ``staged=False`` runs the blocks as
    plain modules through the autograd ops instead. Without a Buffer it is the single-process
    equivalent (same parameters under the same seed, same bf16 wire rounding).
    """

    def __init__(self, cfg: MoEConfig, num_layers: int, num_heads: int, buffer=None,
                 num_ranks: Optional[int] = None, vocab_size: Optional[int] = None, max_seq_len: int = 0,
                 full_init: bool = True, staged: bool = True, device=None, attn_dtype=None,
                 head_dim: Optional[int] = None) -> None:
        super().__init__()
        self.cfg, self.buffer, self.staged = cfg, buffer, staged
        # (dispatch Config, combine Config) every staged dispatch / combine passes per call (also to
        # its backward); None: the Buffer's own choice (Buffer.num_sms or a tuned config)
        self.comm_configs = (None, None)
        self.vocab_size = vocab_size
        if vocab_size is not None:
            self.embed = nn.Embedding(vocab_size, cfg.hidden, device=device)
            self.pos = nn.Parameter(torch.randn(max_seq_len, cfg.hidden, device=device) * 0.02)
        self.blocks = nn.ModuleList(MoEBlock(cfg, num_heads, buffer=buffer, num_ranks=num_ranks,
                                             full_init=full_init, device=device, attn_dtype=attn_dtype,
                                             head_dim=head_dim)
                                    for _ in range(num_layers))
        if vocab_size is not None:
            self.norm = RMSNorm(cfg.hidden, device=device)
            self.head = nn.Linear(cfg.hidden, vocab_size, bias=False, device=device)

    output_keys = ("out",)

    def make_carry(self, x):
        return {"x": x}

    def _prologue(self, x):
        if self.vocab_size is None:
            return x
        return self.embed(x) + self.pos[: x.shape[1]]

    def _epilogue(self, h):
        if self.vocab_size is None:
            return h
        return self.head(self.norm(h))

    def stages(self) -> list:
        out = []
        num_experts = self.cfg.num_experts
        for l, blk in enumerate(self.blocks):
            def attn(c, l=l, blk=blk):
                if l == 0:
                    c = {"h": self._prologue(c["x"])}
                else:
                    c = MoEBlock.stage_finish(c)
                return blk.stage_attn(c)
            out += [ComputeStage(f"attn{l}", attn),
                    DispatchStage(self.buffer, num_experts, name=f"dispatch{l}", config=self.comm_configs[0],
                                  fp8=self.cfg.fp8_dispatch),
                    ComputeStage(f"experts{l}", blk.stage_experts),
                    CombineStage(self.buffer, name=f"combine{l}", config=self.comm_configs[1])]
        # without a head the last stage is a residual add: light (never paired with a comm step)
        out.append(ComputeStage("finish", lambda c: {"out": self._epilogue(MoEBlock.stage_finish(c)["h"])},
                                light=self.vocab_size is None))
        return out

    def forward(self, x):
        """x: token ids [B, S] int64 (with ``vocab_size``) or hidden states [B, S, H].

        Returns: logits [B, S, V] (with ``vocab_size``) or hidden states [B, S, H], in the
        parameters' dtype.
        """
        if self.buffer is not None and self.staged:
            return StagedModule.forward(self, x)
        R = self.blocks[0].moe.num_ranks if len(self.blocks) else 1
        if self.buffer is None and R > 1 and x.shape[0] % R == 0:
            # Single process standing in for R ranks: rank r's sequences are the r-th chunk of the
            # batch; per-rank work runs per chunk (see MoELayer.forward_chunks).
            hs = [self._prologue(c) for c in x.chunk(R)]
            for blk in self.blocks:
                hs = blk.forward_chunks(hs)
            return torch.cat([self._epilogue(h) for h in hs])
        h = self._prologue(x)
        for blk in self.blocks:
            h = blk(h)
        return self._epilogue(h)
