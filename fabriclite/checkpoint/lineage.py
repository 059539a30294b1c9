"""Lineages: which checkpoints of a directory ``save(..., keep=K)`` counts, across restarts and relaunches.

A *lineage* is the chain of checkpoints one training job leaves in a directory, whatever launched it: a restart
round, a SLURM requeue, a new ``sbatch``, a manual relaunch or a spot machine's restart. Every manifest entry
records its lineage id (``"lineage"``; an entry from before lineages counts as the lineage of its run id):

- a run that loaded a checkpoint this directory's manifest records (``load_latest``, or ``fabric.load`` of it)
  continues that checkpoint's lineage;
- otherwise a run continues the lineage of its own newest entry there (the same run id: a later round, a requeue);
- otherwise it starts a lineage named by its run id.

``keep=K`` keeps the K newest checkpoints of the lineage (by the order they were recorded) and deletes the older
ones, whichever run wrote them. Two runs that resume from the same checkpoint both continue its lineage (two
branches); each save keeps the K newest of the lineage, from either branch, and in addition never deletes the
newest checkpoint of another writer that is still alive (``fabriclite.checkpoint.writers``): what a live branch
just wrote, and would resume from, stays. Once that writer is dead its checkpoints count like any other.
Checkpoints of other lineages (unrelated runs sharing the folder) are never deleted.

A save is first recorded as *pending* (``"pending"`` in the manifest: name, lineage, run id, writer); its entry
moves to ``"checkpoints"`` once it is complete. A pending entry whose writer is dead is a save that was killed:
the next save of its lineage (or any save, when its lineage has no complete checkpoint: a run killed in its first
save) deletes what it left, its temporaries and a checkpoint it published but never recorded (unless a complete
entry records that name), and drops the entry. Temporaries whose name carries a dead writer's token are removed
by any save; a live writer's are never touched.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from fabriclite.checkpoint import remote_paths, writers

Entry = Dict[str, Any]


def lineage_of(entry: Entry) -> str:
    """An entry's lineage id (an entry from before lineages: its run id)."""
    return entry.get("lineage") or entry["run_id"]


def choose(loaded: Optional[str], entries: List[Entry], rid: str) -> str:
    """The lineage a run continues (module docstring): ``loaded`` (the lineage of the checkpoint it loaded), else
    that of its run id's newest entry in ``entries`` (oldest first), else ``rid``."""
    if loaded:
        return loaded
    own = [e for e in entries if e["run_id"] == rid]
    return lineage_of(own[-1]) if own else rid


def prune(entries: List[Entry], lineage: str, keep: int, me: Optional[writers.Writer],
          alive: Callable[[Optional[writers.Writer]], bool]) -> Tuple[List[Entry], List[Entry]]:
    """``(kept, dropped)`` of ``entries`` (complete, oldest first): the ``keep`` newest of ``lineage`` stay, and so
    does the newest entry of each other writer of the lineage that is ``alive``; other lineages are kept whole."""
    ours = [e for e in entries if lineage_of(e) == lineage]
    newest: Dict[str, Entry] = {}
    for e in ours:
        if e.get("writer") and e["writer"] != me:
            newest[writers.token(e["writer"])] = e
    protected = {id(e) for e in newest.values() if alive(e["writer"])}
    dropped = [e for e in ours[:-keep] if id(e) not in protected] if keep < len(ours) else []
    gone = {id(e) for e in dropped}
    return [e for e in entries if id(e) not in gone], dropped


def settle_pending(pending: List[Entry], entries: List[Entry], lineage: str, me: Optional[writers.Writer],
                   alive: Callable[[Optional[writers.Writer]], bool]) -> Tuple[List[Entry], List[Entry]]:
    """``(kept, abandoned)`` of the ``pending`` entries, given the complete ``entries`` after this save: a pending
    entry is abandoned when its writer is this process (a save that failed: one is in flight at a time, and it was
    just recorded) or is dead, and it belongs to ``lineage`` or to a lineage without complete checkpoints."""
    lineages = {lineage_of(e) for e in entries}
    kept, abandoned = [], []
    for p in pending:
        ours = lineage_of(p) == lineage or lineage_of(p) not in lineages
        finished = p.get("writer") == me or not alive(p.get("writer"))
        (abandoned if ours and finished else kept).append(p)
    return kept, abandoned


def leftovers(directory: str, abandoned: List[Entry], entries: List[Entry]) -> List[str]:
    """The names in ``directory`` that ``abandoned`` pending entries left: their temporaries, and the checkpoint
    each published at its final name unless a complete entry in ``entries`` records that name."""
    recorded = {e["name"] for e in entries}
    names = [name for name, _ in remote_paths.listdir(directory)]
    out = []
    for p in abandoned:
        tag = writers.token(p["writer"]) if p.get("writer") else None
        if p["name"] not in recorded and p["name"] in names:
            out.append(p["name"])
        if tag is not None:
            out += [n for n in names if n.startswith(f".{p['name']}.tmp-") and tag in n]
    return sorted(set(out))


def dead_temporaries(directory: str, me: Optional[writers.Writer],
                     alive: Callable[[Optional[writers.Writer]], bool]) -> List[str]:
    """Names in the local ``directory`` that a dead writer left: temporaries (``.<name>.tmp-...<token>...``) and
    writer locks (``.fabriclite-writer-<token>.lock``). This process's are left to it."""
    out = []
    for name, _ in remote_paths.listdir(directory):
        if not name.startswith(".") or (".tmp-" not in name and not name.startswith(writers.LOCK_PREFIX)):
            continue
        writer = writers.parse(name)
        if writer is not None and writer != me and not alive(writer):
            out.append(name)
    return out


class Lineages:
    """Global rank 0's memory, for one Fabric: the lineage of the checkpoint it loaded in each directory, and its
    writer locks."""

    def __init__(self) -> None:
        self._loaded: Dict[str, str] = {}
        self.locks = writers.WriterLock()

    def loaded(self, directory: str, name: str, recorded: List[Entry]) -> None:
        """Note the lineage of checkpoint ``name`` of ``directory`` when ``recorded`` (its manifest's checkpoints)
        holds it (``fabriclite.checkpoint.manifest.note_loaded`` reads them; global rank 0, after loading it)."""
        for entry in recorded:
            if entry["name"] == name:
                self._loaded[directory] = lineage_of(entry)

    def lineage(self, directory: str) -> Optional[str]:
        """The lineage of the checkpoint this Fabric loaded from ``directory``, if any."""
        return self._loaded.get(directory)


def alive_in(directory: str) -> Callable[[Optional[writers.Writer]], bool]:
    """``alive(writer)`` for writers of ``directory`` (``writers.is_dead``, its lock files there)."""
    return lambda writer: not writers.is_dead(writer, None if remote_paths.is_remote(directory) else directory)


__all__ = ["Lineages", "alive_in", "choose", "dead_temporaries", "leftovers", "lineage_of", "prune", "settle_pending"]
