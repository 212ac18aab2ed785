"""Pretrained weights and tokenizers for pi0 / pi0.5, from local files only.

Two layouts load, through one explicit name table each (:data:`PALIGEMMA_NAMES`,
:data:`LEROBOT_NAMES`; regular expressions over the file's keys -> the policy's keys):

- a Hugging Face PaliGemma directory (``config.json``, ``model.safetensors`` or its shards with
  ``model.safetensors.index.json``, tokenizer files): the backbone (SigLIP, projector, Gemma)
  starts from it; the action expert and action heads start fresh;
- a pi0 / pi0.5 checkpoint saved by LeRobot (``model.safetensors`` whose keys start with
  ``model.paligemma_with_expert.``): everything but the normalization statistics (those come from
  the data, as for every policy) and, for pi0.5, the state projection (LeRobot's pi0.5 writes the
  state as text tokens; this one projects it, so that projection starts fresh).

A key a table maps to ``None`` is known and deliberately unused (PaliGemma's LM head and final
norm, SigLIP's pooling head, the last layer's prefix-output weights). Anything else that does not
fit -- an unknown key, a missing key, a shape that differs -- fails at start-up naming the file and
the first offending keys.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from slurmvla.config import PolicyConfig
from slurmvla.engine.materialize import copy_full_into
from slurmvla.policy.tokenizer import VOCAB_SIZE, ByteTokenizer

_VISION = r"(?:model\.)?vision_tower\.(?:vision_model\.)?"
_LM = r"(?:model\.language_model\.|language_model\.(?:model\.)?)"
# PaliGemma as transformers saves it (legacy names: language_model.model.*, vision_tower.*) or holds
# it in memory (model.language_model.*, model.vision_tower.*), and the hub's vision_tower.vision_model.*.
PALIGEMMA_NAMES: tuple[tuple[str, str | None], ...] = (
    (rf"^{_VISION}embeddings\.(.*)$", r"vision.embeddings.\1"),
    (rf"^{_VISION}encoder\.layers\.(\d+)\.(.*)$", r"vision.layers.\1.\2"),
    (rf"^{_VISION}post_layernorm\.(.*)$", r"vision.post_layernorm.\1"),
    (rf"^{_VISION}head\..*$", None),  # SigLIP's pooling head: PaliGemma does not use it
    (r"^(?:model\.)?multi_modal_projector\.linear\.(.*)$", r"projector.\1"),
    (rf"^{_LM}embed_tokens\.(.*)$", r"embed_tokens.\1"),
    (rf"^{_LM}layers\.(\d+)\.(.*)$", r"layers.\1.backbone.\2"),
    (rf"^{_LM}norm\..*$", None),  # the backbone's final norm: only its LM head reads it
    # Tied to embed_tokens: read only when the file has no embed_tokens (some savers keep just one).
    (r"^(?:language_model\.)?lm_head\.(.*)$", r"tied:embed_tokens.\1"),
)
# LeRobot's PI0Policy / PI05Policy state dict (lerobot/policies/pi0/modeling_pi0.py,
# pi05/modeling_pi05.py): PI0Pytorch under "model.", PaliGemma under paligemma_with_expert.paligemma,
# the expert a GemmaForCausalLM under paligemma_with_expert.gemma_expert.
_LR = r"^(?:model\.)?paligemma_with_expert\."
LEROBOT_NAMES: tuple[tuple[str, str | None], ...] = (
    *((rf"{_LR}paligemma\.{pattern[1:]}", target) for pattern, target in PALIGEMMA_NAMES),
    (rf"{_LR}gemma_expert\.model\.layers\.(\d+)\.(.*)$", r"layers.\1.expert.\2"),
    (rf"{_LR}gemma_expert\.model\.norm\.(.*)$", r"expert_norm.\1"),
    (rf"{_LR}gemma_expert\.(?:lm_head|model\.embed_tokens)\..*$", None),
    (r"^(?:model\.)?(action_in_proj|action_out_proj|state_proj|action_time_mlp_in|action_time_mlp_out|time_mlp_in|"
     r"time_mlp_out)\.(.*)$", r"\1.\2"),
)
# LeRobot pads state and actions with zeros to max_state_dim / max_action_dim (32): its heads are
# wider than a policy built for the data's dims. Running them on zero-padded inputs and dropping the
# padded outputs is the same as keeping the first rows / columns: (key, dim, which size).
PADDED_HEADS = {"action_in_proj.weight": (1, "action"), "action_out_proj.weight": (0, "action"),
                "action_out_proj.bias": (0, "action"), "state_proj.weight": (1, "state")}
# Policy keys a pretrained file may hold but the policy does not have: the last layer's prefix
# output (see slurmvla.policy.pi0.JointLayer).
_UNUSED_IN_POLICY = re.compile(r"^layers\.\d+\.backbone\.(self_attn\.[qo]_proj|mlp\.|post_attention_layernorm)")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def _rename(key: str, table) -> tuple[bool, str | None]:
    for pattern, target in table:
        m = re.match(pattern, key)
        if m:
            return True, None if target is None else m.expand(target)
    return False, None


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).exists()]
        if missing:
            raise ValueError(f"policy.pretrained_path={str(path)!r}: {index.name} names shards that are not there: "
                             f"{missing[:5]}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise ValueError(f"policy.pretrained_path={str(path)!r} holds no model.safetensors (or "
                     "model.safetensors.index.json with its shards): give a Hugging Face PaliGemma directory or a "
                     "LeRobot pi0 / pi0.5 checkpoint directory")


def read_pretrained(path: str | Path) -> tuple[str, dict[str, torch.Tensor], list[Path]]:
    """``(layout, tensors under the policy's names, files read)``; layout is ``"paligemma"`` or
    ``"lerobot"``."""
    from safetensors import safe_open

    root = Path(path).expanduser()
    if not root.exists():
        raise ValueError(f"policy.pretrained_path={str(path)!r} does not exist")
    files = _safetensors_files(root)
    keys: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), "pt") as handle:
                keys.update({k: f for k in handle.keys()})  # noqa: SIM118 (safe_open has no __iter__)
        except Exception as e:  # a truncated or foreign file
            raise ValueError(f"policy.pretrained_path: cannot read {f} as safetensors ({e})") from None
    layout = "lerobot" if any("paligemma_with_expert." in k for k in keys) else "paligemma"
    table = LEROBOT_NAMES if layout == "lerobot" else PALIGEMMA_NAMES
    renamed, unknown = {}, []
    for key, f in keys.items():
        known, target = _rename(key, table)
        if not known:
            unknown.append(f"{key} ({f.name})")
        elif target is not None:
            renamed[target] = (key, f)
    if unknown:
        raise ValueError(f"policy.pretrained_path={str(path)!r}: {len(unknown)} key(s) fit no entry of the {layout} "
                         f"name table (slurmvla/policy/pretrained.py), first: {unknown[:5]}")
    for target in [t for t in renamed if t.startswith("tied:")]:
        source = renamed.pop(target)
        renamed.setdefault(target[len("tied:"):], source)
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for target, (key, f) in renamed.items():
        by_file.setdefault(f, []).append((target, key))
    for f, pairs in by_file.items():
        with safe_open(str(f), "pt") as handle:
            for target, key in pairs:
                tensors[target] = handle.get_tensor(key)
    return layout, tensors, files


def load_pretrained(policy: nn.Module, path: str | Path) -> str:
    """Copy a pretrained file's weights into ``policy`` (on its current device and dtype); returns
    the layout read. Fails naming the file and the first mismatched keys."""
    layout, tensors, files = read_pretrained(path)
    where = ", ".join(str(f) for f in files[:3]) + (" ..." if len(files) > 3 else "")
    own = dict(policy.named_parameters())
    tensors = {k: v for k, v in tensors.items() if k in own or not _UNUSED_IN_POLICY.match(k)}
    unexpected = sorted(set(tensors) - set(own))
    if unexpected:
        raise ValueError(f"{where}: {len(unexpected)} tensor(s) have no place in policy={policy.cfg.name} "
                         f"(size {policy.cfg.size}), first: {unexpected[:5]}")
    def backbone(k: str) -> bool:
        return k.startswith(("vision.", "projector.", "embed_tokens.")) or ".backbone." in k

    fresh = getattr(policy, "FRESH_FROM_LEROBOT", ())  # parts LeRobot's model does not have
    required = [k for k in own if (layout == "lerobot" and not k.startswith(fresh)) or backbone(k)]
    missing = [k for k in required if k not in tensors]
    if missing:
        raise ValueError(f"{where}: {len(missing)} tensor(s) policy={policy.cfg.name} needs are missing from the "
                         f"{layout} checkpoint, first: {missing[:5]}")
    if layout == "lerobot":
        for k, (dim, _) in PADDED_HEADS.items():
            if k in tensors and k in own and tensors[k].ndim == own[k].ndim \
                    and tensors[k].shape[dim] > own[k].shape[dim]:
                tensors[k] = tensors[k].narrow(dim, 0, own[k].shape[dim])
    wrong = [f"{k}: file {tuple(v.shape)} vs policy {tuple(own[k].shape)}" for k, v in tensors.items()
             if tuple(v.shape) != tuple(own[k].shape)]
    if wrong:
        raise ValueError(f"{where}: {len(wrong)} shape(s) differ from policy={policy.cfg.name} (size "
                         f"{policy.cfg.size}; check policy.width / depth / heads / vocab_size), first: {wrong[:5]}")
    for k, v in tensors.items():
        copy_full_into(own[k], v)  # a sharded parameter takes this rank's part
    return layout


def lerobot_state_dict(policy: nn.Module) -> dict[str, torch.Tensor]:
    """The policy's weights under LeRobot's names (the inverse of :data:`LEROBOT_NAMES`; for tests
    and for handing a fine-tuned policy to LeRobot)."""
    prefix = "model.paligemma_with_expert."
    out = {}
    for name, p in policy.named_parameters():
        if name.startswith("vision."):
            rest = name[len("vision."):]
            rest = re.sub(r"^layers\.", "encoder.layers.", rest)
            key = f"{prefix}paligemma.model.vision_tower.{rest}"
        elif name.startswith("projector."):
            key = f"{prefix}paligemma.model.multi_modal_projector.linear.{name[len('projector.'):]}"
        elif name.startswith("embed_tokens."):
            key = f"{prefix}paligemma.model.language_model.{name}"
        elif m := re.match(r"^layers\.(\d+)\.backbone\.(.*)$", name):
            key = f"{prefix}paligemma.model.language_model.layers.{m[1]}.{m[2]}"
        elif m := re.match(r"^layers\.(\d+)\.expert\.(.*)$", name):
            key = f"{prefix}gemma_expert.model.layers.{m[1]}.{m[2]}"
        elif name.startswith("expert_norm."):
            key = f"{prefix}gemma_expert.model.norm.{name[len('expert_norm.'):]}"
        else:
            key = f"model.{name}"
        out[key] = p.detach().clone().contiguous()
    return out


# -- tokenizer --------------------------------------------------------------------------------------


def _tokenizer_dir(cfg: PolicyConfig) -> Path | None:
    if cfg.tokenizer_path:
        path = Path(cfg.tokenizer_path).expanduser()
        if not any((path / f).exists() for f in TOKENIZER_FILES):
            raise ValueError(f"policy.tokenizer_path={cfg.tokenizer_path!r} holds none of {list(TOKENIZER_FILES)}")
        return path
    if cfg.pretrained_path:
        path = Path(cfg.pretrained_path).expanduser()
        if path.is_dir() and any((path / f).exists() for f in TOKENIZER_FILES):
            return path
        raise ValueError(f"policy.pretrained_path={cfg.pretrained_path!r} holds no tokenizer ({list(TOKENIZER_FILES)}): "
                         "set policy.tokenizer_path to the PaliGemma directory whose tokenizer the weights were "
                         "trained with")
    return None


@dataclass(frozen=True)
class PaliGemmaTokenizer:
    """A Hugging Face tokenizer from a local directory, at a fixed length, as openpi prompts pi0:
    ``<bos> instruction \\n``, padded on the right. Picklable (it loads lazily in each worker)."""

    path: str
    max_len: int

    def _load(self):
        cache = _LOADED.get(self.path)
        if cache is None:
            from transformers import AutoTokenizer

            cache = _LOADED[self.path] = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        return cache

    def vocab_size(self) -> int:
        return len(self._load())

    def __call__(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        tok = self._load()
        text = text.strip().replace("_", " ")
        ids = tok(text + "\n", add_special_tokens=False)["input_ids"]
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        ids = (bos + ids)[: self.max_len]
        out = torch.full((self.max_len,), tok.pad_token_id or 0, dtype=torch.long)
        out[: len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask = torch.zeros(self.max_len, dtype=torch.bool)
        mask[: len(ids)] = True
        return out, mask


_LOADED: dict[str, object] = {}


def tokenizer_for(cfg: PolicyConfig):
    """The pretrained directory's tokenizer, or the byte tokenizer for a randomly initialised policy."""
    path = _tokenizer_dir(cfg)
    if path is None:
        if cfg.vocab_size < VOCAB_SIZE:
            raise ValueError(f"policy.vocab_size={cfg.vocab_size} is below the byte tokenizer's {VOCAB_SIZE} ids "
                             "(used when no policy.pretrained_path / tokenizer_path is set)")
        return ByteTokenizer(cfg.max_text_len)
    tok = PaliGemmaTokenizer(str(path), cfg.max_text_len)
    if tok.vocab_size() > cfg.vocab_size:
        raise ValueError(f"the tokenizer in {path} has {tok.vocab_size()} ids, more than policy.vocab_size="
                         f"{cfg.vocab_size}")
    return tok
