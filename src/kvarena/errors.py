"""Every exception kvarena raises derives from :class:`Error`.

Each refusal also keeps the built-in base a caller would expect (``ValueError``
for a bad value, ``KeyError`` for an unknown name, ``IndexError`` for an index
out of range, ``RuntimeError`` for a resource that ran out), so code written
against the built-ins keeps working while ``except kvarena.Error`` catches
everything the library refuses. This module sits below every other one: it
imports nothing of kvarena.
"""

from __future__ import annotations


class Error(Exception):
    """Base of every exception kvarena raises."""


class InvalidValueError(Error, ValueError):
    """An argument outside its legal range; the message names the value and the range."""


class UnknownNameError(Error, KeyError):
    """A name (field, entry class, request) that does not exist here.

    ``KeyError`` would print its message with quotes; this one prints it as written.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class IndexOutOfRangeError(Error, IndexError):
    """An entry index outside ``[0, entries)``."""


class OutOfMemoryError(Error, MemoryError):
    """The device (or host) could not give the bytes asked for; nothing was built."""


class LayoutMismatchError(Error, ValueError):
    """Two sides disagree on a layout (fingerprints, entry sizes, strides); no byte moved.

    Raised wherever a fingerprint is compared: a checkpoint image against a
    state, a transfer peer's geometry against ours.
    """
