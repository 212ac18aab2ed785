"""Every command in README.md and docs/*.md works, in a cheap form, and every page is reachable.

The commands are the lines of the fenced ``bash`` / ``sh`` / ``console`` blocks that run a program of the project:
``python -m slurmvla.X``, ``torchrun ... -m slurmvla.X``, a ``slurmvla-*`` console script, ``python benchmarks/...``,
``bash scripts/...`` / ``launchers/...`` / ``benchmarks/...`` and ``sbatch sbatch/...``. For each:

- every program named answers ``--help`` with exit status 0;
- the Hydra overrides of a training line (``slurmvla.train``, and the programs and scripts that pass theirs to the
  training: inspect, plan, profile, check, launchers/, sbatch/) compose into a valid config, as ``--cfg job`` would;
- every script named exists.

Placeholders: ``$VAR`` / ``${VAR}`` and ``<...>`` become a dummy value; an optional ``[...]`` keeps its content.
It runs in two child processes (``python tests/test_readme.py``: the programs, the compositions), so torch and Hydra
are imported once for all.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FENCES = {"bash", "sh", "console", "shell"}
# Programs whose positional key=value arguments are training overrides.
COMPOSES = {"slurmvla.train", "slurmvla.inspect", "slurmvla.plan", "slurmvla.profile", "slurmvla.check"}
# Shell entry points that hand their arguments to the training; the DROID ones put the recipe first.
SCRIPT_OVERRIDES = {"launchers/train.sh": [], "sbatch/train.sh": [], "launchers/droid.sh": ["experiment=droid"],
                    "sbatch/droid.sh": ["experiment=droid"]}
# Flags of the composing programs that take a value (the value is no override).
VALUE_FLAGS = {"--cfg", "--gpu", "--nodes", "--gpus-per-node", "--json", "--plot", "--only", "--deadline-s",
               "--package", "-p", "--config-name", "-cn", "--config-dir", "-cd", "--cpu-gib"}


@dataclass
class Command:
    where: str  # path:line
    text: str
    modules: list[str] = field(default_factory=list)  # programs whose --help must exit 0
    files: list[str] = field(default_factory=list)  # files that must exist
    compose: list[list[str]] = field(default_factory=list)  # override lists that must compose


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, logical line) of the shell blocks in ``path``, continuation lines joined."""
    out: list[tuple[int, str]] = []
    fence, pending, start = None, "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip().lower()
            continue
        if fence not in FENCES:
            continue
        if fence == "console" and stripped.startswith("$ "):
            stripped = stripped[2:]
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        out.append((start, pending + stripped))
        pending = ""
    return out


def console_scripts() -> dict[str, str]:
    """pyproject.toml's [project.scripts]: name -> module (Python 3.10 has no tomllib)."""
    section = (REPO / "pyproject.toml").read_text().split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.]+):\w+"', section, re.M))


def substitute(token: str) -> str:
    """A placeholder becomes a value that composes: $VAR, ${VAR}, <what>."""
    token = re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", "/placeholder", token)
    return re.sub(r"<[^<>]*>", "placeholder", token)


def first_sweep_value(override: str) -> str:
    """Under -m, ``key=a,b`` sweeps: its first value stands for all (a comma inside brackets or quotes is a value's)."""
    key, _, value = override.partition("=")
    depth, quote = 0, None
    for i, ch in enumerate(value):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            return f"{key}={value[:i]}"
    return override


def overrides_of(args: list[str], multirun: bool) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in VALUE_FLAGS:
            skip = True
        elif "=" in arg and not arg.startswith("-"):
            out.append(first_sweep_value(substitute(arg)) if multirun else substitute(arg))
    return out


def parse(where: str, line: str, scripts: dict[str, str]) -> Command | None:
    """The checks one documented line asks for; None for a line that runs nothing of the project."""
    line = re.sub(r"(?<=\s)\[([^\[\]]*)\]", r"\1", line)  # an optional part, kept
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError as e:
        return Command(where, line, files=[f"<unparseable: {e}>"])
    env: dict[str, str] = {}
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
        name, _, value = tokens.pop(0).partition("=")
        env[name] = value
    if not tokens:
        return None
    cmd = Command(where, line)
    head, rest = tokens[0], tokens[1:]
    module, args = None, []
    if head in ("python", "python3") and rest[:1] == ["-m"] and len(rest) > 1:
        module, args = rest[1], rest[2:]
        if not module.startswith("slurmvla"):
            return None
    elif head in ("python", "python3") and rest and rest[0].endswith(".py"):
        cmd.files.append(rest[0])
        return cmd
    elif head == "torchrun" and "-m" in rest:
        i = rest.index("-m")
        module, args = rest[i + 1], rest[i + 2:]
    elif head.startswith("slurmvla-"):
        module, args = scripts.get(head, f"<no console script {head}>"), rest
    elif head in ("bash", "sh", "source") and rest:
        script, args = rest[0], rest[1:]
    elif head == "sbatch":
        script = next((t for t in rest if not t.startswith("-")), "<no script>")
        args = rest[rest.index(script) + 1:] if script in rest else []
    else:
        return None
    if module is not None:
        cmd.modules.append(module)
        if module in COMPOSES:
            multirun = "-m" in args or "--multirun" in args
            if module == "slurmvla.profile" and "--compare" in args:
                i = args.index("--compare")
                base = overrides_of(args[:i], multirun)
                variants = [a for a in args[i + 1:] if not a.startswith("-")]
                cmd.compose += [base + overrides_of(shlex.split(v), multirun) for v in variants]
            else:
                cmd.compose.append(overrides_of(args, multirun))
        return cmd
    cmd.files.append(script)
    if script in SCRIPT_OVERRIDES:
        first = SCRIPT_OVERRIDES[script]
        if "EXPERIMENT" in env and first:
            first = [f"experiment={env['EXPERIMENT']}"]
        cmd.compose.append(first + overrides_of(args, multirun=False))
    return cmd


def documented_commands(paths: list[Path] | None = None) -> list[Command]:
    scripts = console_scripts()
    out = []
    for path in paths or doc_files():
        name = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        for number, line in code_lines(path):
            cmd = parse(f"{name}:{number}", line, scripts)
            if cmd is not None:
                out.append(cmd)
    return out


def run_checks(commands: list[Command]) -> dict[str, list[str]]:
    """where -> its failures."""
    failures: dict[str, list[str]] = {}
    for cmd in commands:
        for f in cmd.files:
            if not (REPO / f).is_file():
                failures.setdefault(cmd.where, []).append(f"{f}: no such file")
    modules = sorted({m for c in commands for m in c.modules})
    composes = [json.loads(c) for c in sorted({json.dumps(o) for c in commands for o in c.compose})]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    # Two children side by side: the programs' --help, and the compositions.
    jobs = [{"modules": modules, "composes": []}, {"modules": [], "composes": composes}]
    children = [subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env, cwd=REPO) for _ in jobs]
    results: dict[str, dict] = {"help": {}, "compose": {}}
    for child, job in zip(children, jobs):
        stdout, stderr = child.communicate(json.dumps(job), timeout=600)
        assert child.returncode == 0, stderr[-3000:]
        for kind, found in json.loads(stdout.splitlines()[-1]).items():
            results[kind].update(found)
    for cmd in commands:
        for m in cmd.modules:
            if results["help"][m] is not None:
                failures.setdefault(cmd.where, []).append(f"python -m {m} --help: {results['help'][m]}")
        for o in cmd.compose:
            error = results["compose"][json.dumps(o)]
            if error is not None:
                failures.setdefault(cmd.where, []).append(f"overrides {' '.join(o)}: {error}")
    return failures


def _child() -> None:
    """Runs in the child: each program's --help (in this process, via runpy), then each composition."""
    import runpy

    job = json.loads(sys.stdin.read())
    out: dict[str, dict] = {"help": {}, "compose": {}}
    real_stdout = sys.stdout
    for module in job["modules"]:
        sys.argv = [module, "--help"]
        text = io.StringIO()
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            try:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as e:
                code = e.code or 0
            except BaseException as e:  # noqa: BLE001 -- an import error is this check's finding
                code = f"{type(e).__name__}: {e}"
        out["help"][module] = None if code == 0 else f"exit {code}: {text.getvalue()[-500:].strip()}"
    from hydra.core.global_hydra import GlobalHydra

    from slurmvla.compose import compose

    for overrides in job["composes"]:
        GlobalHydra.instance().clear()
        try:
            compose(overrides)
            error = None
        except Exception as e:  # noqa: BLE001 -- the message is the finding
            error = f"{type(e).__name__}: {e}"
        out["compose"][json.dumps(overrides)] = error
    real_stdout.write("\n" + json.dumps(out) + "\n")


# --- the tests ------------------------------------------------------------------------------------------------

CANARY = """\
```bash
python -m slurmvla.train engine=fsdp_ful                   # a misspelled option
python -m slurmvla.train -m hydra/launcher=slurm_cluster hydra.launcher.nodess=2
python -m slurmvla.nosuch --out <dir>                      # no such program
bash scripts/nosuch.sh
EXPERIMENT=droid sbatch --nodes=2 sbatch/droid.sh trainer.max_stepz=3
python -m slurmvla.train data.root=$DROID_ROOT hydra.run.dir=outputs/<run> engine=ddp [trainer.max_steps=2]
```
"""


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """The documentation's commands and a page of deliberately broken ones, checked in one child run."""
    canary = tmp_path_factory.mktemp("canary") / "canary.md"
    canary.write_text(CANARY)
    docs, broken = documented_commands(), documented_commands([canary])
    return docs, broken, run_checks(docs + broken)


def test_every_documented_command_works(checked):
    docs, _, failures = checked
    assert len(docs) > 50, [c.where for c in docs]  # the extraction found the documentation's commands
    mine = {c.where for c in docs}
    found = {where: why for where, why in failures.items() if where in mine}
    assert not found, "documented commands that fail:\n" + "\n".join(
        f"{where}: {'; '.join(why)}" for where, why in sorted(found.items()))


def test_the_check_catches_broken_commands(checked):
    """A misspelled option, an unknown launcher key, a missing program, a missing script and a bad override after
    an sbatch script each fail; placeholders and optional parts do not."""
    _, broken, failures = checked
    mine = {c.where.rsplit(":", 1)[1]: failures.get(c.where, []) for c in broken}
    assert all(mine[line] for line in ("2", "3", "4", "5", "6")), mine
    assert "fsdp_ful" in mine["2"][0] and "nodess" in mine["3"][0] and "nosuch" in mine["4"][0]
    assert "scripts/nosuch.sh" in mine["5"][0] and "max_stepz" in mine["6"][0]
    assert not mine["7"], mine["7"]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_page_is_linked_and_every_link_resolves():
    readme = (REPO / "README.md").read_text()
    unlinked = [p.name for p in (REPO / "docs").glob("*.md") if f"docs/{p.name}" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"
    broken = []
    for path in doc_files():
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.name}: {target} (no file)")
            elif anchor and dest.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", dest.read_text(), flags=re.S), re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{path.name}: {target} (no such heading)")
    assert not broken, broken


if __name__ == "__main__":
    _child()
