"""Lightning fit with per-step checkpoints; run it again after a crash and it resumes
from the newest durable step (bitwise with a StatefulDataLoader). `# lowdiff`: the glue."""
import lightning.pytorch as pl
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from lowdiff_store.integrations.lightning import LowDiffCallback  # lowdiff


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


x = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
loader = StatefulDataLoader(list(zip(x, x.sum(1, keepdim=True), strict=True)), batch_size=16,
                            shuffle=True)
trainer = pl.Trainer(max_epochs=3, accelerator="cpu", logger=False,
                     enable_checkpointing=False,
                     callbacks=[LowDiffCallback("ckpt-pl/")])  # lowdiff
trainer.fit(Net(), loader)
