"""HandedOver (ds_lioncub/comm/transport/released.py), deterministically: a work kept alive holds its tensors.

The two-rank test (tests/distributed/test_released_collectives.py) counts what gloo's worker still holds right
after each collective, which depends on a race. Here the holder is a gloo work this test keeps alive itself,
on a one-rank gloo group of its own (no default group, so nothing else in the process sees torch.distributed):
while the work lives it holds the views it was handed, and HandedOver must say so; once it is dropped, the wait
returns without warning. A work kept past the wait's limit is let go of with the warning.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ds_lioncub._logging import get_logger
from ds_lioncub.comm.transport import released
from ds_lioncub.comm.transport.released import HandedOver, references

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="torch built without gloo")


@pytest.fixture
def gloo() -> dist.ProcessGroup:
    """A gloo group of one rank, not the default group."""
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))


@pytest.fixture
def warnings_logged(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The package logger's warnings while the test runs, with released.py's warn-once flag cleared."""
    monkeypatch.setattr(released, "_warned", False)
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                messages.append(record.getMessage())

    handler = Keep()
    get_logger().addHandler(handler)
    try:
        yield messages
    finally:
        get_logger().removeHandler(handler)


def test_a_kept_alive_asynchronous_work_is_reported_as_held(
    gloo: dist.ProcessGroup, warnings_logged: list[str]
) -> None:
    handed = HandedOver(torch.ones(8), torch.zeros(3))
    assert handed.still_held() == []  # a control: nothing holds fresh views
    view = handed.tensors[0]
    alone = references(view)
    work = gloo.allreduce([view])
    work.wait()
    for _ in range(3):  # however long it is waited on: the work keeps its tensors while it lives
        held = handed.still_held()
        assert len(held) == 1 and held[0] is view, "a live work's tensor is not reported as held"
    del work
    handed.wait_until_released()
    assert references(view) == alone
    assert handed.still_held() == [] and warnings_logged == []


def test_a_work_kept_past_the_wait_is_let_go_with_a_warning(
    gloo: dist.ProcessGroup, warnings_logged: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(released, "RELEASE_WAIT_S", 0.05)
    handed = HandedOver(torch.ones(8))
    work = gloo.allreduce(handed.tensors)
    work.wait()
    handed.wait_until_released()  # returns after the limit, with the warning, though the work still holds it
    assert [id(view) for view in handed.still_held()] == [id(handed.tensors[0])]
    assert len(warnings_logged) == 1 and "still referenced" in warnings_logged[0]
    del work
