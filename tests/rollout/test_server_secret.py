"""The shared secret of `stapo serve` and the trainer (stapo.serve.secret): a server always has one, the
two sides meet in the default file without the user doing anything, and no secret comes from a command line, a
file others can read, or a blank value. The real server: tests/vllm_cpu/test_server_security.py."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from stapo.cli import main
from stapo.config import ConfigError, STAPOConfig
from stapo.serve.secret import (TOKEN_ENV, check_secret, default_token_file, read_token_file, serve_secret,
                                         trainer_secret)


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A user who set nothing: no STAPO_SERVER_TOKEN, the cache in a fresh directory."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setenv("STAPO_CACHE", str(tmp_path / "cache"))
    return {"STAPO_CACHE": str(tmp_path / "cache")}


def secret_file(path, text: str, mode: int = 0o600):
    path.write_text(text)
    path.chmod(mode)
    return path


def test_serve_makes_a_secret_in_a_0600_file_the_trainer_reads_by_default(env):
    assert trainer_secret(env, None) is None  # nothing yet: the server will answer 401 and the error says why
    secret, line = serve_secret(env, None)
    path = default_token_file(env)
    assert line.startswith(f"the shared secret is in {path} (created, mode 0600")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(secret) == 64 and secret not in line
    assert serve_secret(env, None) == (secret, line.replace("created, mode 0600", "read"))  # a second server: same
    assert trainer_secret(env, None) == secret


def test_servers_started_together_agree_on_one_secret(env):
    got, start = [], threading.Barrier(4)

    def serve():
        start.wait()
        got.append(serve_secret(env, None)[0])
    threads = [threading.Thread(target=serve) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and trainer_secret(env, None) == got[0]
    assert [p.name for p in default_token_file(env).parent.iterdir()] == ["server_token"]  # no temporary left


def test_the_environment_or_token_file_win_and_a_dry_run_writes_nothing(env, tmp_path):
    assert serve_secret(env, None, create=False) == (None, f"the shared secret would be created in "
                                                           f"{default_token_file(env)} (mode 0600)")
    assert not default_token_file(env).exists()
    given = {**env, TOKEN_ENV: "s3cret-from-env"}
    assert serve_secret(given, None) == ("s3cret-from-env", f"the shared secret is {TOKEN_ENV} from the environment")
    own = tmp_path / "shared" / "secret"
    secret, line = serve_secret(env, str(own))
    assert f"give the trainer rollout.server.token_file={own}" in line and read_token_file(own) == secret
    assert trainer_secret(env, str(own)) == secret
    assert trainer_secret({**env, TOKEN_ENV: secret}, str(own)) == secret
    with pytest.raises(ValueError, match="hold different secrets: unset one"):
        trainer_secret(given, str(own))
    with pytest.raises(ValueError, match="both STAPO_SERVER_TOKEN and --token-file"):
        serve_secret(given, str(own))


@pytest.mark.parametrize("value", [" ", "\t", "two words", "line\n", "nön-ascii", "x\x00y"])
def test_a_blank_or_unprintable_secret_is_refused_never_used(env, tmp_path, value):
    with pytest.raises(ValueError, match="STAPO_SERVER_TOKEN holds no usable secret"):
        serve_secret({**env, TOKEN_ENV: value}, None)
    with pytest.raises(ValueError, match="STAPO_SERVER_TOKEN holds no usable secret"):
        trainer_secret({**env, TOKEN_ENV: value}, None)
    path = secret_file(tmp_path / "f", value + "\n")
    with pytest.raises(ValueError, match=f"secret file {path} holds no usable secret"):
        read_token_file(path)


def test_a_file_others_can_read_or_plant_is_refused(tmp_path):
    assert read_token_file(secret_file(tmp_path / "ok", "abc\r\n")) == "abc"  # one line break dropped
    for mode in (0o640, 0o604, 0o666):
        with pytest.raises(ValueError, match=f"only this user can read .* chmod 600"):
            read_token_file(secret_file(tmp_path / f"m{mode:o}", "abc", mode))
    os.mkfifo(tmp_path / "fifo", 0o600)  # would block a reader forever
    with pytest.raises(ValueError, match="must be a regular file"):
        read_token_file(tmp_path / "fifo")
    with pytest.raises(ValueError, match="holds no usable secret"):
        read_token_file(secret_file(tmp_path / "long", "a" * 5000))
    with pytest.raises(ValueError, match="does not exist .* names the file it uses on its first line"):
        read_token_file(tmp_path / "missing")
    if os.geteuid() == 0:  # root can give a file away: a file another user planted is not ours to trust
        planted = secret_file(tmp_path / "planted", "abc")
        os.chown(planted, 12345, 12345)
        with pytest.raises(ValueError, match="uid 12345"):
            read_token_file(planted)
    assert check_secret("a-B_9~!", "x") == "a-B_9~!"


def test_stapo_serve_names_the_secrets_file_first_and_never_prints_the_secret(env, capsys):
    assert main(["serve", "/models/m", "--port", "8001", "--dry-run"]) == 0
    first, second = capsys.readouterr().err.splitlines()[:2]
    assert first == f"stapo serve: the shared secret would be created in {default_token_file(env)} (mode 0600)"
    assert "--middleware stapo.serve.guard.ServerGuard" in second
    secret, _ = serve_secret(env, None)
    assert main(["serve", "/models/m", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"stapo serve: the shared secret is in {default_token_file(env)} (read;")
    assert secret not in err


@pytest.mark.parametrize("args, message", [
    (["--host", "127.0.0.1", "--host", "0.0.0.0"], "--host is given 2 times (vLLM would take the last): give it once"),
    (["--host=127.0.0.1", "--host", "0.0.0.0"], "--host is given 2 times"),
    (["--host", "127.0.0.1", "--hos", "0.0.0.0"], "vLLM would read --hos as --host: write --host in full"),
    (["--api_key", "k"], "drop --api-key"), (["--api-key=k"], "drop --api-key"),
    (["--api-k", "k"], "vLLM would read --api-k as --api-key"),
    (["--token-file", "a", "--token_file", "b"], "--token-file is given 2 times"),
])
def test_stapo_serve_refuses_options_vllm_would_read_otherwise(env, capsys, args, message):
    """vLLM's parser turns `_` into `-`, keeps the last of a repeated option and expands prefixes: the checks read
    options the same way (`--host 127.0.0.1 --host 0.0.0.0` listened on every interface)."""
    assert main(["serve", "/models/m", *args, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_the_trainer_never_takes_the_secret_from_a_command_line(tmp_path):
    with pytest.raises(ConfigError, match="rollout.server_token is no longer read .* rollout.server.token_file"):
        STAPOConfig.from_yaml(None, ["rollout.server_token=s3cret"])
    old_run = STAPOConfig.from_dict({"rollout": {"server_token": None}})  # config.yaml of an earlier run
    assert old_run.rollout.server.token_file is None and "s3cret" not in repr(old_run)
    path = secret_file(tmp_path / "secret", "s3cret")
    cfg = STAPOConfig.from_yaml(None, [f"rollout.server.token_file={path}"])
    assert "s3cret" not in repr(cfg) and "s3cret" not in cfg.to_yaml()
