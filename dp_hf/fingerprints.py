"""Digests of what a resumed run trains on, so that it replays the interrupted run's noise only for the same steps.

A resume restores the noise generator, so the steps after the checkpoint are released again with the same
noise: the same releases when the gradients are the same, a noiseless difference of two clipped sums when
they are not (:meth:`dp_hf.trainer.checkpoint.PrivateCheckpointMixin._rekey_noise_if_settings_changed`
draws fresh noise then). A card audit changed one row of 2,000 between the runs, unseen by the 256 rows the
sampled digest reads, and recovered that example's clipped gradient (1.84 C) from the two releases.

* :func:`content_digest`: every byte of a Hugging Face ``datasets.Dataset`` (its Arrow buffers, the
  indices mapping of a ``select``/``shuffle``, the format and transform) or of a ``TensorDataset``; other
  datasets have none (the sampled :func:`dp_hf.distributed.dataset_digest` is all there is).
* :func:`model_digest`: the model's configuration (dropout rates, ...) and its adapters'.
* :func:`callable_name`: a function by its qualified name (its ``repr`` holds a memory address).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch


def content_digest(dataset: Any) -> str | None:
    """SHA-256 of every byte of ``dataset`` (``datasets.Dataset`` or ``TensorDataset``), else None."""
    digest = hashlib.sha256()
    if _is_hf_dataset(dataset):
        for table in (dataset.data, getattr(dataset, "_indices", None)):
            _digest_table(digest, table)
        digest.update(_stable_repr(dataset.format).encode())
    elif isinstance(dataset, torch.utils.data.TensorDataset):
        for tensor in dataset.tensors:
            tensor = tensor.detach().cpu().contiguous()
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    else:
        return None
    return digest.hexdigest()


def model_digest(model: Any) -> str | None:
    """SHA-256 of the model's ``config`` (as JSON) and of its PEFT adapters' configs; None without a config."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return None
    settings = {key: value for key, value in config.to_dict().items() if key not in _VOLATILE_CONFIG_KEYS}
    digest = hashlib.sha256(_stable_repr(settings).encode())
    adapters = getattr(model, "peft_config", None)
    if isinstance(adapters, Mapping):
        for name in sorted(adapters):
            settings = adapters[name].to_dict() if hasattr(adapters[name], "to_dict") else adapters[name]
            digest.update(f"{name}{_stable_repr(settings)}".encode())
    return digest.hexdigest()


#: Config entries that training or loading sets without changing a gradient (the Trainer turns ``use_cache`` off
#: while training; saving writes the dtype; a model resumed from a checkpoint directory has that directory as
#: its name).
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "use_cache",
        "dtype",
        "torch_dtype",
        "_name_or_path",
        "name_or_path",
        "_commit_hash",
        "transformers_version",
        "architectures",
        "_attn_implementation_autoset",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)


def callable_name(function: Any) -> str | None:
    """``module.qualname`` of a function or of an object's class (None for None)."""
    if function is None:
        return None
    target = function if hasattr(function, "__qualname__") else type(function)
    return f"{getattr(target, '__module__', '?')}.{target.__qualname__}"


def _is_hf_dataset(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        return False
    return isinstance(dataset, datasets.Dataset)


def _digest_table(digest: Any, table: Any) -> None:
    if table is None:
        digest.update(b"no table")
        return
    arrow = getattr(table, "table", table)  # datasets' Table wraps a pyarrow.Table
    digest.update(str(arrow.schema).encode())
    for column in arrow.columns:
        for chunk in column.chunks:
            # Offset and length too: a sliced array shares its buffers with the whole one.
            digest.update(f"{chunk.offset},{len(chunk)}".encode())
            for buffer in chunk.buffers():
                digest.update(b"-" if buffer is None else memoryview(buffer))


def _stable_repr(value: Any) -> str:
    """``repr`` without memory addresses: functions by name, mappings sorted."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{key!r}: {_stable_repr(value[key])}" for key in sorted(value, key=str)) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_stable_repr(item) for item in value) + "]"
    if callable(value):
        return callable_name(value) or "None"
    try:
        return json.dumps(value, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return repr(value)
