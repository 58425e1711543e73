"""The docs against the code: the CLI reference names every flag, the README's commands run, every link resolves."""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from multigpu.cli import build_parser
from multigpu.core.config_file import verb_parsers
from tests.dist import ROOT, run_command

README = ROOT / "README.md"
DOCS = ROOT / "docs"
GPU_ONLY = re.compile(r"#\s*GPU only\b")  # a trailing comment that starts "GPU only"
COMMAND_TIMEOUT = 300


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings} - {"-h", "--help"}


def verb_sections(text: str) -> dict[str, str]:
    """docs/cli.md's text from each "## `multigpu VERB`" heading to the next one."""
    parts = re.split(r"^## `multigpu (\S+)`.*$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_the_cli_reference_names_every_flag_of_every_verb_and_no_other() -> None:
    parser = build_parser()
    text = (DOCS / "cli.md").read_text()
    sections = verb_sections(text)
    parsers = verb_parsers(parser)
    problems = [f"no section for `multigpu {verb}`" for verb in parsers if verb not in sections]
    problems += [f"a section for `multigpu {verb}`, which the parser lacks" for verb in sections.keys() - parsers]
    problems += [f"`multigpu {option}`" for option in options(parser) if f"`{option}`" not in text]
    for verb, sub in parsers.items():
        section = sections.get(verb, "")
        problems += [f"`multigpu {verb} {option}`" for option in sorted(options(sub)) if f"`{option}`" not in section]
        # A flag the parser no longer has is as wrong as a missing one: check each table row's first cell.
        listed = {
            flag
            for row in re.findall(r"^\| (`-.*?) \|", section, flags=re.MULTILINE)
            for flag in re.findall(r"`(-[^`]+)`", row)
        }
        problems += [f"`multigpu {verb} {flag}` is listed but not a flag" for flag in sorted(listed - options(sub))]
    assert not problems, "docs/cli.md is out of date with multigpu.cli.build_parser():\n" + "\n".join(problems)


# -- the README's commands -------------------------------------------------------------------------------------
def readme_commands() -> list[str]:
    """Every line of the README's bash blocks that starts with `multigpu `, continuation lines joined, in order."""
    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(), flags=re.MULTILINE | re.DOTALL)
    lines = (line.strip() for block in blocks for line in block.replace("\\\n", " ").splitlines())
    return [" ".join(line.split()) for line in lines if line.startswith("multigpu ")]


COMMANDS = readme_commands()


def run_in(cwd: Path, command: str) -> subprocess.CompletedProcess:
    """Runs a README command as typed, in `cwd`, with a hard timeout."""
    return run_command([sys.executable, "-m", *shlex.split(command, comments=True)], COMMAND_TIMEOUT, cwd=cwd)


class ReadmeSession:
    """One scratch directory for all the README's commands, run in README order, as a reader would type them:
    `export` reads the checkpoint `train` wrote. A command selected alone first runs the ones above it."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.results: dict[int, subprocess.CompletedProcess] = {}

    def result(self, index: int) -> subprocess.CompletedProcess:
        for earlier in range(index + 1):
            if earlier not in self.results and (earlier == index or runs_here(COMMANDS[earlier])):
                self.results[earlier] = run_in(self.cwd, COMMANDS[earlier])
        return self.results[index]


def runs_here(command: str) -> bool:
    return torch.cuda.is_available() or not GPU_ONLY.search(command)


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> ReadmeSession:
    cwd = tmp_path_factory.mktemp("readme")
    # The files the commands read, where a fresh clone has them; everything they write stays in the scratch dir.
    shutil.copytree(DOCS / "examples", cwd / "docs" / "examples")
    return ReadmeSession(cwd)


def test_the_readme_has_commands_to_run() -> None:
    assert len(COMMANDS) >= 10, COMMANDS


@pytest.mark.timeout(COMMAND_TIMEOUT * 4)  # a command selected alone may first run the ones above it
@pytest.mark.parametrize("index", range(len(COMMANDS)), ids=COMMANDS)
def test_each_readme_command_runs(index: int, session: ReadmeSession) -> None:
    command = COMMANDS[index]
    result = session.result(index)
    if runs_here(command):
        assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stdout}"
    else:
        # The mark must be earned: a command marked "# GPU only" that runs without a GPU should lose the mark.
        assert result.returncode != 0, f"{command} is marked GPU only but ran without a GPU:\n{result.stdout}"


# -- links -----------------------------------------------------------------------------------------------------
def without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lowercase, punctuation dropped, spaces as hyphens; a repeated id gets -1, -2, ..."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", without_code_blocks(path.read_text()), flags=re.MULTILINE):
        base = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        slug, n = base, 0
        while slug in found:
            n += 1
            slug = f"{base}-{n}"
        found.add(slug)
    return found


MARKDOWN = [README, *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("page", MARKDOWN, ids=[str(p.relative_to(ROOT)) for p in MARKDOWN])
def test_every_relative_link_and_repository_path_resolves(page: Path) -> None:
    text = without_code_blocks(page.read_text())
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    # Files named in inline code must exist too: they are the first thing a module move leaves stale.
    for path in re.findall(r"`((?:src|tests|benchmarks|scripts|docs)/[^`\s]*)`", text):
        if not (ROOT / path).exists():
            broken.append(f"`{path}`: no such file in the repository")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)
