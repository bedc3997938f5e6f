"""CurveZMQ key material: ``radixserve keys``, key files, the environment, allow-lists, the
user's default key, and the errors that name what is wrong."""

from __future__ import annotations

import os
import stat

import pytest
import zmq

from radixserve.cli import main
from radixserve.links.keys import (
    ALLOW_ENV,
    KEY_ENV,
    PLAIN,
    CurveKeys,
    LinkKeyError,
    join_endpoint,
    load_security,
    read_key_file,
    split_endpoint,
)


def test_keys_new_writes_a_private_pair_and_a_public_key(tmp_path, capsys):
    assert main(["keys", "new", str(tmp_path / "prefill-a")]) == 0
    secret, public = tmp_path / "prefill-a.key_secret", tmp_path / "prefill-a.key"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    keys = read_key_file(secret)
    assert keys.public_key.decode() in capsys.readouterr().out
    assert zmq.auth.load_certificate(public) == (keys.public_key, None)  # ZeroMQ's format
    with pytest.raises(SystemExit):  # never overwritten
        main(["keys", "new", str(tmp_path / "prefill-a")])
    assert read_key_file(secret) == keys
    assert main(["keys", "show", str(public)]) == 0
    assert capsys.readouterr().out.strip() == keys.public_key.decode()


def test_keys_from_a_file_the_environment_or_the_default_file(tmp_path, capsys):
    main(["keys", "new", str(tmp_path / "a")])
    from_file = load_security(str(tmp_path / "a.key_secret"), env={})
    assert from_file == read_key_file(tmp_path / "a.key_secret")
    main(["keys", "new", "--env"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    name, secret = line.split("=", 1)
    assert name == KEY_ENV
    from_env = load_security(env={KEY_ENV: secret})
    assert from_env.public_key == zmq.curve_public(secret.encode())
    home = {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    first = load_security(env=home)  # made on first use, then the same for every process
    path = tmp_path / "config" / "radixserve" / "zmq.key_secret"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_security(env=home) == first != from_env


def test_allow_lists_take_keys_files_and_directories(tmp_path):
    others = [CurveKeys.generate() for _ in range(3)]
    (tmp_path / "clients").mkdir()
    from radixserve.links.keys import write_key_files

    write_key_files(others[0], tmp_path / "clients" / "router")
    write_key_files(others[1], tmp_path / "decode")
    env = {KEY_ENV: CurveKeys.generate().secret_key.decode(),
           ALLOW_ENV: others[2].public_key.decode()}  # fmt: skip
    keys = load_security(allow=[str(tmp_path / "clients"), str(tmp_path / "decode.key")], env=env)
    assert all(keys.accepts(k.public_key) for k in others)
    assert keys.accepts(keys.public_key) and not keys.accepts(CurveKeys.generate().public_key)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(key_file="/nonexistent.key_secret"), "cannot read a key file"),
        (dict(allow=["not-a-key"]), "neither a public key, a key file nor a directory"),
        (dict(unauthenticated=True, allow=["x"]), "--zmq-unauthenticated takes no"),
    ],
)
def test_bad_key_material_is_an_error_naming_it(kwargs, message):
    with pytest.raises(LinkKeyError, match=message):
        load_security(env={KEY_ENV: CurveKeys.generate().secret_key.decode()}, **kwargs)


def test_a_public_key_file_is_not_a_key_pair(tmp_path):
    main(["keys", "new", str(tmp_path / "a")])
    with pytest.raises(LinkKeyError, match="holds a public key only"):
        load_security(str(tmp_path / "a.key"), env={})
    with pytest.raises(LinkKeyError, match=KEY_ENV):
        load_security(env={KEY_ENV: "too short"})


def test_unauthenticated_only_when_asked_for():
    assert load_security(unauthenticated=True, env={}) is PLAIN
    assert load_security(env={KEY_ENV: CurveKeys.generate().secret_key.decode()}) is not PLAIN


def test_an_endpoint_carries_its_server_key():
    keys = CurveKeys.generate()
    endpoint = join_endpoint("tcp://10.0.0.5:7000", keys.public_key)
    assert split_endpoint(endpoint) == ("tcp://10.0.0.5:7000", keys.public_key)
    assert split_endpoint("tcp://10.0.0.5:7000") == ("tcp://10.0.0.5:7000", None)
    with pytest.raises(LinkKeyError):
        split_endpoint("tcp://10.0.0.5:7000?curve=short")


def test_serve_names_the_flag_of_a_bad_key(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", "0", "--kv-events-endpoint", "tcp://127.0.0.1:0",
              "--zmq-key", "/nonexistent.key_secret"])  # fmt: skip
    assert e.value.code == 2
    assert "--zmq-key" in capsys.readouterr().err


def test_a_default_key_file_that_cannot_be_made_is_an_error_naming_it(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    env = {"XDG_CONFIG_HOME": str(tmp_path / "file")}  # its radixserve/ cannot be made
    with pytest.raises(LinkKeyError, match="cannot make the default key file .* --zmq-key"):
        load_security(env=env)
