"""Training throughput on one GPU: a raw torch loop, fabriclite and Lightning Fabric in the same run.

Two models (a small transformer language model and an MLP) at two precisions (``32-true`` and ``bf16-mixed``),
each framework running the same loop: forward, cross-entropy, backward, AdamW step, on batches made on the
device (no data loading). Every measurement is a fresh process (so each has its own peak GPU memory), and the
frameworks take turns (interleaved rounds, order rotated each round); the table gives the median steps/s over
the rounds, the peak GPU memory (``torch.cuda.max_memory_allocated``) and fabriclite's ratio to the raw loop
(goal >= 0.98) and to Lightning Fabric (goal >= 1).

- raw: ``model.to(device)``; under ``bf16-mixed`` the forward and loss run in ``torch.autocast(bfloat16)``.
- fabriclite / Lightning Fabric: ``Fabric(accelerator=..., devices=1, precision=...)``, ``fabric.setup``,
  ``fabric.backward``.

    python benchmarks/gpu_training.py [--rounds 3] [--steps 200] [--warmup 20]
    python benchmarks/gpu_training.py --device cpu --small --rounds 1 --steps 3 --results /tmp/x.md   # smoke

writes benchmarks/results/gpu_training.md (``--results PATH`` elsewhere).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

FRAMEWORKS = ("raw", "fabriclite", "lightning")
MODELS = ("transformer", "mlp")
PRECISIONS = ("32-true", "bf16-mixed")
RESULT = "BENCH-RESULT "


# ---------------------------------------------------------------------- one measurement (a fresh process)
def build(name: str, small: bool) -> Tuple[Any, Any]:
    """(model, make_batch(device) -> (inputs, targets))."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "mlp":
        width, depth, batch, classes = (64, 2, 16, 10) if small else (2048, 6, 256, 1000)
        layers: List[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        model = nn.Sequential(*layers, nn.Linear(width, classes))

        def batch_mlp(device: Any) -> Tuple[Any, Any]:
            return torch.randn(batch, width, device=device), torch.randint(0, classes, (batch,), device=device)
        return model, batch_mlp
    vocab, dim, heads, depth, seq, batch = (50, 32, 2, 1, 8, 4) if small else (8192, 512, 8, 6, 256, 16)

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
            self.head = nn.Linear(dim, vocab)

        def forward(self, tokens: Any) -> Any:
            mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
            return self.head(self.blocks(self.embed(tokens), mask=mask, is_causal=True)).flatten(0, 1)

    def batch_lm(device: Any) -> Tuple[Any, Any]:
        tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)
        return tokens[:, :-1], tokens[:, 1:].reshape(-1)
    return LM(), batch_lm


def measure(framework: str, model_name: str, precision: str, args: argparse.Namespace) -> Dict[str, Any]:
    import contextlib

    import torch
    import torch.nn.functional as F

    model, make_batch = build(model_name, args.small)
    accelerator = "cuda" if args.device == "cuda" else "cpu"
    if framework == "raw":
        device = torch.device(accelerator)
        model = model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if precision == "bf16-mixed" \
            else contextlib.nullcontext

        def step(x: Any, y: Any) -> None:
            optimizer.zero_grad(set_to_none=True)
            with autocast():
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
    else:
        if framework == "fabriclite":
            from fabriclite import Fabric
        else:
            sys.modules.setdefault("mpi4py", None)  # type: ignore[arg-type]  # Lightning's MPI probe would MPI_Init
            from lightning.fabric import Fabric
        fabric = Fabric(accelerator=accelerator, devices=1, precision=precision)
        fabric.launch()
        device = fabric.device
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

        def step(x: Any, y: Any) -> None:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss)
            optimizer.step()
    batches = [make_batch(device) for _ in range(8)]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for i in range(args.warmup):
        step(*batches[i % len(batches)])
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for i in range(args.steps):
        step(*batches[i % len(batches)])
    sync()
    rate = args.steps / (time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"steps_per_s": rate, "peak_bytes": peak,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}


# ---------------------------------------------------------------------- orchestration
def run_once(framework: str, model: str, precision: str, args: argparse.Namespace) -> Dict[str, Any]:
    from common import clean_env

    cmd = [sys.executable, os.path.abspath(__file__), "--worker", framework, model, precision, "--device", args.device,
           "--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--small"] if args.small else [])
    path = os.pathsep.join(filter(None, [os.path.dirname(HERE), os.environ.get("PYTHONPATH")]))
    env = clean_env({"PYTHONPATH": path})
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise RuntimeError(f"{framework} {model} {precision} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def _mib(value: Any) -> str:
    return "-" if value is None else f"{value / 2**20:.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=3, metavar=("FRAMEWORK", "MODEL", "PRECISION"), help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny models (a smoke test, not a measurement)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    parser.add_argument("--results", default=None, help="the results file (benchmarks/results/gpu_training.md)")
    args = parser.parse_args()
    if args.worker:
        print(RESULT + json.dumps(measure(*args.worker, args)), flush=True)
        return
    from common import Results, table

    results = Results("gpu_training")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA GPU is visible (use --device cpu for a smoke run)")
    frameworks = [f for f in args.frameworks.split(",") if f]
    cases = [(m, p) for m in MODELS for p in PRECISIONS]
    rates: Dict[Tuple[str, str, str], List[float]] = {}
    peaks: Dict[Tuple[str, str, str], Any] = {}
    device = "cpu"
    for r in range(args.rounds):
        for model, precision in cases:
            order = frameworks[r % len(frameworks):] + frameworks[:r % len(frameworks)]
            for framework in order:
                out = run_once(framework, model, precision, args)
                rates.setdefault((model, precision, framework), []).append(out["steps_per_s"])
                peaks[(model, precision, framework)] = out["peak_bytes"]
                device = out["device"]
                print(f"round {r + 1}: {model} {precision} {framework}: {out['steps_per_s']:.1f} steps/s",
                      file=sys.stderr, flush=True)
    rows, goals = [], []
    for model, precision in cases:
        med = {f: statistics.median(rates[(model, precision, f)]) for f in frameworks}
        for f in frameworks:
            rows.append([model, precision, f, f"{med[f]:.1f} steps/s", _mib(peaks[(model, precision, f)]),
                         f"{med[f] / med['raw']:.3f}x" if "raw" in med else "-"])
        if {"raw", "fabriclite"} <= set(med):
            value = med["fabriclite"] / med["raw"]
            goals.append(f"- [{'x' if value >= 0.98 else ' '}] {model} {precision}: fabriclite >= 0.98x the raw loop: "
                         f"{value:.3f}x")
        if {"lightning", "fabriclite"} <= set(med):
            value = med["fabriclite"] / med["lightning"]
            goals.append(f"- [{'x' if value >= 1.0 else ' '}] {model} {precision}: fabriclite >= Lightning Fabric: "
                         f"{value:.3f}x")
    body = (f"One device ({device}), {args.rounds} interleaved rounds, each measurement a fresh process: "
            f"{args.steps} steps after {args.warmup} warm-up; median steps/s over the rounds; peak memory: "
            f"torch.cuda.max_memory_allocated over the timed steps (the last round's).\n\n"
            + table(["model", "precision", "framework", "steps/s (median)", "peak GPU memory", "vs raw loop"], rows)
            + "\n\nGoals:\n\n" + "\n".join(goals) + "\n")
    print(body)
    results.write(body, path=args.results)


if __name__ == "__main__":
    main()
