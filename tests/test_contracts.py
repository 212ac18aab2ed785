"""The contracts beyond the policy are read as declared, never discovered (tests/policy/test_policy_protocol.py holds
the same for the policy).

The engine's callers (the checkpoint layer, the moving average, the trainer), the server and the planner read what
the engine's two protocols, the server's ``InferencePolicy`` and its capability protocols, and the policy config's
typed fields and accessors declare (slurmvla/engine/base.py, slurmvla/inference/server.py,
slurmvla/config/policy.py). These tests read those modules with ``ast`` and check that

(a) no ``getattr`` / ``hasattr`` asks what an engine, a policy or a config has: each one left in them is listed in
    ``NOT_A_CAPABILITY`` with its reason (an exception's ``errno``, a torch operator's tags), and an entry that
    matches nothing any more fails;
(b) an ``isinstance`` on a served policy or an engine tests a declared protocol only (the server's
    ``InferencePolicy`` and ``CAPABILITIES``; an engine is never tested: it declares its checkpoint strategy).

The checker is tested on small sources that probe, so that it cannot pass by seeing nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import slurmvla
from slurmvla.inference import server

SRC = Path(slurmvla.__file__).parent
# The modules held to the rule: files, or folders (ending in "/").
READERS = ("checkpoint.py", "trainer.py", "engine/ema.py", "inference/server.py", "inference/build.py", "planner/")
# (file, receiver, name) of a getattr / hasattr that asks nothing of an engine, a policy or a config, and why.
NOT_A_CAPABILITY = {
    ("checkpoint.py", "e", "errno"): "a write's exception: an OSError's errno, or none (torch.save's short write)",
    ("checkpoint.py", "e", "filename"): "a write's exception: the file an OSError names, where it names one",
    ("inference/server.py", "ws.protocol", "parser_exc"): "websockets' reason for refusing a frame (some versions)",
    ("planner/autocast.py", "func", "__name__"): "a torch function's name (a builtin may have none)",
    ("planner/compiled.py", "op", "tags"): "an aten operator's tags (an overload packet has none)",
    ("planner/compiled.py", "op", "_schema"): "an aten operator's schema (an overload packet has none)",
    ("planner/compiled.py", "getattr(op, '_schema', None)", "name"): "the operator schema's name",
    ("planner/compiled.py", "_op(n)", "tags"): "a graph node's operator's tags",
    ("planner/step_time.py", "aten", "_scaled_dot_product_flash_attention_for_cpu"): "an operator this torch may lack",
}
# The types an isinstance may test a served policy against: its protocol and its optional capabilities.
SERVED = {server.InferencePolicy.__name__, *(c.__name__ for c in server.CAPABILITIES)}
# Expressions that are a served policy or an engine (a name, or an attribute chain ending in it).
SUBJECTS = {"policy": SERVED, "engine": set()}


def _files():
    for reader in READERS:
        paths = sorted((SRC / reader).rglob("*.py")) if reader.endswith("/") else [SRC / reader]
        for path in paths:
            yield path.relative_to(SRC).as_posix(), path.read_text()


def _subject(node: ast.AST) -> str | None:
    """'policy' or 'engine' for ``policy``, ``self.policy``, ``engine``, ``self.engine``, ...; else None."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name if name in SUBJECTS else None


def probes(rel: str, source: str) -> tuple[dict[tuple[str, str, str], str], list[str]]:
    """(file, receiver, name) of every ``getattr`` / ``hasattr`` in ``source`` (a name that is no string constant:
    ``"?"``), with where and how it is called; and every isinstance that tests a policy or an engine against an
    undeclared type."""
    found, undeclared = {}, []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2):
            continue
        receiver, what = node.args[0], node.args[1]
        if node.func.id in ("getattr", "hasattr"):
            name = what.value if isinstance(what, ast.Constant) and isinstance(what.value, str) else "?"
            found[rel, ast.unparse(receiver), name] = f"slurmvla/{rel}:{node.lineno}: {ast.unparse(node)}"
        elif node.func.id == "isinstance" and (subject := _subject(receiver)) is not None:
            types = what.elts if isinstance(what, ast.Tuple) else [what]
            for t in types:
                if ast.unparse(t) not in SUBJECTS[subject]:
                    undeclared.append(f"slurmvla/{rel}:{node.lineno}: isinstance({ast.unparse(receiver)}, "
                                      f"{ast.unparse(t)})")
    return found, undeclared


def capability_probes(rel: str, source: str) -> list[str]:
    """What :func:`probes` finds that ``NOT_A_CAPABILITY`` does not list."""
    found, undeclared = probes(rel, source)
    return [where for key, where in found.items() if key not in NOT_A_CAPABILITY] + undeclared


@pytest.fixture(scope="module")
def scan() -> tuple[list[str], set]:
    bad, seen = [], set()
    for rel, source in _files():
        bad += capability_probes(rel, source)
        seen |= set(probes(rel, source)[0])
    return bad, seen


def test_no_capability_of_an_engine_a_policy_or_a_config_is_discovered(scan):
    bad, _ = scan
    assert not bad, "a capability is discovered instead of read as declared (the engine's StateIO.checkpointing, the " \
        "server's capability protocols, the policy config's typed accessors); if it is none, list it in " \
        "NOT_A_CAPABILITY with its reason:\n" + "\n".join(bad)


def test_every_listed_exception_is_still_there(scan):
    _, seen = scan
    stale = [k for k in NOT_A_CAPABILITY if k not in seen]
    assert not stale, f"entries of NOT_A_CAPABILITY that match nothing any more: {stale}"
    assert {f for f, *_ in seen} >= {"checkpoint.py", "inference/server.py"}, "the scan read nothing"


@pytest.mark.parametrize("rel, source", [
    ("checkpoint.py", 'if hasattr(engine, "snapshot"):\n    pass\n'),
    ("checkpoint.py", 'save = getattr(self.engine, "save_in_background", None)\n'),
    ("inference/server.py", 'make = getattr(self.policy, "session", None)\n'),
    ("inference/server.py", "own = getattr(policy, name)\n"),
    ("inference/server.py", 'code = getattr(e, "errno", None)\n'),  # listed for checkpoint.py, not here
    ("inference/server.py", "ok = isinstance(policy, Sized)\n"),
    ("checkpoint.py", "ok = isinstance(self.engine, (StateIO, Snapshots))\n"),
    ("planner/recompute_choice.py", 'on = getattr(cfg.policy, "gradient_checkpointing", None)\n'),
    ("planner/activations.py", 'ok = all(hasattr(p, k) for k in ("width", "depth"))\n'),
])
def test_the_checker_finds_a_probe(rel, source):
    assert capability_probes(rel, source), source


@pytest.mark.parametrize("rel, source", [
    ("checkpoint.py", 'code = getattr(e, "errno", None)\n'),
    ("inference/server.py", "ok = isinstance(policy, SupportsSessions)\n"),
    ("inference/server.py", "ok = isinstance(self.policy, (InferencePolicy, SupportsMetadata))\n"),
    ("checkpoint.py", "ok = isinstance(strategy, WriteInBackground)\n"),
    ("planner/recompute_choice.py", "on = cfg.policy.gradient_checkpointing\n"),
])
def test_the_checker_passes_a_declared_read(rel, source):
    assert not capability_probes(rel, source), source
