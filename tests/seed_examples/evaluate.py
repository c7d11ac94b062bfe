# The seed's "Full Example (Evaluation)" (spec seed 003), run as written except
# the import lines, the parts the seed leaves as "..." (marked "ours") and the
# seed's typos (marked "seed typo").
import torch
import weightstream as cstorch
import weightstream.metrics as metrics

# ours: what the seed leaves open
BACKEND = globals().get("BACKEND", "wse_ws")
from seed_support import make_model, eval_dataloader_fn, eval_checkpoint  # noqa: E402


cstorch.configure(mgmt_address="localhost:9000")

model: torch.nn.Module = make_model()
compiled_model = cstorch.compile(model, backend=BACKEND)
compiled_model.eval()

loss_fn: torch.nn.Module = torch.nn.CrossEntropyLoss()

accuracy = metrics.AccuracyMetric("accuracy", compute_on_system=True)

state_dict = cstorch.load(eval_checkpoint)
model.load_state_dict(state_dict["model"])

dataloader = cstorch.utils.data.DataLoader(
    eval_dataloader_fn,
    num_steps=100,
)

@cstorch.compile_step
def evaluation_step(batch):
    inputs, targets = batch
    outputs = compiled_model(inputs)
    loss = loss_fn(outputs, targets)

    accuracy(
        labels=targets.clone(),
        predictions=outputs.argmax(-1).int(),
    )

    return loss

total_loss = 0
total_steps = 0

@cstorch.step_closure
def post_eval_step(loss: torch.Tensor):
    global total_loss
    global total_steps  # seed typo: total_steps was assigned without a global

    total_loss += loss.item()
    total_steps += 1


with torch.no_grad():
    for batch in dataloader:
        loss = evaluation_step(batch)

        post_eval_step(loss)

print(f"Eval Accuracy: {float(accuracy)}")  # seed typo: one ")" too many
