"""One line for an error names the exception that was raised, not Ray's wrapper of it."""

from __future__ import annotations

import pytest
from ray.exceptions import RayTaskError

from raylift.core.errors import cause_of, first_line


def raised_in_an_actor(cause: Exception) -> RayTaskError:
    """What ``ray.get`` raises for an actor call that raised ``cause``: Ray's own class,
    built as Ray builds it from the remote traceback."""
    try:
        raise cause
    except Exception as exc:
        import traceback

        remote = RayTaskError(
            "Store.log_model",
            traceback.format_exc(),
            exc,
            "ray::Store.log_model()",
            4242,
            "10.0.0.1",
        )
    return remote.as_instanceof_cause()


def test_a_ray_task_error_shows_its_cause_not_rays_header() -> None:
    error = raised_in_an_actor(ValueError("Logged model with ID 'm-1' not found\nmore"))
    assert "ray::Store.log_model()" in str(error).splitlines()[0]  # what was shown before
    assert isinstance(cause_of(error), ValueError) and not isinstance(cause_of(error), RayTaskError)
    assert first_line(error) == "ValueError: Logged model with ID 'm-1' not found"


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (OSError("Bucket 'x' not found\ndetail"), "OSError: Bucket 'x' not found"),
        (KeyError(), "KeyError"),
    ],
)
def test_a_plain_error_is_its_type_and_first_line(error: Exception, line: str) -> None:
    assert first_line(error) == line
