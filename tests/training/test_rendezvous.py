"""How a trainer pod finds worker 0: the Service's DNS name where it resolves, else the
address the operator publishes in the run's status."""

from __future__ import annotations

import pytest
from kubestar.training.distributed import rendezvous_host


def test_a_name_that_resolves_is_used_as_is() -> None:
    def never() -> str | None:
        raise AssertionError("the status is read only when DNS has no answer")

    assert rendezvous_host("localhost", never) == "localhost"


def test_without_a_name_it_waits_for_the_published_address() -> None:
    answers = iter([None, "", "10.1.2.3"])
    reads: list[int] = []

    def published() -> str | None:
        reads.append(1)
        return next(answers)

    assert rendezvous_host("", published, timeout=60) == "10.1.2.3"
    assert len(reads) == 3


def test_no_address_in_time_says_where_it_looked() -> None:
    with pytest.raises(TimeoutError, match=r"status\.rendezvousAddress"):
        rendezvous_host("", lambda: None, timeout=0)
