"""Cluster environments: detection from real launcher variables, ranks, addresses, forcing, cross-checks."""

import os
import warnings
import socket
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabriclite.environments import (
    DETECTION_ORDER,
    ENVIRONMENTS,
    ClusterEnvironment,
    EnvVarEnvironment,
    FabricliteEnvironment,
    KubeflowEnvironment,
    LightningEnvironment,
    LocalEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
    XLAEnvironment,
    detect_environment,
    expand_hostlist,
    first_host,
)
from fabriclite.environments.fabriclite_env import CHILD_VARS, child_env
from fabriclite.environments.mpi import DEFAULT_PORT
from fabriclite.environments.slurm import parse_tasks_per_node
from helpers import REPO


_PREFIXES = (
    "SLURM_", "OMPI_", "PMI_", "PMIX_", "MV2_", "MPI_LOCAL", "LSB_", "JSM_", "TORCHELASTIC_", "FABRICLITE_",
    "TPU_", "XRT_",
)
_NAMES = (
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "GROUP_WORLD_SIZE", "ROLE_RANK", "NODE_RANK", "PJRT_DEVICE",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Remove every launcher variable this machine may have, so each test sets exactly its own."""
    for name in list(os.environ):
        if name.startswith(_PREFIXES) or name in _NAMES:
            monkeypatch.delenv(name)
    return monkeypatch


def setenv(monkeypatch: pytest.MonkeyPatch, **values: object) -> None:
    for name, value in values.items():
        monkeypatch.setenv(name, str(value))


def facts(env: ClusterEnvironment) -> Tuple[int, int, int, int]:
    return env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()


# ---------------------------------------------------------------- registry and import hygiene


def test_detection_order_and_registry_are_as_documented() -> None:
    assert [cls.name for cls in DETECTION_ORDER] == [
        "torchelastic", "slurm", "lsf", "mpi", "fabriclite", "env", "local",
    ]
    assert set(ENVIRONMENTS) == {cls.name for cls in DETECTION_ORDER} | {"xla"}
    assert ENVIRONMENTS["xla"] is XLAEnvironment and XLAEnvironment not in DETECTION_ORDER
    assert LightningEnvironment is LocalEnvironment and KubeflowEnvironment is EnvVarEnvironment


def test_lightning_import_paths_reexport_the_same_classes() -> None:
    from fabriclite.plugins import SLURMEnvironment as FromPlugins
    from fabriclite.plugins.environments import ClusterEnvironment as Base, TorchElasticEnvironment as Elastic

    assert FromPlugins is SLURMEnvironment and Base is ClusterEnvironment and Elastic is TorchElasticEnvironment


@pytest.mark.slow  # a fresh interpreter importing fabriclite: 2.0 s alone, 33 s at load 19
def test_import_has_no_side_effects() -> None:
    code = textwrap.dedent(
        """
        import os, sys
        before = dict(os.environ)
        import fabriclite.environments, fabriclite.plugins
        assert dict(os.environ) == before, "import changed os.environ"
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch_xla", "mpi4py", "horovod"))
        print(heavy)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------- local


def test_local_is_the_fallback_with_defaults() -> None:
    env = detect_environment()
    assert type(env) is LocalEnvironment
    assert not env.creates_processes_externally and not env.uses_agent_store
    assert (env.main_address, env.main_port) == ("127.0.0.1", 0)
    assert facts(env) == (1, 0, 0, 0)
    assert env.local_world_size() is None and env.num_nodes() is None


def test_local_honours_setters_and_variables(clean_env: pytest.MonkeyPatch) -> None:
    env = LocalEnvironment()
    env.set_world_size(6)
    env.set_global_rank(5)
    setenv(clean_env, MASTER_ADDR="10.0.0.7", MASTER_PORT=29511, NODE_RANK=2, LOCAL_RANK=1)
    assert facts(env) == (6, 5, 1, 2)
    assert (env.main_address, env.main_port) == ("10.0.0.7", 29511)
    env.validate(devices=3, num_nodes=7)  # fabriclite starts the processes: nothing to disagree with
    with pytest.raises(ValueError, match="world size must be an int >= 1"):
        env.set_world_size(0)
    with pytest.raises(ValueError, match="rank must be an int >= 0"):
        env.set_global_rank(-1)


def test_rank_readers_read_the_environment_at_call_time(clean_env: pytest.MonkeyPatch) -> None:
    env = FabricliteEnvironment()  # built before the variables exist, as a Fabric built before launch()
    clean_env.setenv("FABRICLITE_RANK", "3")
    assert env.global_rank() == 3
    clean_env.setenv("FABRICLITE_RANK", "1")
    assert env.global_rank() == 1


# ---------------------------------------------------------------- torchelastic


def _torchrun_vars(monkeypatch: pytest.MonkeyPatch, rank: int = 5, local_rank: int = 1) -> None:
    setenv(
        monkeypatch, TORCHELASTIC_RUN_ID="abc", RANK=rank, LOCAL_RANK=local_rank, WORLD_SIZE=8, GROUP_RANK=2,
        LOCAL_WORLD_SIZE=2, GROUP_WORLD_SIZE=4, ROLE_RANK=rank, MASTER_ADDR="node0", MASTER_PORT=29400,
        TORCHELASTIC_USE_AGENT_STORE="True",
    )


def test_torchelastic_detected_with_ranks(clean_env: pytest.MonkeyPatch) -> None:
    _torchrun_vars(clean_env)
    env = detect_environment()
    assert type(env) is TorchElasticEnvironment and env.creates_processes_externally
    assert facts(env) == (8, 5, 1, 2)
    assert (env.main_address, env.main_port) == ("node0", 29400)
    assert (env.local_world_size(), env.num_nodes()) == (2, 4)
    assert env.uses_agent_store
    clean_env.delenv("GROUP_WORLD_SIZE")
    assert env.num_nodes() == 4  # derived: 8 / 2
    clean_env.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert not env.uses_agent_store


def test_torchelastic_needs_all_its_variables(clean_env: pytest.MonkeyPatch) -> None:
    setenv(clean_env, TORCHELASTIC_RUN_ID="stale")  # left over in a shell: not a torchrun worker
    assert not TorchElasticEnvironment.detect()
    _torchrun_vars(clean_env)
    clean_env.delenv("MASTER_ADDR")
    clean_env.delenv("MASTER_PORT")
    from lightning_utilities.core.rank_zero import rank_zero_only

    clean_env.setattr(rank_zero_only, "rank", 0, raising=False)  # what the strategy sets on global rank 0
    with pytest.warns(UserWarning, match="MASTER_ADDR environment variable is not defined"):  # Lightning's default
        assert TorchElasticEnvironment().main_address == "127.0.0.1"
    with pytest.warns(UserWarning, match="MASTER_PORT environment variable is not defined"):
        assert TorchElasticEnvironment().main_port == 12910
    clean_env.setattr(rank_zero_only, "rank", 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the other ranks stay quiet (Lightning's rank_zero_warn)
        assert TorchElasticEnvironment().main_address == "127.0.0.1"


def test_torchrun_inside_slurm_is_not_a_conflict(clean_env: pytest.MonkeyPatch) -> None:
    """`srun torchrun ...`: SLURM counts one task per node, torchrun the ranks; the inner launcher wins."""
    _slurm_vars(clean_env, SLURM_NTASKS=4, SLURM_NTASKS_PER_NODE=1)
    _torchrun_vars(clean_env)
    env = detect_environment()
    assert type(env) is TorchElasticEnvironment and env.world_size() == 8


# ---------------------------------------------------------------- slurm


def _slurm_vars(monkeypatch: pytest.MonkeyPatch, **overrides: object) -> None:
    values: Dict[str, object] = dict(
        SLURM_NTASKS=6, SLURM_PROCID=4, SLURM_LOCALID=1, SLURM_NODEID=1, SLURM_NNODES=2,
        SLURM_NTASKS_PER_NODE=3, SLURM_JOB_ID=1234567, SLURM_JOB_NAME="train",
        SLURM_NODELIST="gpu[007-008]", SLURM_TASKS_PER_NODE="3(x2)",
    )
    values.update(overrides)
    setenv(monkeypatch, **values)


def test_slurm_detected_with_ranks_address_and_port(clean_env: pytest.MonkeyPatch) -> None:
    _slurm_vars(clean_env)
    env = detect_environment()
    assert type(env) is SLURMEnvironment and env.creates_processes_externally
    assert facts(env) == (6, 4, 1, 1)
    assert env.main_address == "gpu007"
    assert env.main_port == 15000 + 4567  # Lightning's rule: 15000 + last four digits of the job id
    assert (env.local_world_size(), env.num_nodes()) == (3, 2)
    setenv(clean_env, MASTER_ADDR="login7", MASTER_PORT=12345)
    assert (env.main_address, env.main_port) == ("login7", 12345)


def test_slurm_uneven_tasks_per_node(clean_env: pytest.MonkeyPatch) -> None:
    _slurm_vars(clean_env, SLURM_NTASKS=7, SLURM_NODEID=3, SLURM_NNODES=4, SLURM_TASKS_PER_NODE="2(x3),1")
    clean_env.delenv("SLURM_NTASKS_PER_NODE")
    assert SLURMEnvironment().local_world_size() == 1
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError, match=r"'2\(y3\)'"):
        parse_tasks_per_node("2(y3)")


@pytest.mark.parametrize("job_name", ["bash", "interactive"])
def test_slurm_interactive_shell_not_detected_unless_forced(clean_env: pytest.MonkeyPatch, job_name: str) -> None:
    _slurm_vars(clean_env, SLURM_JOB_NAME=job_name, SLURM_NTASKS=1, SLURM_PROCID=0, SLURM_LOCALID=0)
    assert not SLURMEnvironment.detect()
    reason = SLURMEnvironment.not_detected_reason()
    assert reason is not None and job_name in reason and "FABRICLITE_CLUSTER_ENVIRONMENT=slurm" in reason
    assert type(detect_environment()) is LocalEnvironment
    assert type(detect_environment(SLURMEnvironment())) is SLURMEnvironment
    clean_env.setenv("FABRICLITE_CLUSTER_ENVIRONMENT", "slurm")
    assert type(detect_environment()) is SLURMEnvironment


def test_slurm_reason_outside_slurm() -> None:
    assert "SLURM_NTASKS is not set" in (SLURMEnvironment.not_detected_reason() or "")


def test_bad_variable_is_named_with_its_value(clean_env: pytest.MonkeyPatch) -> None:
    _slurm_vars(clean_env, SLURM_PROCID="four")
    with pytest.raises(ValueError, match=r"SLURM_PROCID='four'.*not an integer"):
        SLURMEnvironment().global_rank()
    _slurm_vars(clean_env, SLURM_NTASKS=0)
    with pytest.raises(ValueError, match=r"SLURM_NTASKS='0'.*>= 1"):
        SLURMEnvironment().world_size()
    clean_env.setenv("MASTER_PORT", "70000")
    with pytest.raises(ValueError, match=r"MASTER_PORT='70000'.*TCP port"):
        SLURMEnvironment().main_port


# ---------------------------------------------------------------- slurm hostlists


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node[001-003,007],gpu5", ["node001", "node002", "node003", "node007", "gpu5"]),
        ("a-[1-2]-b", ["a-1-b", "a-2-b"]),
        ("r[1-2]n[8-10]", ["r1n8", "r1n9", "r1n10", "r2n8", "r2n9", "r2n10"]),
        ("host0 host1,host3", ["host0", "host1", "host3"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[7]", ["n7"]),
        ("single", ["single"]),
        ("c1.cluster.org,c[2-3].cluster.org", ["c1.cluster.org", "c2.cluster.org", "c3.cluster.org"]),
    ],
)
def test_hostlist_examples(text: str, hosts: List[str]) -> None:
    assert expand_hostlist(text) == hosts
    assert first_host(text) == hosts[0]


@pytest.mark.parametrize("text", ["node[1-", "node]1[", "n[[1]]", "n[3-1]", "n[a-b]", "n[]", "", " , "])
def test_hostlist_malformed_is_named(text: str) -> None:
    with pytest.raises(ValueError, match="Hostlist"):
        expand_hostlist(text)


_LITERAL = st.text(alphabet="abcxyz-_.0123456789", min_size=1, max_size=6)
_GROUP = st.tuples(st.integers(1, 4), st.sets(st.integers(0, 1500), min_size=1, max_size=5))
_HOST = st.lists(st.one_of(_LITERAL, _GROUP), min_size=1, max_size=4)


def _compress(width: int, numbers: set) -> Tuple[str, List[str]]:
    """SLURM-style bracket text for ``numbers`` (runs become lo-hi), and the names it stands for."""
    ordered = sorted(numbers)
    runs: List[List[int]] = []
    for n in ordered:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    parts = [
        str(run[0]).zfill(width) if len(run) == 1 else f"{str(run[0]).zfill(width)}-{str(run[-1]).zfill(width)}"
        for run in runs
    ]
    return "[" + ",".join(parts) + "]", [str(n).zfill(width) for n in ordered]


@settings(max_examples=300, deadline=None)
@given(st.lists(_HOST, min_size=1, max_size=4), st.sampled_from([",", " ", ", "]))
def test_hostlist_roundtrip(hosts: List[list], separator: str) -> None:
    texts: List[str] = []
    expected: List[str] = []
    for pieces in hosts:
        text, names = "", [""]
        for piece in pieces:
            if isinstance(piece, str):
                text += piece
                names = [name + piece for name in names]
            else:
                bracket, choices = _compress(*piece)
                text += bracket
                names = [name + choice for name in names for choice in choices]
        texts.append(text)
        expected.extend(names)
    joined = separator.join(texts)
    assert expand_hostlist(joined) == expected
    assert first_host(joined) == expected[0]


# ---------------------------------------------------------------- lsf


def test_lsf_detected_from_rankfile(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    me = socket.gethostname()
    rankfile = tmp_path / "rankfile"
    rankfile.write_text("\n".join(["batch1", "other1", "other1", me, me]) + "\n")
    setenv(
        clean_env, LSB_JOBID=98765, LSB_DJOB_RANKFILE=rankfile, JSM_NAMESPACE_SIZE=4, JSM_NAMESPACE_RANK=3,
        JSM_NAMESPACE_LOCAL_RANK=1,
    )
    env = detect_environment()
    assert type(env) is LSFEnvironment
    assert facts(env) == (4, 3, 1, 1)
    assert env.main_address == "other1"  # launch node "batch1" dropped
    assert env.main_port == 10000 + 98765 % 1000
    assert env.num_nodes() == 2


def test_lsf_needs_the_rankfile_and_names_an_unknown_host(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    setenv(clean_env, LSB_JOBID=5, LSB_HOSTS="launch hostA hostA hostB", JSM_NAMESPACE_SIZE=2, JSM_NAMESPACE_RANK=0,
           JSM_NAMESPACE_LOCAL_RANK=0)
    assert not LSFEnvironment.detect()  # Lightning's rule: LSB_DJOB_RANKFILE is required (LSB_HOSTS is not read)
    rankfile = tmp_path / "rankfile"
    rankfile.write_text("launch\nhostA\nhostA\nhostB\n")
    clean_env.setenv("LSB_DJOB_RANKFILE", str(rankfile))
    assert LSFEnvironment.detect()
    env = LSFEnvironment()
    assert env.main_address == "hostA" and env.main_port == 10005
    with pytest.raises(ValueError, match=r"cannot find this host .* among the job's hosts \['hostA', 'hostB'\]"):
        env.node_rank()


# ---------------------------------------------------------------- mpi


def _ompi_vars(monkeypatch: pytest.MonkeyPatch, size: int, rank: int, local_rank: int, local_size: int) -> None:
    setenv(
        monkeypatch, OMPI_COMM_WORLD_SIZE=size, OMPI_COMM_WORLD_RANK=rank, OMPI_COMM_WORLD_LOCAL_RANK=local_rank,
        OMPI_COMM_WORLD_LOCAL_SIZE=local_size, OMPI_COMM_WORLD_NODE_RANK=local_rank,
    )


def test_mpi_on_one_node_uses_localhost(clean_env: pytest.MonkeyPatch) -> None:
    _ompi_vars(clean_env, size=4, rank=2, local_rank=2, local_size=4)
    env = detect_environment()
    assert type(env) is MPIEnvironment
    assert facts(env) == (4, 2, 2, 0)
    assert env.main_address == "127.0.0.1"
    assert env.main_port == DEFAULT_PORT
    clean_env.setenv("OMPI_MCA_ess_base_jobid", "3876519937")
    # the port is 20000 + crc32(job id) % 10000: the same in every rank's process (a per-process hash() would
    # differ between ranks) and different for other jobs
    first = env.main_port
    assert first == 20000 + zlib.crc32(b"3876519937") % 10000
    clean_env.setenv("OMPI_MCA_ess_base_jobid", "3876519938")
    assert env.main_port == 20000 + zlib.crc32(b"3876519938") % 10000 != first


def test_mpi_across_nodes_requires_master_addr(clean_env: pytest.MonkeyPatch) -> None:
    _ompi_vars(clean_env, size=8, rank=5, local_rank=1, local_size=4)
    env = detect_environment()
    assert (env.node_rank(), env.num_nodes(), env.local_world_size()) == (1, 2, 4)
    with pytest.raises(ValueError, match=r"needs MASTER_ADDR .*4 of the 8 ranks.*mpirun -x MASTER_ADDR="):
        env.main_address
    setenv(clean_env, MASTER_ADDR="n0", MASTER_PORT=29600)
    assert (env.main_address, env.main_port) == ("n0", 29600)


def test_mpi_round_robin_placement_is_refused(clean_env: pytest.MonkeyPatch) -> None:
    _ompi_vars(clean_env, size=4, rank=1, local_rank=0, local_size=2)  # --map-by node: rank 1 on node 1
    with pytest.raises(ValueError, match=r"not placed in blocks per node.*--map-by slot.*NODE_RANK"):
        MPIEnvironment().node_rank()
    clean_env.setenv("NODE_RANK", "1")
    assert MPIEnvironment().node_rank() == 1


def test_mpi_pmi_and_mvapich_flavors(clean_env: pytest.MonkeyPatch) -> None:
    setenv(clean_env, PMI_SIZE=4, PMI_RANK=3, MPI_LOCALRANKID=1, MPI_LOCALNRANKS=2)
    assert type(detect_environment()) is MPIEnvironment and facts(MPIEnvironment()) == (4, 3, 1, 1)
    setenv(clean_env, MV2_COMM_WORLD_SIZE=2, MV2_COMM_WORLD_RANK=1, MV2_COMM_WORLD_LOCAL_RANK=1,
           MV2_COMM_WORLD_LOCAL_SIZE=2)
    env = detect_environment()  # MVAPICH2's own variables are preferred to the PMI ones it may also set
    assert facts(env) == (2, 1, 1, 0) and env.main_address == "127.0.0.1"


def test_mpi_without_local_information(clean_env: pytest.MonkeyPatch) -> None:
    setenv(clean_env, PMI_SIZE=4, PMI_RANK=3)
    env = MPIEnvironment()
    with pytest.raises(ValueError, match="MPI_LOCALRANKID, PMI_LOCAL_RANK"):
        env.local_rank()
    with pytest.raises(ValueError, match="does not say how many of the 4 ranks"):
        env.main_address


# ---------------------------------------------------------------- fabriclite children


def test_fabriclite_children_from_child_env(clean_env: pytest.MonkeyPatch) -> None:
    values = child_env(rank=3, local_rank=1, node_rank=1, world_size=6, local_world_size=2, num_nodes=3,
                       main_address="10.1.1.1", main_port=29555)
    assert set(values) == set(CHILD_VARS)
    assert values["FABRICLITE_CLUSTER_ENVIRONMENT"] == "fabriclite"
    setenv(clean_env, **values)
    env = detect_environment()
    assert type(env) is FabricliteEnvironment and env.uses_agent_store and env.creates_processes_externally
    assert facts(env) == (6, 3, 1, 1)
    assert (env.main_address, env.main_port, env.local_world_size(), env.num_nodes()) == ("10.1.1.1", 29555, 2, 3)


def test_fabriclite_child_inside_slurm_task_is_forced(clean_env: pytest.MonkeyPatch) -> None:
    """`srun fabriclite run --devices 4`: the child inherits the SLURM task's variables (1 task per node)."""
    _slurm_vars(clean_env, SLURM_NTASKS=2, SLURM_PROCID=1, SLURM_NTASKS_PER_NODE=1)
    setenv(clean_env, **child_env(rank=6, local_rank=2, node_rank=1, world_size=8, local_world_size=4, num_nodes=2,
                                  main_address="gpu007", main_port=29555))
    env = detect_environment()
    assert type(env) is FabricliteEnvironment and env.world_size() == 8
    clean_env.delenv("FABRICLITE_CLUSTER_ENVIRONMENT")  # without the launcher's forcing, the mismatch is reported
    mismatch = r"slurm \(SLURMEnvironment\) says 2, fabriclite \(FabricliteEnvironment\) says 8"
    with pytest.raises(ValueError, match=mismatch):
        detect_environment()


def test_child_env_rejects_inconsistent_ranks() -> None:
    with pytest.raises(ValueError, match="rank=4/world_size=4"):
        child_env(4, 0, 0, 4, 4, 1, "127.0.0.1", 29500)
    with pytest.raises(ValueError, match="main_port=0"):
        child_env(0, 0, 0, 1, 1, 1, "127.0.0.1", 0)


# ---------------------------------------------------------------- env://


def test_env_contract(clean_env: pytest.MonkeyPatch) -> None:
    setenv(clean_env, MASTER_ADDR="trainer-0", MASTER_PORT=23456, WORLD_SIZE=4, RANK=3)
    env = detect_environment()
    assert type(env) is EnvVarEnvironment and env.creates_processes_externally
    assert facts(env) == (4, 3, 0, 3)  # one process per pod: node rank is the rank (Kubeflow)
    assert (env.main_address, env.main_port) == ("trainer-0", 23456)
    setenv(clean_env, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2)
    assert facts(env) == (4, 3, 1, 1) and env.num_nodes() == 2
    clean_env.setenv("GROUP_RANK", "7")
    assert env.node_rank() == 7
    clean_env.setenv("NODE_RANK", "5")
    assert env.node_rank() == 5
    clean_env.delenv("LOCAL_WORLD_SIZE")
    for name in ("NODE_RANK", "GROUP_RANK"):
        clean_env.delenv(name)
    assert env.node_rank() == 0  # LOCAL_RANK given without a per-node count: nothing to derive from


# ---------------------------------------------------------------- xla


def test_xla_detect_reads_only_variables(clean_env: pytest.MonkeyPatch) -> None:
    assert not XLAEnvironment.detect()
    clean_env.setenv("PJRT_DEVICE", "TPU")
    assert XLAEnvironment.detect()
    assert type(detect_environment()) is LocalEnvironment  # the XLA strategy picks it, not auto-detection
    env = XLAEnvironment()
    assert not env.creates_processes_externally
    clean_env.setenv("MASTER_PORT", "1234")
    assert env.main_port == 1234
    # torch_xla made unimportable (None in sys.modules), whether or not it is installed here
    clean_env.setitem(sys.modules, "torch_xla", None)
    with pytest.raises(ModuleNotFoundError, match="pip install torch_xla"):
        env.world_size()


# ---------------------------------------------------------------- forcing and cross-checks


def test_forced_plugin_beats_variable_and_detection(clean_env: pytest.MonkeyPatch) -> None:
    _torchrun_vars(clean_env)
    clean_env.setenv("FABRICLITE_CLUSTER_ENVIRONMENT", "env")
    forced = LocalEnvironment()
    assert detect_environment(forced) is forced
    assert type(detect_environment()) is EnvVarEnvironment


def test_forced_name_unknown_or_forced_object_wrong(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("FABRICLITE_CLUSTER_ENVIRONMENT", "kubernetes")
    with pytest.raises(ValueError, match=r"'kubernetes'.*Valid names: env, fabriclite, local, lsf, mpi, slurm"):
        detect_environment()
    with pytest.raises(TypeError, match="SLURMEnvironment\\(\\), got 'slurm'"):
        detect_environment("slurm")  # type: ignore[arg-type]


def test_disagreeing_environments_error_names_both(clean_env: pytest.MonkeyPatch) -> None:
    _slurm_vars(clean_env)
    _ompi_vars(clean_env, size=4, rank=0, local_rank=0, local_size=4)
    with pytest.raises(ValueError) as info:
        detect_environment()
    message = str(info.value)
    for part in ("slurm (SLURMEnvironment) says 6", "mpi (MPIEnvironment) says 4",
                 "FABRICLITE_CLUSTER_ENVIRONMENT=slurm"):
        assert part in message
    clean_env.setenv("FABRICLITE_CLUSTER_ENVIRONMENT", "mpi")
    assert type(detect_environment()) is MPIEnvironment


def test_agreeing_environments_first_wins(clean_env: pytest.MonkeyPatch) -> None:
    _slurm_vars(clean_env)
    _ompi_vars(clean_env, size=6, rank=4, local_rank=1, local_size=3)  # srun --mpi=pmix sets both, consistently
    setenv(clean_env, PMI_SIZE=6, PMI_RANK=4)
    assert type(detect_environment()) is SLURMEnvironment


# ---------------------------------------------------------------- validate


def test_validate_names_the_numbers_and_the_fix(clean_env: pytest.MonkeyPatch) -> None:
    _slurm_vars(clean_env)  # 6 ranks, 3 per node, 2 nodes
    env = SLURMEnvironment()
    env.validate(devices=3, num_nodes=2)
    env.validate_settings(3, 2)
    with pytest.raises(ValueError) as info:
        env.validate(devices=2, num_nodes=2)
    message = str(info.value)
    for part in ("devices=2, num_nodes=2", "2 * 2 = 4", "slurm environment started a world of 6",
                 "Pass devices=3, num_nodes=2", 'devices="auto"'):
        assert part in message
    with pytest.raises(ValueError, match=r"num_nodes=1\) asks for 6 processes per node.*started 3 on this node"):
        env.validate(devices=6, num_nodes=1)


def test_set_rank_on_external_environment_is_ignored(clean_env: pytest.MonkeyPatch) -> None:
    _slurm_vars(clean_env)
    env = SLURMEnvironment()
    env.set_world_size(99)
    env.set_global_rank(42)
    assert facts(env) == (6, 4, 1, 1)
