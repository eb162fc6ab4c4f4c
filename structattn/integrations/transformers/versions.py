"""The transformers versions the integration is tested with, checked at import."""

from __future__ import annotations

#: the tested range (the extra's requirement in pyproject.toml): 5.25 names the cache ``cache``
#: in ``forward`` and ``generate`` (``past_key_values`` before)
LOWEST, BELOW = (5, 25), (6, 0)


def check_version(version: str) -> None:
    """Refuse, in one line, a transformers outside the tested range."""
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if not LOWEST <= parts < BELOW:
        raise ImportError(f"structattn.integrations.transformers is tested with transformers "
                          f">={'.'.join(map(str, LOWEST))},<{'.'.join(map(str, BELOW))}; found "
                          f"{version} (pip install 'structattn[transformers]')")
