"""Datasets of the streaming libraries for resume tests, written on local files with each library's own writer (no
network): litdata (``litdata.optimize``), MosaicML Streaming (``streaming.MDSWriter``) and webdataset (tar shards
written with ``webdataset.TarWriter``). Every dataset holds the samples ``{"index": i}`` for ``i`` in ``0 .. length -
1``; ``library_loader`` builds the loader of one kind over them, as a user would, for a rank of the running job.

Only the data lane has these libraries (tests/integration/backends/lane_data); nothing here imports them at import.
"""
from __future__ import annotations

import os
from typing import Any, Dict

#: the loader kinds over these libraries: ``litdata`` / ``streaming`` (``-shuffled``: shuffle=True), ``wds``
KINDS = ("litdata", "litdata-shuffled", "streaming", "streaming-shuffled", "wds")


def _index(i: int) -> Dict[str, int]:
    return {"index": i}


def write_datasets(root: str, length: int, shards: int = 8) -> None:
    """Each library's dataset of ``length`` samples under ``root`` (``lit``, ``mds``, ``wds``), ``shards`` files
    each (litdata's chunks, Streaming's shards, webdataset's tars)."""
    import litdata
    import webdataset as wds
    from streaming import MDSWriter

    per = -(-length // shards)
    litdata.optimize(fn=_index, inputs=list(range(length)), output_dir=os.path.join(root, "lit"), chunk_size=per,
                     num_workers=1, mode="overwrite", start_method="fork")
    # an MDS shard holds what fits in size_limit bytes: ~per samples of one int column
    with MDSWriter(out=os.path.join(root, "mds"), columns={"index": "int"}, size_limit=per * 8 + 16) as writer:
        for i in range(length):
            writer.write({"index": i})
    os.makedirs(os.path.join(root, "wds"), exist_ok=True)
    for shard in range(shards):
        with wds.TarWriter(os.path.join(root, "wds", f"shard-{shard:03d}.tar")) as writer:
            for i in range(shard * per, min(length, (shard + 1) * per)):
                writer.write({"__key__": f"{i:06d}", "index.cls": i})


def _as_index(sample: Any) -> Dict[str, int]:
    return {"index": int(sample["index.cls"] if "index.cls" in sample else sample["cls"])}


def library_loader(kind: str, root: str, batch: int, workers: int, options: Dict[str, Any]) -> Any:
    """The loader of ``kind`` (:data:`KINDS`) over the datasets under ``root``, built in a rank after launch (the
    libraries read the rank then); ``options``: the DataLoader options of the caller (workers' context and all)."""
    shuffle = kind.endswith("-shuffled")
    if kind.startswith("litdata"):
        import litdata

        dataset = litdata.StreamingDataset(os.path.join(root, "lit"), shuffle=shuffle, seed=7)
        extra = {k: v for k, v in options.items() if k in ("persistent_workers", "multiprocessing_context")}
        return litdata.StreamingDataLoader(dataset, batch_size=batch, num_workers=workers, **extra)
    if kind.startswith("streaming"):
        from streaming import StreamingDataset
        from torch.utils.data import DataLoader

        dataset = StreamingDataset(local=os.path.join(root, "mds"), batch_size=batch, shuffle=shuffle,
                                   shuffle_seed=7, num_canonical_nodes=1)
        return DataLoader(dataset, **options)
    if kind == "wds":
        import webdataset as wds
        from torch.utils.data import DataLoader

        urls = sorted(os.path.join(root, "wds", name) for name in os.listdir(os.path.join(root, "wds")))
        dataset = wds.WebDataset(urls, resampled=False, shardshuffle=False, nodesplitter=wds.split_by_node,
                                 workersplitter=wds.split_by_worker, empty_check=False).decode().map(_as_index)
        return DataLoader(dataset, **options)
    raise ValueError(kind)


def blank_resume_block(dataset: Any) -> Any:
    """The node's shared resume block of the Streaming ``dataset``, created and left unwritten (as a rank's
    ``load_state_dict`` leaves it between creating and writing it: what another rank may read then); the block, to
    keep open."""
    import mmap

    from streaming.base.constant import RESUME
    from streaming.base.shared import SharedMemory
    from streaming.base.shared.prefix import _get_path

    return SharedMemory(name=_get_path(dataset._shm_prefix_int, RESUME), create=True, size=mmap.PAGESIZE)


__all__ = ["KINDS", "blank_resume_block", "library_loader", "write_datasets"]
