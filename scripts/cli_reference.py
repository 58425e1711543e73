"""Rewrites docs/cli.md from the parser (multigpu.config.cli_reference); tests/test_docs.py checks they agree."""

from pathlib import Path

from multigpu.cli import build_parser
from multigpu.config.cli_reference import reference

Path(__file__).resolve().parent.parent.joinpath("docs", "cli.md").write_text(reference(build_parser()))
