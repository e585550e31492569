"""The ``health`` config section: each bad value is one message naming the field, and the values reach
the watch (stapo.trainer.components.build_health)."""

from __future__ import annotations

import pytest

from stapo.config import ConfigError, STAPOConfig
from stapo.health import BUILTIN_MONITORS
from stapo.trainer.components import build_health


@pytest.mark.parametrize("overrides, message", [
    (["health.on_alarm=panic"], r"health.on_alarm must be one of \['warn', 'stop', 'rollback'\]"),
    (["health.monitors=[grad_norm, nope]"], "health.monitors: unknown health monitor 'nope'; choose one of"),
    (["health.params={grad_norm: {zz: 1}}"], r"monitor 'grad_norm' has no parameter\(s\) \['zz'\]"),
    (["health.params={grad_norm: 8}"], "health.params.grad_norm must be a mapping of parameters"),
    (["health.monitors=[grad_norm]", "health.params={clip_frac: {z: 4}}"],
     r"health.params sets \['clip_frac'\]: not an active monitor"),
    (["health.window=2"], "health.window must be >= 3"),
    (["health.warmup=60"], r"health.warmup must be in \[0, health.window=50\]"),
    (["health.patience=0"], "health.patience must be >= 1"),
    (["health.keep_healthy=0"], "health.keep_healthy must be >= 1"),
    (["health.rollback_lr_scale=0"], r"health.rollback_lr_scale must be in \(0, 1\]"),
    (["health.rollback_lr_scale=2"], r"health.rollback_lr_scale must be in \(0, 1\]"),
    (["health.max_rollbacks=0"], "health.max_rollbacks must be >= 1"),
    (["health.on_alarm=rollback", "trainer.save_every=0"], "set trainer.save_every > 0"),
    (["health.on_alarm=rollback", "rollout.mode=server", "rollout.server.addresses=[127.0.0.1:8000]",
      "rollout.max_staleness=1"], "health.on_alarm=rollback needs rollout.max_staleness=0"),
])
def test_bad_health_settings_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        STAPOConfig.from_yaml(None, overrides)


def test_the_settings_reach_the_watch():
    default = build_health(STAPOConfig.from_yaml(None, []))
    assert [m.name for m in default.monitors] == list(BUILTIN_MONITORS)
    assert (default.window, default.warmup, default.patience, default.keep_healthy) == (50, 10, 3, 1)
    cfg = STAPOConfig.from_yaml(None, ["health.monitors=[grad_norm, entropy_collapse]", "health.window=20",
                                       "health.warmup=5", "health.patience=2", "health.keep_healthy=3",
                                       "health.params={grad_norm: {z: 8}}"])
    watch = build_health(cfg)
    assert [(m.name, m.threshold) for m in watch.monitors] == [("grad_norm", 8.0), ("entropy_collapse", 0.5)]
    assert (watch.window, watch.warmup, watch.patience, watch.keep_healthy) == (20, 5, 2, 3)
    assert watch.reads == ["entropy_mean", "grad_norm"]
    assert build_health(STAPOConfig.from_yaml(None, ["health.monitors=[]"])).monitors == []
