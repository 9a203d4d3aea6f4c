"""Token strings, hashes and scope implication: pure functions, no services."""

from __future__ import annotations

import hashlib
import re

import pytest

from leader.auth import token_format as tf
from leader.auth.scopes import canonical, effective, grants


def test_minted_tokens_are_well_formed_unique_and_checksummed():
    tokens = {tf.new_secret() for _ in range(200)}
    assert len(tokens) == 200
    for token in tokens:
        assert re.fullmatch(r"sk-swarm-[0-9A-Za-z]{49}", token), token
        assert tf.well_formed(token)
        body = token[len(tf.TOKEN_PREFIX):-tf.CHECKSUM_CHARS]
        assert token.endswith(tf.checksum(body))


def test_secret_body_carries_at_least_128_bits():
    assert 62 ** tf.BODY_CHARS >= 2 ** 128
    assert tf.SECRET_BYTES * 8 >= 128
    assert tf.base62(2 ** 256 - 1, tf.BODY_CHARS)  # the largest secret fits the body's width
    with pytest.raises(ValueError):
        tf.base62(62 ** 3, 3)


@pytest.mark.parametrize("mangle", [
    lambda t: t[:-1] + ("A" if t[-1] != "A" else "B"),  # checksum digit changed
    lambda t: t[:20] + ("x" if t[20] != "x" else "y") + t[21:],  # body changed, checksum kept
    lambda t: t[:-1],  # too short
    lambda t: t + "0",  # too long
    lambda t: "sk-other-" + t[9:],  # another prefix
    lambda t: t[:30] + "-" + t[31:],  # outside the alphabet
])
def test_near_misses_are_not_well_formed(mangle):
    token = tf.new_secret()
    assert tf.well_formed(token)
    assert not tf.well_formed(mangle(token))


def test_hash_and_display_prefix():
    token = tf.new_secret()
    assert tf.hash_secret(token) == hashlib.sha256(token.encode()).hexdigest()
    prefix = tf.display_prefix(token)
    assert token.startswith(prefix) and prefix.startswith("sk-swarm-") and len(prefix) == 13
    assert tf.new_token_id() != tf.new_token_id()


def test_scopes_imply_downwards():
    assert effective(["admin"]) == ["read", "operate", "admin"]
    assert effective(["operate"]) == ["read", "operate"]
    assert effective(["read"]) == ["read"]
    assert grants(["operate"], "read") and not grants(["operate"], "admin")
    assert not grants(["read"], "operate") and not grants([], "read")
    assert grants([], "public")
    assert canonical(["admin", "read", "read", "bogus"]) == ["read", "admin"]
