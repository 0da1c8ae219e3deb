"""``relay console-operators add | remove | list``: the console's operators file.

``add NAME`` makes a token (43 random characters), writes NAME's line (the token's scrypt
hash) into the file, replacing an older one (a new token for NAME: their sessions end),
and prints the token once on stdout. ``remove NAME`` deletes the line: NAME can no longer
log in and their sessions end, nobody else's token changes. The file is
``--file`` or ``RELAY_CONSOLE_OPERATORS_FILE``; it is written whole (a temporary file
renamed over it), readable by its owner only. A running console reads it again when it
changes; in Kubernetes the file is the Secret ``relay-console-operators`` (docs/console.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from service import errors
from service.ops.console import operators
from service.settings import Settings


def _path(args: argparse.Namespace, settings: Settings) -> Path:
    path: Path | None = args.file or settings.console_operators_file
    if path is None:
        raise errors.ConfigError(
            "--file: which operators file? (or set RELAY_CONSOLE_OPERATORS_FILE)"
        )
    return Path(path)


def _lines(path: Path) -> list[str]:
    """The file's lines (none if it does not exist yet); a bad line refuses the command."""
    try:
        text = path.read_text("utf-8")
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        raise errors.ConfigError(f"--file {path}: cannot read it ({exc})") from None
    lines = text.splitlines()
    if any(line.strip() and not line.lstrip().startswith("#") for line in lines):
        operators.parse(text, f"--file {path}")  # a broken file is not edited further
    return lines


def _name_of(line: str) -> str | None:
    stripped = line.strip()
    if not stripped or stripped.startswith("#"):
        return None
    return stripped.split(":", 1)[0]


def _write(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write("".join(f"{line}\n" for line in lines))
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


async def add(args: argparse.Namespace, settings: Settings) -> int:
    path = _path(args, settings)
    if not operators.valid_name(args.name):
        raise errors.ConfigError(
            f"NAME {args.name!r}: 1-64 letters, digits, '.', '@', '-', '_' or inner spaces"
        )
    lines = _lines(path)
    token = operators.new_token()
    line = operators.hash_line(args.name, token)
    replaced = any(_name_of(old) == args.name for old in lines)
    lines = [line if _name_of(old) == args.name else old for old in lines]
    if not replaced:
        lines.append(line)
    _write(path, lines)
    print(token)
    what = "new token for" if replaced else "added"
    print(
        f"relay: {what} {args.name} in {path}; the token above is shown once: give it to "
        f"{args.name} alone",
        file=sys.stderr,
    )
    return errors.ExitCode.OK


async def remove(args: argparse.Namespace, settings: Settings) -> int:
    path = _path(args, settings)
    lines = _lines(path)
    kept = [line for line in lines if _name_of(line) != args.name]
    if len(kept) == len(lines):
        raise errors.ConfigError(f"NAME: no operator {args.name} in {path}")
    _write(path, kept)
    print(f"relay: removed {args.name} from {path}", file=sys.stderr)
    return errors.ExitCode.OK


async def list_(args: argparse.Namespace, settings: Settings) -> int:
    path = _path(args, settings)
    for line in _lines(path):
        name = _name_of(line)
        if name is not None:
            print(name)
    return errors.ExitCode.OK
