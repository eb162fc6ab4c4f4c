"""The certificates' tests check what a certified reading computes, at sizes where the CPU's
cost rule (``kinds.window._band_pays``: a band per head only where reading it is expected to
cost well under the whole past) would read the whole past instead: the rule is set aside
here, and tested on its own (tests/kinds/test_certificate_costs.py)."""

import pytest


@pytest.fixture(autouse=True)
def _certify_at_any_size(monkeypatch):
    from structattn.kinds import window

    monkeypatch.setattr(window, "_band_pays", lambda *args: True)
