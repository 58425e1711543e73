"""Tensors inside the nested containers a batch or a model output is made of, mapped without changing the
containers' types."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch


def map_tensors(data: Any, function: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Applies `function` to every tensor inside nested dicts, lists, tuples, named tuples and dataclasses, and
    returns containers of the same types (a transformers ModelOutput stays one: recipes read `.loss`, `.logits`).

    Containers are copied, never changed in place: the data may be a batch the user's dataset keeps.
    """
    if isinstance(data, torch.Tensor):
        return function(data)
    if isinstance(data, dict):
        if type(data) is dict:
            return {key: map_tensors(value, function) for key, value in data.items()}
        mapped = copy.copy(data)  # a dict subclass (ModelOutput, OrderedDict): its own __setitem__ keeps it whole
        for key, value in data.items():
            mapped[key] = map_tensors(value, function)
        return mapped
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        mapped = copy.copy(data)
        for field in dataclasses.fields(data):
            object.__setattr__(mapped, field.name, map_tensors(getattr(data, field.name), function))
        return mapped
    if isinstance(data, (list, tuple)):
        mapped = [map_tensors(value, function) for value in data]
        return type(data)(*mapped) if hasattr(data, "_fields") else type(data)(mapped)
    return data


def move_to(data: Any, device: torch.device) -> Any:
    return map_tensors(data, lambda tensor: tensor.to(device, non_blocking=device.type == "cuda"))
