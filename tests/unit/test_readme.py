"""The user's guide holds: every relative link of README.md and docs/*.md resolves (anchors
included), every file path the README names exists, and every command it shows runs with
the flags it shows (each script's ``--help``, subcommands included; ``make`` targets in the
Makefile)."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
SCRIPT = re.compile(r"(?:^|\s|/)((?:tools/[\w.-]+\.py)|pretrain_gpt\.py)\b(.*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])")
HELP_TIMEOUT_S = 120


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = _slug(line.lstrip("#"))
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
@pytest.mark.quick
def test_every_relative_link_resolves(doc: Path) -> None:
    for target in LINK.findall(doc.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        assert file.exists(), f"{doc.name}: link to {target} -> {file} does not exist"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file), f"{doc.name}: {target}: no heading with anchor #{anchor} in {file.name}"


def _readme_commands() -> list[str]:
    """Shell lines of the README's code blocks and its inline code spans."""
    text = README.read_text()
    lines: list[str] = []
    blocks = re.findall(r"```(?:bash)?\n(.*?)```", text, flags=re.S)
    for block in blocks:
        joined = block.replace("\\\n", " ")
        lines += [line.split("  #", 1)[0] for line in joined.splitlines() if line.strip()]
    outside = re.sub(r"```.*?```", "", text, flags=re.S)
    lines += CODE.findall(outside)
    return lines


def _script_uses() -> dict[tuple[str, ...], set[str]]:
    """``(script, subcommand?)`` -> the flags the README passes it."""
    uses: dict[tuple[str, ...], set[str]] = {}
    for line in _readme_commands():
        match = SCRIPT.search(line)
        if match is None:
            continue
        script, rest = match.group(1), match.group(2).split("|")[0]
        words = rest.split()
        key: tuple[str, ...] = (script,)
        if words and re.fullmatch(r"[a-z]+", words[0]):
            key = (script, words[0])
        uses.setdefault(key, set()).update(FLAG.findall(rest))
    return uses


def _flag_table_flags() -> set[str]:
    """Every ``--flag`` of the README's flag table (first column), checked against
    ``pretrain_gpt.py --help``; a ``--muon-*`` family and ``/-suffix`` shorthands are read as
    their first member."""
    flags = set()
    for line in README.read_text().splitlines():
        if not line.startswith("| `--"):
            continue
        first = line.split("|")[1]
        for span in CODE.findall(first):
            flags.update(f for f in FLAG.findall(span.split("/-")[0]) if not span.startswith(f + "-*"))
    return flags


@cache
def _help(key: tuple[str, ...]) -> str:
    command = [sys.executable, key[0], *key[1:], "--help"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=HELP_TIMEOUT_S)
    assert done.returncode == 0, f"{' '.join(key)} --help failed: {done.stderr[-2000:]}"
    return done.stdout


@pytest.mark.timeout(4 * HELP_TIMEOUT_S)
def test_every_command_the_readme_shows_exists_with_its_flags() -> None:
    uses = _script_uses()
    uses.setdefault(("pretrain_gpt.py",), set()).update(_flag_table_flags())
    assert ("pretrain_gpt.py",) in uses and any(key[0].startswith("tools/") for key in uses)
    for key in uses:
        assert (ROOT / key[0]).is_file(), f"the README runs {key[0]}, which does not exist"
    with ThreadPoolExecutor(max_workers=4) as pool:
        helps = dict(zip(uses, pool.map(_help, uses)))
    for key, flags in sorted(uses.items()):
        missing = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", helps[key]))
        assert not missing, f"the README passes {missing} to {' '.join(key)}, whose --help does not list them"


@pytest.mark.quick
def test_every_make_target_and_path_the_readme_names_exists() -> None:
    makefile = (ROOT / "Makefile").read_text()
    commands = _readme_commands()
    targets = {m.group(1) for line in commands for m in re.finditer(r"\bmake ([a-z-]+)", line)}
    assert {"demo", "test"} <= targets
    for target in targets:
        assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.M), f"no make target {target!r}"
    paths = {m.group(0) for line in commands
             for m in re.finditer(r"\b(?:examples|tools|tests|docs|canzona_patches|megatron)/[\w./-]+\.(?:py|sh|md|sbatch)\b",
                                  line)}
    assert paths
    for path in sorted(paths):
        assert (ROOT / path).exists(), f"the README names {path}, which does not exist"
