"""The `run` override pattern of Lightning Fabric 2.6: a Fabric subclass's run(*args) is launched by calling
fabric.run(...); checked against Lightning's Fabric in one process, and on 2 real ranks (script mode, spawn)."""
from __future__ import annotations

import pytest

from helpers import json_lines, python, write_script


def _classes():
    from lightning.fabric import Fabric as LightningFabric

    from fabriclite import Fabric

    def make(base):
        class Trainer(base):
            def run(self, x, y=2):
                self.calls = getattr(self, "calls", 0) + 1
                return (x, y, self.world_size, self.global_rank)

        return Trainer

    return make(Fabric), make(LightningFabric), Fabric, LightningFabric


def test_run_override_matches_lightning_in_one_process(monkeypatch):
    for name in ("LT_CLI_USED", "FABRICLITE_CLI_USED"):
        monkeypatch.delenv(name, raising=False)
    Ours, Theirs, Fabric, LightningFabric = _classes()
    ours, theirs = Ours(accelerator="cpu", devices=1), Theirs(accelerator="cpu", devices=1)
    assert ours.run(1, y=3) == theirs.run(1, y=3) == (1, 3, 1, 0)
    assert ours.run(4) == theirs.run(4) == (4, 2, 1, 0)  # a second run: runs again, no error
    assert ours.calls == theirs.calls == 2
    assert Fabric(accelerator="cpu", devices=1).run() is None is LightningFabric(accelerator="cpu", devices=1).run()
    for bad in (lambda: 1, 3):  # launch(fn)'s checks, as Lightning's
        with pytest.raises(TypeError):
            LightningFabric(accelerator="cpu", devices=1).launch(bad)
        with pytest.raises(TypeError):
            Fabric(accelerator="cpu", devices=1).launch(bad)


RUN = """
    import json, os, sys
    import torch
    from fabriclite import Fabric

    class Trainer(Fabric):
        def run(self, base, scale=1):
            total = self.all_reduce(torch.tensor(float(self.global_rank + base)), reduce_op="sum").item()
            return {{"rank": self.global_rank, "total": total * scale, "pid": os.getpid()}}

    if __name__ == "__main__":
        trainer = Trainer(accelerator="cpu", devices=2, strategy="{strategy}")
        result = trainer.run(10, scale=2)
        print("FACTS " + json.dumps(dict(result, main=result["pid"] == os.getpid())), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_run_override_on_two_ranks(tmp_path, strategy):
    result = python(write_script(tmp_path, RUN.format(strategy=strategy)), env={"OMP_NUM_THREADS": "1"}, timeout=120)
    assert result.returncode == 0, result.stderr
    facts = json_lines(result.stdout)
    if strategy == "ddp":  # script mode: every rank runs run() and gets its own result
        assert sorted((f["rank"], f["total"], f["main"]) for f in facts) == [(0, 42.0, True), (1, 42.0, True)]
    else:  # spawn: the launching process gets rank 0's result
        assert [(f["rank"], f["total"], f["main"]) for f in facts] == [(0, 42.0, False)]
