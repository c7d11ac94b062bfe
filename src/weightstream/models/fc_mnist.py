"""The 3-layer fully connected MNIST network of the execution-modes description."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass
class FCMNISTConfig:
    in_features: int = 784
    hidden: tuple[int, ...] = (256, 128)
    num_classes: int = 10
    dropout: float = 0.0

    def __post_init__(self) -> None:
        self.hidden = tuple(self.hidden)
        if self.in_features <= 0 or self.num_classes < 2 or any(h <= 0 for h in self.hidden):
            raise ValueError(
                "FCMNISTConfig: in_features and hidden sizes must be positive and "
                f"num_classes >= 2, got {self}."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"FCMNISTConfig.dropout must be in [0, 1), got {self.dropout}.")


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
