"""Golden outputs of LeRobot 0.6.1's PI0Policy / PI05Policy at a tiny size (the test oracle).

Run in the reference environment (never slurmvla's):

    bash tests/reference/make_env.sh ../lerobot061
    ../lerobot061/bin/python tests/reference/generate_pi0_golden.py      # writes tests/golden/lerobot061/

What is patched in LeRobot, and nothing else: its size tables. ``get_gemma_config`` learns two tiny
variants, and PaliGemma's config, which LeRobot builds from transformers' defaults with the published
SigLIP / vocabulary sizes written in, gets tiny SigLIP sizes and a 320-id vocabulary before the model is
built. Every function that computes (image preprocessing, the processors, normalization, prompt
building, tokenization, embedding, attention, flow matching, sampling, loss) is LeRobot's own.

The weights are rebuilt from a seed by tests/reference/tiny_weights.py (numpy only), so slurmvla's suite
makes the same tensors without this environment; their checksum is recorded. The PaliGemma tokenizer
is replaced by a byte-level tokenizer written with the ``tokenizers`` library (committed beside the
golden files), because nothing can be downloaded here.

Outputs (tests/golden/lerobot061/):
  meta.json                      versions, sizes, seed, weight checksums, inputs that are strings
  tokenizer/                     the tokenizer both sides load
  {pi0,pi05}/state_dict.json     LeRobot's state-dict names and shapes, ties, and the keys its own
                                 save_pretrained writes (the layout an export must match)
  {pi0,pi05}/checkpoint/         LeRobot's config.json and saved processors (normalizer statistics);
                                 the suite adds model.safetensors from the seed
  {pi0,pi05}/golden.safetensors  inputs (raw uint8 frames, state, actions, noise, time, sampling noise)
                                 and outputs (pixels, prompt ids / mask, velocity, per-element loss,
                                 loss, sampled chunk normalized and in the data's units)
"""

from __future__ import annotations

import importlib.metadata as md
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from tiny_weights import fingerprint, tiny_state_dict  # noqa: E402

OUT = HERE.parent / "golden" / "lerobot061"
SEED = 1234
VOCAB = 320
# (width, depth, mlp_dim, num_heads, num_kv_heads, head_dim). LeRobot's joint attention reshapes to 8
# heads (a constant in its code, not a size table), so the tiny variants keep 8 heads.
TINY_GEMMA = {"gemma_tiny_backbone": (64, 2, 128, 8, 1, 8), "gemma_tiny_expert": (32, 2, 64, 8, 1, 8)}
TINY_SIGLIP = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
               "patch_size": 16}
IMAGE_SIZE = 64
HORIZON = 8
STATE_DIM = ACTION_DIM = 8
CAMERAS = ("observation.images.exterior_1_left", "observation.images.exterior_2_left",
           "observation.images.wrist_left")
RAW_H, RAW_W = 48, 80  # needs a resize with padding to 64 x 64
BATCH = 2
TASKS = ["pick_up the red block", "  put the cup\nin the sink  "]


def patch_sizes(modeling) -> None:
    GemmaConfig = modeling.GemmaConfig
    original = modeling.get_gemma_config

    def get_gemma_config(variant):
        if variant in TINY_GEMMA:
            return GemmaConfig(*TINY_GEMMA[variant])
        return original(variant)

    modeling.get_gemma_config = get_gemma_config
    base = modeling.PaliGemmaForConditionalGenerationWithPiGemma

    class Tiny(base):
        def __init__(self, config):
            for k, v in TINY_SIGLIP.items():
                setattr(config.vision_config, k, v)
            config.vision_config.projection_dim = config.text_config.hidden_size
            config.text_config.vocab_size = VOCAB
            config._vocab_size = VOCAB
            config.image_token_index = VOCAB - 1
            super().__init__(config)

    modeling.PaliGemmaForConditionalGenerationWithPiGemma = Tiny
    expert_base = modeling.PiGemmaForCausalLM

    class TinyExpert(expert_base):
        def __init__(self, config, **kw):
            config.vocab_size = VOCAB
            super().__init__(config, **kw)

    modeling.PiGemmaForCausalLM = TinyExpert


def write_tokenizer(path: Path) -> None:
    """Byte-level: 4 specials + 256 bytes, <bos> added in front as PaliGemma's tokenizer does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(specials + sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.save_pretrained(str(path))


def build(kind: str, tokenizer_dir: Path):
    from lerobot.configs import FeatureType, PolicyFeature
    if kind == "pi0":
        from lerobot.policies.pi0 import modeling_pi0 as modeling
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as Config
        from lerobot.policies.pi0.processor_pi0 import make_pi0_pre_post_processors as make_processors
    else:
        from lerobot.policies.pi05 import modeling_pi05 as modeling
        from lerobot.policies.pi05.configuration_pi05 import PI05Config as Config
        from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors as make_processors
    patch_sizes(modeling)
    config = Config(
        paligemma_variant="gemma_2b", action_expert_variant="gemma_300m", chunk_size=HORIZON, n_action_steps=HORIZON,
        image_resolution=(IMAGE_SIZE, IMAGE_SIZE), device="cpu",
        input_features={**{c: PolicyFeature(type=FeatureType.VISUAL, shape=(3, RAW_H, RAW_W)) for c in CAMERAS},
                        "observation.state": PolicyFeature(type=FeatureType.STATE, shape=(STATE_DIM,))},
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION_DIM,))})
    # The variant names pass __post_init__'s check; the tiny sizes go in after it.
    config.paligemma_variant, config.action_expert_variant = "gemma_tiny_backbone", "gemma_tiny_expert"
    torch.manual_seed(0)
    policy = modeling.PI0Policy(config) if kind == "pi0" else modeling.PI05Policy(config)
    policy.eval()

    sd = policy.state_dict()
    ptr: dict[int, str] = {}
    ties = {}
    for k in sorted(sd, key=lambda k: ("lm_head" in k, k)):
        p = sd[k].data_ptr()
        if p in ptr:
            ties[k] = ptr[p]
        else:
            ptr[p] = k
    shapes = {k: list(v.shape) for k, v in sd.items()}
    tensors = tiny_state_dict(shapes, ties, SEED)
    missing, unexpected = policy.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=True)
    assert not missing and not unexpected

    stats = {
        "observation.state": _stats(STATE_DIM, 1),
        "action": _stats(ACTION_DIM, 2),
    }
    import transformers
    real = transformers.AutoTokenizer.from_pretrained

    def local_tokenizer(name, *a, **kw):  # LeRobot names the hub's PaliGemma tokenizer
        return real(str(tokenizer_dir), *a, **kw)

    transformers.AutoTokenizer.from_pretrained = local_tokenizer
    try:
        pre, post = make_processors(config, dataset_stats=stats)
    finally:
        transformers.AutoTokenizer.from_pretrained = real
    return policy, pre, post, tensors, shapes, ties, stats


def _stats(dim: int, salt: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(100 + salt)
    mean = rng.normal(0, 0.5, dim)
    std = rng.uniform(0.2, 1.5, dim)
    q01 = mean - 2.2 * std
    q99 = mean + 2.4 * std
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in
            {"mean": mean, "std": std, "q01": q01, "q99": q99, "min": q01 - std, "max": q99 + std}.items()}


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 1)
    frames = torch.randint(0, 256, (BATCH, 2, RAW_H, RAW_W, 3), generator=g, dtype=torch.uint8)  # 2 present cameras
    state = torch.randn(BATCH, STATE_DIM, generator=g) * 0.8
    state[0, 0] = 25.0  # beyond q99: its bin clips at the top
    actions = torch.randn(BATCH, HORIZON, ACTION_DIM, generator=g)
    return {
        "frames": frames, "state": state, "actions": actions,
        "noise": torch.randn(BATCH, HORIZON, 32, generator=g),
        "time": torch.tensor([0.23, 0.91]),
        "sample_noise": torch.randn(BATCH, HORIZON, 32, generator=g),
    }


def lerobot_batch(x: dict) -> dict:
    batch = {CAMERAS[c]: x["frames"][:, c].permute(0, 3, 1, 2).float() / 255.0 for c in range(2)}
    batch["observation.state"] = x["state"].clone()
    batch["action"] = x["actions"].clone()
    batch["task"] = list(TASKS)
    return batch


def run(kind: str, tokenizer_dir: Path) -> dict:
    from safetensors.torch import save_file

    policy, pre, post, tensors, shapes, ties, stats = build(kind, tokenizer_dir)
    x = inputs()
    model = policy.model
    out: dict[str, torch.Tensor] = {k: v.contiguous() for k, v in x.items()}

    # Training forward: LeRobot's own noise / time draws replaced by the fixed ones.
    model.sample_noise = lambda shape, device: x["noise"].clone()
    model.sample_time = lambda bsize, device: x["time"].clone()
    seen = {}
    def keep_velocity(module, args, output):  # returns None: the output itself is left alone
        seen.setdefault("velocity", output.detach().clone())

    model.action_out_proj.register_forward_hook(keep_velocity)
    inner = model.forward

    def forward(*a, **kw):
        losses = inner(*a, **kw)
        seen["losses"] = losses.detach().clone()
        return losses

    model.forward = forward
    images_seen = {}
    preprocess = policy._preprocess_images

    def preprocess_images(batch):
        images, masks = preprocess(batch)
        images_seen["pixels"] = torch.stack(images[:2], dim=1).detach().clone()
        images_seen["masks"] = torch.stack(masks, dim=1).clone()
        return images, masks

    policy._preprocess_images = preprocess_images
    processed = pre(lerobot_batch(x))
    loss, _ = policy.forward(processed)
    out["velocity"] = seen["velocity"]
    out["losses"] = seen["losses"]
    out["loss"] = loss.detach().reshape(1)
    out["pixels"] = images_seen["pixels"]
    out["image_masks"] = images_seen["masks"]
    out["prompt_ids"] = processed["observation.language.tokens"].long()
    out["prompt_mask"] = processed["observation.language.attention_mask"].bool()
    out["normalized_state"] = processed["observation.state"].float()
    out["normalized_actions"] = processed["action"].float()

    # Sampling: LeRobot's predict_action_chunk with the fixed sampling noise, then its postprocessor.
    model.sample_noise = lambda shape, device: x["sample_noise"].clone()
    seen.clear()
    chunk = policy.predict_action_chunk({k: v for k, v in processed.items() if k != "action"})
    out["chunk_normalized"] = chunk.detach().clone()
    out["chunk"] = post(chunk).detach().clone()

    d = OUT / kind
    if d.exists():
        shutil.rmtree(d)
    (d / "checkpoint").mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(d / "golden.safetensors"),
              metadata={"made_by": f"lerobot {md.version('lerobot')}, torch {md.version('torch')}, "
                                   f"transformers {md.version('transformers')}", "policy": kind})
    # LeRobot's own checkpoint directory; its model.safetensors tells which keys its writer keeps.
    full = OUT / f"_{kind}_full"
    policy.save_pretrained(str(full))
    pre.save_pretrained(str(full))
    post.save_pretrained(str(full))
    from safetensors import safe_open
    with safe_open(str(full / "model.safetensors"), "pt") as f:
        saved_keys = sorted(f.keys())
    for p in full.iterdir():
        if p.name != "model.safetensors":
            shutil.copy(p, d / "checkpoint" / p.name)
    shutil.rmtree(full)
    (d / "state_dict.json").write_text(json.dumps(
        {"shapes": shapes, "ties": ties, "saved_keys": saved_keys}, indent=1, sort_keys=True) + "\n")
    return {"weights_fingerprint": fingerprint(tensors), "num_tensors": len(tensors),
            "parameters": int(sum(np.prod(s) for k, s in shapes.items() if k not in ties)),
            "loss": float(loss)}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    tok = OUT / "tokenizer"
    if tok.exists():
        shutil.rmtree(tok)
    write_tokenizer(tok)
    torch.set_num_threads(1)
    meta = {
        "made_by": {k: md.version(k) for k in ("lerobot", "torch", "transformers", "numpy", "tokenizers")},
        "python": sys.version.split()[0],
        "patched": "LeRobot's size tables only: get_gemma_config gains gemma_tiny_backbone / gemma_tiny_expert "
                   f"{TINY_GEMMA}; PaliGemma's vision config {TINY_SIGLIP} with projection_dim = backbone width "
                   f"and vocabulary {VOCAB} (LeRobot writes the published sizes into PaliGemma's config)",
        "seed": SEED, "image_size": IMAGE_SIZE, "raw_frame": [RAW_H, RAW_W], "horizon": HORIZON,
        "state_dim": STATE_DIM, "action_dim": ACTION_DIM, "cameras": list(CAMERAS), "present_cameras": 2,
        "tasks": TASKS, "vocab_size": VOCAB, "tiny_gemma": TINY_GEMMA, "tiny_siglip": TINY_SIGLIP,
    }
    for kind in ("pi0", "pi05"):
        meta[kind] = run(kind, tok)
        print(kind, meta[kind])
    (OUT / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
