"""Training linear classifiers on frozen features (heads and ramps share this).

The backbone is frozen, so each ramp is a linear layer over features computed once. Features are
standardized for the optimiser and the scaling is folded back into the weights, so the exported
layer reads raw pooled features.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass
class LinearFit:
    weight: np.ndarray
    """[classes, features]"""
    bias: np.ndarray
    """[classes]"""
    train_accuracy: float
    """Fraction of training inputs whose argmax equals their target."""

    def logits(self, features: np.ndarray) -> np.ndarray:
        scores: np.ndarray = features @ self.weight.T + self.bias
        return scores

    def to_linear(self) -> nn.Linear:
        layer = nn.Linear(self.weight.shape[1], self.weight.shape[0])
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(self.weight))
            layer.bias.copy_(torch.from_numpy(self.bias))
        return layer


def train_linear(
    features: np.ndarray,
    targets: np.ndarray,
    n_classes: int,
    *,
    weight_decay: float = 1e-2,
    steps: int = 30,
    seed: int = 0,
) -> LinearFit:
    """Multinomial logistic regression with L2, full-batch L-BFGS (deterministic for a seed)."""
    if features.ndim != 2 or features.shape[0] != targets.shape[0]:
        raise ValueError(f"features {features.shape} and targets {targets.shape} do not match")
    torch.manual_seed(seed)
    x = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
    y = torch.from_numpy(targets.astype(np.int64))
    mean = x.mean(0)
    std = x.std(0).clamp(min=1e-6)
    z = (x - mean) / std
    layer = nn.Linear(x.shape[1], n_classes)
    nn.init.zeros_(layer.weight)
    nn.init.zeros_(layer.bias)
    optimiser = torch.optim.LBFGS(
        layer.parameters(), lr=1.0, max_iter=20, history_size=20, line_search_fn="strong_wolfe"
    )
    loss_fn = nn.CrossEntropyLoss()

    def closure() -> torch.Tensor:
        optimiser.zero_grad()
        loss: torch.Tensor = loss_fn(layer(z), y) + weight_decay * layer.weight.pow(2).sum()
        loss.backward()
        return loss

    for _ in range(steps):
        optimiser.step(closure)
    with torch.no_grad():
        weight = layer.weight / std  # fold the standardization into the layer
        bias = layer.bias - weight @ mean
        accuracy = float((layer(z).argmax(1) == y).float().mean())
    return LinearFit(
        weight=weight.numpy().astype(np.float32), bias=bias.numpy().astype(np.float32), train_accuracy=accuracy
    )
