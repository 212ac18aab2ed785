"""policy.gradient_checkpointing=auto: the least recomputation the planner predicts fits, judged against the
planner's own figures for each setting (computed here with plan_engine, not taken from the choice), a rule on
made-up peaks, a CPU run, and the error for a value that is none of true / false / auto.

The expected choices at pi0.5's published size (bf16, micro-batch 16) are what the planner predicts: on one H200
and on 8 x 80 GB under FSDP every activation fits (no recomputation); under ZeRO-3 the engine refuses activation
checkpointing; on one 80 GB H100 the choice is the cheapest setting whose peak is within the budget, the next
cheaper one over it.
"""

from __future__ import annotations

import logging

import pytest
import yaml

from slurmvla import plan
from slurmvla.compose import compose
from slurmvla.planner.fit import plan_engine, planner_for
from slurmvla.planner.gpus import GPUS, GiB
from slurmvla.planner.recompute_choice import (
    FULL,
    NONE,
    Setting,
    checkpointed_layers,
    choose,
    deepest_stack,
    matmuls,
)
from slurmvla.trainer import Trainer

# The plans of pi0.5 at its published size go to one worker, one after another: the planner of a policy
# configuration (its module tree on fake tensors, each measured pass) is kept for the next (planner_for).
PUBLISHED_PI05 = pytest.mark.xdist_group("pi05-published-plans")


PI05 = ["policy=pi05", "precision=bf16"]


def planned(cfg, setting: Setting, gpu: str, nodes: int = 1, gpus_per_node: int = 1) -> tuple[int, int]:
    """The planner's (peak, budget) of ``setting``, asked directly."""
    c = setting.apply(cfg)
    r = plan_engine(planner_for(c), c, GPUS[gpu], nodes, gpus_per_node, peak_only=True)
    return r["peak_bytes"], r["budget_bytes"]


def ladder(cfg) -> list[Setting]:
    """Every setting in order of cost: none, matmuls at each checkpoint_every from the deepest stack's depth
    down to 1, full."""
    return [NONE, *(matmuls(k) for k in range(deepest_stack(cfg), 0, -1)), FULL]


@pytest.mark.slow
@PUBLISHED_PI05
def test_one_h200_recomputes_nothing_at_the_published_size():
    cfg = compose([*PI05, "trainer.global_batch_size=16"])
    assert cfg.policy.gradient_checkpointing == "auto" and cfg.trainer.micro_batch_size(1) == 16
    choice = choose(cfg, GPUS["h200-141gb"])
    peak, budget = planned(cfg, NONE, "h200-141gb")
    assert peak <= budget
    assert choice.setting == NONE and choice.fits
    assert "fits" in choice.line() and "h200-141gb" in choice.line() and "allocator margin" in choice.line()


@pytest.mark.slow
@PUBLISHED_PI05
def test_eight_80gb_gpus_recompute_nothing_under_fsdp_and_zero3():
    for engine in ("fsdp_full", "zero3"):
        cfg = compose([*PI05, f"engine={engine}", "trainer.global_batch_size=128"])
        assert cfg.trainer.micro_batch_size(8) == 16
        choice = choose(cfg, GPUS["h100-80gb"], 1, 8)
        assert choice.setting == NONE, (engine, choice.line())
        if engine == "zero3":
            assert "refuses activation checkpointing" in choice.reason and not choice.peaks
        else:
            peak, budget = planned(cfg, NONE, "h100-80gb", 1, 8)
            assert peak <= budget and choice.peaks[NONE] == peak


@pytest.mark.slow
@PUBLISHED_PI05
def test_one_h100_gets_the_cheapest_setting_that_fits():
    cfg = compose([*PI05, "trainer.global_batch_size=16"])
    choice = choose(cfg, GPUS["h100-80gb"])
    settings = ladder(cfg)
    i = settings.index(choice.setting)
    peak, budget = planned(cfg, choice.setting, "h100-80gb")
    assert peak <= budget, choice.line()
    assert i > 0, "the planner predicts that pi0.5 keeping every activation at micro-batch 16 fits an 80 GB GPU"
    cheaper_peak, _ = planned(cfg, settings[i - 1], "h100-80gb")
    assert cheaper_peak > budget, (settings[i - 1], cheaper_peak / GiB, budget / GiB)
    assert planned(cfg, NONE, "h100-80gb")[0] > budget
    assert str(choice.setting) in choice.line() and f"{peak / GiB:.2f} GiB" in choice.line()


@pytest.mark.parametrize("budget_gib", [1, 10, 25, 39, 41, 45, 50, 52, 55, 60, 100])
def test_the_choice_is_the_first_setting_in_order_of_cost_that_fits(budget_gib):
    """Made-up peaks, falling as more is recomputed (a hand rule: 10 GiB of model states; activations 50 GiB kept
    whole, each checkpointed layer's share cut to 40 % with matmuls kept, none left with full recomputation): the
    choice is the first of the ladder under the budget, found by a plain scan here. The peaks are a line in the
    checkpointed layers, as the search's first probe assumes: at most two passes between the ladder's ends."""
    cfg = compose(["policy=pi05_tiny", "policy.depth=6", "policy.vision_depth=9"])
    layers = checkpointed_layers(cfg, 1)
    assert layers == 15 and [checkpointed_layers(cfg, k) for k in (2, 3, 4, 9)] == [8, 5, 5, 2]
    asked = []

    def peak(c) -> tuple[int, int]:
        p = c.policy
        asked.append(Setting.of(p))
        if not p.gradient_checkpointing:
            acts = 50
        elif p.checkpoint_saves == "matmuls":
            acts = 50 - 30 * checkpointed_layers(c, p.checkpoint_every) / layers
        else:
            acts = 0
        return int((10 + acts) * GiB), budget_gib * GiB

    choice = choose(cfg, GPUS["h100-80gb"], peak=peak)
    searched = len(asked)
    fitting = [s for s in ladder(cfg) if peak(s.apply(cfg))[0] <= budget_gib * GiB]
    assert choice.setting == (fitting[0] if fitting else FULL)
    assert choice.fits == bool(fitting)
    assert searched <= 5, asked[:searched]


def test_with_trainer_compile_the_choice_weighs_the_compiled_steps_activations(monkeypatch):
    """The plan's passes replaced by made-up peaks (5 GiB per sample kept by eager autograd, 2 GiB by the
    compiled step, 0.1 GiB recomputed): at micro-batch 16 on one 80 GB GPU keeping everything fits only as
    compiled, so trainer.compile=true recomputes nothing and trainer.compile=false does."""
    from slurmvla.planner import fit
    from slurmvla.planner.activations import Pass, ShapeStep

    def run(self, micro, compute, low, count_flops=False, checkpointing=None, cast_inputs=False, compiled=False,
            resident_grads=True):
        per = 0.1 if self.policy.gradient_checkpointing else 2 if compiled else 5
        return Pass(micro, int(per * GiB * micro), 1.0, 1.0, 0.0)

    monkeypatch.setattr(fit, "_LAST", {})
    monkeypatch.setattr(ShapeStep, "run", run)
    chosen = {}
    for compiled in (True, False):
        cfg = compose(["policy=pi05_tiny", "precision=bf16", "trainer.global_batch_size=16",
                       f"trainer.compile={str(compiled).lower()}"])
        chosen[compiled] = choose(cfg, GPUS["h100-80gb"])
    assert chosen[True].setting == NONE, chosen[True].line()
    assert chosen[False].setting != NONE, chosen[False].line()
    assert chosen[False].peaks[NONE] - chosen[True].peaks[NONE] == 3 * 16 * GiB


def test_no_gpu_and_refusing_engines_recompute_nothing_and_true_is_still_refused():
    cfg = compose(["policy=pi05_tiny"])
    assert choose(cfg, None).setting == NONE and "no GPU" in choose(cfg, None).line()
    assert compose(["policy=pi05", "engine=zero3"]).policy.gradient_checkpointing == "auto"
    with pytest.raises(ValueError, match="refused with engine='zero3'"):
        compose(["policy=pi05", "engine=zero3", "policy.gradient_checkpointing=true"])


def test_the_plan_shows_what_auto_chooses(capsys):
    plan.main(["policy=pi05_tiny", "policy.gradient_checkpointing=auto", "--gpu", "h100-80gb"])
    out = capsys.readouterr().out
    assert "gradient checkpointing off" in out and "FITS" in out
    assert "policy.gradient_checkpointing=auto -> none (policy.gradient_checkpointing=false): it fits" in out
    plan.main(["policy=pi05_tiny", "policy.gradient_checkpointing=auto", "engine=zero3", "--gpu", "h100-80gb",
               "--gpus-per-node", "2", "--compare"])
    out = capsys.readouterr().out
    assert "zero3: policy.gradient_checkpointing=auto -> none" in out and "refuses activation checkpointing" in out


def test_a_value_other_than_true_false_auto_is_one_clear_error():
    with pytest.raises(ValueError, match=r"policy.gradient_checkpointing='sometimes' is not valid; choose one of "
                                         r"\[true, false, auto\]"):
        compose(["policy.gradient_checkpointing=sometimes"])


def test_a_cpu_run_with_auto_trains_and_saves_a_concrete_setting(make_cfg, tmp_path, caplog):
    cfg = make_cfg("policy=pi05_tiny", "policy.gradient_checkpointing=auto", "trainer.max_steps=2",
                   "checkpoint.every_steps=0", "trainer.device=cpu")
    with caplog.at_level(logging.INFO, logger="slurmvla"):
        trainer = Trainer(cfg, tmp_path / "run")
        try:
            trainer.fit()
        finally:
            trainer.close()
    saved = yaml.safe_load((tmp_path / "run" / "config.resolved.yaml").read_text())["policy"]
    assert saved["gradient_checkpointing"] is False
    assert trainer.cfg.policy.gradient_checkpointing is False and trainer.policy.gradient_checkpointing is False
    said = [r.getMessage() for r in caplog.records if "gradient_checkpointing=auto" in r.getMessage()]
    assert len(said) == 1 and "no GPU" in said[0]


def test_the_planner_reads_the_policy_configs_typed_options():
    """The layer stacks, ``auto`` and the files a build reads come from the config's own accessors: the built-in
    shape names its stacks, a config without it none (one layer deep, none checkpointed); pi0's clears its files."""
    from slurmvla.config.policy import PolicyConfig
    from slurmvla.planner.model_states import shape_only

    cfg = compose(["policy=pi05_tiny", "policy.depth=6", "policy.vision_depth=9", "policy.gradient_checkpointing=auto"])
    assert cfg.policy.layer_stacks() == (6, 9) and deepest_stack(cfg) == 9 and cfg.policy.recompute_auto
    assert Setting.of(cfg.policy) is None and Setting.of(FULL.apply(cfg).policy) == FULL
    custom = compose(["policy=custom", "policy.target=tests.broken_policies.Sound"])
    assert type(custom.policy) is PolicyConfig and custom.policy.layer_stacks() == ()
    assert deepest_stack(custom) == 1 and checkpointed_layers(custom, 1) == 0 and shape_only(custom.policy) is custom.policy
    pi0 = compose(["policy=pi0_tiny", "policy.pretrained_path=weights", "policy.tokenizer_path=tokenizer",
                   "policy.stats_source=checkpoint"]).policy
    cleared = shape_only(pi0)
    assert (cleared.pretrained_path, cleared.tokenizer_path, cleared.stats_source) == (None, None, "data")
    assert (pi0.pretrained_path, pi0.stats_source) == ("weights", "checkpoint")
