"""What the seed examples leave as "...": a model and data (ours).

The model is the seeds' 3-layer FC-MNIST network; the data are scikit-learn's
8x8 handwritten digits (a real data set bundled with scikit-learn), upsampled
to 28x28 so the network takes its usual 784 inputs.
"""

import torch
import torch.nn.functional as F

from weightstream.models import FCMNIST

loss_scale = 0.0  # static "no loss scaling", the seed's condition
checkpoint_path = None
eval_checkpoint = None  # set by the test to a checkpoint the training example wrote


def make_model():
    torch.manual_seed(0)
    return FCMNIST()


def _digits(split: str):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False).flatten(1)
    y = torch.tensor(y)
    cut = int(0.8 * len(y))
    return (x[:cut], y[:cut]) if split == "train" else (x[cut:], y[cut:])


def train_dataloader_fn():
    x, y = _digits("train")
    ds = torch.utils.data.TensorDataset(x, y)
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True, generator=g, drop_last=True)


def eval_dataloader_fn():
    x, y = _digits("eval")
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=36)
