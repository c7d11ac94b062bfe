# The seed's "Full Example (Training)" (spec seed 003), run as written except:
#   - the import line (weightstream instead of cerebras_pytorch.experimental);
#   - the parts the seed leaves as "..." are filled with a model and data of our
#     choice (marked "ours");
#   - the seed's typos are fixed, each marked "seed typo".
import torch
import weightstream as cstorch

# ours: what the seed leaves open
BACKEND = globals().get("BACKEND", "wse_ws")
from seed_support import make_model, train_dataloader_fn, loss_scale, checkpoint_path  # noqa: E402
LOSSES = []

# Needs to be run at the beginning before model initialization
checkpoint_steps = 100
cstorch.configure(
    checkpoint_steps=checkpoint_steps,
    mgmt_address="localhost:9000",
)

# user defined model
model: torch.nn.Module = make_model()
compiled_model = cstorch.compile(model, backend=BACKEND)

loss_fn: torch.nn.Module = torch.nn.CrossEntropyLoss()

optimizer: cstorch.optim.Optimizer = cstorch.optim.configure_optimizer(
    optimizer_type="SGD",
    params=model.parameters(),
    lr=0.05,
    momentum=0.9,
)
lr_scheduler: cstorch.optim.lr_scheduler.LRScheduler = cstorch.optim.configure_lr_scheduler(
    optimizer, learning_rate={"scheduler": "Linear", "initial_learning_rate": 0.05,
                              "end_learning_rate": 0.01, "total_iters": 200},
)

grad_scaler = None
if loss_scale != 0.0:
    grad_scaler = cstorch.amp.GradScaler(loss_scale=loss_scale)

@cstorch.step_closure
def save_checkpoint(step):
    checkpoint_file = f"checkpoint_{step}.mdl"

    state_dict = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
    }
    if lr_scheduler:
        state_dict["lr_scheduler"] = lr_scheduler.state_dict()
    if grad_scaler:
        state_dict["grad_scaler"] = grad_scaler.state_dict()

    state_dict["global_step"] = step

    cstorch.save(state_dict, checkpoint_file)

global_step = 0

# Load checkpoint if provided
if checkpoint_path is not None:
    state_dict = cstorch.load(checkpoint_path)

    model.load_state_dict(state_dict["model"])
    optimizer.load_state_dict(state_dict["optimizer"])
    if lr_scheduler:
        lr_scheduler.load_state_dict(state_dict["lr_scheduler"])
    if grad_scaler:
        grad_scaler.load_state_dict(state_dict["grad_scaler"])

    global_step = state_dict.get("global_step", 0)

dataloader = cstorch.utils.data.DataLoader(
    train_dataloader_fn,
    num_steps=200,
)

@cstorch.compile_step
def training_step(batch):
    inputs, targets = batch
    outputs = compiled_model(inputs)
    loss = loss_fn(outputs, targets)

    cstorch.amp.optimizer_step(
        loss, optimizer, grad_scaler, max_gradient_norm=1.0
    )

    return loss

@cstorch.step_closure
def post_training_step(loss: torch.Tensor):
    print("Loss: ", loss.item())
    LOSSES.append(loss.item())  # ours: keep the losses for the test

for i, batch in enumerate(dataloader):
    loss = training_step(batch)  # seed typo: training_step(dataloader)

    post_training_step(loss)

    # Can only save checkpoint on predetermined steps
    if i % checkpoint_steps == 0:
        save_checkpoint(i)
