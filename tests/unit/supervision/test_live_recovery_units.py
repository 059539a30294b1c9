"""Live recovery's pieces that need no torchft: the options a supervisor hands its ranks, the lighthouse address
flag, the lighthouse status page's heartbeats, and the one-line refusals of `fabriclite run --fault-tolerant`
(the whole mode runs in the ft lane: tests/integration/backends/lane_ft)."""
from __future__ import annotations

import importlib.util
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabriclite import Fabric, cli
from fabriclite.supervision.lighthouse import (FIRST_QUORUM_TIMEOUT_S, LighthouseError, LiveOptions,
                                               advertised_address, group_of, live_groups, parse_address,
                                               ranks_mismatch, ranks_of, replica_name, wait_reachable)

HAS_TORCHFT = importlib.util.find_spec("torchft") is not None
hosts = st.from_regex(r"[a-z][a-z0-9.-]{0,20}", fullmatch=True)


@given(lighthouse_host=hosts, port=st.integers(1, 65535), groups=st.integers(1, 64), data=st.data())
def test_live_options_round_trip_through_the_rank_environment(lighthouse_host, port, groups, data):
    group = data.draw(st.integers(0, groups - 1))
    options = LiveOptions(f"{lighthouse_host}:{port}", group, groups, data.draw(st.integers(1, groups)), "10.0.0.7",
                          first_quorum_timeout=data.draw(st.floats(0.001, 1e6)))
    with pytest.MonkeyPatch.context() as patch:
        for name, value in options.to_env().items():
            patch.setenv(name, value)
        back = LiveOptions.from_env()
    assert back == options and back.host_port == (lighthouse_host, port)


def test_live_options_from_an_older_supervisor_get_the_default_first_quorum_timeout(monkeypatch):
    options = LiveOptions("h:1", 0, 2)
    for name, value in options.to_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("FABRICLITE_FT_FIRST_QUORUM_TIMEOUT")
    assert LiveOptions.from_env().first_quorum_timeout == FIRST_QUORUM_TIMEOUT_S == 300.0


@given(group=st.integers(0, 10_000), suffix=st.sampled_from(["", ":2f0c9a1e-8d7b-4c2e-9f3a-1b2c3d4e5f60", ":x"]))
def test_group_of_reads_the_node_rank_from_a_replica_id(group, suffix):
    assert group_of(f"group_{group}{suffix}") == group


@pytest.mark.parametrize("replica_id", ["other_1", "group_", "group_1x", "xgroup_1", "", "r_group_1", "r2group_1"])
def test_group_of_is_none_for_another_jobs_replica_id(replica_id):
    assert group_of(replica_id) is None
    assert ranks_of(replica_id) is None


@given(group=st.integers(0, 10_000), ranks=st.integers(1, 64),
       suffix=st.sampled_from(["", ":2f0c9a1e-8d7b-4c2e-9f3a-1b2c3d4e5f60"]))
def test_a_replica_name_carries_the_group_and_its_ranks_per_group(group, ranks, suffix):
    name = replica_name(group, ranks)
    assert group_of(name + suffix) == group and ranks_of(name + suffix) == ranks
    assert (name == f"group_{group}") == (ranks == 1)  # one rank per group: the name is as before groups of ranks
    assert name.endswith(f"_{group}")  # torchft reads the trailing digits as the group's number


def test_a_group_of_another_size_is_an_error_naming_both_numbers():
    ids = [replica_name(0, 2) + ":uuid", replica_name(1, 1) + ":uuid", "someone_else:uuid"]
    assert ranks_mismatch(ids, 0, 2) is not None and ranks_mismatch([ids[0], ids[2]], 1, 2) is None
    message = ranks_mismatch(ids, 0, 2)
    assert "replica group 0 runs 2 rank(s) per group (--devices 2) but replica group 1 runs 1 (--devices 1)" \
        in message, message


@given(groups=st.integers(1, 16), ranks=st.integers(1, 8), data=st.data())
def test_libraries_see_the_jobs_ranks_across_the_groups(groups, ranks, data):
    group, group_rank = data.draw(st.integers(0, groups - 1)), data.draw(st.integers(0, ranks - 1))
    env = LiveOptions("127.0.0.1:1", group, groups).job_ranks(group_rank, ranks)
    assert env == {"RANK": str(group * ranks + group_rank), "WORLD_SIZE": str(groups * ranks),
                   "NODE_RANK": str(group)}


def test_the_healed_state_holds_no_parameters():
    import torch
    from torch import nn

    from fabriclite.strategies.torchft.replica_strategy import plain_tensors

    weight = nn.Parameter(torch.ones(2))
    state = {"model": {"w": weight}, "scale": nn.Parameter(torch.zeros(1)), "list": [weight, 3], "step": 4}
    plain = plain_tensors(state)
    for value in (plain["model"]["w"], plain["scale"], plain["list"][0]):
        assert type(value) is torch.Tensor  # PGTransport's check: a plain tensor, not a Parameter
    assert plain["model"]["w"].data_ptr() == weight.data_ptr() and plain["step"] == 4 and plain["list"][1] == 3


def test_live_options_are_none_outside_the_mode(monkeypatch):
    monkeypatch.delenv("FABRICLITE_FT_LIGHTHOUSE", raising=False)
    assert LiveOptions.from_env() is None


@given(host=hosts, port=st.integers(1, 65535))
def test_parse_address_reads_host_and_port(host, port):
    assert parse_address(f"{host}:{port}", "--lighthouse") == (host, port)
    assert parse_address(f"[::1]:{port}", "--lighthouse") == ("::1", port)


@pytest.mark.parametrize("bad", ["host", "host:", ":80", "host:0", "host:70000", "host:http"])
def test_parse_address_names_the_flag_and_the_form(bad):
    with pytest.raises(ValueError, match=rf"--lighthouse '{bad}': expected HOST:PORT"):
        parse_address(bad, "--lighthouse")


def test_live_groups_reads_torchft_0_2s_status_page():
    # the page torchft 0.2.0's lighthouse served for one heartbeat (copied from a real run), plus other units
    page = """<h2>Heartbeats</h2>\n<ul>\n  <li class="heartbeat\n    \n  ">\n    group_2:abc: seen 1.352519704s ago
  </li>\n  <li class="heartbeat">group_0:d-e: seen 350.5ms ago</li>\n  <li>group_1:f: seen 12µs ago</li>\n</ul>"""
    assert live_groups(page, 1.0) == ["group_0:d-e", "group_1:f"]
    assert live_groups(page, 2.0) == ["group_2:abc", "group_0:d-e", "group_1:f"]
    assert live_groups("<ul></ul>", 1.0) == []


def test_advertised_address_is_loopback_for_a_local_lighthouse():
    for host in ("127.0.0.1", "localhost", "127.0.1.1"):
        assert advertised_address(host) == "127.0.0.1"


def test_wait_reachable_names_the_lighthouse_after_the_timeout():
    with pytest.raises(LighthouseError, match=r"could not reach the lighthouse at 127.0.0.1:1 within \d+ s "
                                              r"\(timeout 1 s\)"):
        wait_reachable("127.0.0.1", 1, timedelta(seconds=1))


def run_cli(capsys, *args: str) -> tuple:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", *args, __file__])
    lines = capsys.readouterr().err.strip().splitlines()
    return exit_info.value.code, lines[-1]


@pytest.mark.skipif(HAS_TORCHFT, reason="checks the refusal where torchft is missing (the core suite's venv)")
def test_fault_tolerant_without_torchft_is_one_line_naming_the_extra(capsys):
    code, line = run_cli(capsys, "--fault-tolerant", "--num-nodes", "2")
    assert code == 2
    assert line == ("fabriclite run: error: --fault-tolerant needs torchft, which is not installed: pip install "
                    "'fabriclite[ft]' (torchft 0.2.0 and its pinned requirements).")


@pytest.mark.skipif(HAS_TORCHFT, reason="checks the refusal where torchft is missing (the core suite's venv)")
def test_fabric_strategy_fault_tolerant_without_torchft_names_the_extra(no_launch_env):
    with pytest.raises(ValueError, match=r"strategy='fault_tolerant' needs torchft.*fabriclite\[ft\]"):
        Fabric(strategy="fault_tolerant", accelerator="cpu", devices=1)


@pytest.mark.parametrize("flag", [["--min-replicas", "2"], ["--lighthouse", "h:1"],
                                  ["--first-quorum-timeout", "30"]])
def test_live_flags_without_fault_tolerant_are_refused(capsys, flag):
    code, line = run_cli(capsys, *flag)
    assert code == 2 and line == f"fabriclite run: error: {flag[0]} needs --fault-tolerant."


@given(groups=st.integers(1, 16), data=st.data())
def test_data_is_sharded_by_replica_group(groups, data):
    from fabriclite.strategies.torchft.replica_strategy import FaultTolerantStrategy

    group = data.draw(st.integers(0, groups - 1))
    strategy = FaultTolerantStrategy()
    strategy.options = LiveOptions("127.0.0.1:1", group, groups)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": groups, "rank": group}  # one rank per group
