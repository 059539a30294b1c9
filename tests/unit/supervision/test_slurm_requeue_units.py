"""SLURM, in process: the requeue signal's parsing, SLURMEnvironment(auto_requeue, requeue_signal), what the
ranks and the supervisor take from them, and `fabriclite run`'s layout inside a SLURM step (read from SLURM's
variables, set here as srun sets them; the real engine runs in the SLURM lane, tests/integration/engines)."""
from __future__ import annotations

import argparse
import signal

import pytest
from hypothesis import given, strategies as st

from fabriclite import cli
from fabriclite.environments.slurm import SLURMEnvironment, parse_signal
from fabriclite.supervision.rank import signals as rank_signals
from fabriclite.supervision.agent.preemption import PreemptOptions

STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "3", "SLURM_PROCID": "2",
        "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_NUM_TASKS": "3", "SLURM_NODEID": "2", "SLURM_LOCALID": "0",
        "SLURM_STEP_NODELIST": "gpu[07-09]", "SLURM_JOB_NAME": "train"}


@given(st.sampled_from([signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGHUP]), st.data())
def test_a_signal_is_read_from_its_name_number_or_enum(sig, data):
    spelled = data.draw(st.sampled_from([sig, int(sig), sig.name, sig.name[3:], sig.name.lower()[3:], str(int(sig))]))
    assert parse_signal(spelled, "--requeue-signal") is sig


@pytest.mark.parametrize("bad", ["KILL", "SIGSTOP", "INT", "USR3", "", "1.5", None, True, 999])
def test_a_bad_requeue_signal_names_the_value_and_the_fix(bad):
    with pytest.raises(ValueError, match=r"--requeue-signal=.*expected the signal SLURM sends .* USR1 .* USR2"):
        parse_signal(bad, "--requeue-signal")


def test_slurm_environment_keeps_and_checks_its_arguments(no_launch_env):
    assert SLURMEnvironment().requeue_signal is signal.SIGUSR1 and SLURMEnvironment().auto_requeue is True
    assert SLURMEnvironment(requeue_signal="USR2").requeue_signal is signal.SIGUSR2
    no_launch_env.setenv("FABRICLITE_REQUEUE_SIGNAL", "USR2")
    assert SLURMEnvironment().requeue_signal is signal.SIGUSR2  # the default follows --requeue-signal's variable
    assert SLURMEnvironment(requeue_signal=signal.SIGUSR1).requeue_signal is signal.SIGUSR1  # the code wins
    with pytest.raises(ValueError, match=r"SLURMEnvironment\(auto_requeue='no'\): expected True or False"):
        SLURMEnvironment(auto_requeue="no")
    with pytest.raises(ValueError, match=r"SLURMEnvironment\(requeue_signal\)=9: SIGKILL cannot be used"):
        SLURMEnvironment(requeue_signal=9)


def test_the_ranks_requeue_settings_come_from_the_environment_or_the_supervisors_variables(no_launch_env):
    assert rank_signals.requeue_settings(None) == (signal.SIGUSR1, True)
    assert rank_signals.requeue_settings(SLURMEnvironment(auto_requeue=False, requeue_signal="USR2")) == \
        (signal.SIGUSR2, False)
    no_launch_env.setenv("FABRICLITE_REQUEUE", "0")  # switches requeueing off for SLURMEnvironment too
    assert rank_signals.requeue_settings(SLURMEnvironment()) == (signal.SIGUSR1, False)
    no_launch_env.setenv("FABRICLITE_REQUEUE_SIGNAL", "usr2")
    assert rank_signals.requeue_settings(None) == (signal.SIGUSR2, False)
    options = PreemptOptions.from_env()
    assert options.signals == (signal.SIGTERM, signal.SIGUSR2) and not options.requeue
    assert options.child_env() == {"FABRICLITE_REQUEUE_SIGNAL": "SIGUSR2"}
    no_launch_env.setenv("FABRICLITE_REQUEUE_SIGNAL", "TERMINATE")
    with pytest.raises(ValueError, match=r"\$FABRICLITE_REQUEUE_SIGNAL='TERMINATE': not a signal"):
        PreemptOptions.from_env()


def prepare(tmp_path, *flags):
    script = tmp_path / "train.py"
    script.write_text("")
    args = cli._parser().parse_args(["run", "--accelerator", "cpu", "--devices", "2", *flags, str(script)])
    command, layout, address, port, _, _, _, _, preempt = cli._prepare_run(args)
    return layout, address, port, preempt


def test_fabriclite_run_in_a_slurm_step_takes_the_layout_from_slurm(tmp_path, no_launch_env):
    for name, value in STEP.items():
        no_launch_env.setenv(name, value)
    layout, address, port, preempt = prepare(tmp_path)
    assert (layout.num_nodes, layout.node_rank, layout.world_size) == (3, 2, 6)
    assert (address, port) == ("gpu07", 15000 + 4242)  # the step's first node; SLURMEnvironment's port rule
    assert preempt.requeue_signal is signal.SIGUSR1 and preempt.requeue
    layout, address, port, preempt = prepare(tmp_path, "--main-address", "10.0.0.1", "--main-port", "29400",
                                             "--requeue-signal", "USR2", "--no-requeue")
    assert (address, port, layout.node_rank) == ("10.0.0.1", 29400, 2)  # flags win
    assert preempt.requeue_signal is signal.SIGUSR2 and not preempt.requeue


@pytest.mark.parametrize("env,expected", [
    ({**STEP, "SLURM_STEP_NUM_TASKS": "6"}, "this SLURM step runs 6 tasks on 3 nodes, so several `fabriclite run` "
     "would start on one node; start one per node: srun --ntasks-per-node=1 fabriclite run"),
    ({k: v for k, v in STEP.items() if k not in ("SLURM_STEP_ID", "SLURM_STEP_NUM_NODES")} |
     {"SLURM_JOB_NUM_NODES": "3"}, "fabriclite run in the batch script of a 3-node SLURM job would start the ranks "
     "of one node only; start one per node: srun --ntasks-per-node=1 fabriclite run"),
])
def test_fabriclite_run_refuses_a_slurm_layout_it_cannot_run(tmp_path, no_launch_env, capsys, env, expected):
    for name, value in env.items():
        no_launch_env.setenv(name, value)
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--devices", "2", str(script)])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and line.startswith("fabriclite run: error: ") and expected in line, line


def test_a_bad_requeue_signal_flag_is_one_error_line(tmp_path, no_launch_env, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--requeue-signal", "KILL", str(script)])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and line.startswith("fabriclite run: error: --requeue-signal='KILL': SIGKILL "
                                                         "cannot be used"), line
