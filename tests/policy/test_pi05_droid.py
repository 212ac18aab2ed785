"""experiment=pi05_droid: openpi's choices for fine-tuning pi0.5 on DROID in LeRobot format, and the
recipe run end to end at pi0.5's tiny size from a LeRobot checkpoint directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slurmvla.compose import compose
from slurmvla.inference.load import load_exported
from slurmvla.trainer import Trainer

pytest.importorskip("transformers")
from tests.policy.test_pi0_parity import GOLDEN, lerobot_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# openpi's TrainConfig "pi05_droid_finetune" and the defaults it leaves in place, transcribed from
# Physical-Intelligence/openpi (15a9616): src/openpi/training/config.py (TrainConfig: ema_decay 0.99,
# LeRobotDROIDDataConfig, DroidInputs / DroidOutputs), src/openpi/training/optimizer.py
# (CosineDecaySchedule: warmup 1000, peak 2.5e-5, decay_steps 30000, decay_lr 2.5e-6; AdamW: b1 0.9,
# b2 0.95, eps 1e-8, weight_decay 1e-10, clip_gradient_norm 1.0), src/openpi/models/pi0_config.py
# (max_token_len 200 for pi05, discrete_state_input), src/openpi/models/model.py (preprocess_observation
# augments every training image).
OPENPI = {"batch_size": 32, "num_train_steps": 20_000, "action_horizon": 16, "action_dim": 32, "max_token_len": 200,
          "ema_decay": 0.99, "warmup_steps": 1_000, "peak_lr": 2.5e-5, "decay_steps": 30_000, "decay_lr": 2.5e-6,
          "b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": 1e-10, "clip_gradient_norm": 1.0, "save_interval": 1_000}


def test_pi05_droid_makes_openpis_choices():
    cfg = compose(["experiment=pi05_droid", "data.root=/d", "policy.pretrained_path=/ckpt"])
    p, t, o, s = cfg.policy, cfg.trainer, cfg.optim, cfg.scheduler
    assert (p.name, p.size, p.state_input, p.state_normalization, p.action_normalization, p.stats_source) == \
        ("pi05", "pi05", "discrete", "quantile", "quantile", "checkpoint")
    assert (p.action_horizon, p.max_action_dim, p.max_text_len) == \
        (OPENPI["action_horizon"], OPENPI["action_dim"], OPENPI["max_token_len"])
    assert list(cfg.data.cameras) == ["observation.images.exterior_1_left", "observation.images.wrist_left"]
    assert list(cfg.data.action_keys) == ["action.joint_velocity", "action.gripper_position"]
    assert cfg.data.augment == "openpi" and cfg.data.augment_wrist_cameras is None  # openpi's rule: "wrist" in the key
    assert (t.global_batch_size, t.max_steps, t.ema_decay, t.max_grad_norm) == \
        (OPENPI["batch_size"], OPENPI["num_train_steps"], OPENPI["ema_decay"], OPENPI["clip_gradient_norm"])
    assert (o.lr, tuple(o.betas), o.eps, o.weight_decay) == \
        (OPENPI["peak_lr"], (OPENPI["b1"], OPENPI["b2"]), OPENPI["eps"], OPENPI["weight_decay"])
    assert (s.name, s.warmup_steps, s.decay_steps) == ("cosine", OPENPI["warmup_steps"], OPENPI["decay_steps"])
    assert o.lr * s.min_lr_ratio == pytest.approx(OPENPI["decay_lr"])
    assert (cfg.precision, cfg.checkpoint.every_steps) == ("bf16", OPENPI["save_interval"])
    assert list(cfg.serve.cameras) == ["observation/exterior_image_1_left", "observation/wrist_image_left"]
    with pytest.raises(ValueError, match="policy.stats_source=checkpoint reads the statistics saved beside"):
        compose(["experiment=pi05_droid", "data.root=/d"])


def test_pi05_droid_trains_from_a_lerobot_checkpoint_and_exports_its_average(sample_root, tmp_path):
    source = lerobot_checkpoint("pi05", tmp_path / "pi05_droid")
    cfg = compose(["experiment=pi05_droid", "policy=pi05_tiny", f"policy.pretrained_path={source}",
                   f"policy.tokenizer_path={GOLDEN / 'tokenizer'}", f"data.root={sample_root}", "data.num_workers=0",
                   "engine=single", "trainer.max_steps=4", "trainer.global_batch_size=4", "checkpoint.every_steps=4",
                   "trainer.val_every_steps=0", "trainer.log_every_steps=2", "trainer.progress_bar=false",
                   "scheduler.warmup_steps=1", "scheduler.decay_steps=8", "optim.lr=1e-3", "trainer.ema_decay=0.5",
                   "logging.wandb.mode=disabled"])
    trainer = Trainer(cfg, tmp_path / "run")
    start = trainer.engine.model_state_dict()
    try:
        trainer.fit()
    finally:
        trainer.close()
    # The checkpoint's quantile statistics, not the data's, normalize the DROID-style actions.
    stats = load_file(str(source / "policy_preprocessor_step_3_normalizer_processor.safetensors"))
    q01, q99 = stats["action.q01"].double(), stats["action.q99"].double()
    assert torch.allclose(start["action_offset"].double(), (q01 + q99) / 2, rtol=1e-6)
    assert torch.allclose(start["action_scale"].double(), (q99 - q01) / 2, rtol=1e-6)
    out = tmp_path / "ema.safetensors"
    subprocess.run([sys.executable, "-m", "slurmvla.export", str(tmp_path / "run"), str(out), "--ema"], check=True,
                   cwd=REPO, capture_output=True)
    loaded = load_exported(out)
    weights = load_file(str(tmp_path / "run" / "checkpoints" / "step_00000004" / "model.safetensors"))
    average = loaded.policy.state_dict()
    moved = [k for k in weights if not torch.equal(weights[k], start[k])]
    assert moved and all(not torch.equal(average[k], weights[k]) for k in moved)
    chunk = loaded.policy.sample_actions({"images": torch.zeros(1, 2, 48, 80, 3, dtype=torch.uint8),
                                          "image_mask": torch.ones(1, 2, dtype=torch.bool), "state": torch.zeros(1, 8),
                                          "instruction": ["pick up the cup"]})
    assert chunk.shape == (1, 16, 8) and torch.isfinite(chunk).all()
