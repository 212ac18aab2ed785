"""Pretrained weights and tokenizers for pi0 / pi0.5, from local files only.

Three layouts load, through one explicit name table each (:data:`PALIGEMMA_NAMES`,
:data:`LEROBOT_NAMES`; regular expressions over the file's keys -> the policy's keys):

- a Hugging Face PaliGemma directory (``config.json``, ``model.safetensors`` or its shards with
  ``model.safetensors.index.json``, tokenizer files): the backbone (SigLIP, projector, Gemma)
  starts from it; the action expert and action heads start fresh;
- a pi0 / pi0.5 checkpoint saved by LeRobot (``model.safetensors`` whose keys start with
  ``model.paligemma_with_expert.``): every weight, strictly (its normalization statistics are
  read by :mod:`slurmvla.policy.stats` when ``policy.stats_source=checkpoint``);
- openpi's own checkpoint directory (``params/``, an orbax parameter tree, and ``assets/<id>/norm_stats.json``):
  every weight, strictly, its tree mapped onto LeRobot's names first (:mod:`slurmvla.policy.pi0.openpi`,
  which needs the ``openpi`` extra) and then through :data:`LEROBOT_NAMES`.

A key a table maps to ``None`` is known and deliberately unused (PaliGemma's LM head and final
norm, SigLIP's pooling head, the last layer's prefix-output weights). Anything else that does not
fit -- an unknown key, a missing key, a shape that differs -- fails at start-up naming the file and
the first offending keys.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from slurmvla.config.policy import PolicyConfig
from slurmvla.parameters import base_parameters, copy_full_into
from slurmvla.policy.pi0 import openpi
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
# Policy keys a pretrained file may hold but the policy does not have: the last layer's prefix
# output (see slurmvla.policy.pi0.model.JointLayer).
_UNUSED_IN_POLICY = re.compile(r"^layers\.\d+\.backbone\.(self_attn\.[qo]_proj|mlp\.|post_attention_layernorm)")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
log = logging.getLogger(__name__)


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
                     "model.safetensors.index.json with its shards) and no openpi params/: give a Hugging Face "
                     "PaliGemma directory, a LeRobot pi0 / pi0.5 checkpoint directory or an openpi checkpoint "
                     "directory")


def check_pretrained_path(path: str | Path) -> list[Path]:
    """The weight files at ``policy.pretrained_path`` (none read), or the ValueError :func:`read_pretrained`
    would raise about the path only after the model is built."""
    root = Path(path).expanduser()
    if not root.exists():
        raise ValueError(f"policy.pretrained_path={str(path)!r} does not exist")
    if openpi.is_openpi_checkpoint(root):
        openpi.require_orbax(path)
        return [root / "params"]
    return _safetensors_files(root)


def _renamed(keys, table, path: str | Path, layout: str, label=str) -> dict[str, str]:
    """``{policy key: file key}`` for ``keys`` through ``table``; a key that fits no entry fails naming it
    (``label`` says where it is)."""
    renamed, unknown = {}, []
    for key in keys:
        known, target = _rename(key, table)
        if not known:
            unknown.append(label(key))
        elif target is not None:
            renamed[target] = key
    if unknown:
        raise ValueError(f"policy.pretrained_path={str(path)!r}: {len(unknown)} key(s) fit no entry of the {layout} "
                         f"name table (slurmvla/policy/pi0/weights.py), first: {unknown[:5]}")
    for target in [t for t in renamed if t.startswith("tied:")]:
        source = renamed.pop(target)
        renamed.setdefault(target[len("tied:"):], source)
    return renamed


def read_openpi(path: str | Path) -> dict[str, torch.Tensor]:
    """An openpi checkpoint directory's weights under LeRobot's names (``model.`` prefixed, as LeRobot saves
    them)."""
    root = Path(path).expanduser()
    flat = openpi.read_tree(root)
    mapped = openpi.lerobot_tensors(flat, str(root / "params"))
    return {f"model.{k}": torch.from_numpy(v) for k, v in mapped.items()}


def read_pretrained(path: str | Path) -> tuple[str, dict[str, torch.Tensor], list[Path]]:
    """``(layout, tensors under the policy's names, files read)``; layout is ``"paligemma"``, ``"lerobot"``
    or ``"openpi"``."""
    from safetensors import safe_open

    files = check_pretrained_path(path)
    if openpi.is_openpi_checkpoint(Path(path).expanduser()):
        lerobot = read_openpi(path)
        renamed = _renamed(lerobot, LEROBOT_NAMES, path, "openpi (mapped onto LeRobot's names)")
        return "openpi", {target: lerobot[key] for target, key in renamed.items()}, files
    keys: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), "pt") as handle:
                keys.update({k: f for k in handle.keys()})  # noqa: SIM118 (safe_open has no __iter__)
        except Exception as e:  # a truncated or foreign file
            raise ValueError(f"policy.pretrained_path: cannot read {f} as safetensors ({e})") from None
    layout = "lerobot" if any("paligemma_with_expert." in k for k in keys) else "paligemma"
    table = LEROBOT_NAMES if layout == "lerobot" else PALIGEMMA_NAMES
    renamed = _renamed(keys, table, path, layout, label=lambda k: f"{k} ({keys[k].name})")
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for target, key in renamed.items():
        by_file.setdefault(keys[key], []).append((target, key))
    for f, pairs in by_file.items():
        with safe_open(str(f), "pt") as handle:
            for target, key in pairs:
                tensors[target] = handle.get_tensor(key)
    return layout, tensors, files


def load_pretrained(policy: nn.Module, path: str | Path) -> str:
    """Copy a pretrained file's weights into ``policy`` (on its current device and dtype); returns
    the layout read. Strict: a tensor that fits no entry of the layout's name table, a tensor the
    policy needs and the file lacks, or a shape that differs fails naming the file and the first keys.
    Tensors the tables name as computing nothing the policy reads (PaliGemma's LM head and final
    norm, the last layer's prefix outputs, the expert's LM head) are logged; a PaliGemma directory
    has no action expert, so the expert and heads start fresh. ``policy.allow_partial_load=true``
    turns missing tensors into a warning that names them."""
    layout, tensors, files = read_pretrained(path)
    where = ", ".join(str(f) for f in files[:3]) + (" ..." if len(files) > 3 else "")
    own = base_parameters(policy)  # plain names: the same with or without low-rank adapters
    unused = sorted(k for k in tensors if k not in own and _UNUSED_IN_POLICY.match(k))
    tensors = {k: v for k, v in tensors.items() if k not in unused}
    unexpected = sorted(set(tensors) - set(own))
    if unexpected:
        raise ValueError(f"{where}: {len(unexpected)} tensor(s) have no place in policy={policy.cfg.name} "
                         f"(size {policy.cfg.size}), first: {unexpected[:5]}")

    def backbone(k: str) -> bool:
        return k.startswith(("vision.", "projector.", "embed_tokens.")) or ".backbone." in k

    required = [k for k in own if layout in ("lerobot", "openpi") or backbone(k)]
    missing = [k for k in required if k not in tensors]
    if missing and not policy.cfg.allow_partial_load:
        hint = (" (policy.state_input=continuous has a state projection that the published pi0.5 does not)"
                if any(k.startswith("state_proj.") for k in missing) else "")
        raise ValueError(f"{where}: {len(missing)} tensor(s) policy={policy.cfg.name} needs are missing from the "
                         f"{layout} checkpoint{hint}, first: {missing[:5]}; policy.allow_partial_load=true keeps "
                         "their random initialisation")
    if missing:
        log.warning("policy.allow_partial_load: %d tensor(s) keep their random initialisation: %s", len(missing),
                    missing)
    wrong = [f"{k}: file {tuple(v.shape)} vs policy {tuple(own[k].shape)}" for k, v in tensors.items()
             if tuple(v.shape) != tuple(own[k].shape)]
    if wrong:
        raise ValueError(f"{where}: {len(wrong)} shape(s) differ from policy={policy.cfg.name} (size "
                         f"{policy.cfg.size}; check policy.width / depth / heads / vocab_size / max_action_dim / "
                         f"max_state_dim), first: {wrong[:5]}")
    for k, v in tensors.items():
        copy_full_into(own[k], v)  # a sharded parameter takes this rank's part
    log.info("loaded %d tensors from %s (%s layout); %d computing nothing the policy reads were left out "
             "(kept by export: it re-reads them from this file)", len(tensors), where, layout, len(unused))
    return layout


def _lerobot_name(name: str) -> str:
    prefix = "model.paligemma_with_expert."
    if name.startswith("vision."):
        rest = re.sub(r"^layers\.", "encoder.layers.", name[len("vision."):])
        return f"{prefix}paligemma.model.vision_tower.vision_model.{rest}"
    if name.startswith("projector."):
        return f"{prefix}paligemma.model.multi_modal_projector.linear.{name[len('projector.'):]}"
    if name.startswith("embed_tokens."):
        return f"{prefix}paligemma.model.language_model.{name}"
    if m := re.match(r"^layers\.(\d+)\.backbone\.(.*)$", name):
        return f"{prefix}paligemma.model.language_model.layers.{m[1]}.{m[2]}"
    if m := re.match(r"^layers\.(\d+)\.expert\.(.*)$", name):
        return f"{prefix}gemma_expert.model.layers.{m[1]}.{m[2]}"
    if name.startswith("expert_norm."):
        return f"{prefix}gemma_expert.model.norm.{name[len('expert_norm.'):]}"
    return f"model.{name}"


def lerobot_state_dict(policy: nn.Module, pretrained_path: str | Path | None = None) -> dict[str, torch.Tensor]:
    """The policy's weights under LeRobot 0.6.1's names, complete: every key its ``PI0Policy`` /
    ``PI05Policy`` state dict has, so LeRobot loads the file with ``strict=True``.

    Tensors LeRobot's model holds but that compute nothing its actions read (PaliGemma's LM head and
    final norm, the last layer's prefix outputs, the expert's LM head) are taken from the LeRobot or
    openpi checkpoint the policy started from when ``pretrained_path`` is one (an exact round trip), else
    written as LeRobot's model would tie or start them: the LM head equal to the token embeddings,
    the others zero."""
    cfg = policy.cfg
    out = {_lerobot_name(n): p.detach().float().clone().contiguous() for n, p in policy.named_parameters()}
    prefix = "model.paligemma_with_expert."
    last = f"{prefix}paligemma.model.language_model.layers.{cfg.depth - 1}."
    heads = cfg.num_heads * cfg.head_dim
    absent = {
        f"{prefix}paligemma.lm_head.weight": (cfg.vocab_size, cfg.width),
        f"{prefix}paligemma.model.language_model.norm.weight": (cfg.width,),
        f"{prefix}gemma_expert.lm_head.weight": (cfg.vocab_size, cfg.expert_width),
        f"{last}self_attn.q_proj.weight": (heads, cfg.width), f"{last}self_attn.o_proj.weight": (cfg.width, heads),
        f"{last}mlp.gate_proj.weight": (cfg.mlp_dim, cfg.width), f"{last}mlp.up_proj.weight": (cfg.mlp_dim, cfg.width),
        f"{last}mlp.down_proj.weight": (cfg.width, cfg.mlp_dim), f"{last}post_attention_layernorm.weight": (cfg.width,),
    }
    kept = _lerobot_originals(pretrained_path, set(absent))
    for key, shape in absent.items():
        if key in out:
            continue
        if key in kept and tuple(kept[key].shape) == shape:
            out[key] = kept[key].float().contiguous()
        elif key.endswith("paligemma.lm_head.weight"):
            out[key] = out[f"{prefix}paligemma.model.language_model.embed_tokens.weight"].clone()
        else:
            out[key] = torch.zeros(shape)
    return out


def _lerobot_originals(path: str | Path | None, keys: set[str]) -> dict[str, torch.Tensor]:
    """Those of ``keys`` a LeRobot checkpoint at ``path`` holds, or an openpi one maps to (nothing for another
    layout, no path, or an openpi checkpoint where orbax is not installed)."""
    if not path:
        return {}
    from safetensors import safe_open

    if openpi.is_openpi_checkpoint(Path(path).expanduser()):
        try:
            return {k: v for k, v in read_openpi(path).items() if k in keys}
        except ValueError:  # orbax is not installed here: the tensors are written as LeRobot's model starts them
            return {}
    try:
        files = _safetensors_files(Path(path).expanduser())
    except ValueError:
        return {}
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as handle:
            for k in handle.keys():  # noqa: SIM118
                name = k if k.startswith("model.") else f"model.{k}"
                if name in keys:
                    out[name] = handle.get_tensor(k)
    return out


# -- tokenizer --------------------------------------------------------------------------------------


def tokenizer_dir(cfg: PolicyConfig) -> Path | None:
    """Where the policy's tokenizer is: ``tokenizer_path``, else ``pretrained_path`` when it holds one;
    None for the byte tokenizer. A ValueError names a directory that holds none."""
    if cfg.tokenizer_path:
        path = Path(cfg.tokenizer_path).expanduser()
        _must_be_dir("policy.tokenizer_path", cfg.tokenizer_path, "a PaliGemma directory with tokenizer files")
        if not any((path / f).exists() for f in TOKENIZER_FILES):
            raise ValueError(f"policy.tokenizer_path={cfg.tokenizer_path!r} holds no tokenizer: none of "
                             f"{list(TOKENIZER_FILES)} is in it (it has: {_listing(path)})")
        return path
    if cfg.pretrained_path:
        path = Path(cfg.pretrained_path).expanduser()
        if not path.exists():
            _must_be_dir("policy.pretrained_path", cfg.pretrained_path, "a Hugging Face PaliGemma directory, a "
                         "LeRobot pi0 / pi0.5 checkpoint directory or an openpi checkpoint directory")
        if path.is_dir() and any((path / f).exists() for f in TOKENIZER_FILES):
            return path
        where = f"none of {list(TOKENIZER_FILES)} is in it (it has: {_listing(path)})" if path.is_dir() else \
            "it is a file, not a directory with tokenizer files"
        raise ValueError(f"policy.pretrained_path={cfg.pretrained_path!r} holds no tokenizer: {where}; set "
                         "policy.tokenizer_path to the PaliGemma directory whose tokenizer the weights were trained with")
    return None


def _must_be_dir(key: str, value: str, what: str) -> None:
    """A configured directory that does not exist (or is a file) fails naming the key and the value."""
    path = Path(value).expanduser()
    if not path.exists():
        raise ValueError(f"{key}={value!r} does not exist; give {what}")
    if not path.is_dir():
        raise ValueError(f"{key}={value!r} is not a directory; give {what}")


def _listing(path: Path, most: int = 6) -> str:
    names = sorted(p.name for p in path.iterdir())
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "") if names else "nothing"


@dataclass(frozen=True)
class PaliGemmaTokenizer:
    """A Hugging Face tokenizer from a local directory, at a fixed length, as LeRobot prompts pi0:
    ``<bos> instruction \\n``, padded on the right (``encode``: any prompt, e.g. pi0.5's). Picklable (it
    loads lazily in each worker)."""

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
        """pi0's prompt: the instruction as given, ending in a newline (LeRobot's Pi0NewLineProcessor)."""
        return self.encode(text if text.endswith("\n") else text + "\n")

    def encode(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``<bos>`` + the text's ids, cut to ``max_len`` and padded on the right."""
        tok = self._load()
        ids = tok(text, add_special_tokens=False)["input_ids"]
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
    path = tokenizer_dir(cfg)
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
