"""interfaces/plugins.py: plugins declare their capabilities and are held to them."""

from __future__ import annotations

import pytest

from epick.interfaces import (
    EXTENSION_POINTS,
    Capabilities,
    FilterPlugin,
    PluginError,
    PluginSpecError,
    ScorePlugin,
    check_plugin,
)


class Scorer:
    name = "s"
    capabilities = Capabilities.SCORE

    def score(self, cycle, candidates):
        return []


def plugin(caps, **methods):
    """A plugin object declaring ``caps`` with exactly ``methods``."""
    return type("P", (), {"name": "p", "capabilities": caps, **methods})()


def test_a_plugin_that_has_what_it_declares_is_accepted_with_its_capabilities():
    assert check_plugin("s", Scorer()) == Capabilities.SCORE
    both = plugin(Capabilities.FILTER | Capabilities.PRE_REQUEST,
                  filter=lambda s, c, x: x, pre_request=lambda s, c, e: None)
    assert check_plugin("p", both) == Capabilities.FILTER | Capabilities.PRE_REQUEST


def test_no_capabilities_is_refused_naming_the_plugin_and_its_type():
    class Bare:
        def score(self, cycle, candidates):
            return []

    with pytest.raises(PluginSpecError, match=r"plugin 'bare': Bare declares no `capabilities`") as e:
        check_plugin("bare", Bare())
    assert e.value.plugin == "bare"


def test_capabilities_of_the_wrong_type_are_refused():
    with pytest.raises(PluginSpecError, match="got 'score'"):
        check_plugin("x", plugin("score", score=lambda s, c, x: []))


def test_capabilities_without_an_extension_point_are_refused():
    for caps in (Capabilities.NONE, Capabilities.STATE | Capabilities.SCORES_IN_RANGE):
        with pytest.raises(PluginSpecError, match="implements no extension point"):
            check_plugin("x", plugin(caps, export_state=lambda s: b"",
                                     import_state=lambda s, b: None, score=lambda s, c, x: []))


@pytest.mark.parametrize("caps, has, missing", [
    (Capabilities.SCORE, {}, "score"),
    (Capabilities.FILTER, {"score": lambda s, c, x: []}, "filter"),
    (Capabilities.POST_RESPONSE, {}, "post_response"),
    (Capabilities.SCORE | Capabilities.STATE, {"score": lambda s, c, x: [],
                                               "export_state": lambda s: b""}, "import_state"),
])
def test_a_declared_capability_without_its_method_is_refused_naming_both(caps, has, missing):
    with pytest.raises(PluginSpecError, match=rf"declares \w+ but has no {missing}\(\) method"):
        check_plugin("x", plugin(caps, **has))


def test_a_method_that_is_not_callable_counts_as_missing():
    with pytest.raises(PluginSpecError, match="no score"):
        check_plugin("x", plugin(Capabilities.SCORE, score="not a function"))


def test_extension_points_are_the_four_stages():
    assert EXTENSION_POINTS == (Capabilities.FILTER | Capabilities.SCORE
                                | Capabilities.PRE_REQUEST | Capabilities.POST_RESPONSE)
    assert not EXTENSION_POINTS & (Capabilities.STATE | Capabilities.SCORES_IN_RANGE)


def test_plugin_error_carries_who_where_and_what_for_the_metrics():
    err = PluginError("load", "score", "timeout", "over budget")
    assert (err.plugin, err.stage, err.kind, err.reason) == ("load", "score", "timeout",
                                                             "over budget")
    assert str(err) == "policy 'load' score: timeout: over budget"


def test_the_protocols_recognise_what_implements_them():
    assert isinstance(Scorer(), ScorePlugin)
    assert not isinstance(Scorer(), FilterPlugin)
