"""The divergence guard's rule (train/divergence.py, docs/recipes.md): the median of the last
`window` log steps far above the lowest such median so far, or a loss that is not a number;
warn only warns, once; off checks only NaN."""
from __future__ import annotations

import logging
import math

import pytest

from llama_fsdp.config.schema import DivergenceConfig
from llama_fsdp.train.divergence import Diverged, DivergenceGuard, report


def _feed(guard, losses, start=1):
    for i, loss in enumerate(losses, start):
        guard.observe(i, loss, lr=1e-3)


def test_a_median_far_above_its_lowest_stops():
    g = DivergenceGuard(DivergenceConfig())
    _feed(g, [6.4, 4.0, 2.0, 1.5])
    g.observe(5, 3.1)  # 2.07x the lowest loss and 1.6 above it, but the median (2.0) is not
    assert g.suspect  # (a step above the line is not saved)
    with pytest.raises(Diverged) as e:
        g.observe(6, 3.2, lr=0.5)  # the median of 1.5, 3.1, 3.2: 3.1
    assert (e.value.step, e.value.best, e.value.lr) == (6, 2.0, 0.5)  # the lowest median
    assert [s for s, _ in e.value.recent] == [1, 2, 3, 4, 5, 6]
    assert "the median of the last 3 log steps' losses, 3.1, is 1.55x the lowest so far " \
        "(2) and 1.1 above it" in str(e.value)


@pytest.mark.parametrize("losses", [
    [1.2, 3.0, 1.3],  # one bad batch (2.5x, 1.8 above): back below the line at the next
    [1.2, 1.9, 1.3],  # 1.58x but 0.7 above: under the rise
    [2.0, 1.9, 0.56, 1.9, 2.0],  # one easy batch: the median never takes it for the best
    [1.2, 1.7, 1.75],  # 1.46x: under the ratio
    [0.3, 0.8, 0.9],  # 3x, but 0.6 above: under the rise (a small loss's noise)
    [6.4, 6.5, 8.0],  # the first steps' rise: 1.25x
])
def test_noise_and_one_bad_batch_are_not_divergence(losses):
    g = DivergenceGuard(DivergenceConfig())
    _feed(g, losses)  # (raises Diverged if it stopped)
    medians = [sorted(losses[max(0, i - 2):i + 1])[(min(i, 2)) // 2] for i in range(len(losses))]
    assert not g.suspect and g.best == min(medians)


def test_a_loss_that_is_not_a_number_stops_at_once_whatever_the_action():
    for action in ("stop", "warn", "off"):
        g = DivergenceGuard(DivergenceConfig(action=action))
        _feed(g, [6.4, 3.0])
        with pytest.raises(Diverged, match=r"diverged at step 3 \(the loss is nan\)"):
            g.observe(3, math.nan)
    with pytest.raises(Diverged, match="the loss is inf"):
        DivergenceGuard(DivergenceConfig()).observe(1, math.inf)


def test_warn_warns_once_and_trains_on(caplog):
    g = DivergenceGuard(DivergenceConfig(action="warn"))
    with caplog.at_level(logging.WARNING, logger="llama_fsdp.train.divergence"):
        _feed(g, [2.0, 1.0, 5.0, 6.0, 7.0, 8.0])
    # (step 3: the median of 2, 1, 5 is 2, twice the lowest median, 1, and 1 above it)
    assert caplog.text.count("the loss diverged at step") == 1
    assert "the loss diverged at step 3" in caplog.text
    assert "train.divergence.action=warn: training on" in caplog.text
    off = DivergenceGuard(DivergenceConfig(action="off"))
    _feed(off, [2.0, 1.0, 50.0, 60.0])
    assert not off.suspect


def test_the_thresholds_are_configurable():
    g = DivergenceGuard(DivergenceConfig(ratio=1.1, min_rise=0.05, window=1))
    _feed(g, [2.0, 1.0])
    with pytest.raises(Diverged):
        g.observe(3, 1.2)


def test_the_report_says_the_lr_against_the_recipe_the_checkpoint_and_the_fix():
    err = Diverged(7, [(6, 9.0), (7, 12.0)], 1.5, "why", lr=2.5)
    given = report(err, peak_lr=3.0, source="train.lr", recipe_lr=3e-3,
                   last_good="step_000005 (resume=auto continues from it)").splitlines()
    assert given[1] == "learning rate at step 7: 2.5 (peak 3, train.lr; the recipe's is 0.003)"
    assert given[2] == "last good checkpoint: step_000005 (resume=auto continues from it)"
    assert given[3].startswith("fix: lower the learning rate, e.g. train.lr=0.003 (the "
                               "recipe's: or drop the override)")
    own = report(err, peak_lr=3e-4, source="recipe: 8b lora sft", recipe_lr=3e-4,
                 last_good=None).splitlines()
    assert own[1] == "learning rate at step 7: 2.5 (peak 0.0003, recipe: 8b lora sft)"
    assert own[2] == "no checkpoint was saved before it (save.every_steps)"
    assert "e.g. train.lr=3e-05" in own[3]


def test_bad_thresholds_are_refused_before_launch_naming_the_key():
    from llama_fsdp.run.spec import ConfigError
    from tests.conftest import make_spec

    with pytest.raises(ConfigError) as e:
        make_spec(["train.divergence.action=maybe", "train.divergence.ratio=0.5",
                   "train.divergence.window=0", "train.divergence.min_rise=nan"])
    assert e.value.problems == [
        "train.divergence.ratio=0.5 must be > 1",
        "train.divergence.min_rise=nan must be a finite number >= 0",
        "train.divergence.window=0 must be in [1, 1000]",
        "train.divergence.action='maybe' is not one of stop, warn, off"]


def test_a_resumed_guard_judges_by_the_checkpoints_history_with_the_configs_thresholds():
    """A checkpoint carries the guard's history (JSON, through DCP): the resumed run's first
    step is judged against the lowest median so far, with the thresholds the config sets now."""
    import json

    g = DivergenceGuard(DivergenceConfig())
    _feed(g, [6.4, 4.0, 2.0])
    back = DivergenceGuard(DivergenceConfig(ratio=3.0, window=5))
    back.load_state_dict(json.loads(json.dumps(g.state_dict())))
    assert back.best == 4.0 and list(back.recent) == [(1, 6.4), (2, 4.0), (3, 2.0)]
    assert back.recent.maxlen == 6 and back.cfg.ratio == 3.0
    back.observe(4, 9.0)  # 2.25x the lowest median (4.0): under the new ratio of 3
    assert not back.suspect
    back.observe(5, 13.0)  # 3.25x: above the line, not saved (a fresh history: best 9.0)
    assert back.suspect
    fresh = DivergenceGuard(DivergenceConfig())
    assert json.loads(json.dumps(fresh.state_dict()))["best"] == math.inf


def test_a_resume_says_each_changed_hyperparameter_in_one_line():
    from llama_fsdp.train.resume import changes, record
    from llama_fsdp.config.schema import TrainConfig

    t = TrainConfig(lr=3.0, warmup_steps=0, min_lr_ratio=0.1, weight_decay=0.0, beta1=0.9,
                    beta2=0.95, eps=1e-8, max_grad_norm=1.0)
    now = record(TrainConfig(**{**t.__dict__, "lr": 3e-4, "max_steps": 100,
                                "divergence": DivergenceConfig(ratio=2.0)}))
    assert changes(record(t), now) == [
        "resume: train.lr 3.0 -> 3.0e-04 (the config's value applies)",
        "resume: train.max_steps 60 -> 100 (the config's value applies)",
        "resume: train.divergence.ratio 1.5 -> 2.0 (the config's value applies)"]
    assert changes(record(t), record(t)) == []
    assert "the config's values apply" in changes(None, now)[0]
