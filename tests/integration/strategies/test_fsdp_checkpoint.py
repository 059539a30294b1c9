"""fsdp checkpoints on real ranks: the sharded layout (Lightning's), full files keyed by parameter name, loading
across world sizes (2 -> 1, 1 -> 2, 2 -> 3) and into DDP, bit-exact resume, the atomic swap (failed writes,
a crash between the renames), a missing shard named before anything loads, ``fabriclite consolidate``."""
from __future__ import annotations

import os

import pytest
import torch

from fabriclite import Fabric
from fabriclite.checkpoint.atomic import atomic_save, publish
from test_fsdp import Block, build, fsdp_fabric, full_weights, train


def _setup(fabric, seed=0):
    model = build(seed)
    return fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _sharded_round_trip(fabric, root):
    """Save at step 5, resume in a fresh model, compare with the uninterrupted run; load into DDP too."""
    out = {}
    fsdp = fsdp_fabric(fabric.world_size, auto_wrap_policy={Block})
    model, opt = _setup(fsdp)
    out["losses"] = train(fsdp, model, opt, steps=5)[0]
    path = os.path.join(root, "sharded.ckpt")
    fsdp.save(path, {"model": model, "optimizer": opt, "step": 5, "note": "hi"})
    out["files"] = sorted(os.listdir(path))
    out["siblings"] = sorted(os.listdir(root))
    out["at_5"] = full_weights(fsdp, model)
    fsdp.save(path, {"model": model, "optimizer": opt, "step": 5, "note": "hi"})  # over the old one
    out["losses"] += train(fsdp, model, opt, steps=5)[0]
    out["uninterrupted"] = full_weights(fsdp, model)

    resumed, ropt = _setup(fsdp, seed=99)
    state = {"model": resumed, "optimizer": ropt, "step": 0}
    remainder = fsdp.load(path, state)
    out["restored"] = (state["step"], remainder)
    out["resumed_losses"] = train(fsdp, resumed, ropt, steps=5)[0]
    out["resumed"] = full_weights(fsdp, resumed)

    ddp_model, ddp_opt = _setup(fabric, seed=7)  # the pool's own fabric: DDP
    fabric.load(path, {"model": ddp_model, "optimizer": ddp_opt})
    out["ddp_at_5"] = {k: v.clone() for k, v in ddp_model.module.state_dict().items()}
    out["ddp_losses"] = train(fabric, ddp_model, ddp_opt, steps=5)[0]
    out["ddp_final"] = {k: v.clone() for k, v in ddp_model.module.state_dict().items()}
    return out


def _full_file(fabric, root, source):
    out = {}
    fsdp = fsdp_fabric(fabric.world_size, auto_wrap_policy={Block}, state_dict_type="full")
    model, opt = _setup(fsdp)
    path = os.path.join(root, "full.ckpt")
    if source is None:
        train(fsdp, model, opt, steps=3)
        fsdp.save(path, {"model": model, "optimizer": opt, "step": 3})
        out["weights"] = full_weights(fsdp, model)
        raw = torch.load(path, weights_only=True)
        out["keys"] = sorted(raw), sorted(raw["model"]), sorted(raw["optimizer"]["state"])
        out["param_groups"] = raw["optimizer"]["param_groups"][0]["params"]
        source = path
    loaded, lopt = _setup(fsdp, seed=42)
    state = {"model": loaded, "optimizer": lopt, "step": 0}
    fsdp.load(source, state)
    out["loaded"] = full_weights(fsdp, loaded)
    out["step"] = state["step"]
    out["optimizer"] = fsdp.strategy.get_optimizer_state(lopt.optimizer)  # gathered, keyed by name, on rank 0
    out["next_losses"] = train(fsdp, loaded, lopt, steps=2)[0]
    return out


@pytest.fixture(scope="module")
def round_trip(pool2, tmp_path_factory):
    """The 2-rank sharded round trip, run once: (every rank's results, the folder holding sharded.ckpt)."""
    root = tmp_path_factory.mktemp("fsdp_ckpt")
    return pool2.run(_sharded_round_trip, str(root)), root


def test_sharded_checkpoint_layout_resume_and_load_into_ddp(round_trip):
    results, tmp_path = round_trip
    r0 = results[0]
    assert r0["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert r0["siblings"] == ["sharded.ckpt"]  # no temporary or old directory left beside it
    assert torch.load(tmp_path / "sharded.ckpt" / "meta.pt", weights_only=True) == {"step": 5, "note": "hi"}
    for r in results:
        assert r["restored"] == (5, {"note": "hi"})
        assert r["resumed_losses"] == r["losses"][5:]  # bit for bit
        assert all(torch.equal(r0["ddp_at_5"][k], v) for k, v in r0["at_5"].items())
        for key, value in r["ddp_final"].items():
            assert torch.allclose(value, r0["uninterrupted"][key], rtol=1e-5, atol=1e-7)
        assert torch.allclose(torch.tensor(r["ddp_losses"]), torch.tensor(r["losses"][5:]), rtol=1e-5)
    assert r0["resumed"].keys() == r0["uninterrupted"].keys()
    assert all(torch.equal(r0["resumed"][k], v) for k, v in r0["uninterrupted"].items())

    # 2 -> 1: this process alone (no process group) loads the 2-rank checkpoint
    single = Fabric(accelerator="cpu", devices=1)
    model = build(seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = single.setup(model, opt)
    assert single.load(tmp_path / "sharded.ckpt", {"model": model, "optimizer": opt}) == {"step": 5, "note": "hi"}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in r0["at_5"].items())
    assert len(opt.state_dict()["state"]) == len(r0["at_5"])  # every parameter's AdamW moments came back

    # consolidate: one file plain torch.load reads
    from fabriclite.cli import main

    assert main(["consolidate", str(tmp_path / "sharded.ckpt")]) == 0
    whole = torch.load(str(tmp_path / "sharded.ckpt") + ".consolidated", weights_only=True)
    assert whole["step"] == 5 and whole["note"] == "hi"
    assert all(torch.equal(whole["model"][k], v) for k, v in r0["at_5"].items())
    assert sorted(whole["optimizer"]["state"]) == sorted(r0["at_5"])  # keyed by parameter name


def test_full_files_keyed_by_name_load_both_ways(pool2, tmp_path):
    results = pool2.run(_full_file, str(tmp_path), None)
    r0 = results[0]
    top, model_keys, opt_keys = r0["keys"]
    assert top == ["model", "optimizer", "step"] and model_keys == opt_keys == sorted(r0["weights"])
    assert r0["param_groups"] == list(build().state_dict().keys())  # parameter names, in order
    assert all(torch.equal(r0["loaded"][k], v) for k, v in r0["weights"].items())
    assert results[1]["step"] == 3 and results[0]["next_losses"] != results[1]["next_losses"]

    # 1 -> 2: a one-process (index-keyed) file loads into 2 fsdp ranks, optimizer state included
    single = Fabric(accelerator="cpu", devices=1)
    model = build(seed=0)
    model, opt = single.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    train(single, model, opt, steps=3)
    single.save(tmp_path / "one.ckpt", {"model": model, "optimizer": opt, "step": 3})
    saved = torch.load(tmp_path / "one.ckpt", weights_only=True)
    names = list(build().state_dict().keys())
    expected = train(single, model, opt, steps=1, clip=False)[0]
    results = pool2.run(_full_file, str(tmp_path / "run2"), str(tmp_path / "one.ckpt"))
    assert [r["step"] for r in results] == [3, 3]
    # the first forward after loading sees the single process's weights (rank 0 has its batches)
    assert torch.allclose(torch.tensor(results[0]["next_losses"][0]), torch.tensor(expected[0]), rtol=1e-6)
    loaded = results[0]["optimizer"]["state"]
    for index, name in enumerate(names):
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded[name][moment], saved["optimizer"]["state"][index][moment]), (name, moment)


def _three_ranks_load(fabric, path):
    fsdp = fsdp_fabric(fabric.world_size, auto_wrap_policy={Block})
    model, opt = _setup(fsdp, seed=11)
    state = {"model": model, "optimizer": opt}
    remainder = fsdp.load(path, state)
    return full_weights(fsdp, model), remainder


def _failing_saves(fabric, root):
    fsdp = fsdp_fabric(fabric.world_size)
    model, opt = _setup(fsdp)
    path = os.path.join(root, "ckpt")
    fsdp.save(path, {"model": model, "optimizer": opt, "version": 1})
    out = {}
    with pytest.raises(Exception) as info:  # meta.pt cannot pickle a lambda: rank 0's write fails after the shards
        fsdp.save(path, {"model": model, "optimizer": opt, "version": 2, "bad": lambda: 0})
    out["error"] = f"{type(info.value).__name__}: {info.value}"
    fsdp.strategy.barrier()  # rank 0 has removed the failed save's temporary directory
    out["after_failure"] = sorted(os.listdir(root))
    fsdp.strategy.barrier()  # every rank has listed the folder before rank 0 changes it
    # a crash between the renames: the old checkpoint aside, the new one not yet in
    if fsdp.global_rank == 0:
        os.rename(path, os.path.join(root, ".ckpt.old-deadbeef"))
    fsdp.strategy.barrier()
    state = {"model": model, "optimizer": opt, "version": 0}
    fsdp.load(path, state)
    out["recovered"] = state["version"], sorted(os.listdir(root))
    # mismatched keys: strict refuses on every rank, strict=False loads the keys both have
    bigger = fsdp.setup_module(build(seed=3, depth=3))
    with pytest.raises(KeyError) as info:
        fsdp.load(path, {"model": bigger})
    out["strict"] = f"{type(info.value).__name__}: {info.value}"
    assert fsdp.load(path, {"model": bigger}, strict=False) == {"version": 1}
    out["partial"] = torch.equal(full_weights(fsdp, bigger).get("0.weight", torch.zeros(0)),
                                 full_weights(fsdp, model).get("0.weight", torch.ones(0)))
    # a rank's shard missing: named before anything is loaded
    if fsdp.global_rank == 0:
        os.remove(os.path.join(path, "__1_0.distcp"))
    fsdp.strategy.barrier()
    before = full_weights(fsdp, model)
    with pytest.raises(FileNotFoundError) as info:
        fsdp.load(path, {"model": model, "optimizer": opt})
    out["missing"] = str(info.value)
    after = full_weights(fsdp, model)
    out["untouched"] = all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(NotImplementedError, match="filter"):
        fsdp.save(os.path.join(root, "filtered"), {"model": model}, filter={"model": lambda k, v: True})
    return out


def test_failed_saves_keep_the_previous_checkpoint_and_missing_shards_are_named(pool2, tmp_path):
    results = pool2.run(_failing_saves, str(tmp_path))
    assert results[0]["partial"]  # strict=False loaded the shared keys (full weights compared on rank 0)
    for r in results:
        assert "lambda" in r["error"] or "pickle" in r["error"].lower(), r["error"]
        assert r["after_failure"] == ["ckpt"]  # the temporary directory is gone, the old checkpoint in place
        assert r["recovered"] == (1, ["ckpt"])
        assert "missing ['__1_0.distcp']" in r["missing"] and "Nothing was loaded" in r["missing"]
        assert r["untouched"]
        assert "3.fc1.weight" in r["strict"], r["strict"]  # the key the checkpoint lacks is named


def _one_rank_cannot_write(fabric, root, failing, what):
    """A sharded save (keep=, so the manifest is its commit point) of which one file cannot be written, on rank
    ``failing`` only: ``what="shard"``, that process may write no file larger than 0 bytes; ``"meta"``, none
    larger than 64 KiB, and the state holds a 256 KiB blob that goes to rank 0's ``meta.pt`` (RLIMIT_FSIZE, as a
    full quota would; SIGXFSZ ignored, so the write raises EFBIG): a real error on one rank inside the write every
    rank takes part in, or after it."""
    import resource
    import signal

    fsdp = fsdp_fabric(fabric.world_size)
    model, opt = _setup(fsdp)
    fsdp.save(os.path.join(root, "step-1"), {"model": model, "optimizer": opt, "version": 1}, keep=3)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.getsignal(signal.SIGXFSZ)
    out = {}
    if fsdp.global_rank == failing:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0 if what == "shard" else 64 * 1024, limit[1]))
    try:
        fsdp.save(os.path.join(root, "step-2"), {"model": model, "optimizer": opt, "version": 2,
                                                 "blob": bytes(256 * 1024)}, keep=3)
        out["error"] = None
    except Exception as err:  # noqa: BLE001 - compared by the test (DCP's own BaseException must not leak)
        out["error"] = f"{type(err).__name__}: {err}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    fsdp.strategy.barrier()  # every rank is out of the failed save
    out["listing"] = sorted(os.listdir(root))
    state = {"model": model, "optimizer": opt, "version": 0}
    out["latest"] = os.path.basename(fsdp.load_latest(root, state) or "")
    out["version"] = state["version"]
    return out


@pytest.mark.parametrize("failing, what", [(1, "shard"), (0, "shard"), (0, "meta")])
def test_a_sharded_save_failing_on_one_rank_raises_on_every_rank_and_counts_for_nothing(pool2, tmp_path, failing,
                                                                                         what):
    results = pool2.run(_one_rank_cannot_write, str(tmp_path), failing, what)
    target = tmp_path / "step-2"
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} did not raise"
        # the failing rank: its OSError, naming the checkpoint, the cause and the file (a small shard reaches the
        # disk only in the closing flush); the other: which rank failed, and why
        cause = f"OSError: [Errno 27] Saving the checkpoint {target} failed: File too large (writing "
        if rank == failing:
            assert r["error"].startswith(cause), r["error"]
            assert r["error"].endswith("meta.pt)" if what == "meta" else f"__{failing}_0.distcp)"), r["error"]
        else:
            assert r["error"].startswith(f"RuntimeError: Saving {target} failed on rank(s) [{failing}]: "
                                         f"{{{failing}: '{cause}"), r["error"]
        # no temporary, no step-2: the manifest still names step-1, which loads
        assert [n for n in r["listing"] if "manifest" not in n] == ["step-1"], r["listing"]
        assert (r["latest"], r["version"]) == ("step-1", 1)


def test_two_rank_checkpoint_loads_on_three_ranks(round_trip, pool3):
    results, root = round_trip
    r0 = results[0]
    loaded = pool3.run(_three_ranks_load, str(root / "sharded.ckpt"))
    assert [remainder for _, remainder in loaded] == [{"step": 5, "note": "hi"}] * 3
    weights = loaded[0][0]  # gathered on rank 0
    assert sorted(weights) == sorted(r0["at_5"]) and all(torch.equal(weights[k], v) for k, v in r0["at_5"].items())


@pytest.mark.parametrize("make, match", [
    (lambda p: None, "does not exist"),
    (lambda p: p.write_text("x"), "must be a folder"),
    (lambda p: p.mkdir(), "not a sharded checkpoint"),
])
def test_consolidate_refuses_bad_folders(tmp_path, capsys, make, match):
    from fabriclite.cli import main

    folder = tmp_path / "ckpt"
    make(folder)
    with pytest.raises(SystemExit) as info:
        main(["consolidate", str(folder)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("fabriclite consolidate: error: ") and match in err[-1]


def test_consolidate_will_not_overwrite(tmp_path, capsys):
    from fabriclite.cli import main

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "meta.pt").write_bytes(b"")
    (tmp_path / "out.pt").write_text("keep me")
    with pytest.raises(SystemExit):
        main(["consolidate", str(tmp_path / "ckpt"), "--output_file", str(tmp_path / "out.pt")])
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "out.pt").read_text() == "keep me"


def test_publish_swaps_directories_and_files_either_way(tmp_path):
    from fabriclite.strategies import SingleDeviceStrategy

    strategy = SingleDeviceStrategy("cpu")
    target = tmp_path / "ckpt"

    def write_dir(tmp):
        os.makedirs(tmp)
        (open(os.path.join(tmp, "a"), "w")).write("dir")

    atomic_save("file", target)  # a one-file checkpoint (TorchCheckpointIO's way)
    assert torch.load(target, weights_only=True) == "file"
    publish(strategy, target, write_dir)
    assert (target / "a").read_text() == "dir"
    atomic_save("file2", target)
    assert torch.load(target, weights_only=True) == "file2" and os.listdir(tmp_path) == ["ckpt"]


KILL_JOB = """
    import hashlib, os, signal, sys
    import torch
    from torch import nn
    from fabriclite import Fabric
    from fabriclite.strategies import FSDPStrategy

    path, mode = sys.argv[1], sys.argv[2]
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={nn.Linear}))
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 6))
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))

    def steps(first, last):
        for step in range(first, last):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1000 * fabric.global_rank + step))
            opt.zero_grad()
            fabric.backward(model(x).pow(2).mean())
            opt.step()

    def digest():
        state = fabric.strategy.get_module_state_dict(model._forward_module)
        return hashlib.sha256(b"".join(v.numpy().tobytes() for _, v in sorted(state.items()))).hexdigest()

    class Killer:  # pickled into meta.pt by rank 0, after every shard is written: rank 0 dies mid-save
        def __reduce__(self):
            os.kill(os.getpid(), signal.SIGKILL)

    if mode == "train":
        steps(0, 3)
        fabric.save(path, {"model": model, "optimizer": opt, "step": 3})
        steps(3, 6)
        if fabric.global_rank == 0:
            print("DIGEST", digest(), flush=True)
        else:
            digest()
        fabric.save(path, {"model": model, "optimizer": opt, "step": 6, "killer": Killer()})
    else:
        state = {"model": model, "optimizer": opt, "step": 0}
        fabric.load(path, state)
        steps(state["step"], 6)
        line = f"DIGEST {digest()}"
        if fabric.global_rank == 0:
            print(line, "STEP", state["step"], flush=True)
"""


def test_a_killed_sharded_save_keeps_the_previous_one_and_resume_is_bit_exact(tmp_path):
    from helpers import python, write_script

    script = write_script(tmp_path, KILL_JOB)
    path = str(tmp_path / "ckpt")
    killed = python(script, path, "train", timeout=180)
    assert killed.returncode != 0  # rank 0 was killed inside the second save
    uninterrupted = [line.split()[1] for line in killed.stdout.splitlines() if line.startswith("DIGEST")]
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert torch.load(os.path.join(path, "meta.pt"), weights_only=True) == {"step": 3}  # the previous one
    resumed = python(script, path, "resume", timeout=180)
    assert resumed.returncode == 0, (resumed.stdout[-1500:], resumed.stderr[-3000:])
    (line,) = [line for line in resumed.stdout.splitlines() if line.startswith("DIGEST")]
    assert line.split()[1:] == [uninterrupted[0], "STEP", "3"]  # bit for bit
