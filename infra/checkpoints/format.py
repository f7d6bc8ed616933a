"""The checkpoint format: run state <-> safetensors + JSON, checksummed files, the manifest that marks a
checkpoint complete, and durable writes (docs of the layout: `infra/checkpoints/store.py`).

Nothing is ever unpickled: tensors come from `safetensors.torch.load_file`, everything else from JSON,
decoded into a fixed set of types.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

FORMAT_NAME = "posttrain-checkpoint"
FORMAT_VERSION = 2  # 2: the trainer ranks' tensors are shards (`infra.checkpoints.shards`)
MANIFEST = "manifest.json"
META = "meta.json"
TMP_PREFIX = ".tmp-"
STEP_DIR = re.compile(r"^step_(\d{8,})$")
PART_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
RESERVED_PARTS = {"meta", "manifest"}
_LOADABLE_SUFFIXES = (".safetensors", ".json", ".distcp")  # .distcp: tensors only, read with weights_only=True
_SAFETENSORS_DTYPES = frozenset(safetensors.torch._TYPES.values())
# Deeper nesting than this in a checkpoint's JSON is damage: posttrain's own files nest a few levels (a skeleton about
# four per level of the saved state), and the code that walks them recurses once per level.
MAX_JSON_DEPTH = 256


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, verified or loaded; the message says what to do."""



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

def parse_json(data: bytes | str, where: str, remedy: str) -> Any:
    """A checkpoint's JSON (`where` names its file or object); CheckpointError `"<where> is not valid JSON (...);
    <remedy>"` when it does not parse or nests deeper than `MAX_JSON_DEPTH`: damage, never a RecursionError."""
    deep = f"nested deeper than {MAX_JSON_DEPTH} levels"
    try:
        value = json.loads(data)
    except RecursionError:
        raise CheckpointError(f"{where} is not valid JSON ({deep}); {remedy}") from None
    except ValueError as exc:
        raise CheckpointError(f"{where} is not valid JSON ({exc}); {remedy}") from None
    stack = [(value, 1)]
    while stack:  # no recursion
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise CheckpointError(f"{where} is not valid JSON ({deep}); {remedy}")
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))
    return value


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_durably(path: Path, data: bytes | str) -> None:
    """Write `data` to `path` and fsync it (a rename after this publishes complete contents only)."""
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())


def write_json(path: Path, obj: Any) -> None:
    write_durably(path, json.dumps(obj, indent=1, ensure_ascii=False))


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_step(path: str | Path) -> int:
    """The step of a checkpoint directory `.../step_XXXXXXXX`."""
    match = STEP_DIR.match(Path(path).name)
    if not match:
        raise CheckpointError(f"{path} is not a checkpoint directory (expected a name like step_00000040)")
    return int(match.group(1))


def verify_checkpoint(path: str | Path, *, check_hashes: bool = True) -> dict:
    """The parsed manifest of a complete, intact checkpoint directory; else CheckpointError.

    Checks: manifest present and parsable, known format version, every listed file a plain name
    ending in .safetensors/.json/.distcp that exists with the listed size and sha256, every part with its
    two files, meta.json listed, and no file in the directory that the manifest does not list. With
    `check_hashes`, every listed .json file also parses (`parse_json`) and meta.json is a JSON object: a file
    whose hash was made to match is still damage when it is garbage or nested 100k deep.
    """
    path = Path(path)
    manifest_path = path / MANIFEST
    remedy = (f"do not load it: resume from an older checkpoint (CheckpointStore.latest_valid() skips "
              f"it) or restore this step from the remote copy, then delete {path}")
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: it is incomplete (the writer "
                              f"crashed or it was copied partially); {remedy}")
    try:
        data = manifest_path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{manifest_path} cannot be read ({exc}); {remedy}") from exc
    manifest = parse_json(data, str(manifest_path), remedy)
    check_manifest_structure(manifest, str(manifest_path), remedy)
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
            digest = sha256_file(file)
            if digest != entry["sha256"]:
                raise CheckpointError(f"{file} has sha256 {digest} but {MANIFEST} records {entry['sha256']}: "
                                      f"the file is corrupted or was modified; {remedy}")
    if check_hashes:
        for name in (n for n in listed if n.endswith(".json")):
            value = parse_json((path / name).read_bytes(), str(path / name), remedy)
            if name == META and not isinstance(value, dict):
                raise CheckpointError(f"{path / name} is not a JSON object; {remedy}")
    return manifest


def check_manifest_structure(manifest: Any, where: str, remedy: str) -> None:
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
            fail(f"lists {name!r}; only .safetensors, .json and .distcp (tensor shards, read with "
                 f"weights_only=True) files are ever loaded from a checkpoint (no pickles)")
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int)
                and isinstance(entry.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])):
            fail(f"entry for {name!r} lacks an integer size and a sha256 hex digest")
    if META not in files:
        fail(f"does not list {META}")
    for part in parts:
        if not isinstance(part, str) or not PART_NAME.match(part) or part in RESERVED_PARTS:
            fail(f"part name {part!r} is not valid")
        for name in (f"{part}.safetensors", f"{part}.json"):
            if name not in files:
                fail(f"part {part!r} lacks {name}")
