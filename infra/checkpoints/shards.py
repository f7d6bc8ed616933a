"""The trainer ranks' tensors in a checkpoint: written and read by every rank with torch.distributed.checkpoint.

Each rank writes the shards it holds (model and optimizer state, `LLMTrainer.shard_state`) into the step's
directory as `__<rank>_<n>.distcp` files, and rank 0 writes `shards.json`, the index of every tensor: its
dtype, global shape, and which file holds which slice (offsets and sizes). A read gives every rank exactly the
slices its own layout needs, so a checkpoint written by N ranks in one sharding loads onto M ranks in any
other (`none`, `fsdp`, `hsdp`).

`write_shards` returns at once after a staging copy of the rank's tensors (host memory, one copy of the rank's
shards); the files are written and fsynced in a background thread, at most one save at a time per process. The
staging buffers belong to one stager per process (`_stager`), allocated by the first save (pinned on CUDA, filled
with non-blocking copies), refilled by the next ones and freed before the final export (`release_staging`); each
file's sha256 is computed from the bytes as they are written, not read back from disk. Nothing here is unpickled:
the index is JSON (torch.distributed.checkpoint's own index is a pickle, so this module writes and reads its own),
only tensors are stored, and they are read with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from infra.checkpoints.format import CheckpointError, parse_json, sha256_file, write_json
from rl_core.atomic import fsync_dir

SHARD_INDEX = "shards.json"
SHARD_SUFFIX = ".distcp"
INDEX_FORMAT = "posttrain-shards"
_background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-shards")
_stager: DefaultStager | None = None  # this process's staging buffers, reused by every save (`_staging`)
_writing: Future | None = None  # this process's save in flight: its files are written from the staging buffers


def _staging() -> DefaultStager:
    """The process's one stager: its host copies of the tensors (pinned memory on CUDA, copied without blocking) are
    made by the first save and kept, keyed by the tensors' storages, so later saves copy into them again."""
    global _stager
    if _stager is None:
        cuda = torch.cuda.is_available()
        _stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                               use_async_staging=False, use_non_blocking_copy=cuda))
    return _stager


def release_staging() -> None:
    """Free the process's staging buffers (after the save in flight, if any, is written): before the final export,
    whose host memory the plan counts without them (`rl_core.placement.host_memory`). The next save stages anew."""
    global _stager
    if _writing is not None:
        wait([_writing])
    if _stager is not None:
        _stager.close()
        _stager = None


class _HashingStream:
    """A file stream that hashes what is written to it, in order: the file's sha256 without reading it back (a seek
    makes the hash unusable: `digest` is then None)."""

    def __init__(self, stream: Any):
        self._stream, self._sha, self.size, self.sequential = stream, hashlib.sha256(), 0, True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._sha.update(view)
        self.size += view.nbytes
        return self._stream.write(data)

    def seek(self, *args: Any) -> int:
        self.sequential = False
        return self._stream.seek(*args)

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, ...: the file's own
        return getattr(self._stream, name)

    @property
    def digest(self) -> str | None:
        return self._sha.hexdigest() if self.sequential else None


class _HashingFileSystem(FileSystem):
    """The local file system of torch.distributed.checkpoint, recording each written file's size and sha256."""

    def __init__(self) -> None:
        super().__init__()
        self.hashed: dict[str, tuple[int, str | None]] = {}
        self._lock = threading.Lock()  # DCP may write files from several threads

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = _HashingStream(stream)
            yield hashing
        with self._lock:
            self.hashed[Path(path).name] = (hashing.size, hashing.digest)


class _Writer(dcp.FileSystemWriter):
    """torch.distributed.checkpoint's file writer, with the index written as JSON and the files it wrote recorded
    with their sha256 as written."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=True)
        self.fs = _HashingFileSystem()
        self.written: dict[str, None] = {}  # the files, in the order written (a file holds many tensors)

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        self.written.update(dict.fromkeys(r.storage_data.relative_path for r in future.wait()))
        return future

    def finish(self, metadata: Metadata, results) -> None:
        storage = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        write_json(Path(self.path) / SHARD_INDEX, _encode_index(metadata, storage))
        self.written[SHARD_INDEX] = None


class _Reader(dcp.FileSystemReader):
    """torch.distributed.checkpoint's file reader, its index read from `shards.json`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / SHARD_INDEX
        remedy = "resume from another checkpoint (CheckpointStore.latest_valid() skips damaged ones)"
        try:
            return _decode_index(parse_json(path.read_bytes(), str(path), remedy))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{path} is not a shard index ({type(exc).__name__}: {exc}); {remedy}") from exc


def _tensor_leaves(tree: Any, path: str = "") -> None:
    """Refuse anything but nested dicts of tensors (a non-tensor would be pickled by torch.distributed.checkpoint)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            _tensor_leaves(value, f"{path}.{key}" if path else str(key))
    elif not isinstance(tree, torch.Tensor):
        raise TypeError(f"sharded checkpoint: {path} is a {type(tree).__name__}; only tensors are written as shards "
                        "(put other values in the trainer's plain state)")


def _every_nth(tree: dict, start: int, step: int) -> dict:
    """The leaves of `tree` at positions start, start + step, ... in sorted key order, in the same nesting."""
    leaves: list[tuple[tuple[str, ...], torch.Tensor]] = []

    def walk(node: dict, path: tuple[str, ...]) -> None:
        for key in sorted(node, key=str):
            if isinstance(node[key], dict):
                walk(node[key], (*path, key))
            else:
                leaves.append(((*path, key), node[key]))

    walk(tree, ())
    out: dict = {}
    for path, value in leaves[start::step]:
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def write_shards(tensors: dict[str, Any], directory: str | Path, group: Any = None,
                 replica: tuple[int, int] | None = None) -> Future:
    """Start writing this rank's `tensors` (nested dicts of tensors or DTensor shards) into `directory`; every rank
    calls it. Returns once they are staged (copied to host memory), with a future of `{file name: {"size",
    "sha256"}}` for the files this rank wrote (rank 0: `shards.json` too), hashed after they are on disk. `group`: a
    process group with a CPU backend kept for checkpoints, so that its collectives never interleave with
    training's. `replica=(rank, ranks)`: the ranks hold identical whole copies (unsharded data parallel), so each
    stages and writes only every `ranks`-th tensor, starting at its `rank`-th."""
    global _writing
    _tensor_leaves(tensors)
    if _writing is not None and not _writing.done():
        raise RuntimeError("write_shards: this process's last checkpoint is still being written from the staging "
                           "buffers the next one would fill; wait for its future first")
    if replica is not None:
        tensors = _every_nth(tensors, *replica)
    writer = _Writer(directory)
    upload = dcp.async_save(tensors, storage_writer=writer, process_group=group, no_dist=not _distributed(),
                            async_stager=_staging())

    def finished() -> dict[str, dict]:
        upload.result()  # raises the write's error
        files = {}
        for name in writer.written:
            path = Path(directory) / name
            size, digest = writer.fs.hashed.get(name, (None, None))
            if size != path.stat().st_size or digest is None:  # written otherwise than in one pass: read it back
                size, digest = path.stat().st_size, sha256_file(path)
            files[name] = {"size": size, "sha256": digest}
        fsync_dir(Path(directory))
        return files

    _writing = _background.submit(finished)
    return _writing


def read_shards(tensors: dict[str, Any], directory: str | Path, group: Any = None) -> None:
    """Fill `tensors` (this rank's layout: the structure `write_shards` got, possibly from another number of ranks or
    another sharding) in place from `directory`; every rank calls it. A tensor the checkpoint lacks raises
    CheckpointError naming it."""
    _tensor_leaves(tensors)
    try:
        dcp.load(tensors, storage_reader=_Reader(directory), process_group=group, no_dist=not _distributed())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP wraps every rank's error in its own, a BaseException
        raise CheckpointError(f"reading the trainer's shards from {directory} failed: {type(exc).__name__}: "
                              f"{str(exc)[:2000]}; the checkpoint does not hold this trainer's tensors (another model "
                              "or model.lora setting?) or is damaged; resume from another one") from exc


def full_tensors(directory: str | Path, prefix: str = "model") -> dict[str, torch.Tensor]:
    """The whole tensors under `prefix` (`model`: the weights, or with LoRA the adapters, by parameter name), read in
    this process on CPU, without a process group: a checkpoint's weights for tools outside a run."""
    path = Path(directory) / SHARD_INDEX
    index = parse_json(path.read_bytes(), str(path), "export another step")
    tensors = {fqn[len(prefix) + 1:]: torch.empty(md.size, dtype=md.properties.dtype)
               for fqn, md in _decode_index(index).state_dict_metadata.items() if fqn.startswith(prefix + ".")}
    read_shards({prefix: tensors}, directory)
    return tensors


# ------------------------------------------------------------------------------------ the index as JSON

def _size(values: Any) -> list[int]:
    return [int(v) for v in values]


def _encode_index(metadata: Metadata, storage: dict[MetadataIndex, _StorageInfo]) -> dict:
    tensors = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise TypeError(f"sharded checkpoint: {fqn} is not a tensor")
        props = md.properties
        if props.layout != torch.strided:
            raise TypeError(f"sharded checkpoint: {fqn} has layout {props.layout}; only dense tensors are written")
        tensors[fqn] = {"dtype": str(props.dtype).removeprefix("torch."), "size": _size(md.size),
                        "chunks": [{"offsets": _size(c.offsets), "sizes": _size(c.sizes)} for c in md.chunks]}
    items = [{"fqn": index.fqn, "offset": None if index.offset is None else _size(index.offset), "index": index.index,
              "file": info.relative_path, "at": info.offset, "length": info.length,
              "transforms": list(info.transform_descriptors or [])}
             for index, info in storage.items()]
    planner = {fqn: list(path) for fqn, path in (metadata.planner_data or {}).items()}
    return {"format": INDEX_FORMAT, "version": 1, "dcp_version": metadata.version, "tensors": tensors,
            "storage": items, "planner": planner}


def _decode_index(data: dict) -> Metadata:
    if data.get("format") != INDEX_FORMAT or data.get("version") != 1:
        raise ValueError(f"format {data.get('format')!r} version {data.get('version')!r} is not {INDEX_FORMAT} 1")
    tensors: dict[str, TensorStorageMetadata] = {}
    for fqn, md in data["tensors"].items():
        dtype = getattr(torch, md["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {md['dtype']!r} of {fqn}")  # noqa: TRY004 - a bad file, not a bad call
        chunks = [ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"])) for c in md["chunks"]]
        tensors[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(md["size"]), chunks)
    storage = {}
    for item in data["storage"]:
        name = item["file"]
        if not (isinstance(name, str) and name.endswith(SHARD_SUFFIX) and "/" not in name and not name.startswith(".")):
            raise ValueError(f"shard file name {name!r} is not a plain .distcp file name")
        offset = None if item["offset"] is None else torch.Size(item["offset"])
        storage[MetadataIndex(item["fqn"], offset, item["index"])] = _StorageInfo(
            name, int(item["at"]), int(item["length"]), tuple(item["transforms"]) or None)
    planner = {fqn: tuple(path) for fqn, path in data["planner"].items()}
    return Metadata(tensors, planner_data=planner, storage_data=storage, storage_meta=StorageMeta(),
                    version=data["dcp_version"])
