"""The emulated API's label selectors: existence terms (a bare key, !key) match as Kubernetes does."""

from __future__ import annotations

from exitplan.devcluster.kubeobjects import labels_match, parse_label_selector


def test_the_emulated_api_matches_an_existence_selector():
    """A bare key selects every object with the label (it raised IndexError: the values of '!=' were read for it)."""
    assert labels_match({"exitplan.io/service": "a"}, parse_label_selector("exitplan.io/service"))
    assert not labels_match({"other": "x"}, parse_label_selector("exitplan.io/service"))
    assert labels_match({"other": "x"}, parse_label_selector("!exitplan.io/service,other=x"))
