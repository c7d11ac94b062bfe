"""A seed-style training script (spec seed 003's shape) for the data-parallel tests.

It never calls ``init_process_group``: run as-is it trains on one device; under
``torchrun`` or ``weightstream launch --num_csx N`` the API joins the ranks by
itself. Every configuration trains the same small language model (a tied
embedding and head, so units share a parameter) for a few steps on fixed global
batches that the script makes for one device: the DataLoader gives each rank
its share. It saves ``cstorch.save({"model": model.state_dict(), ...})`` per
configuration (rank 0 writes) and a JSON record per rank.

usage: dp_seed_style.py OUT_DIR
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import weightstream as cstorch

OUT = sys.argv[1]
STEPS = 4
GLOBAL_BATCH = 16  # two micro-batches of each share of 1, 2 and 4 ranks
VOCAB, WIDTH, SEQ = 48, 24, 6

# (store_sharding, optimizer, loss scaling, micro-batches, reduce_bucket_bytes):
# the grid of the acceptance test; bucket bytes 0 is one collective per unit. "no_sync": two micro-batches, the first under
# compiled.no_sync(); "twice": two backwards before the step, both reduced.
CONFIGS = [
    ("replicated", "SGD", "dynamic", None, 0),
    ("replicated", "AdamW", "dynamic", None, 0),
    ("sharded", "SGD", "dynamic", None, 0),
    ("sharded", "AdamW", None, None, 0),
    ("sharded", "AdamW", "dynamic", "no_sync", 0),
    ("sharded", "SGD", None, "twice", 0),
    ("replicated", "AdamW", None, "twice", 0),
    # The default buckets: neighbouring units share a collective up to 4 MiB.
    ("replicated", "AdamW", "dynamic", None, None),
    ("sharded", "SGD", None, "no_sync", None),
]


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(3)
        )
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: two units share it

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def input_fn():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ + 1), generator=g)
    data = torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])
    # Global batches, as for one device: no rank logic here (Note [rank share]).
    return torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH, shuffle=False)


def train(sharding, optimizer_type, loss_scale, micro, bucket_bytes):
    # Each rank draws other weights: compile() broadcasts rank 0's to all.
    torch.manual_seed(1 + (dist.get_rank() if dist.is_initialized() else 0))
    model = TinyLM()
    compiled = cstorch.compile(
        model,
        backend="wse_ws",
        device="cpu",
        granularity="module",
        store_sharding=sharding,
        **({} if bucket_bytes is None else {"reduce_bucket_bytes": bucket_bytes}),
    )
    kwargs = {"lr": 0.05, "momentum": 0.9} if optimizer_type == "SGD" else {"lr": 0.01}
    optimizer = cstorch.optim.configure_optimizer(
        optimizer_type=optimizer_type, params=model.parameters(), **kwargs
    )
    scaler = cstorch.amp.GradScaler(loss_scale=loss_scale) if loss_scale else None
    compiled.engine.events.enabled = True
    losses = []

    def loss_of(inputs, targets):
        logits = compiled(inputs)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    @cstorch.compile_step
    def training_step(batch):
        inputs, targets = batch
        if micro is None:
            loss = loss_of(inputs, targets)
        else:
            # Gradient accumulation over two halves of the share.
            half = inputs.shape[0] // 2
            first = loss_of(inputs[:half], targets[:half]) / 2
            scaled = first if scaler is None else scaler.scale(first)
            if micro == "no_sync":
                with compiled.no_sync():
                    scaled.backward()
            else:
                scaled.backward()
            loss = loss_of(inputs[half:], targets[half:]) / 2
        # A norm far below the gradients': every step clips, by the whole model's norm.
        cstorch.amp.optimizer_step(loss, optimizer, scaler, max_gradient_norm=0.05)
        return loss

    @cstorch.step_closure
    def record(loss):
        losses.append(loss.item())

    dataloader = cstorch.utils.data.DataLoader(input_fn, num_steps=STEPS)
    shapes = []
    for batch in dataloader:
        shapes.append(list(batch[0].shape))
        compiled.engine.events.events.clear()  # keep the last step's events
        record(training_step(batch))
    name = f"{sharding}-{optimizer_type}" + (f"-{micro}" if micro else "")
    name += "-buckets" if bucket_bytes is None else ""
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    cstorch.save(state, os.path.join(OUT, f"{name}.mdl"))
    events = [(e, i) for e, i, _ in compiled.engine.events.events]
    units = [u.display_name for u in compiled.plan.units]  # forward order
    compiled.close()
    return name, {"losses": losses, "shapes": shapes, "events": events, "units": units}


def main():
    os.makedirs(OUT, exist_ok=True)
    record = {"runs": {}}
    for config in CONFIGS:
        name, result = train(*config)
        record["runs"][name] = result
    record["initialized"] = dist.is_initialized()
    record["world"] = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
