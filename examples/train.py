"""Train a small classifier on synthetic data with DDP on 2 CPU ranks: log loss and a torchmetrics accuracy
through the CSV logger, save a checkpoint every epoch, and resume from it.

    python examples/train.py                     # 4 epochs, "interrupted" after 2 and resumed from the checkpoint
    python examples/train.py --epochs 6 --out /tmp/run
    python examples/train.py --resume            # continue from <out>/last.ckpt (e.g. after raising --epochs)

Apart from ``fabric.gather_eval`` (a fabriclite addition: the validation predictions of all ranks, each sample
once), this is an ordinary Lightning Fabric script: the two imports are the only fabriclite-specific lines.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabriclite import Fabric
from fabriclite.loggers import CSVLogger

FEATURES, CLASSES = 32, 4


def synthetic_data(n: int, seed: int) -> TensorDataset:
    """Points around one random centre per class (the same for every seed), labels = the class."""
    centres = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    return TensorDataset(centres[labels] + torch.randn(n, FEATURES, generator=g) * 3.0, labels)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, CLASSES))


def run(fabric: Fabric, args: argparse.Namespace, stop_after: int | None = None) -> int:
    """Build everything, restore ``<out>/last.ckpt`` if there is one, train up to ``args.epochs`` (or
    ``stop_after`` epochs in this call); returns the next epoch."""
    fabric.seed_everything(args.seed)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = fabric.setup(model, optimizer)
    train_loader, val_loader = fabric.setup_dataloaders(
        DataLoader(synthetic_data(args.samples, seed=1), batch_size=args.batch_size, shuffle=True),
        DataLoader(synthetic_data(args.samples // 4, seed=2), batch_size=args.batch_size))
    state = {"model": model, "optimizer": optimizer, "train_loader": train_loader, "epoch": 0}
    checkpoint = os.path.join(args.out, "last.ckpt")
    if os.path.exists(checkpoint):
        fabric.load(checkpoint, state)
        fabric.print(f"resumed from {checkpoint} at epoch {state['epoch']}")

    train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=CLASSES).to(fabric.device)
    train_loss = torchmetrics.MeanMetric().to(fabric.device)
    done = 0
    for epoch in range(state["epoch"], args.epochs):
        model.train()
        for x, y in train_loader:
            optimizer.zero_grad()
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y)
            fabric.backward(loss)
            optimizer.step()
            train_acc.update(logits.argmax(dim=1), y)
            train_loss.update(loss.detach(), weight=len(y))
        val_acc = evaluate(fabric, model, val_loader)
        metrics = {"train/loss": train_loss.compute(), "train/acc": train_acc.compute(), "val/acc": val_acc}
        fabric.log_dict(metrics, step=epoch)  # every rank calls it; rank 0 writes
        fabric.print(f"epoch {epoch}: " + "  ".join(f"{k}={float(v):.4f}" for k, v in metrics.items()))
        train_acc.reset()
        train_loss.reset()
        state["epoch"] = epoch + 1
        fabric.save(checkpoint, state)  # rank 0 writes atomically; all ranks return once the file is complete
        done += 1
        if stop_after is not None and done >= stop_after:
            break
    return state["epoch"]


@torch.no_grad()
def evaluate(fabric: Fabric, model: nn.Module, loader: DataLoader) -> float:
    """Accuracy over the whole validation set, every sample counted once across the ranks."""
    model.eval()
    predictions, targets = [], []
    for x, y in loader:
        predictions.append(model(x).argmax(dim=1))
        targets.append(y)
    gathered = fabric.gather_eval({"pred": torch.cat(predictions), "target": torch.cat(targets)}, loader)
    assert len(gathered["target"]) == len(loader.dataset)
    return (gathered["pred"] == gathered["target"]).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--interrupt-after", type=int, default=2,
                        help="stop after this many epochs, then resume from the checkpoint (0: no interruption)")
    parser.add_argument("--resume", action="store_true", help="continue from <out>/last.ckpt instead of starting over")
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "fabriclite-train-example"))
    args = parser.parse_args()

    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy="ddp",
                    loggers=CSVLogger(args.out, name="logs", version="run"))
    fabric.launch()
    checkpoint = os.path.join(args.out, "last.ckpt")
    if fabric.is_global_zero and not args.resume:  # start over: no checkpoint, no metrics of an earlier run
        if os.path.exists(checkpoint):
            os.remove(checkpoint)
        shutil.rmtree(fabric.logger.log_dir, ignore_errors=True)
    fabric.barrier()

    interrupt = args.interrupt_after if not args.resume and args.interrupt_after > 0 else None
    next_epoch = run(fabric, args, stop_after=interrupt)
    if next_epoch < args.epochs:
        fabric.print(f"-- interrupted after epoch {next_epoch - 1}; starting again from the checkpoint --")
        next_epoch = run(fabric, args)
    fabric.print(f"done: {next_epoch} epochs; metrics in {fabric.logger.log_dir}/metrics.csv, "
                 f"checkpoint {checkpoint}")


if __name__ == "__main__":
    main()
