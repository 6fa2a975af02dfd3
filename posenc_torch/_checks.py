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
a device.  The bad-input errors of the public functions are :class:`InputTypeError` and
:class:`InputValueError`, both :class:`InputError`: "posenc refused these arguments", a
signal of posenc's own that does not depend on an exception class.  The shim states the
class of a failure in the first words of its message (:data:`TYPE_ERROR_TAG`,
:data:`VALUE_ERROR_TAG`), since the exception type torch delivers from a C++ op is
torch's choice (ValueError up to torch 2.14, RuntimeError from 2.15 on); :func:`op_error`
reads the tag.
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

class InputError(Exception):
    """posenc refused the arguments of a call: a wrong type, dtype, shape, size or value.

    Never raised itself: a public function raises :class:`InputTypeError` or
    :class:`InputValueError`, which are also the built-in TypeError and ValueError of the
    error policy.  Failures that are not about the arguments (allocation, threads, a
    device) are RuntimeErrors and not InputErrors."""


class InputTypeError(InputError, TypeError):
    """A wrong type or dtype, or a missing input (the policy's TypeError)."""


class InputValueError(InputError, ValueError):
    """A wrong rank, shape, size, section list, grid or value (the policy's ValueError)."""


#: How the shim's failures state their class: the first words of the message
#: (csrc/torch/stable_support.h, kTypeErrorTag and kValueErrorTag); an untagged failure of
#: an op is a RuntimeError (allocation, threads, a device).
TYPE_ERROR_TAG = "TypeError: "
VALUE_ERROR_TAG = "ValueError: "
_TAGS: tuple[tuple[str, type[InputError]], ...] = ((TYPE_ERROR_TAG, InputTypeError),
                                                  (VALUE_ERROR_TAG, InputValueError))


def op_error(err: BaseException) -> BaseException:
    """The public exception for an op's exception, whatever its type: a message that
    starts with a class tag gives that class (:class:`InputTypeError` or
    :class:`InputValueError`) with the message after the tag; anything else (an untagged
    failure, or an error Python raised) stays as it is."""
    if not isinstance(err, InputError):
        message = str(err)
        for tag, cls in _TAGS:
            if message.startswith(tag):
                return cls(message[len(tag):])
    return err


def explain(err: BaseException, check: Callable[..., None], *args: object) -> BaseException:
    """The exception a public function raises after its op raised ``err``: the error
    ``check(*args)`` finds (it names the public arguments), else ``op_error(err)``.
    Called only on failure: the success path never runs ``check``."""
    try:
        check(*args)
    except (InputError, NotImplementedError) as found:
        return found
    return op_error(err)


def allocation_error(err: RuntimeError, what: str) -> RuntimeError:
    """The RuntimeError for a tensor torch could not allocate (``err``, raised from it), in
    the policy's terms: ``what`` names the tensor and the argument its size came from.
    CUDA's OutOfMemoryError stays one."""
    cls = torch.OutOfMemoryError if isinstance(err, torch.OutOfMemoryError) else RuntimeError
    return cls(f"could not allocate {what}")


#: The range of the ops' ``int`` arguments (int64): a Python int outside it never reaches
#: the op (the dispatcher would refuse it without naming the argument).
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


def check_int(name: str, value: object, minimum: int | None = None) -> int:
    """An int (not a bool) that fits in int64 and, with ``minimum``, is at least that."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputTypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise InputValueError(f"{name} must be >= {minimum}, got {value}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise InputValueError(f"{name} must fit in int64 (-2^63 to 2^63 - 1), got {value}")
    return value


def check_str(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise InputTypeError(f"{name} must be a str, got {type(value).__name__}")
    return value


def pairing_code(pairing: str) -> int:
    if pairing == "half":
        return 0
    if pairing == "adjacent":
        return 1
    check_str("pairing", pairing)
    raise InputValueError(f"pairing must be 'half' or 'adjacent', got {pairing!r}")


def check_bool(name: str, value: object) -> bool:
    """True or False only: ``bool("no")`` is True, so a string or a number is a TypeError."""
    if value is not True and value is not False:
        raise InputTypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_real(name: str, value: object) -> float:
    """A real number (int or float, numpy's included) as a float.  bool and tensors are
    TypeErrors: ``float()`` of a tensor that requires grad would drop its gradient."""
    if (isinstance(value, bool) or isinstance(value, torch.Tensor)
            or not isinstance(value, numbers.Real)):
        raise InputTypeError(f"{name} must be a real number (int or float), got "
                             f"{type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise InputValueError(f"{name} is too large for a float: {value}") from None


def check_dtype(name: str, dtype: object) -> torch.dtype:
    """A torch.dtype (which one the op decides: its TypeError names ``name``)."""
    if not isinstance(dtype, torch.dtype):
        raise InputTypeError(f"{name} must be a torch.dtype, got {type(dtype).__name__}")
    return dtype


def check_tensor(name: str, t: object, ndim: int | tuple[int, ...], layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if t.dim() not in dims:
        raise InputValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    return t


def check_tensors(**tensors: object) -> None:
    """Each argument that is not None is a tensor (else TypeError), and all are on one
    device where the kernels run (:func:`check_same_device`)."""
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_same_device(**{name: t for name, t in tensors.items() if t is not None})


def check_same_device(**tensors: torch.Tensor) -> None:
    """The tensors (at least one) are on one device, one where the kernels run (else
    NotImplementedError) or meta."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise InputValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; "
                "all tensors must be on the same device")
    if first.device.type not in ("meta", *KERNEL_DEVICES):
        raise NotImplementedError(
            f"posenc_torch kernels run on {' and '.join(KERNEL_DEVICES)} tensors; "
            f"{first_name} is on {first.device}")


def check_sections(mrope_section: object, name: str = "mrope_section") -> list[int]:
    """A list or tuple of 3 non-negative ints (never a tensor: HF repeats it as a list)."""
    if isinstance(mrope_section, torch.Tensor) or not isinstance(mrope_section, Sequence):
        raise InputTypeError(f"{name} must be a list or tuple of 3 ints, got "
                             f"{type(mrope_section).__name__}")
    sections = list(mrope_section)
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in sections):
        raise InputTypeError(f"{name} must hold ints, got {mrope_section!r}")
    if len(sections) != 3:
        raise InputValueError(f"{name} must be 3 ints (T, H, W), got {mrope_section!r}")
    if any(s < 0 for s in sections):
        raise InputValueError(f"{name} entries must be non-negative, got {mrope_section!r}")
    if any(s > INT64_MAX for s in sections):
        raise InputValueError(f"{name} entries must fit in int64, got {mrope_section!r}")
    return sections


def check_unsqueeze_dim(unsqueeze_dim: object) -> int:
    """1 for (B, H, T, D) q/k, 2 for (B, T, H, D); -3 and -2 name the same dims."""
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int):
        raise InputTypeError(f"unsqueeze_dim must be an int, got {type(unsqueeze_dim).__name__}")
    canonical = {1: 1, -3: 1, 2: 2, -2: 2}.get(unsqueeze_dim)
    if canonical is None:
        raise InputValueError(
            f"unsqueeze_dim must be 1 (q, k as (batch, heads, seq, head_dim)) or 2 "
            f"((batch, seq, heads, head_dim)), got {unsqueeze_dim}")
    return canonical
