"""The model zoo used by the run command, the examples and the benchmarks."""

from weightstream.models.fc_mnist import FCMNIST
from weightstream.models.gpt import GPT, GPTConfig

__all__ = ["FCMNIST", "GPT", "GPTConfig"]
