"""Moving a model to its device with its tied weights still tied.

``Module.to`` moves a parameter in place (``param.data = moved``) only where the CPU tensor and
the device's tensor share a tensor implementation (CPU and CUDA do). Where they do not (XLA,
the meta device, and out-of-tree devices registered through PrivateUse1 such as TorchTPU's),
each module gets a new Parameter of its own, so a tied embedding and output head become two
independent weights, each trained only on the gradient of its own use, with no error.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def _shared(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Each parameter or buffer held under more than one name (a tied embedding and output
    head), as its [(module name, attribute), ...], first name first."""
    seen: dict[int, list[tuple[str, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None:
                seen.setdefault(id(t), []).append((module_name, attr))
    return [names for names in seen.values() if len(set(names)) > 1]


def to_device_keeping_ties(model: nn.Module, device: torch.device) -> nn.Module:
    """``model.to(device)`` with its shared parameters and buffers still shared: the first
    name's moved tensor is put back under every other name (a no-op where ``Module.to`` kept
    the tie itself)."""
    shared = _shared(model)
    model = model.to(device)
    for names in shared:
        first_module, first_attr = names[0]
        tensor = getattr(model.get_submodule(first_module), first_attr)
        for module_name, attr in names[1:]:
            setattr(model.get_submodule(module_name), attr, tensor)
    return model
