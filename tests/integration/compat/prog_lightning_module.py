"""A LightningModule driven by Fabric (Lightning's "LightningModule with Fabric" guide): manual optimization
with ``self.optimizers()`` and ``self.manual_backward`` (outside the forward, as DDP needs), ``self.log`` /
``self.log_dict`` to Fabric's loggers, ``self.all_gather``, and its hooks reached through ``fabric.call``."""
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule

from common import fabric_module, make_dataset, make_model, recording_logger_class, weights

Fabric = fabric_module().Fabric  # from lightning.fabric import Fabric  |  from fabriclite import Fabric


class LitModel(LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = make_model()
        self.hook_calls = []
        self.gathered = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):  # runs through the strategy's forward (DDP)
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        self.log_dict({"batch_idx": float(batch_idx), "half_loss": loss / 2})
        self.gathered.append(self.all_gather(loss.detach()))
        return loss

    def optimize(self, loss):  # manual optimization, outside the forward
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def on_train_epoch_start(self):
        self.hook_calls.append(("on_train_epoch_start", self.global_rank))

    def on_train_epoch_end(self):
        self.hook_calls.append(("on_train_epoch_end", self.global_rank))


def main(workdir):
    logger = recording_logger_class()()
    fabric = Fabric(accelerator="cpu", loggers=logger)
    fabric.seed_everything(2)
    model = LitModel()
    optimizer = model.configure_optimizers()
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(make_dataset(seed=2), batch_size=8, shuffle=True))
    losses = []
    for epoch in range(2):
        fabric.call("on_train_epoch_start")
        for batch_idx, batch in enumerate(loader):
            loss = model.training_step(batch, batch_idx)
            model.optimize(loss)
            losses.append(loss.detach())
        fabric.call("on_train_epoch_end")
    return {
        "weights": weights(model),
        "losses": torch.stack(losses),
        "logged": logger.records,
        "gathered": torch.stack(model.module.gathered),
        "hooks": model.module.hook_calls,
        "logger_is_fabric_logger": model.module.logger is logger,
        "trainer_rank": model.module.trainer.global_rank,
    }
