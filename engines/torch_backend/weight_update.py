"""Weights of a running model replaced from a checkpoint: staged and checked first, swapped after.

Contract:
- :func:`stage_checkpoint` opens a Hugging Face directory of ``*.safetensors`` after checking,
  from the files' headers alone, every tensor against the running model: its name (one the
  model has, each once, none missing), its shape, and its dtype, which must be the dtype the
  model runs in (no silent conversion: a trainer sends what the engines serve). The first
  tensor that does not match raises :class:`CheckpointMismatch` (400) naming it, before any
  data is read; the running model is never touched. The staged tensors are safetensors'
  memory maps of the files (no second copy in host memory); the engine's digest of the files
  reads every byte while it prepares, so a read error surfaces then and the swap copies from
  the page cache. The files must not be rewritten in place until the update is acknowledged.
- :func:`swap_in` copies staged tensors into the model's parameters in place, so their
  storage (and any CUDA graph captured on it) stays; on CUDA it ends with a device
  synchronize, so once it returns the new weights are in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engines.torch_backend.model import DecoderModel
from engines.torch_backend.weights import hf_shapes, parameter_for
from service.protocol.checkpoint import checkpoint_files
from service.protocol.errors import ErrorCode, WireError

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointMismatch(WireError):
    """A checkpoint that does not fit the running model; the message names the first bad tensor."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.MALFORMED, message)


@dataclass(slots=True)
class StagedWeights:
    """Every tensor of a checkpoint that matched the running model, mapped from its files."""

    tensors: list[tuple[str, torch.Tensor]]


def _skipped(name: str, tied: bool) -> bool:
    return name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight")


def check_checkpoint(model: DecoderModel, dtype: torch.dtype, path: str | Path) -> list[Path]:
    """The checkpoint's files once every tensor's name, shape and dtype matched; raises
    :class:`CheckpointMismatch` at the first that does not (files and tensors in name order)."""
    from safetensors import safe_open

    files = checkpoint_files(path)
    config = model.config
    expected = hf_shapes(config)
    seen: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if _skipped(name, config.tie_word_embeddings):
                    continue
                where = f"{name} (in {file.name})"
                if name not in expected:
                    raise CheckpointMismatch(f"{where} is not a tensor of the running model")
                if name in seen:
                    raise CheckpointMismatch(f"{where} appears twice in the checkpoint")
                info = handle.get_slice(name)
                shape = tuple(info.get_shape())
                if shape != expected[name]:
                    raise CheckpointMismatch(f"{where} has shape {shape}, the running model's is {expected[name]}")
                stored = _DTYPES.get(info.get_dtype())
                if stored != dtype:
                    raise CheckpointMismatch(
                        f"{where} has dtype {info.get_dtype()}, the running model's is {str(dtype).removeprefix('torch.')}"
                    )
                seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointMismatch(f"{missing[0]} is missing from the checkpoint ({len(missing)} tensors missing)")
    return files


def stage_checkpoint(model: DecoderModel, dtype: torch.dtype, path: str | Path) -> StagedWeights:
    """Check the checkpoint (see :func:`check_checkpoint`), then map its tensors."""
    from safetensors import safe_open

    files = check_checkpoint(model, dtype, path)
    tied = model.config.tie_word_embeddings
    tensors: list[tuple[str, torch.Tensor]] = []
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            tensors.extend((name, handle.get_tensor(name)) for name in handle.keys() if not _skipped(name, tied))
    return StagedWeights(tensors)


def swap_in(model: DecoderModel, staged: StagedWeights) -> None:
    """Copy every staged tensor into its parameter, in place (tied embeddings stay tied)."""
    with torch.no_grad():
        for name, tensor in staged.tensors:
            parameter, rows = parameter_for(model, name)
            parameter[rows].copy_(tensor)
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
