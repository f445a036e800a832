"""A plain accelerate loop with per-step checkpoints: DiffCheckpointer takes the prepared
optimizer as is; restore(..., missing_ok=True) makes the same script start or resume.
Lines marked `# lowdiff` are the glue."""
import torch
from accelerate import Accelerator

from lowdiff_store.torch import DiffCheckpointer, restore  # lowdiff

acc = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
res = restore("ckpt-acc/", model, opt, missing_ok=True)  # lowdiff
with DiffCheckpointer("ckpt-acc/", model, opt) as ckpt:  # lowdiff
    for step in range(0 if res is None else res.step, 300):  # lowdiff
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
