"""The 3-layer fully connected MNIST network of the execution-modes description."""

from __future__ import annotations

from torch import nn


class FCMNIST(nn.Module):
    """[B, 784] (or [B, 1, 28, 28]) -> logits [B, 10]."""

    def __init__(
        self,
        in_features: int = 784,
        hidden: tuple[int, ...] = (256, 128),
        num_classes: int = 10,
        dropout: float = 0.0,
    ):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)
