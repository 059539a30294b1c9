"""The property tests guard the structure check: with the check broken on purpose, both property files fail.

What is broken is the per-call check that the leaves still match the cached structure (``structure.signature``,
the key of the spec cache, and ``structure.read_uniform``, the one-pass check of a uniform collection): the
patched key sees only how many leaves there are, and the patched uniform check stacks the leaves without
comparing their dtypes, so a collection whose dtypes or shapes changed is packed with a stale plan. The
patch is made by a ``sitecustomize`` module on the ``PYTHONPATH`` of a child pytest, so that it applies in the
child and in every rank the child spawns (tests/support/pool.py starts them with ``spawn``). Each property
file then runs unchanged in that child, and must fail.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent

BREAK = textwrap.dedent("""
    import os
    if os.environ.get("FABRICLITE_TEST_BROKEN_CHECK") == "1":
        import torch
        from fabriclite.collectives import structure

        def blind_signature(leaves):
            return ("broken", len(leaves))  # dtypes, shapes, devices and types no longer part of the key

        def careless_stack(spec, leaves):
            try:
                stacked = torch.stack(leaves)
            except Exception:
                return None
            return stacked.to(spec.uniform[0]) if stacked.dim() == 1 else None  # dtypes never compared

        structure.signature = blind_signature
        structure.read_uniform = careless_stack
        os.environ["FABRICLITE_TEST_BROKEN_CHECK_APPLIED"] = "1"
""")

#: the two property files and the test of each that runs on two ranks
CASES = [
    ("test_collectives_property.py", "test_properties_on_two_ranks"),
    ("test_collectives_cache_property.py", "test_structures_changing_between_calls"),
]


def _run(tmp_path: Path, node: str) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BREAK)
    probe = tmp_path / "probe_test.py"  # proves the patch is live in the child (and reported in its output)
    probe.write_text("import os\n\ndef test_patch_is_live():\n"
                     "    from fabriclite.collectives import structure\n"
                     "    assert structure.signature.__name__ == 'blind_signature'\n"
                     "    assert os.environ.get('FABRICLITE_TEST_BROKEN_CHECK_APPLIED') == '1'\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["FABRICLITE_TEST_BROKEN_CHECK"] = "1"
    env.pop("PYTEST_ADDOPTS", None)
    # the property runs take about 1-3 minutes each on the shared 2-core machine; 15 minutes is a hang
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
         "-c", str(ROOT / "pyproject.toml"), str(probe), node],
        cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.timeout(1000)
@pytest.mark.parametrize("filename, test", CASES)
def test_a_broken_structure_check_fails_the_property_tests(tmp_path, filename, test):
    result = _run(tmp_path, f"{HERE / filename}::{test}")
    out = result.stdout + result.stderr
    # the probe passed (the patch was live in the child), the property test failed, nothing else went wrong
    assert result.returncode == 1 and "1 failed, 1 passed" in out, (
        f"{filename} did not fail with the structure check broken (exit {result.returncode}):\n{out[-3000:]}")
