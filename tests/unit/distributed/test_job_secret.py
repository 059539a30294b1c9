"""The job secret's file and the closed-by-default rule (distributed/job_secret.py, `fabriclite run`)."""
from __future__ import annotations

import os
import stat

import pytest

from fabriclite import cli
from fabriclite.distributed import job_secret


@pytest.fixture
def no_secret(monkeypatch):
    monkeypatch.delenv(job_secret.SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv(job_secret.INSECURE_ENV, raising=False)


def test_new_secret_is_private_random_and_never_overwritten(tmp_path, no_secret):
    path = str(tmp_path / "job.secret")
    assert cli.main(["new-secret", path]) == 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    secret = job_secret.read_secret(path)
    assert len(secret) == 64 and int(secret, 16) >= 0
    other = str(tmp_path / "other.secret")
    job_secret.write_new_secret(other)
    assert job_secret.read_secret(other) != secret
    with pytest.raises(SystemExit) as ended:
        cli.main(["new-secret", path])
    assert ended.value.code == 2
    assert job_secret.read_secret(path) == secret


@pytest.mark.parametrize("case, expected", [
    ("missing", "does not exist"),
    ("open", "readable or writable by others.*chmod 600"),
    ("short", "fewer than the 16"),
    ("folder", "not a regular file"),
])
def test_a_bad_secret_file_is_named_with_the_fix(tmp_path, case, expected):
    path = tmp_path / "job.secret"
    if case == "folder":
        path.mkdir()
        os.chmod(path, 0o700)
    elif case != "missing":
        path.write_text("short" if case == "short" else "x" * 40)
        os.chmod(path, 0o644 if case == "open" else 0o600)
    with pytest.raises(job_secret.JobSecretError, match=expected) as err:
        job_secret.read_secret(str(path))
    assert str(path) in str(err.value)


def test_the_secret_is_read_stripped(tmp_path):
    path = tmp_path / "job.secret"
    path.write_text("  " + "k" * 20 + "\n")
    os.chmod(path, 0o600)
    assert job_secret.read_secret(str(path)) == b"k" * 20


def test_closed_by_default_for_many_nodes_only(tmp_path, no_secret, monkeypatch):
    assert job_secret.for_job(1) is None  # one node: loopback only, nothing to authenticate
    with pytest.raises(job_secret.JobSecretError, match="--job-secret-file.*--insecure") as err:
        job_secret.for_job(2)
    assert "new-secret" in str(err.value) and "security.md" in str(err.value)
    assert job_secret.for_job(2, fault_tolerant=True) is None  # torchft's clients cannot prove it (security.md)
    monkeypatch.setenv(job_secret.INSECURE_ENV, "1")
    assert job_secret.for_job(2) is None
    path = tmp_path / "job.secret"
    job_secret.write_new_secret(str(path))
    monkeypatch.setenv(job_secret.SECRET_FILE_ENV, str(path))
    assert job_secret.for_job(3) == job_secret.read_secret(str(path))


def test_fabriclite_run_refuses_a_multi_node_job_without_a_secret(tmp_path, no_secret, capsys):
    script = tmp_path / "train.py"
    script.write_text("print('never started')\n")
    with pytest.raises(SystemExit) as ended:
        cli.main(["run", "--num-nodes", "2", "--node-rank", "1", "--accelerator", "cpu", str(script)])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert "fabriclite run: error:" in err and "--job-secret-file" in err and "--insecure" in err
    with pytest.raises(SystemExit) as ended:
        cli.main(["run", "--num-nodes", "2", "--node-rank", "1", "--accelerator", "cpu",
                  "--job-secret-file", str(tmp_path / "absent"), str(script)])
    assert ended.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_the_insecure_line_names_the_address_and_the_risk():
    line = job_secret.insecure_line("10.0.0.1:29500")
    assert "--insecure" in line and "10.0.0.1:29500" in line and "security.md" in line
    assert "\n" not in line
