"""A step's checkpoint as a transformers directory (`posttrain export`), loadable without posttrain.

`export_checkpoint(run, step, to)` reads checkpoint `step` of a run (the newest without one): verified against its
manifest, its trainer shards read whole into the base model in this process (any rank count and sharding wrote them,
`infra.checkpoints.shards`), and writes what `final_model/` holds (`rl_core.model.loading.save_policy`, one writer for
both): `config.json`, `model.safetensors`, `generation_config.json` when the model has one, and the tokenizer
files. With LoRA it writes the adapter in PEFT's format (`adapter_config.json`, `adapter_model.safetensors`, the
model card `README.md`), its base model named by the run's hub id, or by its local path when the run had none (the
README says how to load it elsewhere: `rl_core.model.loading.name_base_model`), or with `merged=True` the merged model.
A step that is only on S3 (`tracking.checkpoint_uri`) is downloaded and verified first, into a temporary directory
that is removed afterwards: the run's own checkpoints are not touched.

What the checkpoint says is data, never permission: `trust_remote_code` comes only from the operator
(`trust_remote_code=True`, `posttrain export --trust-remote-code`); a checkpoint whose `meta.json` asks for it is
refused (anyone who can write the run directory or its S3 prefix writes that file). The target is never the run
directory, a directory holding it, or a place inside it other than under `<run>/export/`: `--overwrite` replaces
the target whole.

Nothing is unpickled: the driver's parts are safetensors and JSON, the shards tensors read with
`torch.load(weights_only=True)` (`infra.checkpoints.shards`), the model's base from its safetensors.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from infra.checkpoints.resume import checkpoint_prefix, read_run_state
from infra.checkpoints.shards import read_shards
from infra.checkpoints.store import MANIFEST, STEP_DIR, CheckpointError, CheckpointStore, checkpoint_step
from rl_core.atomic import atomic_directory
from rl_core.config import JobConfig, ModelConfig, PosttrainConfig, TrackingConfig
from rl_core.config.legacy import translate
from rl_core.model import lora

EXPORT_DIR = "export"  # the default target: <run>/export/step-<N>
RESOLVED = "config_resolved.yaml"


class ExportError(RuntimeError):
    """An export that cannot be made; the message names the file and what to do."""


@dataclass(frozen=True)
class Exported:
    path: Path
    step: int
    form: str  # "model" (full fine-tuning), "adapter" or "merged" (LoRA)


def find_run_dir(run: str | Path) -> Path:
    """A run directory given as its path, or as a job name under the default `job.out_dir`."""
    path = Path(run).expanduser()
    if path.is_dir():
        return path
    by_name = Path(JobConfig.model_fields["out_dir"].default) / str(run)
    if by_name.is_dir():
        return by_name
    raise ExportError(f"no run directory {str(run)!r} (nor {by_name}); pass a run directory (runs/<job.name>) or a "
                      "job name whose run directory is under runs/")


def default_target(run_dir: Path, step: int) -> Path:
    return run_dir / EXPORT_DIR / f"step-{step}"


class _Checkpoints:
    """A run's checkpoints: the local ones, and the remote ones when the run mirrors to S3."""

    def __init__(self, run_dir: Path):
        self.local = CheckpointStore(run_dir / "checkpoints")
        self.remote_uri = _remote_prefix(run_dir)
        self._scratch: tempfile.TemporaryDirectory | None = None

    def local_steps(self) -> dict[int, Path]:
        """Every local step directory, complete or not."""
        root = self.local.root
        dirs = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)] if root.is_dir() else []
        return {checkpoint_step(p): p for p in dirs}

    def remote_steps(self) -> list[int]:
        if not self.remote_uri:
            return []
        try:
            return self._remote().list_remote()
        except CheckpointError as exc:  # the endpoint down past the retry budget, credentials
            raise ExportError(f"listing the checkpoints at {self.remote_uri} failed: {exc}") from None

    def available(self) -> list[int]:
        valid = {checkpoint_step(p) for p in self.local.list_valid()}
        return sorted(valid | set(self.remote_steps()))

    def step_dir(self, step: int | None) -> Path:
        """The verified directory of `step` (None: the newest step that verifies, local or remote)."""
        if step is None:
            chosen = self.local.latest_valid() if self.remote_uri is None else self._remote_latest()
            if chosen is None:
                raise ExportError(f"{self.local.root} holds no complete checkpoint"
                                  + (f" and {self.remote_uri} none either" if self.remote_uri else "")
                                  + "; checkpoints are written every rl.save_every steps and at the end of a run")
            return chosen
        local = self.local_steps().get(step)
        if local is not None:
            if not (local / MANIFEST).is_file():
                if step in self.remote_steps():
                    return self._download(step)
                raise ExportError(f"checkpoint step {step} is torn: {local / MANIFEST} is missing (the run stopped "
                                  f"while writing it, or it was copied partially); export another step "
                                  f"({self._listing()})")
            return local
        if step in self.remote_steps():
            return self._download(step)
        raise ExportError(f"no checkpoint of step {step} in {self.local.root}"
                          + (f" nor at {self.remote_uri}" if self.remote_uri else "") + f"; {self._listing()}")

    def _listing(self) -> str:
        steps = self.available()
        return f"available steps: {', '.join(map(str, steps))}" if steps else "the run has no complete checkpoint"

    def _remote(self) -> CheckpointStore:
        if self._scratch is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="posttrain-export-")
        return CheckpointStore(Path(self._scratch.name), remote_uri=self.remote_uri)

    def _download(self, step: int) -> Path:
        try:
            return self._remote().download(step)  # verified against its manifest before it is returned
        except CheckpointError as exc:
            raise ExportError(f"checkpoint step {step} at {self.remote_uri}: {exc}") from None

    def _remote_latest(self) -> Path | None:
        local = {checkpoint_step(p): p for p in self.local.list_valid()}
        newest = max({*local, *self.remote_steps()}, default=None)
        if newest is None:
            return None
        return local[newest] if newest in local else self._download(newest)

    def close(self) -> None:
        if self._scratch is not None:
            self._scratch.cleanup()


def _remote_prefix(run_dir: Path) -> str | None:
    """`<tracking.checkpoint_uri>/<job.name>/<run id>` of a run that mirrors its checkpoints to S3, else None."""
    import yaml

    resolved, run_id = run_dir / RESOLVED, read_run_state(run_dir).get("run_id")
    if not resolved.is_file() or not isinstance(run_id, str):
        return None
    data = translate(yaml.safe_load(resolved.read_text()) or {})
    uri = (data.get("tracking") or {}).get("checkpoint_uri")
    if not uri:
        return None
    # only the sections the prefix reads: validating the whole config would import the run's own code
    sections = {"job": JobConfig.model_validate(data.get("job") or {}),
                "tracking": TrackingConfig.model_validate(data["tracking"])}
    return checkpoint_prefix(PosttrainConfig.model_construct(**sections), run_id)


def _model_config(meta: dict, checkpoint: Path, trust_remote_code: bool) -> ModelConfig:
    """The run's `model` section, with `trust_remote_code` the operator's; a relative local base model path that is
    not found here is looked up again from the directory the run was started in (the run directory's
    `<job.out_dir>/<job.name>` stripped)."""
    data = translate(meta.get("config") or {})
    if "model" not in data:
        raise ExportError(f"{checkpoint / 'meta.json'} holds no run config; it was not written by a posttrain run")
    model = ModelConfig.model_validate(data["model"])
    if model.trust_remote_code and not trust_remote_code:
        raise ExportError(f"{checkpoint / 'meta.json'} sets model.trust_remote_code=true; an export never takes it "
                          "from a checkpoint (whoever can write the checkpoint writes that file). If you trust the "
                          f"code of the base model {model.name_or_path!r}, pass --trust-remote-code")
    model = model.model_copy(update={"trust_remote_code": trust_remote_code})
    base = Path(model.name_or_path).expanduser()
    run_dir = meta.get("run_dir")
    job = JobConfig.model_validate(data.get("job") or {})
    if not base.is_absolute() and not base.exists() and run_dir and not Path(job.out_dir).is_absolute():
        origin = Path(run_dir)
        for _ in Path(job.out_dir, job.name).parts:
            origin = origin.parent
        if (origin / base).exists():
            model = model.model_copy(update={"name_or_path": str(origin / base)})
    return model


def _check_outside_run(target: Path, run_dir: Path) -> None:
    """Refuse a target that is the run directory, holds it, or lies inside it anywhere but under `<run>/export/`
    (paths resolved, symlinks followed): writing the export replaces the target whole."""
    where, run = target.resolve(), run_dir.resolve()
    exports = run / EXPORT_DIR
    if where == run or run.is_relative_to(where):
        raise ExportError(f"{target} ({where}) is the run directory or holds it ({run}): writing the export there "
                          "would delete the run's checkpoints, metrics and config; pass another --to")
    if where.is_relative_to(run) and not (where.is_relative_to(exports) and where != exports):
        raise ExportError(f"{target} ({where}) is inside the run directory {run}: writing the export there would "
                          f"replace the run's own files; pass a --to outside it, or under {exports}/")


def _prepare_target(target: Path, overwrite: bool, run_dir: Path) -> None:
    _check_outside_run(target, run_dir)
    if target.exists() and not target.is_dir():
        raise ExportError(f"{target} exists and is not a directory; pass another --to")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ExportError(f"{target} exists and is not empty; pass --overwrite to replace it, or another --to")


def _reward_model(model_cfg: ModelConfig):
    """`(model, tokenizer)` of a reward model's run, as its trainer ranks built them (`build_trainer`)."""
    from rl_core.algorithms.reward_model import reward_model
    from rl_core.model.loading import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(model_cfg)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return reward_model(resolve_model_path(model_cfg.name_or_path), trust_remote_code=model_cfg.trust_remote_code,
                        pad_token_id=pad), tokenizer


def export_checkpoint(run: str | Path, step: int | None = None, to: str | Path | None = None, *,
                      merged: bool = False, overwrite: bool = False, trust_remote_code: bool = False) -> Exported:
    """Write checkpoint `step` of `run` (a run directory or a job name; None: its newest step) as a transformers
    directory at `to` (default `<run>/export/step-<N>`). With LoRA: the adapter, or the merged model with
    `merged`. The directory appears whole (written beside it, then renamed); an existing non-empty one is refused
    unless `overwrite`, and one that is, holds or lies in the run directory (but for `<run>/export/...`) always.
    `trust_remote_code` lets the base model's own code run (the checkpoint cannot ask for it). Raises ExportError
    naming the file and what to do."""
    from rl_core.algorithms.reward_model import HEAD
    from rl_core.model.loading import load_policy, save_policy
    from rl_core.training.state import load_model_shards

    run_dir = find_run_dir(run)
    checkpoints = _Checkpoints(run_dir)
    try:
        if to is not None:
            _prepare_target(Path(to), overwrite, run_dir)  # before any download or load
        directory = checkpoints.step_dir(step)
        step = checkpoint_step(directory)
        target = Path(to) if to is not None else default_target(run_dir, step)
        _prepare_target(target, overwrite, run_dir)
        try:
            parts, meta = checkpoints.local.load(directory)  # every file checked against the manifest
        except CheckpointError as exc:
            raise ExportError(f"checkpoint step {step} cannot be read: {exc}") from None
        model_cfg = _model_config(meta, directory, trust_remote_code)
        objective = ((translate(meta.get("config") or {}).get("rl") or {}).get("objective") or {}).get("type")
        head = HEAD if objective == "reward_model" else None  # a reward model's run: its sequence classifier
        try:
            model, tokenizer = load_policy(model_cfg) if head is None else _reward_model(model_cfg)
        except (OSError, ValueError) as exc:  # a missing directory, an unreachable hub id
            raise ExportError(f"the run's base model {model_cfg.name_or_path!r} (model.name_or_path in "
                              f"{directory / 'meta.json'}) cannot be loaded: {exc}; an export needs its config, "
                              "tokenizer and frozen weights: make it available at that path") from None
        if lora.enabled(model_cfg):
            model = lora.wrap(model, model_cfg.lora, value_head=head)
        try:
            lora.check_base(model, parts.get("trainer", {}))
        except ValueError as exc:
            raise ExportError(f"checkpoint step {step} ({directory}): {exc}") from None
        try:
            load_model_shards(model, lambda tensors: read_shards(tensors, directory))
        except CheckpointError as exc:
            raise ExportError(f"checkpoint step {step}: {exc}") from None
        form = "model" if not lora.is_lora(model) else "merged" if merged else "adapter"
        with atomic_directory(target) as tmp:
            save_policy(model, tokenizer, tmp, merged=form != "adapter", adapter_dir="" if form == "adapter" else None,
                        base=model_cfg.name_or_path)
            (tmp / "posttrain_export.json").write_text(json.dumps(
                {"run_dir": str(run_dir.resolve()), "step": step, "form": form,
                 "base_model": model_cfg.name_or_path}, indent=1))
        return Exported(target, step, form)
    finally:
        checkpoints.close()
