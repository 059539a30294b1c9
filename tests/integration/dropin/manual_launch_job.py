"""One rank of a job started by hand, as Lightning's manual-launch docs do it (each process gets MASTER_ADDR,
MASTER_PORT, NODE_RANK, LOCAL_RANK and WORLD_SIZE; nothing else launches). ``$DROPIN_FABRIC`` picks the framework
("lightning.fabric" or "fabriclite"); the code below is the same for both. Prints one ``FACTS {json}`` line.

Before launch(): rank_zero_only / rank_zero_warn / rank_zero_info taken from the ``utilities.rank_zero`` submodule.
Then Fabric(devices=2).launch() (joins: the ranks exist), an all_reduce, a method that runs the network outside
forward (refused until marked with mark_forward_method, then synchronised by DDP), and a torch.compile'd module
set up under DDP.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import warnings

# a root handler first: records rank_zero_info's messages under both frameworks (Lightning adds its own handler, and
# stops propagation, only when the root logger has none)
records = []


class Keep(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        records.append(record.getMessage())


logging.getLogger().addHandler(Keep())
logging.getLogger().setLevel(logging.INFO)

import torch  # noqa: E402
from torch import nn  # noqa: E402

FRAMEWORK = os.environ["DROPIN_FABRIC"]
rank_zero = importlib.import_module(FRAMEWORK + ".utilities.rank_zero")
facts = {"pid": os.getpid()}


@rank_zero.rank_zero_only
def only_on_zero() -> str:
    return "ran"


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    facts["rank_zero_only"] = only_on_zero()
    facts["rank_zero_only.rank"] = rank_zero.rank_zero_only.rank
    rank_zero.rank_zero_warn("warned before launch")
    rank_zero.rank_zero_info("logged before launch")
facts["warned"] = [str(w.message) for w in caught if "before launch" in str(w.message)]
facts["logged"] = [m for m in records if "before launch" in m]

fabric = importlib.import_module(FRAMEWORK).Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
facts["ranks"] = [fabric.world_size, fabric.global_rank, fabric.local_rank, fabric.node_rank]
facts["sum"] = fabric.all_reduce(torch.tensor(float(fabric.global_rank + 1)), reduce_op="sum").item()


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * 2

    def describe(self) -> str:
        return "a method that runs no submodule"


torch.manual_seed(fabric.global_rank)  # different initial weights: DDP broadcasts rank 0's
module = Generator()
model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
x = torch.full((2, 4), float(fabric.global_rank + 1))  # different data on every rank
try:
    model.generate(x)
    facts["unmarked"] = "no error"
except RuntimeError as err:
    facts["unmarked"] = ["RuntimeError", "mark_forward_method('generate')" in str(err)]
facts["describe"] = model.describe()
model.mark_forward_method("generate")
fabric.backward(model.generate(x).sum())
optimizer.step()
facts["weights"] = [round(v, 6) for v in model.layer.weight.detach().flatten().tolist()]

torch.manual_seed(0)
plain = Generator()
compiled = fabric.setup(torch.compile(plain, backend="eager"))
facts["compiled"] = [type(compiled._forward_module).__name__, type(compiled._forward_module._orig_mod).__name__,
                     compiled._original_module is plain, sorted(compiled.state_dict()),
                     [round(v, 6) for v in compiled(torch.ones(1, 4)).flatten().tolist()]]
fabric.barrier()
print("FACTS " + json.dumps(facts), flush=True)
