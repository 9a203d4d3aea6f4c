"""core/nats_jwt.py and `swarm nats-auth --callout`: JWTs signed and checked, .creds files written and
read back, bad input refused with a message that says what is wrong."""

from __future__ import annotations

import json

import nkeys
import pytest

from core import nats_jwt
from core.cli import main
from core.nats_auth import AuthDir, fellow_user
from core.nats_callout import CalloutDir


def test_a_jwt_round_trips_and_a_forgery_is_refused():
    issuer, other = nats_jwt.new_key(), nats_jwt.new_key()
    token = nats_jwt.user_claims(issuer, "UABC", "fellow-f1", "$G", {"publish": {"allow": ["a.>"]}})
    claims = nats_jwt.decode(token)
    assert claims["iss"] == nats_jwt.public(issuer) and claims["nats"]["pub"] == {"allow": ["a.>"]}
    head, body, _ = token.split(".")
    forged = nats_jwt.encode({**claims, "iss": nats_jwt.public(other)}, other).split(".")[2]
    with pytest.raises(nats_jwt.JwtError, match="signature"):
        nats_jwt.decode(f"{head}.{body}.{forged}")
    with pytest.raises(nats_jwt.JwtError, match="expired"):
        nats_jwt.decode(nats_jwt.user_claims(issuer, "UABC", "x", "$G", {}, expires_s=-1))
    with pytest.raises(nats_jwt.JwtError, match="three parts"):
        nats_jwt.decode("not-a-jwt")


def test_a_creds_file_names_its_user_and_a_bad_one_is_refused(tmp_path):
    issuer, user = nats_jwt.new_key(), nats_jwt.new_key(nkeys.PREFIX_BYTE_USER)
    token = nats_jwt.user_claims(issuer, nats_jwt.public(user), "fellow-f1", "$G", {})
    path = nats_jwt.write_creds(tmp_path / "f1.creds", token, user.seed)
    assert nats_jwt.read_creds(path) == (token, user.seed.decode())
    assert nats_jwt.creds_user(path) == "fellow-f1"
    (tmp_path / "bad.creds").write_text("hello")
    with pytest.raises(nats_jwt.JwtError, match="not a NATS .creds file"):
        nats_jwt.read_creds(tmp_path / "bad.creds")
    with pytest.raises(nats_jwt.JwtError, match="cannot read"):
        nats_jwt.read_creds(tmp_path / "missing.creds")
    stranger = nats_jwt.new_key(nkeys.PREFIX_BYTE_USER)
    nats_jwt.write_creds(tmp_path / "swapped.creds", token, stranger.seed)
    with pytest.raises(nats_jwt.JwtError, match="not the key its JWT was issued to"):
        nats_jwt.creds_user(tmp_path / "swapped.creds")


def test_nats_auth_callout_writes_the_callout_config_and_creds(tmp_path, capsys):
    folder = tmp_path / "auth"
    assert main(["nats-auth", str(folder), "--fellow", "f1", "--callout"]) == 0
    auth = AuthDir(folder)
    block = json.loads(auth.config.read_text().split(":", 1)[1])
    assert block["auth_callout"]["auth_users"] == ["leader"]
    assert block["auth_callout"]["issuer"] == nats_jwt.public(CalloutDir(auth).issuer())
    assert [u.get("user") for u in block["users"]] == ["leader", None]  # no fellow in the server's config
    assert nats_jwt.creds_user(CalloutDir(auth).creds(fellow_user("f1"))) == fellow_user("f1")
    seed = CalloutDir(auth).seed_file.read_text()
    assert main(["nats-auth", str(folder), "--fellow", "f2"]) == 0  # once on, it stays on, same key
    assert CalloutDir(auth).seed_file.read_text() == seed and CalloutDir(auth).creds(fellow_user("f2")).exists()
