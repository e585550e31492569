"""The shared secret of `stapo serve` and the trainer: where each side finds it (docs/rollout.md, "Security").

Never from a command line (``/proc/PID/cmdline`` is world-readable); a file only when it is this user's regular
file that nobody else can read (a planted or shared file would hand the server a secret others know).
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

__all__ = ["TOKEN_ENV", "check_secret", "default_token_file", "read_token_file", "serve_secret", "trainer_secret"]

TOKEN_ENV = "STAPO_SERVER_TOKEN"
_SECRET_BYTES = 32
_MAX_FILE_BYTES = 4096


def check_secret(value: str, source: str) -> str:
    """``value`` if it can be a secret (printable ASCII, no spaces, not empty); ValueError naming ``source``."""
    if not value or any(not "!" <= ch <= "~" for ch in value):
        raise ValueError(f"{source} holds no usable secret: it must be printable ASCII without spaces or line "
                         "breaks (e.g. the output of `openssl rand -hex 32`)")
    return value


def default_token_file(env: Mapping[str, str]) -> Path:
    """``$STAPO_CACHE/server_token``, else ``~/.cache/stapo/server_token``."""
    base = env.get("STAPO_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "stapo") / "server_token"


def read_token_file(path: Path) -> str:
    """The secret ``path`` holds (one trailing line break dropped); ValueError when it is missing, not this
    user's regular file, readable by others, or holds no usable secret."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO planted there cannot block the open
    except FileNotFoundError:
        raise ValueError(f"secret file {path} does not exist (`stapo serve` names the file it uses on its "
                         "first line)") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ValueError(f"secret file {path} must be a regular file of this user that only this user can read "
                             f"(it is mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid}): chmod 600 {path}")
        raw = f.read(_MAX_FILE_BYTES + 1)
    text = raw.decode("ascii", errors="replace").removesuffix("\n").removesuffix("\r")
    if len(raw) > _MAX_FILE_BYTES:
        text = " "  # refused below: no secret is that long
    return check_secret(text, f"secret file {path}")


def _create_token_file(path: Path) -> tuple[str, bool]:
    """``(secret, created)``: a fresh secret linked into ``path`` (0600) from a private temporary file, so no reader
    sees it half-written, or the one another server wrote there first."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".server_token.")  # mode 0600
    try:
        secret = secrets.token_hex(_SECRET_BYTES)
        with os.fdopen(fd, "w") as f:
            f.write(secret + "\n")
        try:
            os.link(tmp, path)
            return secret, True
        except FileExistsError:
            return read_token_file(path), False
    finally:
        os.unlink(tmp)


def serve_secret(env: Mapping[str, str], token_file: str | None, create: bool = True) -> tuple[str | None, str]:
    """`stapo serve`'s secret: its environment, else ``token_file``, else the default file (created when missing;
    not with ``create=False``, a dry run: None then); and a line saying where it is."""
    given = env.get(TOKEN_ENV)
    if given and token_file:
        raise ValueError(f"both {TOKEN_ENV} and --token-file give the shared secret: give one")
    if given:
        return check_secret(given, TOKEN_ENV), f"the shared secret is {TOKEN_ENV} from the environment"
    path = Path(token_file).expanduser().absolute() if token_file else default_token_file(env)
    trainer = ("the trainer on this machine reads it by default" if not token_file
               else f"give the trainer rollout.server.token_file={path}")
    if path.exists():
        return read_token_file(path), f"the shared secret is in {path} (read; {trainer})"
    if not create:
        return None, f"the shared secret would be created in {path} (mode 0600)"
    secret, created = _create_token_file(path)
    return secret, f"the shared secret is in {path} ({'created, mode 0600' if created else 'read'}; {trainer})"


def trainer_secret(env: Mapping[str, str], token_file: str | None) -> str | None:
    """The trainer's secret: its environment, else ``token_file``, else the default file; None without one."""
    given = check_secret(env[TOKEN_ENV], TOKEN_ENV) if env.get(TOKEN_ENV) else None
    if token_file:
        from_file = read_token_file(Path(token_file).expanduser())
        if given is not None and not hmac.compare_digest(given, from_file):
            raise ValueError(f"{TOKEN_ENV} and rollout.server.token_file ({token_file}) hold different secrets: "
                             "unset one")
        return from_file
    if given is not None:
        return given
    default = default_token_file(env)
    return read_token_file(default) if default.exists() else None
