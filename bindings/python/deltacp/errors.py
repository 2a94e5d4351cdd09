"""deltacp.errors — the exceptions deltacp raises, for callers that handle them apart.

Every error of the C++ core (``deltacp::Error`` and its kinds, reference/include/deltacp/error.h) reaches
Python as one of these classes (bindings/src/module.cpp). Each derives from ``DeltaCPError`` and from the
builtin exception it stands for, so ``except ValueError`` keeps working::

    DeltaCPError                        base of everything deltacp raises on purpose; .argument names the
    |                                   offending argument ("" when none)
    +-- InvalidArgumentError (ValueError)   a shape, layout, size, value or device that does not fit
    |   +-- NumericError                    non-finite inputs or outputs, a log decay g > 0 (docs/errors.md)
    +-- DTypeError (TypeError)              a tensor of the wrong dtype
    +-- OutOfMemoryError (MemoryError)      a device allocation that did not fit (bytes requested and free)
    +-- CUDAError (RuntimeError)            a CUDA call that failed (launch, driver)
    +-- CPTimeoutError (RuntimeError)       a context-parallel collective that did not complete in time

``Error`` is ``InvalidArgumentError`` (the name the C++ core's error had before these classes).

This module imports nothing from the package: everything else may import it.
"""

from __future__ import annotations

__all__ = ["DeltaCPError", "InvalidArgumentError", "Error", "NumericError", "DTypeError", "OutOfMemoryError",
           "CUDAError", "CPTimeoutError"]


class DeltaCPError(Exception):
    """Base class of every error deltacp raises on purpose. ``argument`` names the offending argument
    (parsed from the message "deltacp: argument 'q': ..." when not given), "" when the error is about none."""

    def __init__(self, message: str = "", argument: str | None = None):
        super().__init__(message)
        if argument is None:
            argument = _argument_of(message)
        self.argument = argument


def _argument_of(message: str) -> str:
    head = "deltacp: argument '"
    if isinstance(message, str) and message.startswith(head):
        end = message.find("'", len(head))
        if end > 0:
            return message[len(head):end]
    return ""


class InvalidArgumentError(DeltaCPError, ValueError):
    """A shape, layout, size, value or device that does not fit what the call expects."""


Error = InvalidArgumentError


class NumericError(InvalidArgumentError):
    """Values that make the recurrence blow up: a non-finite input, a log decay g > 0 (gdn, kda), or a
    non-finite output or gradient. The message names the tensor, the first bad index and the likely cause
    (docs/errors.md). Checked on every CPU call; on the GPU when DELTACP_CHECK=1."""


class DTypeError(DeltaCPError, TypeError):
    """A tensor whose dtype the call does not take."""


class OutOfMemoryError(DeltaCPError, MemoryError):
    """A device allocation that did not fit: the message gives the bytes requested and the bytes free."""


class CUDAError(DeltaCPError, RuntimeError):
    """A CUDA runtime call or kernel launch that failed."""


class CPTimeoutError(DeltaCPError, RuntimeError):
    """A context-parallel collective did not complete within the context's timeout (a peer stalled or died).
    The communicator is stopped; build a new context to continue."""
