"""The PyTorch modules of the early-exit decoder that `exitplan.prepare.decoder` trains and exports.

A pre-norm transformer layer with an explicit KV cache (`Layer`), the exit head after it (`Head`), the
whole decoder (`EarlyExitDecoder`: token and position embeddings, one layer and one head per block) and
the two modules exported as the bundle's blocks (`FirstBlock`: embeddings and layer 0; `LayerBlock`: a
later layer). torch is imported here, at the top: exitplan.prepare.decoder imports this module only
when it builds a model, so its options, data and manifest stay importable without torch.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F


class Layer(nn.Module):
    """A pre-norm transformer layer: `forward` with an explicit KV cache, `train_forward` without one."""

    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.d, self.n_heads, self.head_dim = d, n_heads, d // n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(
        self, x: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden states of the new positions, present key, present value): the past followed by the new entries."""
        b, q, _ = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, q, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        key = torch.cat([past_key, qkv[1]], dim=2)
        value = torch.cat([past_value, qkv[2]], dim=2)
        past = past_key.shape[2]
        scores = qkv[0] @ key.transpose(-1, -2) * (1.0 / math.sqrt(self.head_dim))
        query_pos = torch.arange(q, device=x.device).unsqueeze(1) + past
        key_pos = torch.arange(key.shape[2], device=x.device).unsqueeze(0)
        scores = scores.masked_fill(key_pos > query_pos, -1e9)
        attended = (scores.softmax(-1) @ value).transpose(1, 2).reshape(b, q, self.d)
        x = x + self.proj(attended)
        return x + self.mlp(self.ln2(x)), key, value

    def train_forward(self, x: torch.Tensor) -> torch.Tensor:
        b, q, _ = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, q, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, q, self.d))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class Head(nn.Module):
    """An exit head (or the final head): LayerNorm, then a linear map to the vocabulary."""

    def __init__(self, d: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.out(self.norm(hidden))
        return logits


class EarlyExitDecoder(nn.Module):
    """Token and position embeddings, then `layers` layers, each followed by its head."""

    def __init__(self, *, vocab: int, d: int, n_heads: int, context: int, layers: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.tokens = nn.Embedding(vocab, d)
        self.positions = nn.Embedding(context, d)
        self.layers = nn.ModuleList(Layer(d, n_heads) for _ in range(layers))
        self.heads = nn.ModuleList(Head(d, vocab) for _ in range(layers))

    def blocks(self) -> list[tuple[Layer, Head]]:
        """Every layer with the head that follows it (the two ModuleLists hold only these)."""
        return [(cast(Layer, layer), cast(Head, head)) for layer, head in zip(self.layers, self.heads)]

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        embedded: torch.Tensor = self.tokens(input_ids) + self.positions(position_ids)
        return embedded

    def train_logits(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """Logits of every head [heads][b, s, vocab] (training: full causal attention, no cache)."""
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0).expand_as(input_ids)
        x = self.embed(input_ids, positions)
        out = []
        for layer, head in self.blocks():
            x = layer.train_forward(x)
            out.append(head(x))
        return out


class FirstBlock(nn.Module):
    """The bundle's first block: the embeddings and layer 0."""

    def __init__(self, model: EarlyExitDecoder) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        layer = cast(Layer, self.model.layers[0])
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = layer(
            self.model.embed(input_ids, position_ids), past_key, past_value
        )
        return out


class LayerBlock(nn.Module):
    """A later block of the bundle: one layer."""

    def __init__(self, layer: Layer) -> None:
        super().__init__()
        self.layer = layer

    def forward(
        self, hidden: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = self.layer(hidden, past_key, past_value)
        return out
