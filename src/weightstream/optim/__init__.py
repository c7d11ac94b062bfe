"""weightstream.optim: optimizers and the helpers that configure them (``cstorch.optim``).

Every optimizer creates its whole state at construction (``preinitialize``) and,
where torch.optim has the same algorithm, updates parameters bit for bit like
it (see Note [matching torch.optim bit for bit] in optimizer.py).
"""

from weightstream.optim import lr_scheduler
from weightstream.optim.adafactor import Adafactor
from weightstream.optim.adam import Adam, Adamax, AdamW, NAdam, RAdam
from weightstream.optim.adaptive import Adadelta, Adagrad, RMSprop, Rprop
from weightstream.optim.configure import configure_optimizer, param_groups_with_weight_decay
from weightstream.optim.lamb_lion import Lamb, Lion
from weightstream.optim.lr_scheduler import configure_lr_scheduler
from weightstream.optim.muon import Muon
from weightstream.optim.optimizer import Optimizer
from weightstream.optim.sgd import ASGD, SGD

__all__ = [
    "ASGD",
    "SGD",
    "Adadelta",
    "Adafactor",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "Lamb",
    "Lion",
    "Muon",
    "NAdam",
    "Optimizer",
    "RAdam",
    "RMSprop",
    "Rprop",
    "configure_lr_scheduler",
    "configure_optimizer",
    "lr_scheduler",
    "param_groups_with_weight_decay",
]
