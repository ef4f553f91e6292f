"""``scheduler_lib.broker`` exports the broker, its transactions, what they return and
raise; the poison policies have their own namespace, ``scheduler_lib.broker.poison``, and
their old names here still work, with a DeprecationWarning naming the new import."""

from __future__ import annotations

import importlib

import pytest

import scheduler_lib.broker as broker_package
from scheduler_lib.broker import poison


def test_every_exported_name_is_there() -> None:
    missing = [name for name in broker_package.__all__ if name not in vars(broker_package)]
    assert not missing


def test_policy_types_are_not_exported_here_any_more() -> None:
    assert "PoisonPolicy" not in broker_package.__all__
    assert "Park" not in broker_package.__all__


@pytest.mark.parametrize("name", ["PoisonPolicy", "Park", "PoisonDetector", "PoisonEvent"])
def test_an_old_import_still_works_and_says_where_it_moved(name: str) -> None:
    # Given code written against the old export, When it imports the name
    with pytest.warns(DeprecationWarning, match=f"import {name} from scheduler_lib.broker.poison"):
        found = getattr(importlib.import_module("scheduler_lib.broker"), name)
    # Then it gets the very class of the new namespace
    assert found is getattr(poison, name)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchThing"):
        broker_package.NoSuchThing  # noqa: B018
