"""The Transformer-BiGRU network (the paper's architecture), as a plain torch module.

Input: a window of feature vectors (batch, time, features). Output: for each target, horizon and
quantile (P50, P90) one value. Two orders are supported, since the paper describes both:
`attn_first` (self-attention, then the GRUs: the paper's parameter table) and `gru_first` (the
BiGRU feeding the attention: its method section). P90 is built as P50 + softplus(delta), so the
quantiles never cross.

Only manager/ imports torch (see ../shared/STYLE.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal, cast

import torch
from torch import nn

Order = Literal["attn_first", "gru_first"]


@dataclass(frozen=True)
class ModelConfig:
    n_features: int
    n_targets: int = 2
    n_horizons: int = 5
    max_len: int = 512
    attn_layers: int = 2
    attn_heads: int = 4
    key_channels: int = 32  # per head, so d_model = heads * key_channels
    gru_forward_units: int = 6
    gru_backward_units: int = 10
    dropout: float = 0.01
    order: Order = "attn_first"

    @property
    def d_model(self) -> int:
        return self.attn_heads * self.key_channels

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ModelConfig:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)  # type: ignore[arg-type]


class _AttentionBlock(nn.Module):
    """Self-attention with a residual connection and layer norm.

    Written with one fused QKV projection and `scaled_dot_product_attention` rather than
    `nn.MultiheadAttention`, whose CPU fast path spends more time re-packing Q/K/V than multiplying
    (measured: 6.2 -> 4.5 ms for two layers over 64 windows of 16 steps on one thread). With
    `last_only` only the last position is queried (what `gru_first` reads), which is exact and
    cheaper.
    """

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of {heads} heads")
        self.heads = heads
        self.dropout_p = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        batch, steps, d = x.shape
        q, k, v = self.qkv(x).view(batch, steps, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if last_only:
            q = q[:, :, -1:, :]
            x = x[:, -1:, :]
        p = self.dropout_p if self.training else 0.0
        att = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p)
        att = att.transpose(1, 2).reshape(batch, q.shape[2], d)
        out: torch.Tensor = self.norm(x + self.out(att))
        return out


class _BiGRU(nn.Module):
    """A forward and a backward GRU of different widths over the same sequence."""

    def __init__(self, d_in: int, forward_units: int, backward_units: int) -> None:
        super().__init__()
        self.fwd = nn.GRU(d_in, forward_units, batch_first=True)
        self.bwd = nn.GRU(d_in, backward_units, batch_first=True)
        self.out_dim = forward_units + backward_units

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-step outputs (B, T, out_dim), summary (B, out_dim)) where the summary is the forward
        GRU's last state and the backward GRU's state after reading the sequence from the end."""
        f_seq, f_last = self.fwd(x)
        b_seq_rev, b_last = self.bwd(torch.flip(x, dims=[1]))
        b_seq = torch.flip(b_seq_rev, dims=[1])
        return torch.cat([f_seq, b_seq], dim=-1), torch.cat([f_last[-1], b_last[-1]], dim=-1)


class TransformerBiGRU(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.input_proj = nn.Linear(config.n_features, d)
        self.position = nn.Embedding(config.max_len, d)
        self.attn = nn.ModuleList(
            _AttentionBlock(d, config.attn_heads, config.dropout) for _ in range(config.attn_layers)
        )
        if config.order == "attn_first":
            self.gru = _BiGRU(d, config.gru_forward_units, config.gru_backward_units)
            self.gru_to_attn: nn.Module = nn.Identity()
            head_in = self.gru.out_dim
        elif config.order == "gru_first":
            self.gru = _BiGRU(d, config.gru_forward_units, config.gru_backward_units)
            self.gru_to_attn = nn.Linear(self.gru.out_dim, d)
            head_in = d
        else:
            raise ValueError(f"unknown order {config.order!r}")
        self.dropout = nn.Dropout(config.dropout)
        n_out = config.n_targets * config.n_horizons
        self.head_p50 = nn.Linear(head_in, n_out)
        self.head_delta = nn.Linear(head_in, n_out)
        # Start from "no change" for the median: with targets expressed as the change from the
        # last value, training begins at the last-value forecast instead of a random offset.
        nn.init.zeros_(self.head_p50.weight)
        nn.init.zeros_(self.head_p50.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, n_features) with T <= max_len. Returns (B, n_targets, n_horizons, 2) where the
        last axis is (P50, P90)."""
        batch, steps, _ = x.shape
        if steps > self.config.max_len:
            raise ValueError(f"window of {steps} steps exceeds max_len {self.config.max_len}")
        pos = self.position(torch.arange(steps, device=x.device)).unsqueeze(0)
        h = self.input_proj(x)
        if self.config.order == "attn_first":
            h = h + pos
            for block in self.attn:
                h = block(h)
            _, summary = self.gru(h)
        else:
            seq, _ = self.gru(h)
            h = self.gru_to_attn(seq) + pos
            last = len(self.attn) - 1
            for i, block in enumerate(self.attn):
                h = block(h, last_only=i == last)
            summary = h[:, -1, :]
        z = self.dropout(torch.relu(summary))
        p50 = self.head_p50(z)
        p90 = p50 + nn.functional.softplus(self.head_delta(z))
        out = torch.stack([p50, p90], dim=-1)
        return out.view(batch, self.config.n_targets, self.config.n_horizons, 2)


def pinball_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Quantile (pinball) loss for pred (B, T, H, 2) against target (B, T, H); mask marks valid
    targets (a missing target contributes nothing)."""
    quantiles = torch.tensor([0.5, 0.9], device=pred.device, dtype=pred.dtype)
    err = target.unsqueeze(-1) - pred
    loss = torch.maximum(quantiles * err, (quantiles - 1) * err)
    if mask is None:
        return loss.mean()
    m = mask.unsqueeze(-1).to(loss.dtype).expand_as(loss)
    return (loss * m).sum() / m.sum().clamp_min(1.0)


class _FusedAttention(nn.Module):
    """An `_AttentionBlock` for inference whose Q/K/V projection may be computed by the caller
    (folded into an earlier affine map) and which, with `last_only`, queries from the last position
    alone without projecting keys and values at every position: per head, the scores
    q . (W_k x_t + b_k) are (W_k^T q) . x_t plus a term the same for every t (which the softmax
    cancels), and the weighted values sum_t a_t (W_v x_t + b_v) are W_v (sum_t a_t x_t) + b_v since the
    weights sum to one. The same function up to float rounding, with about a tenth of the layer's
    multiply-adds at a window of 16."""

    # Buffers, registered in __init__ (declared here for their type).
    w_q: torch.Tensor
    b_q: torch.Tensor
    w_kv: torch.Tensor
    b_kv: torch.Tensor
    w_k_heads: torch.Tensor
    w_v_heads: torch.Tensor
    b_v_heads: torch.Tensor

    def __init__(self, block: _AttentionBlock) -> None:
        super().__init__()
        self.heads = block.heads
        d = block.out.in_features
        w, b = block.qkv.weight.detach(), block.qkv.bias.detach()
        self.register_buffer("w_q", w[:d].clone())
        self.register_buffer("b_q", b[:d].clone())
        self.register_buffer("w_kv", w[d:].clone())
        self.register_buffer("b_kv", b[d:].clone())
        dh = d // self.heads
        # per head: W_k (heads, dh, d); W_v transposed (heads, d, dh); b_v (heads, 1, dh)
        self.register_buffer("w_k_heads", w[d : 2 * d].reshape(self.heads, dh, d).clone())
        self.register_buffer("w_v_heads", w[2 * d :].reshape(self.heads, dh, d).transpose(1, 2).contiguous())
        self.register_buffer("b_v_heads", b[2 * d :].reshape(self.heads, 1, dh).clone())
        self.scale = 1.0 / math.sqrt(dh)
        self.out = block.out
        self.norm = block.norm

    def forward(self, x: torch.Tensor, qkv: torch.Tensor | None, last_only: bool) -> torch.Tensor:
        batch, steps, d = x.shape
        dh = d // self.heads
        if qkv is None and last_only:
            return self._last_query(x)
        if qkv is not None:
            q, k, v = qkv.view(batch, steps, 3, self.heads, dh).permute(2, 0, 3, 1, 4)
        else:
            kv = nn.functional.linear(x, self.w_kv, self.b_kv)
            k, v = kv.view(batch, steps, 2, self.heads, dh).permute(2, 0, 3, 1, 4)
            q_in = x[:, -1:, :] if last_only else x
            q = nn.functional.linear(q_in, self.w_q, self.b_q).view(batch, -1, self.heads, dh).transpose(1, 2)
        if last_only:
            q = q[:, :, -1:, :]
            x = x[:, -1:, :]
        att = nn.functional.scaled_dot_product_attention(q, k, v)
        att = att.transpose(1, 2).reshape(batch, q.shape[2], d)
        out: torch.Tensor = self.norm(x + self.out(att))
        return out

    def _last_query(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output at the last position, keys and values folded into the query (see the
        class's docstring). x: (B, T, d) -> (B, 1, d)."""
        batch, _, d = x.shape
        last = x[:, -1:, :]
        q = nn.functional.linear(last[:, 0], self.w_q, self.b_q).view(batch, self.heads, d // self.heads)
        qk = torch.bmm(q.transpose(0, 1), self.w_k_heads) * self.scale  # (heads, B, d)
        weights = torch.softmax(torch.bmm(x, qk.permute(1, 2, 0)), dim=1)  # (B, T, heads)
        mixed = torch.bmm(weights.transpose(1, 2), x)  # (B, heads, d)
        att = torch.bmm(mixed.transpose(0, 1), self.w_v_heads) + self.b_v_heads  # (heads, B, dh)
        out: torch.Tensor = self.norm(last + self.out(att.transpose(0, 1).reshape(batch, 1, d)))
        return out


def _folded_gru(gru: nn.GRU, weight: torch.Tensor, bias: torch.Tensor) -> nn.GRU:
    """A GRU reading x directly where `gru` read `weight @ x + bias`: the affine map is folded into
    the GRU's input weights (the same function up to float rounding)."""
    folded = nn.GRU(weight.shape[1], gru.hidden_size, batch_first=True)
    w_ih = gru.get_parameter("weight_ih_l0")
    with torch.no_grad():
        folded.get_parameter("weight_ih_l0").copy_(w_ih @ weight)
        folded.get_parameter("bias_ih_l0").copy_(w_ih @ bias + gru.get_parameter("bias_ih_l0"))
        folded.get_parameter("weight_hh_l0").copy_(gru.get_parameter("weight_hh_l0"))
        folded.get_parameter("bias_hh_l0").copy_(gru.get_parameter("bias_hh_l0"))
    return folded


class FusedTransformerBiGRU(nn.Module):
    """The same function as a trained `TransformerBiGRU` in eval mode, with its affine maps folded
    together for inference (about half the multiply-adds at a window of 16):

    - the input projection and the position embedding are folded into the first attention layer's
      Q/K/V projection (and, for `gru_first`, the input projection into the GRUs' input weights, the
      GRU-to-attention map and position into the first Q/K/V projection);
    - the last attention layer of `gru_first` projects the query of the last position only.

    Outputs equal the original's up to float rounding (tests compare at 1e-4 relative). Windows
    longer than the one it was built for are refused; shorter ones are fine. Not for training.
    """

    # Buffers, registered in __init__ (declared here for their type).
    w_h0: torch.Tensor
    b_h0: torch.Tensor
    w_qkv0: torch.Tensor
    b_qkv0: torch.Tensor

    def __init__(self, model: TransformerBiGRU, window_s: int) -> None:
        super().__init__()
        cfg = model.config
        if window_s > cfg.max_len:
            raise ValueError(f"window of {window_s} steps exceeds max_len {cfg.max_len}")
        self.config = cfg
        self.window_s = window_s
        blocks = [cast(_AttentionBlock, block) for block in model.attn]  # model.attn holds only these
        with torch.no_grad():
            pos = model.position.weight[:window_s].detach().clone()  # (T, d)
            w_in, b_in = model.input_proj.weight.detach(), model.input_proj.bias.detach()
            first = blocks[0].qkv
            if cfg.order == "gru_first":
                self.fwd = _folded_gru(model.gru.fwd, w_in, b_in)
                self.bwd = _folded_gru(model.gru.bwd, w_in, b_in)
                assert isinstance(model.gru_to_attn, nn.Linear)
                w_a, b_a = model.gru_to_attn.weight.detach(), model.gru_to_attn.bias.detach()
            else:
                self.gru = model.gru
                w_a, b_a = w_in, b_in
            # h0 = A x + (b + pos_t); qkv0 = W h0 + c = (W A) x + (W (b + pos_t) + c)
            self.register_buffer("w_h0", w_a.clone())
            self.register_buffer("b_h0", (b_a[None, :] + pos).clone())
            self.register_buffer("w_qkv0", (first.weight @ w_a).clone())
            self.register_buffer("b_qkv0", ((b_a[None, :] + pos) @ first.weight.T + first.bias).clone())
        self.attn = nn.ModuleList(_FusedAttention(block) for block in blocks)
        self.head_p50 = model.head_p50
        self.head_delta = model.head_delta
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, _ = x.shape
        if steps > self.window_s:
            raise ValueError(f"window of {steps} steps exceeds the {self.window_s} this model was fused for")
        if self.config.order == "gru_first":
            f_seq, _ = self.fwd(x)
            b_rev, _ = self.bwd(torch.flip(x, dims=[1]))
            a_in = torch.cat([f_seq, torch.flip(b_rev, dims=[1])], dim=-1)
        else:
            a_in = x
        h = nn.functional.linear(a_in, self.w_h0) + self.b_h0[:steps]
        qkv: torch.Tensor | None = nn.functional.linear(a_in, self.w_qkv0) + self.b_qkv0[:steps]
        last = len(self.attn) - 1
        gru_first = self.config.order == "gru_first"
        for i, block in enumerate(self.attn):
            h = block(h, qkv, gru_first and i == last)
            qkv = None
        if gru_first:
            summary = h[:, -1, :]
        else:
            _, summary = self.gru(h)
        z = torch.relu(summary)
        p50 = self.head_p50(z)
        p90 = p50 + nn.functional.softplus(self.head_delta(z))
        return torch.stack([p50, p90], dim=-1).view(batch, self.config.n_targets, self.config.n_horizons, 2)
