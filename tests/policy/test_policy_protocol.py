"""The policy protocol (slurmvla/policy/base.py) lists exactly what the library calls on a policy.

``Policy`` declares every hook: the contract's methods and flags (``CONTRACT``, defaults included), the statistics
buffers (``STATS_BUFFERS``) and the optional capabilities (``CAPABILITIES``, ``None`` where not offered). These
tests read every module of ``slurmvla/`` with ``ast`` and check that

(a) no hook is discovered: no ``getattr`` / ``hasattr`` on a policy for a declared name (the declaration is read);
(b) nothing is read or set on a policy that torch.nn.Module and the protocol do not declare;
(c) every capability declared is read somewhere (nothing declared that nobody calls);

and, by behaviour, that a plain ``nn.Module`` class made a policy offers no capability while pi0 / pi0.5 offer
theirs.

Which expressions are a policy module: the rule (``policy_expression``) takes every ``policy`` -- a name, or an
attribute chain ending in ``.policy`` (``self.policy``, ``loaded.policy``, ``self._step().policy``) -- for a policy,
unless the chain goes through a config (a link named ``cfg`` / ``config``: ``cfg.policy``, ``self.cfg.policy`` are
``PolicyConfig``) or is listed in ``NOT_POLICY`` with its reason; plus the other names a built policy goes by
(``ALIASES``) and, for classes, ``cls`` where it is a policy class, ``policy_class(...)`` and ``type(<policy>)``.
So a new ``policy`` that is not one fails (b) until it is listed, a stale entry of either list fails, and a
capability read through a name the rule does not know fails the backstop: the rule cannot pass by seeing nothing.
Each built-in policy's own package reads its own attributes and is not the library (``OWN``).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from torch import nn

import slurmvla
from slurmvla.policy.base import CAPABILITIES, CONTRACT, STATS_BUFFERS, Policy, as_policy_class

SRC = Path(slurmvla.__file__).parent
DOCS = SRC.parent / "docs" / "policies.md"
# A policy's own package: its code reads its own attributes (pi0's weights read policy.cfg, policy.vision).
OWN = ("policy/pi0/", "policy/flow_vla/")
# (file, expression) where ``policy`` is not a policy module, and why.
NOT_POLICY = {
    ("config/__init__.py", "self.policy"): "Config.policy: the policy's config node",
    ("compose.py", "policy"): "the composed node's policy mapping",
    ("inference/server.py", "policy"): "the served InferencePolicy (anything with infer(obs))",
    ("inference/server.py", "self.policy"): "the served InferencePolicy",
    ("rollout.py", "server.policy"): "the server's InferencePolicy (a Runner)",
    ("plan.py", "c.policy"): "a Config's policy node",
    ("sim/metaworld/expert.py", "self.policy"): "Meta-World's scripted expert (get_action)",
    ("formats.py", "policy"): "a saved config's policy mapping (migrated on load)",
    ("planner/scaling.py", "base.policy"): "a Config's policy node",
}
# Other names under which the library reads a built policy (none today: it is always a ``policy``), and where.
ALIASES: dict[str, str] = {}
# Where ``cls`` / ``self.cls`` is a policy class (policy_class's).
CLASS_FILES = ("policy/__init__.py", "policy/base.py", "check/subject.py", "trainer.py", "parameters.py")
# Capabilities whose names nothing else in slurmvla uses: read on anything, they must be read on a policy.
DISTINCT = tuple(n for n in CAPABILITIES if n not in ("cfg", "gradient_checkpointing"))
DECLARED = set(CONTRACT) | set(CAPABILITIES)
MODULE_NAMES = set(dir(nn.Module()))
CLASS_NAMES = MODULE_NAMES | set(dir(type))


def _text(node: ast.AST) -> str:
    return ast.unparse(node)


def _through_config(node: ast.AST) -> bool:
    """Whether an attribute chain goes through a config: a link named ``cfg`` or ``config`` (``self.cfg.policy``),
    or a call that composes or reads one (``compose([...]).policy``, ``read_config(...).policy``)."""
    while isinstance(node, ast.Attribute):
        node = node.value
        if isinstance(node, ast.Call):
            node = node.func
            link = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
            if "compose" in link or "config" in link:
                return True
            continue
        link = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
        if link in ("cfg", "config"):
            return True
    return False


class Rule:
    """Which expressions of one file are a policy module or a policy class; records what each list matched."""

    def __init__(self, rel: str, used: set):
        self.rel, self.used = rel, used

    def policy_expression(self, node: ast.AST) -> str | None:
        """'module' or 'class' for a policy expression, else None."""
        text = _text(node)
        if (self.rel, text) in NOT_POLICY:
            self.used.add((self.rel, text))
            return None
        if text in ALIASES:
            self.used.add(text)
            return "module"
        ends_in_policy = (isinstance(node, ast.Name) and node.id == "policy") or \
            (isinstance(node, ast.Attribute) and node.attr == "policy")
        if ends_in_policy and not _through_config(node):
            return "module"
        if text in ("cls", "self.cls") and self.rel in CLASS_FILES:
            return "class"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "policy_class":
                return "class"
            if node.func.id == "type" and len(node.args) == 1 and self.policy_expression(node.args[0]) == "module":
                return "class"
        return None


def _library():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if not rel.startswith(OWN):
            yield rel, ast.parse(path.read_text(), filename=str(path))


def _accesses(tree: ast.AST):
    """(node, receiver, name, how) for every ``x.name`` and every ``getattr / hasattr / setattr(x, "name")``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node, node.value, node.attr, "attribute"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            yield node, node.args[0], node.args[1].value, node.func.id


def _scan():
    used: set = set()
    reads, discovered, undeclared, unseen = defaultdict(list), [], [], []
    for rel, tree in _library():
        rule = Rule(rel, used)
        for node, receiver, name, how in _accesses(tree):
            kind = rule.policy_expression(receiver)
            where = f"slurmvla/{rel}:{node.lineno}: {_text(receiver)}"
            if kind is None:
                if name in DISTINCT:
                    unseen.append(f"{where}.{name} ({how})")
                continue
            reads[name].append(where)
            if how in ("getattr", "hasattr") and name in DECLARED:
                discovered.append(f"{where}: {how}(..., {name!r})")
            allowed = (CLASS_NAMES if kind == "class" else MODULE_NAMES) | DECLARED | set(STATS_BUFFERS)
            if name not in allowed:
                undeclared.append(f"{where}.{name} ({how})")
    return reads, discovered, undeclared, unseen, used


@pytest.fixture(scope="module")
def scan():
    return _scan()


def test_no_hook_is_discovered_with_getattr(scan):
    _, discovered, *_ = scan
    assert not discovered, "a declared hook is discovered instead of read (policy.<name> is declared on every " \
        "built policy; None where not offered):\n" + "\n".join(discovered)


def test_the_library_reads_nothing_on_a_policy_that_the_protocol_does_not_declare(scan):
    reads, _, undeclared, *_ = scan
    assert not undeclared, "read on a policy, declared neither by torch.nn.Module nor in slurmvla/policy/base.py " \
        "(CONTRACT, STATS_BUFFERS, CAPABILITIES): declare it there, with its contract, or stop reading it:\n" + \
        "\n".join(undeclared)
    # The rule sees the library's policies: a rule that saw nothing would pass the line above.
    assert sum(len(v) for v in reads.values()) > 50, dict(reads)


def test_the_rule_knows_every_name_a_policy_goes_by(scan):
    *_, unseen, used = scan
    assert not unseen, "a capability read on an expression the rule does not take for a policy: add it to " \
        "ALIASES (or, if it is not a policy, NOT_POLICY):\n" + "\n".join(unseen)
    stale = [k for k in [*NOT_POLICY, *ALIASES] if k not in used]
    assert not stale, f"entries of NOT_POLICY / ALIASES that match nothing any more: {stale}"


def test_every_declared_capability_is_read_somewhere(scan):
    reads, *_ = scan
    unread = [n for n in CAPABILITIES if not reads.get(n)]
    assert not unread, f"declared in slurmvla/policy/base.py but read on no policy in slurmvla/: {unread}"
    for name in CAPABILITIES:
        print(f"{name}: {', '.join(sorted(set(w.split(': ')[0] for w in reads[name])))}")


def test_each_hook_is_declared_on_policy_with_a_docstring():
    """Every name of the protocol is on Policy, a capability as None, each with its contract in a docstring."""
    for name in (*CONTRACT, *CAPABILITIES):
        assert hasattr(Policy, name), name
    for name in CAPABILITIES:
        assert getattr(Policy, name) is None, name
    assert not set(CONTRACT) & set(CAPABILITIES) and not set(STATS_BUFFERS) & DECLARED
    body = next(n for n in ast.parse((SRC / "policy" / "base.py").read_text()).body
                if isinstance(n, ast.ClassDef) and n.name == "Policy").body
    documented = set()
    for node, after in zip(body, [*body[1:], None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            documented.add(node.target.id)
        elif isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
            documented.add(node.name)
    missing = [n for n in (*CONTRACT, *CAPABILITIES) if n not in documented]
    assert not missing, f"declared on Policy without a docstring of its contract: {missing}"


def test_the_docs_table_lists_every_capability():
    section = DOCS.read_text().split("### Optional capabilities", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `(\w+)[`(]", section, flags=re.M)
    assert sorted(rows) == sorted(CAPABILITIES), rows


class Plain(nn.Module):
    def __init__(self, cfg=None, stats=None):  # noqa: ANN001
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, batch: dict) -> dict:
        return {"loss": self.lin(batch["x"]).sum()}


def test_a_plain_module_made_a_policy_offers_no_capability_and_keeps_its_own_methods():
    cls = as_policy_class(Plain)
    policy = cls()
    assert cls.forward is Plain.forward and policy.wrap_units() == []
    assert {n: getattr(policy, n) for n in CAPABILITIES} == dict.fromkeys(CAPABILITIES)
    assert policy.supports_rtc is False and policy.supports_rtc_training is False
    assert list(dict(policy.named_parameters())) == ["lin.weight", "lin.bias"]


def test_the_reference_policy_offers_its_switch_and_config_only():
    from slurmvla.compose import compose
    from slurmvla.policy import build_policy

    cfg = compose(["policy=tiny"]).policy
    policy = build_policy(cfg)
    offered = {n for n in CAPABILITIES if getattr(policy, n) is not None}
    assert offered == {"cfg", "gradient_checkpointing"}, offered


@pytest.mark.parametrize("name", ["pi0_tiny", "pi05_tiny"])
def test_pi0_offers_every_capability(name):
    pytest.importorskip("transformers")
    from slurmvla.compose import compose
    from slurmvla.policy import build_policy, policy_class

    cfg = compose([f"policy={name}"]).policy
    cls = policy_class(cfg)
    methods = ("init_parameter", "load_initial_weights", "prepare_training", "prepare_inference", "prefix_modules",
               "projection_groups")
    assert all(callable(getattr(cls, n)) for n in methods)
    policy = build_policy(cfg)
    assert isinstance(policy.init_seed, int) and policy.gradient_checkpointing is False and policy.cfg.name == cfg.name
    assert {n for n in CAPABILITIES if getattr(policy, n) is None} == set()
    assert torch.is_tensor(policy.action_scale)
