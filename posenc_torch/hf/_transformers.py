"""The one place that imports the installed transformers: its version, a model type's
modeling module, the class of a module that defines a method, and the function inside a
hub-kernel layer that transformers puts in place of a function."""

from __future__ import annotations

import importlib
import types


class Unsupported(RuntimeError):
    """A known model type that the installed transformers does not let posenc patch."""


class Absent(Unsupported):
    """A known model type that the installed transformers does not have at all: patch()
    with no arguments passes it by without a warning (it did not drop out, it is not
    there); asked for by name it is refused like any other."""


def module() -> types.ModuleType:
    try:
        import transformers
    except ImportError as e:
        raise ImportError("posenc_torch.hf needs transformers installed") from e
    return transformers


def version() -> str:
    return module().__version__


def modeling_module(model_type: str) -> types.ModuleType:
    """``transformers.models.<type>.modeling_<type>``; ``Absent`` when this release has no
    such model, ``Unsupported`` when its module fails to import."""
    release = version()
    name = f"transformers.models.{model_type}.modeling_{model_type}"
    try:
        return importlib.import_module(name)
    except ImportError as e:
        absent = isinstance(e, ModuleNotFoundError) and e.name in (
            name, f"transformers.models.{model_type}")
        raise (Absent if absent else Unsupported)(
            f"cannot import {name} from transformers {release} ({e}); model type "
            f"{model_type!r} needs a transformers version that has it") from e


def owner_class(module_: types.ModuleType, name: str) -> type:
    """The one class of ``module_`` that defines the method ``name``; Unsupported if there
    is not exactly one."""
    owners = [value for value in vars(module_).values()
              if isinstance(value, type) and value.__module__ == module_.__name__
              and name in vars(value)]
    if len(owners) != 1:
        raise Unsupported(
            f"expected one class defining {name} in {module_.__name__} (transformers "
            f"{version()}), found {[c.__name__ for c in owners]}; this release computes it "
            "in a way posenc_torch does not know")
    return owners[0]


def hub_kernel_function(obj: object, name: str) -> types.FunctionType | None:
    """The function ``name`` inside ``obj`` when ``obj`` is a hub-kernel layer made of it,
    else None.

    With the ``kernels`` package importable, transformers decorates its rotary functions
    with ``use_kernel_forward_from_hub("rotary_pos_emb")``, which puts in the function's
    place an ``nn.Module`` instance (its class names a ``kernel_layer_name``) whose
    forward calls a kernel where ``kernelize`` gave the calling module one, and the
    function otherwise: the free variable of that forward that is a function called
    ``name``.  Unsupported for such a layer without one (another ``kernels`` release)."""
    import torch

    layer = getattr(type(obj), "kernel_layer_name", None)
    if layer is None or not isinstance(obj, torch.nn.Module):
        return None
    forward = vars(type(obj)).get("forward")
    found = []
    for cell in getattr(forward, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, types.FunctionType) and value.__name__ == name:
            found.append(value)
    if len(found) != 1:
        raise Unsupported(f"{name} is a hub-kernel layer ({layer!r}, of the kernels "
                          f"package) that wraps no function {name} posenc_torch can read")
    return found[0]
