"""How the Ray backend quotes Ray's error texts (no Ray needed: the texts are
Ray 2.60's, as its ActorDiedError words them)."""
from __future__ import annotations

import pytest

from mxload._runtime.ray.errors import IMPORT_HINT, creation_error, first_line, plain

pytestmark = pytest.mark.timeout(60)

HEADER = ("The actor died because of an error raised in its creation task, "
          "\x1b[36mray::LoaderActor.__init__()\x1b[39m (pid=26808, ip=192.0.2.2, actor_id=962beb, "
          "repr=<{cls} object at 0x7f4458618a90>)\n")
# The actor's class did not import on the worker: Ray ran a placeholder that raises this.
TEMPORARY = "mxload._runtime.ray.actor.FunctionActorManager._create_fake_actor_class.<locals>.TemporaryActor"
CLASS_NOT_IMPORTED = HEADER.format(cls=TEMPORARY) + (
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    "RuntimeError: The actor with name LoaderActor failed to import on the worker. This may be because "
    "needed library dependencies are not installed in the worker environment:\n\n"
    "\x1b[36mray::LoaderActor.__init__()\x1b[39m (pid=26808, ip=192.0.2.2)\n"
    "                  ^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "/repo/mxload/__init__.py", line 9, in <module>\n'
    "    raise ImportError(explain_missing_core(_error)) from None\n"
    "ImportError: mxload's compiled core (mxload._core) is not built")
# The constructor itself raised (two lines of message).
INIT_RAISED = HEADER.format(cls="mxload._runtime.ray.actor.LoaderActor") + (
    "Traceback (most recent call last):\n"
    '  File "/repo/mxload/_runtime/ray/actor.py", line 99, in __init__\n'
    "    enter_process(config, dataset)\n"
    "    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    "ValueError: no such worker\nsecond line")


class FakeActorDied(Exception):
    def __init__(self, text: str, actor_init_failed: bool = True):
        super().__init__(text)
        self.actor_init_failed = actor_init_failed


def test_the_creation_error_is_the_last_exception_of_ray_s_text_without_colour_codes():
    cause = creation_error(FakeActorDied(CLASS_NOT_IMPORTED))
    assert cause == f"ImportError: mxload's compiled core (mxload._core) is not built ({IMPORT_HINT})"
    assert creation_error(FakeActorDied(INIT_RAISED)) == "ValueError: no such worker\nsecond line"


def test_an_error_that_is_not_a_failed_creation_has_no_creation_error():
    assert creation_error(FakeActorDied(INIT_RAISED, actor_init_failed=False)) is None
    assert creation_error(RuntimeError("the node died")) is None


def test_a_creation_error_without_a_traceback_is_ray_s_whole_text():
    assert creation_error(FakeActorDied("\x1b[31mno traceback\x1b[0m here")) == "no traceback here"


def test_colour_codes_are_stripped_from_every_quoted_text():
    assert plain("\x1b[36mray::A.f()\x1b[39m \x1b[1;31mbold red\x1b[0m") == "ray::A.f() bold red"
    assert first_line(FakeActorDied(CLASS_NOT_IMPORTED)).startswith(
        "The actor died because of an error raised in its creation task, ray::LoaderActor.__init__() (pid")
