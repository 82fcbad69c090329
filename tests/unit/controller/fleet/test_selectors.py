from __future__ import annotations

import pytest

from controller.fleet.selectors import SelectorError, parse_selector

LOBBY_T4 = {"site": "lobby", "gpu": "t4"}
DOCK_ORIN_CANARY = {"site": "dock", "gpu": "orin", "canary": "true"}
BARE: dict[str, str] = {}


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("", [True, True, True]),
        ("site=lobby", [True, False, False]),
        ("site==lobby", [True, False, False]),
        ("site!=lobby", [False, True, True]),  # no key satisfies != (Kubernetes semantics)
        ("gpu in (t4,orin)", [True, True, False]),
        ("gpu in (t4, orin)", [True, True, False]),
        ("gpu notin (t4)", [False, True, True]),
        ("canary", [False, True, False]),
        ("!canary", [True, False, True]),
        ("gpu in (t4,orin),!canary", [True, False, False]),
        ("site=dock, canary, gpu=orin", [False, True, False]),
    ],
)
def test_selectors_match_like_kubernetes(selector: str, expected: list[bool]) -> None:
    sel = parse_selector(selector)
    assert [sel.matches(labels) for labels in (LOBBY_T4, DOCK_ORIN_CANARY, BARE)] == expected


@pytest.mark.parametrize(
    ("selector", "needle"),
    [
        ("gpu in (t4", "unbalanced"),
        ("gpu in t4)", "unbalanced"),
        ("gpu in ()", "empty value list"),
        ("site=lo bby", "invalid label value"),
        ("si te=lobby", "invalid label key"),
        ("a=b=c", "unexpected '='"),
        ("site=lobby,,gpu=t4", "empty requirement"),
        ("gpu within (t4)", "cannot parse"),
        ("x" * 2000, "longer than"),
    ],
)
def test_bad_selectors_say_what_is_wrong(selector: str, needle: str) -> None:
    with pytest.raises(SelectorError, match=needle):
        parse_selector(selector)
