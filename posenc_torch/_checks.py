"""Argument checks that need Python, and the one error policy of the public functions.

The C++ shim validates what an op receives (shapes, sizes, dtypes, sections, values): it
is the one layer that checks op arguments.  What stays here is what only Python sees:
option names and types, tensor types, devices, and messages in terms of a public
function's own arguments where those differ from the op's (the vision layout, the layout
chosen by ``unsqueeze_dim``).  The rotation functions run these checks only after their
op has failed (or while tracing, where no kernel runs), so a call that succeeds pays for
none of them.

Error policy (README, "Errors"): TypeError for a wrong type or dtype, ValueError for a
wrong shape, size, section or value, RuntimeError for failures of allocation, threads or
a device.  The shim cannot raise TypeError (the stable ABI has no such exception): its
type failures are ValueErrors whose message starts with :data:`TYPE_ERROR_TAG`, which
:func:`op_error` turns into TypeErrors.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence

import torch

from . import _C

#: The float dtypes of the kernels, in the order of posenc.h's pe_dtype (tests/test_constants.py
#: holds the two together).
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.bfloat16,
                                         torch.float16)

# Devices the kernels run on: the CPU, and CUDA GPUs when the extension has its CUDA kernels.
KERNEL_DEVICES: tuple[str, ...] = ("cpu", "cuda") if _C.has_cuda() else ("cpu",)

#: How the shim's type failures start (csrc/torch/stable_support.h, kTypeErrorTag).
TYPE_ERROR_TAG = "TypeError: "


def op_error(err: BaseException) -> BaseException:
    """The public exception for an op's exception: a ValueError tagged as a type failure
    becomes a TypeError with the message after the tag; anything else stays as it is."""
    if type(err) is ValueError:
        message = str(err)
        if message.startswith(TYPE_ERROR_TAG):
            return TypeError(message[len(TYPE_ERROR_TAG):])
    return err


def explain(err: BaseException, check: Callable[..., None], *args: object) -> BaseException:
    """The exception a public function raises after its op raised ``err``: the error
    ``check(*args)`` finds (it names the public arguments), else ``op_error(err)``.
    Called only on failure: the success path never runs ``check``."""
    try:
        check(*args)
    except (TypeError, ValueError, NotImplementedError) as found:
        return found
    return op_error(err)


#: The range of the ops' ``int`` arguments (int64): a Python int outside it never reaches
#: the op (the dispatcher would refuse it without naming the argument).
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


def check_int(name: str, value: object, minimum: int | None = None) -> int:
    """An int (not a bool) that fits in int64 and, with ``minimum``, is at least that."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name} must fit in int64 (-2^63 to 2^63 - 1), got {value}")
    return value


def check_str(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value


def pairing_code(pairing: str) -> int:
    if pairing == "half":
        return 0
    if pairing == "adjacent":
        return 1
    check_str("pairing", pairing)
    raise ValueError(f"pairing must be 'half' or 'adjacent', got {pairing!r}")


def check_bool(name: str, value: object) -> bool:
    """True or False only: ``bool("no")`` is True, so a string or a number is a TypeError."""
    if value is not True and value is not False:
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_real(name: str, value: object) -> float:
    """A real number (int or float, numpy's included) as a float.  bool and tensors are
    TypeErrors: ``float()`` of a tensor that requires grad would drop its gradient."""
    if (isinstance(value, bool) or isinstance(value, torch.Tensor)
            or not isinstance(value, numbers.Real)):
        raise TypeError(f"{name} must be a real number (int or float), got "
                        f"{type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} is too large for a float: {value}") from None


def check_dtype(name: str, dtype: object) -> torch.dtype:
    """A torch.dtype (which one the op decides: its TypeError names ``name``)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(dtype).__name__}")
    return dtype


def check_tensor(name: str, t: object, ndim: int | tuple[int, ...], layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if t.dim() not in dims:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    return t


def check_tensors(**tensors: object) -> None:
    """Each argument that is not None is a tensor (else TypeError), and all are on one
    device where the kernels run (:func:`check_same_device`)."""
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_same_device(**{name: t for name, t in tensors.items() if t is not None})


def check_same_device(**tensors: torch.Tensor) -> None:
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; "
                "all tensors must be on the same device")
    if first.device.type not in ("meta", *KERNEL_DEVICES):
        raise NotImplementedError(
            f"posenc_torch kernels run on {' and '.join(KERNEL_DEVICES)} tensors; "
            f"{first_name} is on {first.device}")


def check_sections(mrope_section: object, name: str = "mrope_section") -> list[int]:
    """A list or tuple of 3 non-negative ints (never a tensor: HF repeats it as a list)."""
    if isinstance(mrope_section, torch.Tensor) or not isinstance(mrope_section, Sequence):
        raise TypeError(f"{name} must be a list or tuple of 3 ints, got "
                        f"{type(mrope_section).__name__}")
    sections = list(mrope_section)
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in sections):
        raise TypeError(f"{name} must hold ints, got {mrope_section!r}")
    if len(sections) != 3:
        raise ValueError(f"{name} must be 3 ints (T, H, W), got {mrope_section!r}")
    if any(s < 0 for s in sections):
        raise ValueError(f"{name} entries must be non-negative, got {mrope_section!r}")
    if any(s > INT64_MAX for s in sections):
        raise ValueError(f"{name} entries must fit in int64, got {mrope_section!r}")
    return sections


def check_unsqueeze_dim(unsqueeze_dim: object) -> int:
    """1 for (B, H, T, D) q/k, 2 for (B, T, H, D); -3 and -2 name the same dims."""
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int):
        raise TypeError(f"unsqueeze_dim must be an int, got {type(unsqueeze_dim).__name__}")
    canonical = {1: 1, -3: 1, 2: 2, -2: 2}.get(unsqueeze_dim)
    if canonical is None:
        raise ValueError(
            f"unsqueeze_dim must be 1 (q, k as (batch, heads, seq, head_dim)) or 2 "
            f"((batch, seq, heads, head_dim)), got {unsqueeze_dim}")
    return canonical
