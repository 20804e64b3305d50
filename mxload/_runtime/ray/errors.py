"""Ray's error texts as mxload quotes them in its own errors.

Ray colours parts of its messages for a terminal (the ``ray::Actor.method()``
header of a task's traceback): quoted into an exception or a log file, the
colour codes are noise, so every text taken from Ray goes through ``plain``.

An actor that cannot be created (its ``__init__`` raised, or Ray could not
import its class on the worker and substituted a ``TemporaryActor``) fails
its calls with an ActorDiedError whose message is one line of Ray's own
("The actor died because of an error raised in its creation task, ...")
followed by the creation task's traceback; the exception that caused it is
only the end of that text (Ray keeps no object of it).  ``creation_error``
finds it, so the loader's error says what it was.
"""
from __future__ import annotations

import re

__all__ = ["IMPORT_HINT", "creation_error", "first_line", "plain"]

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")   # CSI sequences: colours, bold, resets
# Ray's signs that the worker could not import what the actor needs: the
# placeholder class it creates instead, and its RuntimeError saying so.
_IMPORT_FAILED = ("TemporaryActor", "failed to import on the worker")

IMPORT_HINT = (
    "the worker's Python could not import mxload, e.g. because Ray puts the "
    "driver's working directory first on its workers' sys.path and that directory holds an "
    "mxload/ source folder without its compiled core (the repository root): run the script "
    "from another directory, build the core in place (pip install -e .), or ship a working "
    "mxload with RayBackend(runtime_env=...)")


def plain(text: str) -> str:
    """`text` without terminal escape sequences."""
    return _ANSI.sub("", text)


def first_line(error: BaseException) -> str:
    text = plain(str(error)).strip()
    return text.splitlines()[0] if text else ""


def creation_error(error: BaseException) -> str | None:
    """The exception that stopped an actor's creation, as "Type: message"
    (the last one of the creation task's traceback), or None when `error`
    is not a failed creation."""
    if not getattr(error, "actor_init_failed", False):
        return None
    text = plain(str(error)).rstrip()
    lines = text.splitlines()
    # A Python traceback ends with its frames ("  File ...", each followed by
    # indented lines) and then the exception, whose message may span lines.
    start = 0
    for i, line in enumerate(lines):
        if line.startswith("  File "):
            start = i + 1
            while start < len(lines) and lines[start][:1] in (" ", "\t"):
                start += 1
    cause = "\n".join(lines[start:]).strip() if start else ""
    if not cause:   # no traceback: Ray's text is all there is
        cause = text.strip()
    imported = not cause.startswith(("ImportError", "ModuleNotFoundError"))
    if not imported or any(sign in text for sign in _IMPORT_FAILED):
        cause = f"{cause} ({IMPORT_HINT})"
    return cause
