"""The method registry: each generation's budget resolved once, to a fixed size or an auto budget."""

from __future__ import annotations

import pytest

from specexec.methods import Auto, BudgetError, Fixed, method


@pytest.mark.parametrize(
    "name, given, resolved",
    [
        ("specexec", None, Auto()),  # the method's own default
        ("specexec", "auto", Auto()),
        ("specexec", 64, Fixed(64)),
        ("dsl", None, Auto()),
        ("sd", None, Fixed(4)),
        ("specinfer", None, Fixed(32)),
        ("ar", None, Fixed(0)),
        ("ar", 0, Fixed(0)),
        ("sd", Fixed(3), Fixed(3)),  # already resolved: kept
    ],
)
def test_a_budget_resolves_once_to_one_value(name: str, given, resolved) -> None:
    assert method(name).resolve_budget(given) == resolved
    assert method(name).sized_by_cost(given) is isinstance(resolved, Auto)


@pytest.mark.parametrize(
    "name, given, message",
    [
        ("sd", "auto", "budget 'auto' is for methods 'dsl' and 'specexec', not 'sd'"),
        ("sd", 0, "budget must be an integer >= 1 or 'auto', got 0"),
        ("specexec", True, "got True"),
        ("specexec", "64", "got '64'"),
        ("specexec", 2.5, "got 2.5"),
        ("sd", Fixed(0), "got 0"),  # a resolved value is checked too
        ("ar", Auto(), "budget 'auto' is for methods"),
    ],
)
def test_a_budget_a_method_cannot_take_is_refused(name: str, given, message: str) -> None:
    with pytest.raises(BudgetError, match=message.replace("(", r"\(")):
        method(name).resolve_budget(given)
    assert method(name).sized_by_cost(given) is False


def test_a_budget_is_written_back_as_its_option() -> None:
    assert Fixed(16).option == 16 and Auto().option == "auto"
