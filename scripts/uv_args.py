"""Prints uv's arguments for the package indexes pip is configured with on this machine (pip.conf files and PIP_*
variables, read through `pip config list`): uv reads neither, and scripts/setup.sh installs with uv."""

import shlex
import subprocess
import sys

FLAGS = {key: f"--{key}" for key in ("index-url", "extra-index-url", "find-links", "constraint")}
# pip's precedence, lowest first: a variable overrides the site file, which overrides the user's, then the global one.
SCOPES = ["global", "user", "site", ":env:"]


def main() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    chosen: dict[str, tuple[int, str]] = {}
    for line in listed.splitlines():
        name, _, quoted = line.partition("=")
        scope, _, key = name.rpartition(".")
        if key in FLAGS and scope in SCOPES:
            rank = SCOPES.index(scope)
            if key not in chosen or rank >= chosen[key][0]:
                chosen[key] = (rank, shlex.split(quoted)[0])
    args = [part for key, (_, value) in chosen.items() for item in value.split() for part in (FLAGS[key], item)]
    print(shlex.join(args))


if __name__ == "__main__":
    main()
