"""The ``run`` override pattern (Lightning 2.x's Fabric subclass): ``MyFabric(...).run(*args)`` launches the
processes, runs ``run`` in each, and returns rank 0's result."""
import torch
import torch.nn.functional as F

from common import fabric_module, make_model, plain, rank_batches, weights

Fabric = fabric_module().Fabric  # from lightning.fabric import Fabric  |  from fabriclite import Fabric


class MyFabric(Fabric):
    def run(self, steps, scale=1.0):
        self.seed_everything(8)
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * scale)
        model, optimizer = self.setup(model, optimizer)
        for x, y in rank_batches(self.global_rank, steps, seed=8):
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            self.backward(loss)
            optimizer.step()
        return plain({"rank": self.global_rank, "weights": weights(model),
                      "sum": self.all_reduce(torch.tensor(self.global_rank + 1.0), reduce_op="sum")})


def main(workdir):
    return MyFabric(accelerator="cpu", strategy="ddp_spawn", devices=2).run(3, scale=0.5)
