"""Small models for the engine tests, each exercising one streaming hazard."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from weightstream.models import FCMNIST, GPT, GPTConfig


def fc_mnist() -> nn.Module:
    return FCMNIST()


def gpt_tied() -> nn.Module:
    return GPT(GPTConfig(vocab_size=128, seq_len=16, n_layer=4, d_model=32, n_head=4))


class CalledTwice(nn.Module):
    """One submodule applied twice in one forward."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(20, 32)
        self.shared = nn.Linear(32, 32)
        self.out = nn.Linear(32, 5)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        return self.out(h)


class NormDropout(nn.Module):
    """BatchNorm running statistics and dropout random numbers must match eager."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 64)
        self.bn = nn.BatchNorm1d(64)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(64, 5)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.bn(self.fc1(x)))))


class PartlyFrozen(nn.Module):
    """A frozen embedding-like first layer and a frozen bias."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 5)
        self.fc1.weight.requires_grad_(False)
        self.fc1.bias.requires_grad_(False)
        self.fc2.bias.requires_grad_(False)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class RootParams(nn.Module):
    """Parameters used directly in the root's forward: its own (scale, offset) and,
    nanoGPT style, a child's weight read without calling the child (output head)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.scale = nn.Parameter(torch.ones(16) * 1.5)
        self.offset = nn.Parameter(torch.zeros(16))
        self.mix = nn.Linear(16, 16)

    def forward(self, idx):
        h = self.emb(idx) * self.scale + self.offset
        h = torch.tanh(self.mix(h))
        return h @ self.emb.weight.t()  # [B, T, 50]
