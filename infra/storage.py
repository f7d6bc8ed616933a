"""Checkpoint storage: atomic checkpoint directories on local disk, mirrored to S3 with boto3.

Layout of one checkpoint (`root` is e.g. `runs/<name>/checkpoints`)::

    root/step_00000040/
        trainer_rank0.safetensors   the tensors of part "trainer_rank0" (flatten_state)
        trainer_rank0.json          its skeleton: everything that is not a tensor, as tagged JSON
        meta.json                   the caller's meta dict
        manifest.json               written last: format version, step, parts, size + sha256 per file

A checkpoint is written into `root/.tmp-step_...`, every file and the directory are fsynced, the
manifest comes last, then the directory is renamed to `step_XXXXXXXX`. A directory whose manifest is
missing, unparsable or does not match its files is never loaded. Nothing is ever unpickled: tensors
come from `safetensors.torch.load_file`, everything else from JSON, decoded into a fixed set of types.

With `remote_uri="s3://bucket/prefix"` each completed checkpoint is uploaded to
`prefix/step_XXXXXXXX/<file>` (manifest last, multipart for large files) and verified (size and
sha256 of every object) before older checkpoints are pruned. A failed upload raises
`CheckpointUploadError`; the local checkpoint and its predecessors stay. With `background_upload=True`
(what training runs use) the upload runs in a thread, so training continues on local checkpoints
while S3 is down, and the upload catches up when it is back; `flush()` waits for it.

What is retried: transient S3 errors (connection errors, timeouts, 5xx, throttling/SlowDown,
RequestTimeout) are retried with exponential backoff and jitter for up to S3_RETRY_BUDGET_S seconds
in all (long enough to ride out an endpoint restart; `retry_budget_s=` or the environment variable
POSTTRAIN_S3_RETRY_BUDGET_S override it). Anything else (an invalid request such as a bad bucket
name, NoSuchBucket, AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch, missing credentials)
fails at once, naming the URI and what to fix.

Credentials come only from the environment / AWS profiles (boto3's own chain): a URI with
`user:password@` is refused, and every message and log line goes through `rl_core.redact`.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import logging
import os
import random
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import safetensors.torch
import torch

from rl_core.redact import has_userinfo, redact_message, redact_uri

log = logging.getLogger("posttrain.storage")

FORMAT_NAME = "posttrain-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
META = "meta.json"
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_PART_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_RESERVED_PARTS = {"meta", "manifest"}
_LOADABLE_SUFFIXES = (".safetensors", ".json")
_SAFETENSORS_DTYPES = frozenset(safetensors.torch._TYPES.values())
MiB = 1024 * 1024
# Total time (seconds) a transient S3 failure of one call is retried for: a shared S3 outage or an
# endpoint restart (~30 s) is ridden out instead of stopping training.
S3_RETRY_BUDGET_S = 120.0
RETRY_BUDGET_ENV = "POSTTRAIN_S3_RETRY_BUDGET_S"
# Jitter has its own generator: the global `random` stream belongs to the training run (checkpointed).
_JITTER = random.Random()


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, verified or loaded; the message says what to do."""


class CheckpointUnavailable(CheckpointError):
    """The remote store could not be reached (transient errors past the retry budget); nothing is damaged."""


class CheckpointUploadError(CheckpointError):
    """The upload to S3 failed after all retries; `local_path` is the intact local checkpoint."""

    def __init__(self, message: str, local_path: Path):
        super().__init__(message)
        self.local_path = local_path


# ------------------------------------------------------------------------------ state <-> tensors

def flatten_state(obj: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Split a nested state into `(tensors, skeleton)`: a flat tensor dict and a JSON-able skeleton.

    Handles dict (any key that is itself encodable: int, str, tuple, ...), OrderedDict (with a
    module state_dict's `_metadata`), list, tuple, torch tensors of any dtype and device (stored
    on CPU, contiguous), numpy arrays and scalars, python int (any size), float (inf/nan exact),
    bool, None, str, bytes, torch.Size, torch.dtype, torch.device. Anything else raises TypeError
    with the path of the value. `unflatten_state(*flatten_state(x))` equals `x` bitwise.
    """
    tensors: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()

    def add_tensor(path: str, tensor: torch.Tensor) -> str:
        key = path or "tensor"
        if key in tensors:
            n = 1
            while f"{key}#{n}" in tensors:
                n += 1
            key = f"{key}#{n}"
        tensors[key] = tensor
        return key

    def encode(value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, np.generic):  # before int/float: np.float64 subclasses float
            array = np.asarray(value)
            _check_numpy_dtype(array.dtype, path)
            return {"t": "npscalar", "dtype": array.dtype.str, "b64": base64.b64encode(array.tobytes()).decode()}
        if isinstance(value, int):
            value = int(value)
            # python refuses to print/parse ints of > 4300 decimal digits; hex has no such limit
            return value if abs(value) < 2 ** 64 else {"t": "bigint", "hex": hex(value)}
        if isinstance(value, float):
            return {"t": "float", "hex": float(value).hex()}
        if isinstance(value, torch.Tensor):
            return encode_tensor(value, path)
        if isinstance(value, np.ndarray):
            _check_numpy_dtype(value.dtype, path)
            raw = torch.from_numpy(np.ascontiguousarray(value).reshape(-1).view(np.uint8).copy())
            key = add_tensor(path, raw)
            return {"t": "ndarray", "key": key, "dtype": value.dtype.str, "shape": list(value.shape)}
        if isinstance(value, torch.Size):
            return {"t": "torch_size", "v": list(value)}
        if isinstance(value, torch.dtype):
            return {"t": "torch_dtype", "v": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"t": "torch_device", "v": str(value)}
        if isinstance(value, bytes):
            return {"t": "bytes", "b64": base64.b64encode(value).decode()}
        if isinstance(value, tuple) and type(value) is tuple:
            return {"t": "tuple", "v": [encode(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, list) and type(value) is list:
            return {"t": "list", "v": [encode(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if type(value) in (dict, collections.OrderedDict):
            items = []
            for k, v in value.items():
                if isinstance(k, (torch.Tensor, np.ndarray)):
                    raise TypeError(f"flatten_state: a tensor/array is used as a dict key at {path or '/'}")
                items.append([encode(k, f"{path}/<key>"), encode(v, f"{path}/{_path_component(k)}")])
            node: dict[str, Any] = {"t": "dict" if type(value) is dict else "odict", "items": items}
            metadata = getattr(value, "_metadata", None)
            if metadata is not None:  # nn.Module.state_dict() keeps per-module versions here
                node["metadata"] = encode(metadata, f"{path}/<_metadata>")
            return node
        raise TypeError(
            f"flatten_state: cannot store {type(value).__module__}.{type(value).__qualname__} at "
            f"{path or '/'}; convert it to tensors, numpy arrays or plain python values (dict, list, "
            f"tuple, int, float, str, bool, None) before checkpointing")

    def encode_tensor(tensor: torch.Tensor, path: str) -> dict:
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise TypeError(f"flatten_state: tensor at {path or '/'} has layout {tensor.layout}; "
                            f"only dense tensors can be checkpointed (call .to_dense())")
        tensor = tensor.detach().cpu().contiguous()
        if tensor.untyped_storage().nbytes():
            ptr = tensor.untyped_storage().data_ptr()
            if ptr in seen_storages:  # safetensors refuses shared storage: store a copy
                tensor = tensor.clone()
            else:
                seen_storages.add(ptr)
        node: dict[str, Any] = {"t": "tensor"}
        if tensor.dtype not in _SAFETENSORS_DTYPES:  # e.g. complex128: keep its bytes, exactly
            node["dtype"] = str(tensor.dtype).removeprefix("torch.")
            node["shape"] = list(tensor.shape)
            tensor = tensor.reshape(-1).view(torch.uint8).clone()
        node["key"] = add_tensor(path, tensor)
        return node

    skeleton = encode(obj, "")
    return tensors, skeleton


def unflatten_state(tensors: Mapping[str, torch.Tensor], skeleton: Any) -> Any:
    """Inverse of `flatten_state`; raises CheckpointError on a malformed skeleton or missing tensor."""
    used: set[str] = set()

    def tensor_for(key: Any) -> torch.Tensor:
        if not isinstance(key, str) or key not in tensors:
            raise CheckpointError(f"skeleton refers to tensor {key!r}, which is not in the safetensors file")
        used.add(key)
        return tensors[key]

    def decode(node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, str)):
            return node
        if not isinstance(node, dict) or not isinstance(node.get("t"), str):
            raise CheckpointError(f"malformed checkpoint skeleton node: {str(node)[:200]}")
        kind = node["t"]
        if kind == "float":
            return float.fromhex(node["hex"])
        if kind == "bigint":
            return int(node["hex"], 16)
        if kind == "tensor":
            tensor = tensor_for(node["key"])
            if "dtype" in node:
                dtype = getattr(torch, node["dtype"], None)
                if not isinstance(dtype, torch.dtype):
                    raise CheckpointError(f"unknown torch dtype {node['dtype']!r} in checkpoint skeleton")
                tensor = tensor.view(dtype).reshape(node["shape"])
            return tensor
        if kind == "ndarray":
            dtype = _numpy_dtype(node["dtype"])
            raw = tensor_for(node["key"]).numpy().tobytes()
            return np.frombuffer(raw, dtype=dtype).reshape(node["shape"]).copy()
        if kind == "npscalar":
            dtype = _numpy_dtype(node["dtype"])
            return np.frombuffer(base64.b64decode(node["b64"]), dtype=dtype)[0]
        if kind == "tuple":
            return tuple(decode(v) for v in node["v"])
        if kind == "list":
            return [decode(v) for v in node["v"]]
        if kind in ("dict", "odict"):
            out = {} if kind == "dict" else collections.OrderedDict()
            for key, value in node["items"]:
                out[decode(key)] = decode(value)
            if "metadata" in node:
                out._metadata = decode(node["metadata"])  # type: ignore[attr-defined]
            return out
        if kind == "torch_size":
            return torch.Size(node["v"])
        if kind == "torch_dtype":
            dtype = getattr(torch, node["v"], None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"unknown torch dtype {node['v']!r} in checkpoint skeleton")
            return dtype
        if kind == "torch_device":
            return torch.device(node["v"])
        if kind == "bytes":
            return base64.b64decode(node["b64"])
        raise CheckpointError(f"unknown node type {kind!r} in checkpoint skeleton (written by a newer version?)")

    try:
        obj = decode(skeleton)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"malformed checkpoint skeleton: {type(exc).__name__}: {exc}") from exc
    unused = set(tensors) - used
    if unused:
        raise CheckpointError(f"safetensors file holds tensors the skeleton does not use: {sorted(unused)[:5]}")
    return obj


def _path_component(key: Any) -> str:
    return key if isinstance(key, str) else repr(key)


def _check_numpy_dtype(dtype: np.dtype, path: str) -> None:
    if dtype.hasobject or dtype.fields is not None or dtype.kind == "V":
        raise TypeError(f"flatten_state: numpy dtype {dtype} at {path or '/'} holds python objects or "
                        f"fields; only plain numeric/string dtypes can be checkpointed")


def _numpy_dtype(text: Any) -> np.dtype:
    if not isinstance(text, str):
        raise CheckpointError(f"malformed numpy dtype {text!r} in checkpoint skeleton")
    dtype = np.dtype(text)
    if dtype.hasobject or dtype.fields is not None or dtype.kind == "V":
        raise CheckpointError(f"numpy dtype {text!r} in checkpoint skeleton is not allowed")
    return dtype


# ------------------------------------------------------------------------------------ file helpers

def _sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that a rename or a new file inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes | str) -> None:
    """Write `data` to `path` and fsync it (a rename after this publishes complete contents only)."""
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: Path, obj: Any) -> None:
    write_durably(path, json.dumps(obj, indent=1, ensure_ascii=False))


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_step(path: str | Path) -> int:
    """The step of a checkpoint directory `.../step_XXXXXXXX`."""
    match = _STEP_DIR.match(Path(path).name)
    if not match:
        raise CheckpointError(f"{path} is not a checkpoint directory (expected a name like step_00000040)")
    return int(match.group(1))


def verify_checkpoint(path: str | Path, *, check_hashes: bool = True) -> dict:
    """The parsed manifest of a complete, intact checkpoint directory; else CheckpointError.

    Checks: manifest present and parsable, known format version, every listed file a plain name
    ending in .safetensors/.json that exists with the listed size and sha256, every part with its
    two files, meta.json listed, and no file in the directory that the manifest does not list.
    """
    path = Path(path)
    manifest_path = path / MANIFEST
    remedy = (f"do not load it: resume from an older checkpoint (CheckpointStore.latest_valid() skips "
              f"it) or restore this step from the remote copy, then delete {path}")
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: it is incomplete (the writer "
                              f"crashed or it was copied partially); {remedy}")
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{manifest_path} is not valid JSON ({exc}); {remedy}") from exc
    _check_manifest_structure(manifest, str(manifest_path), remedy)
    listed = manifest["files"]
    present = {p.name for p in path.iterdir()} - {MANIFEST}
    unlisted = sorted(present - set(listed))
    if unlisted:
        raise CheckpointError(f"checkpoint {path} contains {unlisted}, which {MANIFEST} does not list; "
                              f"refusing to load a directory with unaccounted files; {remedy}")
    for name, entry in listed.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is listed in {MANIFEST} but missing; {remedy}")
        size = file.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"{file} has {size} bytes but {MANIFEST} records {entry['size']}: the file "
                                  f"is truncated or was modified; {remedy}")
        if check_hashes:
            digest = _sha256_file(file)
            if digest != entry["sha256"]:
                raise CheckpointError(f"{file} has sha256 {digest} but {MANIFEST} records {entry['sha256']}: "
                                      f"the file is corrupted or was modified; {remedy}")
    return manifest


def _check_manifest_structure(manifest: Any, where: str, remedy: str) -> None:
    def fail(what: str) -> None:
        raise CheckpointError(f"{where}: {what}; {remedy}")

    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        fail(f"not a {FORMAT_NAME} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        fail(f"format_version {manifest.get('format_version')!r} is not {FORMAT_VERSION} (written by "
             f"another posttrain version; load it with that version)")
    if not isinstance(manifest.get("step"), int) or isinstance(manifest.get("step"), bool):
        fail("no integer step")
    files, parts = manifest.get("files"), manifest.get("parts")
    if not isinstance(files, dict) or not isinstance(parts, list):
        fail("no files/parts listing")
    for name, entry in files.items():
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", "..") \
                or name.startswith(".") or name == MANIFEST:
            fail(f"file name {name!r} is not a plain file name")
        if not name.endswith(_LOADABLE_SUFFIXES):
            fail(f"lists {name!r}; only .safetensors and .json files are ever loaded from a checkpoint "
                 f"(no pickles)")
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int)
                and isinstance(entry.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])):
            fail(f"entry for {name!r} lacks an integer size and a sha256 hex digest")
    if META not in files:
        fail(f"does not list {META}")
    for part in parts:
        if not isinstance(part, str) or not _PART_NAME.match(part) or part in _RESERVED_PARTS:
            fail(f"part name {part!r} is not valid")
        for name in (f"{part}.safetensors", f"{part}.json"):
            if name not in files:
                fail(f"part {part!r} lacks {name}")


# ----------------------------------------------------------------------------------------- store

class CheckpointStore:
    """Atomic checkpoints under `root`, kept to the newest `keep`, optionally mirrored to S3.

    Args:
      root: the checkpoint directory of a run, e.g. `runs/<name>/checkpoints` (created on save).
      keep: how many checkpoints to keep, locally and remotely (>= 1).
      remote_uri: `s3://bucket/prefix`, or None for local only.
      s3_client: a boto3 S3 client; default `boto3.client("s3", endpoint_url=endpoint_url)`, which
        honours `AWS_ENDPOINT_URL` and takes credentials from the environment / AWS profiles only.
      endpoint_url: an explicit S3 endpoint (else `AWS_ENDPOINT_URL` or AWS).
      retry_budget_s: how long (seconds, in all) one S3 call is retried on transient errors; None
        reads POSTTRAIN_S3_RETRY_BUDGET_S, else S3_RETRY_BUDGET_S. Other errors are not retried.
      retry_base_delay_s / retry_max_delay_s: between tries it sleeps base * 2**i, capped at max, with
        jitter (a uniform draw from half of that to all of it), never past the budget.
      upload_attempts: an optional cap on the tries of one call (None: the budget alone decides).
      background_upload: upload from a background thread, so `save` returns once the local checkpoint is
        in place and training goes on while S3 is slow or briefly down. One upload runs at a time; a
        checkpoint still waiting when a newer one is saved is skipped (the newer one supersedes it).
        A background upload that fails for good is raised by the next `save` or by `flush()`.
      multipart_threshold / multipart_chunksize: files of at least the threshold are uploaded in
        parts of chunksize bytes (S3 requires parts of >= 5 MiB except the last).
    """

    def __init__(self, root: str | Path, *, keep: int = 3, remote_uri: str | None = None, s3_client=None,
                 endpoint_url: str | None = None, upload_attempts: int | None = None,
                 retry_base_delay_s: float = 0.5, retry_max_delay_s: float = 30.0,
                 retry_budget_s: float | None = None, multipart_threshold: int = 64 * MiB,
                 multipart_chunksize: int = 16 * MiB, max_concurrency: int = 4, background_upload: bool = False):
        if int(keep) < 1:
            raise ValueError(f"keep={keep}: at least the newest checkpoint must be kept (keep >= 1)")
        if upload_attempts is not None and int(upload_attempts) < 1:
            raise ValueError(f"upload_attempts={upload_attempts}: must be >= 1 (or None: no cap)")
        if retry_budget_s is None:
            retry_budget_s = _budget_from_env()
        if not float(retry_budget_s) >= 0:
            raise ValueError(f"retry_budget_s={retry_budget_s}: must be >= 0 seconds")
        if multipart_chunksize < 5 * MiB:
            raise ValueError(f"multipart_chunksize={multipart_chunksize}: S3 parts must be >= 5 MiB")
        self.root = Path(root)
        self.keep = int(keep)
        self.remote_uri = remote_uri
        self.bucket, self.prefix = _parse_s3_uri(remote_uri) if remote_uri else (None, "")
        self._s3 = s3_client
        self.endpoint_url = endpoint_url
        self.upload_attempts = None if upload_attempts is None else int(upload_attempts)
        self.retry_budget_s = float(retry_budget_s)
        self.retry_base_delay_s = float(retry_base_delay_s)
        self.retry_max_delay_s = float(retry_max_delay_s)
        self.multipart_threshold = int(multipart_threshold)
        self.multipart_chunksize = int(multipart_chunksize)
        self.max_concurrency = int(max_concurrency)
        self.background_upload = bool(background_upload) and self.bucket is not None
        self._uploads = threading.Condition()
        self._pending: Path | None = None  # the newest checkpoint waiting for the uploader
        self._uploading: Path | None = None
        self._upload_error: CheckpointUploadError | None = None
        self._uploader: threading.Thread | None = None

    # ------------------------------------------------------------------------------------- local

    def path_for(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def save(self, step: int, parts: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> Path:
        """Write checkpoint `step` atomically, upload it when remote, then prune to the newest `keep`.

        `parts` maps a name (letters, digits, `_.-`) to any state `flatten_state` accepts, e.g.
        `{"trainer_rank0": trainer.state_dict(), "driver": {...}}`; `meta` is a JSON-able dict.
        Returns the checkpoint directory. Raises CheckpointUploadError (local copy kept, nothing
        pruned) when the upload fails after all retries.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: a checkpoint step is a non-negative int")
        if not parts:
            raise ValueError("save: parts is empty; pass at least one named state, e.g. {'trainer_rank0': ...}")
        for name in parts:
            if not isinstance(name, str) or not _PART_NAME.match(name) or name in _RESERVED_PARTS:
                raise ValueError(f"part name {name!r}: use letters, digits, '_', '.', '-' (not 'meta' or "
                                 f"'manifest')")
        try:
            meta_json = json.loads(json.dumps(dict(meta or {})))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"save: meta must be JSON-serialisable ({exc}); put tensors in parts") from exc

        self._raise_upload_error()
        final = self.path_for(step)
        if final in (self._pending, self._uploading):  # a step rewritten while it is being uploaded
            self.flush()
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_stale_tmp_dirs()
        tmp = self.root / f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            files: dict[str, dict] = {}
            for name, state in parts.items():
                tensors, skeleton = flatten_state(state)
                st_path = tmp / f"{name}.safetensors"
                safetensors.torch.save_file(tensors, st_path, metadata={"format": "pt"})
                _fsync_file(st_path)
                _write_json(tmp / f"{name}.json", {"format": FORMAT_NAME, "skeleton": skeleton})
            _write_json(tmp / META, meta_json)
            for file in sorted(tmp.iterdir()):
                files[file.name] = {"size": file.stat().st_size, "sha256": _sha256_file(file)}
            manifest = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step": step,
                        "parts": list(parts), "created_unix": time.time(), "files": files}
            _write_json(tmp / MANIFEST, manifest)  # last: its presence marks the checkpoint complete
            fsync_dir(tmp)
            self._move_into_place(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("checkpoint step %d written to %s", step, final)

        if self.background_upload:
            self._queue_upload(final)
        elif self.bucket is not None:
            # just written and hashed; raises CheckpointUploadError, and then nothing is pruned
            self.upload(final, verify_local=False)
            self._prune_remote()
        self._prune_local()
        return final

    # --------------------------------------------------------------------------- background uploads

    def _queue_upload(self, path: Path) -> None:
        with self._uploads:
            if self._pending is not None:
                log.info("checkpoint %s not uploaded: superseded by %s before its upload started", self._pending.name,
                         path.name)
            self._pending = path
            if self._uploader is None or not self._uploader.is_alive():
                self._uploader = threading.Thread(target=self._upload_loop, name="checkpoint-upload", daemon=True)
                self._uploader.start()
            self._uploads.notify_all()

    def _upload_loop(self) -> None:
        while True:
            with self._uploads:
                if self._pending is None or self._upload_error is not None:
                    self._uploader = None
                    self._uploads.notify_all()
                    return
                path, self._pending, self._uploading = self._pending, None, self._pending
            try:
                self.upload(path, verify_local=False)
                self._prune_remote()
            except CheckpointUploadError as exc:
                error = exc
            except Exception as exc:  # noqa: BLE001 - reported to the training thread, never lost
                error = CheckpointUploadError(redact_message(f"uploading checkpoint {path} failed: "
                                                             f"{type(exc).__name__}: {exc}"), local_path=path)
            else:
                error = None
            with self._uploads:
                self._uploading = None
                if error is not None:
                    log.warning("%s", error)
                    self._upload_error = error
                self._uploads.notify_all()

    def _raise_upload_error(self) -> None:
        with self._uploads:
            error, self._upload_error = self._upload_error, None
        if error is not None:
            raise error

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the background upload (if any) to finish; raise CheckpointUploadError when it failed.

        `timeout` (seconds; None: as long as it takes, which the retry budget bounds) raises
        CheckpointUploadError when the upload is still running by then.
        """
        with self._uploads:
            # done: nothing waiting or running, or the uploader stopped at a failure (raised below)
            done = self._uploads.wait_for(lambda: self._uploading is None and (
                self._pending is None or self._upload_error is not None), timeout)
        if not done:
            raise CheckpointUploadError(f"the upload of {self._uploading or self._pending} to {self.remote_uri} "
                                        f"was still running after {timeout:g} s", local_path=self._uploading)
        self._raise_upload_error()

    def load(self, path_or_step: int | str | Path) -> tuple[dict[str, Any], dict]:
        """`(parts, meta)` of a verified checkpoint (a step of this store, or a directory path).

        Every file is checked against the manifest (size and sha256) first; a mismatch, a missing
        manifest or a listed file that is not .safetensors/.json raises CheckpointError naming the
        file. Tensors come back on CPU.
        """
        if isinstance(path_or_step, int) and not isinstance(path_or_step, bool):
            path = self.path_for(path_or_step)
        else:
            path = Path(path_or_step)
        if not path.is_dir():
            raise CheckpointError(f"no checkpoint directory {path}; CheckpointStore.list_valid() lists the "
                                  f"loadable ones")
        manifest = verify_checkpoint(path)
        parts: dict[str, Any] = {}
        for name in manifest["parts"]:
            try:
                sidecar = json.loads((path / f"{name}.json").read_bytes())
                skeleton = sidecar["skeleton"]
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{path / (name + '.json')} is not a checkpoint skeleton ({exc})") from exc
            tensors = safetensors.torch.load_file(path / f"{name}.safetensors")
            try:
                parts[name] = unflatten_state(tensors, skeleton)
            except CheckpointError as exc:
                raise CheckpointError(f"{path / (name + '.safetensors')}: {exc}") from exc
        meta = json.loads((path / META).read_bytes())
        return parts, meta

    def list_valid(self) -> list[Path]:
        """Local checkpoint directories that pass `verify_checkpoint` (checksums), oldest first."""
        return [p for p in self._step_dirs() if self._is_valid(p)]

    def latest_valid(self, prefer_remote_if_local_missing: bool = True) -> Path | None:
        """The newest checkpoint that verifies, local or remote; None when there is none anywhere.

        With a remote configured (and `prefer_remote_if_local_missing`), local and remote steps are
        considered together, newest first: a step whose local copy is missing or damaged (a truncated
        file, a crash mid-copy) is restored from its remote copy instead of falling back to an older
        step, whose next save would overwrite the intact remote one. A remote copy that is itself
        damaged is skipped with a warning naming it. When the remote cannot be listed or a download
        fails for a transient reason (the endpoint down past the retry budget), this raises
        CheckpointUnavailable rather than silently resuming from an older step. Every step passed over
        is logged as a warning.
        """
        local = self._step_dirs()
        valid = {checkpoint_step(p): p for p in local if self._is_valid(p)}
        damaged = sorted(checkpoint_step(p) for p in local if checkpoint_step(p) not in valid)
        remote: list[int] = []
        if self.bucket is not None and prefer_remote_if_local_missing:
            remote = self.list_remote()  # raises CheckpointUnavailable when the endpoint stays down
        skipped: list[str] = []
        for step in sorted(set(valid) | set(remote), reverse=True):
            if step in valid:
                chosen = valid[step]
                break
            try:
                chosen = self.download(step)
                break
            except CheckpointUnavailable as exc:
                raise CheckpointUnavailable(redact_message(
                    f"checkpoint step {step} is on {self.remote_uri} but could not be downloaded: {exc}. Not resuming "
                    f"from an older step (its next save would overwrite step {step}); retry when the endpoint "
                    f"(AWS_ENDPOINT_URL) is reachable")) from None
            except CheckpointError as exc:
                skipped.append(f"step {step} (remote copy damaged: {redact_message(str(exc))})")
        else:
            chosen = None
        newest_chosen = checkpoint_step(chosen) if chosen is not None else -1
        skipped += [f"step {s} (local copy damaged, no remote copy)" for s in damaged
                    if s > newest_chosen and s not in remote]
        if skipped:
            log.warning("resuming from %s, passing over newer %s",
                        f"step {newest_chosen}" if chosen is not None else "the start", "; ".join(skipped))
        return chosen

    def _step_dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        dirs = [p for p in self.root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
        return sorted(dirs, key=checkpoint_step)

    def _is_valid(self, path: Path) -> bool:
        try:
            verify_checkpoint(path)
            return True
        except CheckpointError as exc:
            log.warning("ignoring checkpoint %s: %s", path, exc)
            return False

    def _remove_stale_tmp_dirs(self) -> None:
        # one writer per run directory (the driver); a leftover temp dir is from a crashed save
        for stale in self.root.glob(f"{TMP_PREFIX}*"):
            if stale.is_dir():
                log.info("removing stale temporary checkpoint directory %s", stale)
                shutil.rmtree(stale, ignore_errors=True)

    def _move_into_place(self, tmp: Path, final: Path) -> None:
        """Rename `tmp` to `final`; an existing `final` (same step, rewritten) is renamed away first."""
        old = None
        if final.exists():
            old = final.parent / f"{TMP_PREFIX}replaced-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _prune_local(self) -> None:
        dirs = self._step_dirs()
        complete = [p for p in dirs if (p / MANIFEST).is_file()]
        if len(complete) <= self.keep:
            return
        oldest_kept = checkpoint_step(complete[-self.keep])
        with self._uploads:
            busy = {self._pending, self._uploading}
        for path in dirs:
            if checkpoint_step(path) < oldest_kept and path not in busy:
                log.info("pruning local checkpoint %s (keep=%d)", path, self.keep)
                doomed = path.parent / f"{TMP_PREFIX}pruned-{path.name}-{uuid.uuid4().hex[:8]}"
                os.rename(path, doomed)  # so a crash mid-delete leaves no half step dir
                shutil.rmtree(doomed, ignore_errors=True)

    # ------------------------------------------------------------------------------------- remote

    @property
    def s3(self):
        if self._s3 is None:
            import boto3  # credentials: environment / AWS profiles only (boto3's default chain)
            self._s3 = boto3.client("s3", endpoint_url=self.endpoint_url or None)
        return self._s3

    def _key(self, step: int, name: str = "") -> str:
        return "/".join(x for x in (self.prefix, step_dir_name(step), name) if x)

    def _retry(self, what: str, fn: Callable[[], Any]) -> Any:
        """`fn()`, retried on transient S3 errors until `retry_budget_s` is spent (or `upload_attempts`
        tries); any other S3 error raises _S3Failure at once with what to fix. Each failure is logged
        as "<what> failed (attempt n ...)"."""
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        caught = (ClientError, BotoCoreError, Boto3Error, ConnectionError, TimeoutError)
        what = redact_message(what)
        start = time.monotonic()
        deadline = start + self.retry_budget_s
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except caught as exc:
                reason = redact_message(f"{type(exc).__name__}: {exc}")
                if not is_transient_s3_error(exc):
                    log.warning("%s failed (attempt %d): %s; not retried: not a transient error", what, attempt,
                                reason)
                    error = _client_error(exc)
                    code = str(error.response.get("Error", {}).get("Code", "")) if error is not None else ""
                    raise _S3Failure(what, attempt, reason,
                                     f"not retried: this error is not transient; {s3_error_fix(exc)}",
                                     missing=code in ("NoSuchKey", "404")) from None
                now = time.monotonic()
                capped = self.upload_attempts is not None and attempt >= self.upload_attempts
                if now >= deadline or capped:
                    log.warning("%s failed (attempt %d, %.1f s): %s; giving up", what, attempt, now - start, reason)
                    limit = (f"upload_attempts={self.upload_attempts} reached" if capped else
                             f"transient errors are retried for {self.retry_budget_s:g} s ({RETRY_BUDGET_ENV})")
                    raise _S3Failure(what, attempt, reason,
                                     f"{limit}; gave up after {now - start:.1f} s: check that the endpoint "
                                     f"(AWS_ENDPOINT_URL) is up and reachable") from None
                cap = min(self.retry_max_delay_s, self.retry_base_delay_s * 2 ** min(attempt - 1, 60))
                delay = min(_JITTER.uniform(cap / 2, cap), deadline - now)
                log.warning("%s failed (attempt %d, %.1f s of %g s): %s; transient, retrying in %.2f s", what,
                            attempt, now - start, self.retry_budget_s, reason, delay)
                time.sleep(delay)

    def upload(self, path: str | Path, *, verify_local: bool = True) -> None:
        """Upload a complete local checkpoint (manifest last) and verify every object's size and sha256.

        Raises CheckpointUploadError after the retries are spent; the local directory is untouched.
        """
        path = Path(path)
        manifest = verify_checkpoint(path, check_hashes=verify_local)
        step = manifest["step"]
        if self.bucket is None:
            raise CheckpointError("upload: this CheckpointStore has no remote_uri")
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=self.multipart_threshold,
                                multipart_chunksize=self.multipart_chunksize,
                                max_concurrency=self.max_concurrency)
        files = dict(manifest["files"])
        files[MANIFEST] = {"size": (path / MANIFEST).stat().st_size, "sha256": _sha256_file(path / MANIFEST)}
        data_files = sorted(n for n in files if n != MANIFEST)

        def put(name: str) -> None:
            key = self._key(step, name)
            extra = {"Metadata": {"sha256": files[name]["sha256"]}}
            self._retry(f"upload {path / name} to s3://{self.bucket}/{key}", lambda: self.s3.upload_file(
                str(path / name), self.bucket, key, ExtraArgs=extra, Config=config))

        try:
            # a rewritten step: drop the old manifest first so the remote copy is never "complete"
            # with a mix of old and new files
            self._retry(f"delete old s3://{self.bucket}/{self._key(step, MANIFEST)}",
                        lambda: self.s3.delete_object(Bucket=self.bucket, Key=self._key(step, MANIFEST)))
            for name in data_files:
                put(name)
            for name in data_files:  # every object verified before the manifest makes the step look complete
                try:
                    self._verify_remote_object(step, name, files[name])
                except _S3Failure as exc:  # lost or altered while the endpoint was down: the local file is the truth
                    log.warning("%s; uploading it again", exc)
                    put(name)
                    self._verify_remote_object(step, name, files[name])
            put(MANIFEST)
            self._verify_remote_object(step, MANIFEST, files[MANIFEST])
            remote_manifest = self._retry(
                f"read back s3://{self.bucket}/{self._key(step, MANIFEST)}",
                lambda: self.s3.get_object(Bucket=self.bucket, Key=self._key(step, MANIFEST))["Body"].read())
            if hashlib.sha256(remote_manifest).hexdigest() != files[MANIFEST]["sha256"]:
                raise _S3Failure(f"verify s3://{self.bucket}/{self._key(step, MANIFEST)}", 1,
                                 "the manifest read back differs from the local one")
        except _S3Failure as exc:
            raise CheckpointUploadError(redact_message(
                f"uploading checkpoint {path} to {self.remote_uri} failed: {exc}. The local checkpoint is "
                f"intact and older checkpoints were not pruned; check the endpoint (AWS_ENDPOINT_URL), the "
                f"bucket and the credentials in the environment, then call CheckpointStore.upload({str(path)!r}) "
                f"or save again"), local_path=path) from None
        log.info("checkpoint step %d uploaded to %s and verified", step, self.remote_uri)

    def _verify_remote_object(self, step: int, name: str, entry: dict) -> None:
        key = self._key(step, name)
        head = self._retry(f"head s3://{self.bucket}/{key}",
                           lambda: self.s3.head_object(Bucket=self.bucket, Key=key))
        size, digest = head.get("ContentLength"), (head.get("Metadata") or {}).get("sha256")
        if size != entry["size"] or digest != entry["sha256"]:
            raise _S3Failure(f"verify s3://{self.bucket}/{key}", 1,
                             f"remote object has size {size} and sha256 {digest}, the local file "
                             f"{entry['size']} and {entry['sha256']}")

    def _list_remote_keys(self) -> dict[int, list[str]]:
        keys: dict[int, list[str]] = {}
        base = f"{self.prefix}/" if self.prefix else ""

        def list_all() -> list[str]:
            out = []
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
                out.extend(obj["Key"] for obj in page.get("Contents", []))
            return out

        try:
            all_keys = self._retry(f"list s3://{self.bucket}/{base}", list_all)
        except _S3Failure as exc:
            raise CheckpointUnavailable(redact_message(f"listing {self.remote_uri} failed: {exc}; check AWS_ENDPOINT_URL, "
                                                 f"the bucket and the credentials in the environment")) from None
        for key in all_keys:
            rest = key[len(base):].split("/")
            if len(rest) == 2 and _STEP_DIR.match(rest[0]):
                keys.setdefault(checkpoint_step(rest[0]), []).append(key)
        return keys

    def list_remote(self) -> list[int]:
        """Steps with a manifest under `remote_uri`, oldest first (validity is checked on download)."""
        if self.bucket is None:
            return []
        return sorted(step for step, keys in self._list_remote_keys().items()
                      if self._key(step, MANIFEST) in keys)

    def download(self, step: int) -> Path:
        """Download remote checkpoint `step` into `root`, verify it, and return its directory."""
        if self.bucket is None:
            raise CheckpointError("download: this CheckpointStore has no remote_uri")
        remote = f"s3://{self.bucket}/{self._key(step)}"
        remedy = f"the remote checkpoint {remote} is damaged; use an older step or delete it"
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{TMP_PREFIX}download-{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            try:
                body = self._retry(f"get {remote}/{MANIFEST}", lambda: self.s3.get_object(
                    Bucket=self.bucket, Key=self._key(step, MANIFEST))["Body"].read())
                manifest = json.loads(body)
            except ValueError as exc:
                raise CheckpointError(f"{remote}/{MANIFEST} is not valid JSON ({exc}); {remedy}") from exc
            _check_manifest_structure(manifest, f"{remote}/{MANIFEST}", remedy)
            if manifest["step"] != step:
                raise CheckpointError(f"{remote}/{MANIFEST} records step {manifest['step']}; {remedy}")
            for name in manifest["files"]:
                self._retry(f"download {remote}/{name}", lambda name=name: self.s3.download_file(
                    self.bucket, self._key(step, name), str(tmp / name)))
                _fsync_file(tmp / name)
            manifest_file = tmp / MANIFEST
            manifest_file.write_bytes(body)
            _fsync_file(manifest_file)
            fsync_dir(tmp)
            verify_checkpoint(tmp)  # sizes and sha256 of what arrived
            self._move_into_place(tmp, self.path_for(step))
        except _S3Failure as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            # an object missing from a listed step is damage (skip the step); anything else (the endpoint
            # down past the budget, credentials) says nothing about the checkpoint
            error = CheckpointError if exc.missing else CheckpointUnavailable
            raise error(redact_message(f"downloading {remote} failed: {exc}")) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("checkpoint step %d restored from %s to %s", step, remote, self.path_for(step))
        return self.path_for(step)

    def delete_remote(self) -> int:
        """Delete every checkpoint object under `remote_uri` (a fresh run that overwrites an old one).

        Manifests go first, so an interrupted delete never leaves a step that looks complete.
        Returns the number of objects deleted.
        """
        if self.bucket is None:
            return 0
        doomed = [k for keys in self._list_remote_keys().values() for k in keys]
        doomed.sort(key=lambda k: not k.endswith("/" + MANIFEST))
        for batch in _chunks(doomed, 1000):
            self._retry(f"delete {len(batch)} objects under {self.remote_uri}", lambda batch=batch: self.s3.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}))
        return len(doomed)

    def _prune_remote(self) -> None:
        by_step = self._list_remote_keys()
        complete = sorted(s for s, keys in by_step.items() if self._key(s, MANIFEST) in keys)
        if len(complete) <= self.keep:
            return
        oldest_kept = complete[-self.keep]
        doomed = [k for s, keys in by_step.items() if s < oldest_kept for k in keys]
        # manifests first: a half-deleted step must never look complete
        doomed.sort(key=lambda k: not k.endswith("/" + MANIFEST))
        for batch in _chunks(doomed, 1000):
            self._retry(f"delete {len(batch)} objects under {self.remote_uri}", lambda batch=batch: self.s3.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}))
        if doomed:
            log.info("pruned remote checkpoints older than step %d (keep=%d)", oldest_kept, self.keep)


# ------------------------------------------------------------------------------ S3 error classes

# ClientError codes worth retrying (throttling, timeouts, server-side trouble); any HTTP 5xx or 429 too.
TRANSIENT_S3_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded", "BandwidthLimitExceeded",
    "RequestTimeout", "RequestTimeoutException", "InternalError", "InternalServerError", "ServiceUnavailable",
    "ServiceUnavailableException", "PriorRequestNotComplete", "OperationAborted", "500", "502", "503", "504",
})
# What to fix, for the non-transient errors a misconfiguration produces.
_FIXES = {
    "NoSuchBucket": "the bucket does not exist at this endpoint: create it, or fix the bucket in "
                    "tracking.checkpoint_uri (and AWS_ENDPOINT_URL)",
    "InvalidBucketName": "fix the bucket name in tracking.checkpoint_uri",
    "AccessDenied": "the credentials may not use this bucket/prefix: check the bucket policy and the "
                    "credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE)",
    "AllAccessDisabled": "all access to this bucket is disabled: use another bucket in tracking.checkpoint_uri",
    "InvalidAccessKeyId": "the access key is unknown to this endpoint: fix AWS_ACCESS_KEY_ID (or AWS_PROFILE) "
                          "and AWS_ENDPOINT_URL",
    "SignatureDoesNotMatch": "the secret key does not match the access key: fix AWS_SECRET_ACCESS_KEY "
                             "(or AWS_PROFILE)",
    "ExpiredToken": "the session token expired: refresh the credentials (AWS_SESSION_TOKEN or AWS_PROFILE)",
    "NoSuchKey": "the object is missing: the remote checkpoint is incomplete; use another step",
    "404": "the object or bucket is missing: check tracking.checkpoint_uri",
    "403": "access refused: check the credentials and the bucket policy",
}


def _error_chain(exc: BaseException) -> Iterable[BaseException]:
    """`exc`, then what it wraps (boto3's S3UploadFailedError wraps a ClientError, RetriesExceededError its last
    error), outermost first."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = getattr(current, "last_exception", None) or current.__cause__ or current.__context__


def _client_error(exc: BaseException):
    from botocore.exceptions import ClientError

    return next((e for e in _error_chain(exc) if isinstance(e, ClientError)), None)


def is_transient_s3_error(exc: BaseException) -> bool:
    """True for errors a retry can cure: connection errors, timeouts, HTTP 5xx/429, throttling
    (SlowDown, ...), RequestTimeout. False for invalid requests (ParamValidationError), missing
    credentials, NoSuchBucket, AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch, other 4xx."""
    from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    for err in _error_chain(exc):
        if isinstance(err, ClientError):
            code = str(err.response.get("Error", {}).get("Code", ""))
            status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            return code in TRANSIENT_S3_CODES or status >= 500 or status == 429
        if isinstance(err, (BotoConnectionError, HTTPClientError, IncompleteReadError, ConnectionError,
                            TimeoutError)):
            return True
    return False


def s3_error_fix(exc: BaseException) -> str:
    """What to fix for a non-transient S3 error, in words."""
    from botocore.exceptions import (
        NoCredentialsError,
        NoRegionError,
        ParamValidationError,
        PartialCredentialsError,
    )

    client_error = _client_error(exc)
    if client_error is not None:
        code = str(client_error.response.get("Error", {}).get("Code", ""))
        return _FIXES.get(code, f"S3 refused the request ({code or 'no error code'}): check "
                                f"tracking.checkpoint_uri, AWS_ENDPOINT_URL and the credentials")
    for err in _error_chain(exc):
        if isinstance(err, ParamValidationError):
            return ("the request is invalid before it reaches S3: fix tracking.checkpoint_uri "
                    "(s3://bucket/prefix, a valid bucket name)")
        if isinstance(err, (NoCredentialsError, PartialCredentialsError)):
            return "no usable AWS credentials: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
        if isinstance(err, NoRegionError):
            return "no AWS region: set AWS_DEFAULT_REGION (or AWS_PROFILE's region)"
    return "check tracking.checkpoint_uri, AWS_ENDPOINT_URL and the credentials in the environment"


def _budget_from_env() -> float:
    raw = os.environ.get(RETRY_BUDGET_ENV, "").strip()
    if not raw:
        return S3_RETRY_BUDGET_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{RETRY_BUDGET_ENV}={raw!r}: expected seconds, e.g. {S3_RETRY_BUDGET_S:g}") from None
    if not value >= 0:
        raise ValueError(f"{RETRY_BUDGET_ENV}={raw!r}: must be >= 0 seconds")
    return value


class _S3Failure(Exception):
    """An S3 call that failed for good; `missing`: the object does not exist (NoSuchKey / 404), as opposed to
    an endpoint, credential or bucket problem."""

    def __init__(self, what: str, attempts: int, reason: str, note: str = "", missing: bool = False):
        self.missing = missing
        tries = f"after {attempts} attempt{'s' if attempts > 1 else ''}"
        super().__init__(redact_message(f"{what}: {reason} ({tries}{'; ' + note if note else ''})"))


def _chunks(items: list, size: int) -> Iterable[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def _parse_s3_uri(uri: str) -> tuple[str, str]:
    if has_userinfo(uri) or "@" in urlparse(uri).netloc:
        raise ValueError(f"remote_uri={redact_uri(uri)!r}: credentials in the URI are refused; give them through "
                         f"the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) or an AWS profile (AWS_PROFILE)")
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"remote_uri={redact_uri(uri)!r}: expected s3://bucket/prefix")
    return parsed.netloc, parsed.path.strip("/")
