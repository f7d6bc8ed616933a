"""What the sharded start-up load (`infra.workers.sharded_load`) may read of a local checkpoint.

- `checkpoint_files`: each tensor's safetensors file. A split checkpoint's `model.safetensors.index.json` is checked
  before anything is opened: a JSON object whose `weight_map` maps tensor names to file names, every file a regular
  file inside the model directory once its path is resolved (`..`, absolute paths and symlinks out of it are
  refused; a hub cache snapshot's links into its repository's `blobs/` are the model's own files). A malformed or
  escaping index is a `ValueError` naming the index, the key and the fix, the same on every rank, never a `KeyError`
  or `RecursionError`; there is no fallback to rank 0, whose transformers load would follow the same index.
- `quantized` (and `FLOAT_DTYPES`, checked per tensor by `read_own_shards`): a checkpoint whose stored tensors are
  not the weights themselves (scales, packed integers, float8). Rows sliced from those without their scales would be
  wrong weights, loaded silently; such a checkpoint is left to rank 0's load (`from_pretrained`, which knows the
  quantization), or to its own error there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})  # safetensors' names; float8 weights come with scales
# the last part of a tensor name that holds a quantization's scales, zero points or packed weights (FP8 blocks,
# GPTQ/AWQ, compressed-tensors, bitsandbytes)
QUANTIZED_NAMES = frozenset({"weight_scale", "weight_scale_inv", "scales", "qweight", "qzeros", "g_idx",
                             "weight_zero_point", "input_scale", "absmax", "quant_map", "SCB", "weight_packed"})


def _short(text: str) -> str:
    return repr(text if len(text) <= 120 else text[:120] + "...")


def _json_kind(value: Any) -> str:
    """What a parsed JSON value was in the file: `a JSON array`, `a JSON number`, ..."""
    kinds = {dict: "object", list: "array", str: "string", bool: "true/false", int: "number", float: "number"}
    return "null" if value is None else f"a JSON {kinds.get(type(value), type(value).__name__)}"


def _refuse(index: Path, why: str) -> ValueError:
    return ValueError(f"{index}: {why}; fix or remove the index (`save_pretrained` writes a valid one: a JSON object "
                      "whose 'weight_map' maps each tensor name to a safetensors file in the model directory) before "
                      "the sharded load reads this checkpoint")


def _roots(root: Path) -> list[Path]:
    """Where a checkpoint's files may lie once resolved: its directory, and for a snapshot of the hub's cache
    (`models--org--name/snapshots/<rev>`, whose files are links to `../../blobs/<hash>`) that repository's blobs."""
    blobs = root.parent.parent / "blobs"
    return [root, blobs.resolve()] if root.parent.name == "snapshots" and blobs.is_dir() else [root]


def _resolved(root: Path, path: Path) -> Path | None:
    """`path` resolved (symlinks followed; a loop stays a link, which is no regular file), None when that leaves the
    checkpoint's roots (`_roots`)."""
    resolved = Path(os.path.realpath(path))
    return resolved if any(resolved.is_relative_to(r) for r in _roots(root)) else None


def _inside(root: Path, index: Path, key: str, file: Any) -> str:
    """The resolved path of the index's entry `file` for tensor `key`, refused unless it is a regular file inside
    the model directory `root`."""
    where = f"weight_map[{_short(key)}]"
    if not isinstance(file, str):
        raise _refuse(index, f"{where} is {_json_kind(file)}, not a file name")
    if not file:
        raise _refuse(index, f"{where} is empty, not a file name")
    if "\x00" in file:
        raise _refuse(index, f"{where} holds a NUL character")
    resolved = None if os.path.isabs(file) or ".." in Path(file).parts else _resolved(root, root / file)
    if resolved is None:
        raise _refuse(index, f"{where} names {_short(file)}, outside the model directory {root} once resolved "
                             "(symlinks followed), and the sharded load opens no file outside it: copy the file "
                             "into the directory and name it relative to it")
    if not resolved.is_file():  # missing, a directory, a device, a link loop
        raise _refuse(index, f"{where} names {_short(file)}, which is not a file in {root}")
    return str(resolved)


def _own_file(root: Path, path: Path) -> str:
    """The resolved path of the index or the one safetensors file `path`, refused unless it is a regular file
    inside the model directory."""
    resolved = _resolved(root, path)
    if resolved is None:
        raise ValueError(f"{path.name} in {root} is a link outside the model directory (resolved: "
                         f"{os.path.realpath(path)}), and the sharded load opens no file outside it; copy the file "
                         "into the directory")
    if not resolved.is_file():
        raise ValueError(f"{path} is not a regular file; replace it with the checkpoint's own")
    return str(resolved)


def _weight_map(index: Path) -> dict[str, Any]:
    """The index's `weight_map`, its shape checked (the entries' files are checked by `_inside`)."""
    try:
        content = json.loads(index.read_bytes().decode())
    except RecursionError:
        raise _refuse(index, "its JSON is nested too deep") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, an over-long integer
        raise _refuse(index, f"not JSON ({error})") from None
    if not isinstance(content, dict):
        raise _refuse(index, f"{_json_kind(content)}, not a JSON object")
    if "weight_map" not in content:
        raise _refuse(index, "no 'weight_map' in it")
    weight_map = content["weight_map"]
    if not isinstance(weight_map, dict):
        raise _refuse(index, f"its 'weight_map' is {_json_kind(weight_map)}, not an object of tensor name -> file "
                             "name")
    return weight_map


def checkpoint_files(path: str) -> dict[str, str]:
    """`{tensor name: safetensors file}` of a local model directory (its `model.safetensors.index.json`, or its one
    `*.safetensors` file), each file resolved and checked to lie inside the directory (`ValueError` naming the index,
    the key and the fix otherwise, and for a malformed index); empty for a hub id or a directory without safetensors.
    """
    from safetensors import safe_open

    root = Path(path)
    if not root.is_dir():
        return {}
    root = root.resolve()
    index = root / INDEX
    if index.exists() or index.is_symlink():
        _own_file(root, index)
        files: dict[str, str] = {}
        checked: dict[str, str] = {}  # file name -> resolved path: a split checkpoint names a few files many times
        for name, file in _weight_map(index).items():
            if not (isinstance(file, str) and file in checked):
                checked[file] = _inside(root, index, name, file)
            files[name] = checked[file]
        return files
    found = sorted(root.glob("*.safetensors"))
    if len(found) != 1:
        return {}
    file = _own_file(root, found[0])
    with safe_open(file, "pt") as f:
        return {name: file for name in f.keys()}  # noqa: SIM118 - safe_open is not a dict


def quantized(config: Any, files: dict[str, str]) -> str | None:
    """Why the checkpoint's tensors are not its weights as stored (its config's `quantization_config`, or a scale or
    packed tensor among its files), None when nothing says so; a weight stored in a non-float dtype is caught per
    tensor (`FLOAT_DTYPES`)."""
    settings = getattr(config, "quantization_config", None)
    if settings:
        method = settings.get("quant_method") if isinstance(settings, dict) else getattr(settings, "quant_method", None)
        return f"its config.json sets quantization_config (quant_method={method!r})"
    name = next((n for n in files if n.rsplit(".", 1)[-1] in QUANTIZED_NAMES or ".quant_state." in n), None)
    return None if name is None else f"it holds {_short(name)}, a quantization's scales or packed weights"
