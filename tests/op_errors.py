"""What a raw ``torch.ops.posenc`` call raises for a bad argument (README, "Errors").

The shim states the class of the error policy in the first words of its message,
"TypeError: " or "ValueError: "; the exception type is torch's to choose: torch 2.11 to
2.14 deliver these failures as ValueError, torch 2.15 and later as RuntimeError.  (The
public functions raise the class the message names, on every torch.)  A torch release that
changes this again fails the tests that use :func:`raw_raises`, so that the README's raw-op
contract is updated with it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pytest
import torch

from posenc_torch import _checks

#: The exception type of a raw op's bad-argument failure under the running torch.
RAW_BAD_INPUT: type[Exception] = (
    ValueError if torch.torch_version.TorchVersion(torch.__version__) < (2, 15) else RuntimeError)

_TAGS = {TypeError: _checks.TYPE_ERROR_TAG, ValueError: _checks.VALUE_ERROR_TAG}


@contextlib.contextmanager
def raw_raises(kind: type[Exception], match: str | None = None) -> Iterator[None]:
    """The block raises :data:`RAW_BAD_INPUT` whose message is the tag of ``kind``
    (TypeError or ValueError) followed by a message in which ``match`` is found
    (``re.search``; a leading ``^`` anchors it right after the tag)."""
    tag = _TAGS[kind]
    with pytest.raises(Exception) as info:
        yield
    assert type(info.value) is RAW_BAD_INPUT, (
        f"a raw op under torch {torch.__version__} raised {type(info.value).__name__}, "
        f"expected {RAW_BAD_INPUT.__name__}: {info.value}")
    message = str(info.value)
    assert message.startswith(tag), f"no {tag!r} tag: {message!r}"
    if match is not None:
        assert re.search(match, message[len(tag):]), f"{match!r} not in {message!r}"
