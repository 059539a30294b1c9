"""Which cluster environment this process is in, decided in one written-down order.

Order (first match wins):

1. a forced instance, ``Fabric(plugins=[SLURMEnvironment()])``;
2. a name forced with ``FABRICLITE_CLUSTER_ENVIRONMENT=<name>`` (any key of :data:`ENVIRONMENTS`);
3. the classes of :data:`DETECTION_ORDER`: torchelastic > slurm > lsf > mpi > fabriclite (children of fabriclite's
   supervisor) > env (plain ``env://``) > local (the fallback; fabriclite starts the processes).

Forced environments are trusted as given (that is what forcing is for: a SLURM interactive shell, say). An
automatically detected one is cross-checked: if another external environment also detects and reports a different
world size, ValueError names both and how to force one. A winner that is itself a launcher which may run inside a
scheduler's task (torchrun, fabriclite's supervisor) is not cross-checked: it is the innermost launcher, and the
variables around it count launchers, not ranks (``srun torchrun ...`` is a normal job).
"""

import os
from typing import Dict, List, Optional, Tuple, Type

from fabriclite.environments.base import ClusterEnvironment
from fabriclite.environments.env_var import EnvVarEnvironment
from fabriclite.environments.fabriclite_env import FORCE_VAR, FabricliteEnvironment
from fabriclite.environments.local import LocalEnvironment
from fabriclite.environments.lsf import LSFEnvironment
from fabriclite.environments.mpi import MPIEnvironment
from fabriclite.environments.slurm import SLURMEnvironment
from fabriclite.environments.torchelastic import TorchElasticEnvironment
from fabriclite.environments.xla import XLAEnvironment

#: Automatic detection order; the first class whose ``detect()`` is True wins.
DETECTION_ORDER: Tuple[Type[ClusterEnvironment], ...] = (
    TorchElasticEnvironment,
    SLURMEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    FabricliteEnvironment,
    EnvVarEnvironment,
    LocalEnvironment,
)

#: Every environment by name, for ``FABRICLITE_CLUSTER_ENVIRONMENT=<name>``. "xla" is forceable but not auto-detected.
ENVIRONMENTS: Dict[str, Type[ClusterEnvironment]] = {
    cls.name: cls for cls in (*DETECTION_ORDER, XLAEnvironment)
}

#: The environment variable that forces an environment by name.
FORCE_ENVIRONMENT_VAR = FORCE_VAR


def environment_by_name(name: str) -> ClusterEnvironment:
    """A new instance of the environment called ``name``; ValueError listing the valid names otherwise."""
    cls = ENVIRONMENTS.get(name.strip().lower())
    if cls is None:
        raise ValueError(
            f"Unknown cluster environment {name!r} (from {FORCE_ENVIRONMENT_VAR}). "
            f"Valid names: {', '.join(sorted(ENVIRONMENTS))}."
        )
    return cls()


def detected_environments() -> List[Type[ClusterEnvironment]]:
    """Every class of :data:`DETECTION_ORDER` whose ``detect()`` is True, in order (always ends with local)."""
    return [cls for cls in DETECTION_ORDER if cls.detect()]


def _cross_check(winner: ClusterEnvironment, others: List[Type[ClusterEnvironment]]) -> None:
    """ValueError when another detected external environment reports a different world size than ``winner``."""
    if winner.nested_launcher:
        return  # the innermost launcher: the variables of the launchers around it count something else
    world = None
    for cls in others:
        if cls is LocalEnvironment:
            continue
        other = cls()
        try:
            other_world = other.world_size()
        except ValueError:
            continue  # its variables are incomplete or malformed: it lost anyway, the winner's are what count
        if world is None:
            world = winner.world_size()
        if other_world != world:
            raise ValueError(
                f"Two cluster environments detected with different world sizes: {winner.name} "
                f"({type(winner).__name__}) says {world}, {other.name} ({cls.__name__}) says {other_world}. "
                f"{winner.name} comes first in the detection order, but the mismatch means one set of variables is "
                f"stale or describes something else. Force the right one with {FORCE_ENVIRONMENT_VAR}={winner.name} "
                f"(or ={other.name}), or Fabric(plugins=[{type(winner).__name__}()]), or unset the other's variables."
            )


def detect_environment(forced: Optional[ClusterEnvironment] = None) -> ClusterEnvironment:
    """The cluster environment of this process: ``forced`` if given, else the one named by
    ``FABRICLITE_CLUSTER_ENVIRONMENT``, else the first of :data:`DETECTION_ORDER` that detects, cross-checked.

    Raises TypeError for a ``forced`` that is not a ClusterEnvironment, ValueError for an unknown forced name or
    when two detected external environments disagree on the world size. Reads ``os.environ`` only; writes nothing.
    """
    if forced is not None:
        if not isinstance(forced, ClusterEnvironment):
            raise TypeError(
                f"A forced cluster environment must be a ClusterEnvironment instance such as SLURMEnvironment(), "
                f"got {forced!r} of type {type(forced).__name__}."
            )
        return forced
    name = os.environ.get(FORCE_ENVIRONMENT_VAR, "").strip()
    if name:
        return environment_by_name(name)
    found = detected_environments()
    winner = found[0]()
    _cross_check(winner, found[1:])
    return winner
