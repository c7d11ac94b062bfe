"""The model zoo used by the run command, the examples and the benchmarks."""

from weightstream.models import zoo  # noqa: F401  (registers llama, gptj, gpt3_xl)
from weightstream.models.fc_mnist import FCMNIST
from weightstream.models.gpt import GPT, GPTConfig
from weightstream.models.gptj import GPTJ, GPTJConfig
from weightstream.models.llama import Llama, LlamaConfig

__all__ = ["FCMNIST", "GPT", "GPTJ", "GPTConfig", "GPTJConfig", "Llama", "LlamaConfig"]
