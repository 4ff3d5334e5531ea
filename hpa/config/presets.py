"""Named presets: lists of dotted overrides applied before the user's (``hpa train --preset NAME``).

``recipe`` is the HPA recipe as published (w_ppo = w_dpo = 0.4, w_kl = 0.2) without the parts hpa adds
by default to decide how far the learned reward is trusted: the preference anchor, per-component
advantages, the trust gate and the automatic balance, and the SFT replay (docs/results.md, "The defaults and
where each was chosen").
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from hpa.config.errors import ConfigError, closest

PRESETS: Dict[str, Tuple[str, ...]] = {
    "recipe": ("algorithm.dpo.rpo_alpha=null", "algorithm.advantage.per_component=false",
               "algorithm.hpa.trust.regime=off", "algorithm.hpa.balance.enabled=false", "algorithm.replay.coef=0.0"),
}


def with_preset(name: Optional[str], overrides: Sequence[str]) -> List[str]:
    """``overrides`` after the preset's (the user's win); no preset: ``overrides`` as they are."""
    if name is None:
        return list(overrides)
    if name not in PRESETS:
        raise ConfigError("--preset", f"unknown preset {name!r}; valid: {', '.join(PRESETS)} (closest: "
                                      f"{', '.join(closest(name, PRESETS))})")
    return [*PRESETS[name], *overrides]
