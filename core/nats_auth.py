"""NATS users and permissions: one user per role (leader, ops, each fellow), written as a nats-server
config; and the credentials a process connects with (SWARM_NATS_USER, SWARM_NATS_PASSWORD).

A leader may do anything. Ops may only read the event log and the heartbeats: no consumer it could
create replaces, deletes or outlives another's. A fellow may publish its own heartbeat, the events a
fellow reports (stage ready, replica lost, unloaded, load failed, request finished or failed) on
subjects that name it, token frames and ring frames; it may take only its own commands (a consumer
filtered to them), pull from the request queues, and read only its own inbox. Which request queues: on a
nats-server the leader manages (`swarm up`; AuthDir with `grants.json`), only those of the loads whose
stage 0 the leader placed on it (leader.serving.grants keeps them, and reloads the server); on one it
does not, any load's (the leader cannot change that server's users). Nothing else: not
`load.placed`, not `api_token.*`, not another fellow's heartbeat or commands, not the event log, not a
stored token frame, not stream info (which would list the requests in flight: it learns only the stream
names, and of a request whose id it knows whether frames are stored, by a publish the stream refuses). What
it may publish the leader still checks against its placements (leader.projectors.authority) and the
requests' frame keys (events.frames). A client without a user is refused (no `no_auth_user`).

A leaf node (`swarm nats --leaf`, a home's local nats-server) links to the hub as a `leaf-<name>` user
whose rights are the union of its fellows' rights, with their JetStream API requests in the hub's
domain: what the leaf forwards can be no more than those fellows may do. The leaf itself checks each
fellow with `leaf-<name>.conf`, which holds only those fellows' users.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from events.subjects import (
    COMMANDS_STREAM,
    EVENTS_STREAM,
    HEARTBEATS_STREAM,
    REQUESTS_STREAM,
    commands_for,
    event,
    event_watch,
    heartbeat,
    request,
    request_consumer,
)

LEADER_USER = "leader"
OPS_USER = "ops"
HUB_DOMAIN = "swarm"  # the JetStream domain of a nats-server that takes leaf nodes

# What a fellow (and its stage processes) publishes on swarm.evt.<type>; every other type is refused.
FELLOW_EVENTS = ("load.stage_ready", "load.replica_lost", "load.unloaded", "load.failed",
                 "request.finished", "request.failed")


def fellow_user(fellow_id: str) -> str:
    return "fellow-" + fellow_id


def leaf_user(name: str) -> str:
    return "leaf-" + name


def inbox_prefix(user: str) -> str:
    """Each user's replies come on its own inbox subjects, which only it may read."""
    return "_INBOX." + user


@dataclass(frozen=True)
class Credentials:
    """A user and its password, or (`creds`) a `.creds` file whose JWT names the user (core.nats_jwt;
    the auth callout checks it: core.nats_callout)."""

    user: str
    password: str
    creds: Path | None = None

    def env(self) -> dict[str, str]:
        if self.creds is not None:
            return {"SWARM_NATS_CREDS": str(self.creds)}
        return {"SWARM_NATS_USER": self.user, "SWARM_NATS_PASSWORD": self.password}

    def connect_options(self) -> dict:
        if self.creds is not None:  # the JWT goes as the token too: a callout sees no JWT in config mode
            from core.nats_jwt import read_creds

            return {"user_credentials": str(self.creds), "token": read_creds(self.creds)[0], "user": self.user,
                    "inbox_prefix": inbox_prefix(self.user)}
        return {"user": self.user, "password": self.password, "inbox_prefix": inbox_prefix(self.user)}


def _consumer_api(stream: str, consumer: str, filter_subject: str = ">") -> list[str]:
    """Publish rights to create (with a filter within `filter_subject`), inspect, pull from and ack one
    durable consumer (`*`: any). The create names its filter in the subject (nats-py does, for a consumer
    with a name), so the filter is checked here: not the legacy forms that carry it in the payload."""
    return [
        f"$JS.API.CONSUMER.INFO.{stream}.{consumer}",
        f"$JS.API.CONSUMER.CREATE.{stream}.{consumer}.{filter_subject}",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}",
        f"$JS.ACK.{stream}.{consumer}.>",
    ]


def _reader_api(stream: str) -> list[str]:
    """Publish rights to read a stream and nothing else: its info and messages, and ephemeral consumers
    created by the legacy subject (the server refuses a durable one there; a named create, which could
    replace another's consumer, is not allowed), pulled from; no delete, purge or update."""
    return [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.>", f"$JS.API.CONSUMER.CREATE.{stream}",
            f"$JS.API.CONSUMER.INFO.{stream}.*", f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*"]


def leader_permissions() -> dict:
    return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}


def ops_permissions() -> dict:
    return {
        "publish": {"allow": ["$JS.API.INFO", *_reader_api(EVENTS_STREAM), *_reader_api(HEARTBEATS_STREAM)]},
        "subscribe": {"allow": [inbox_prefix(OPS_USER) + ".>"]},
    }


def request_queues(loads: list[str] | None) -> list[str]:
    """Publish rights on request consumers: those of `loads` (each filtered to its load's subject), or
    any load's (None: a server whose users the leader does not manage)."""
    if loads is None:
        return _consumer_api(REQUESTS_STREAM, "*")
    return [s for load_id in loads for s in _consumer_api(REQUESTS_STREAM, request_consumer(load_id), request(load_id))]


def fellow_permissions(fellow_id: str, js_domain: str | None = None, loads: list[str] | None = None) -> dict:
    """`js_domain`: its JetStream API requests as a leaf node maps them, into the hub's domain; `loads`:
    the loads whose request queues it may pull from (None: any load's)."""
    user = fellow_user(fellow_id)
    command_consumer = "fellow-" + fellow_id  # events.subjects.command_consumer
    perms = {
        "publish": {"allow": [
            heartbeat(fellow_id),  # raises ValueError on an id that is not a subject token
            # its events on subjects that name it (core.bus.publish_event): the leader knows who sent one
            *(event(kind, fellow_id) for kind in FELLOW_EVENTS),
            "swarm.tok.*", "swarm.ring.>",
            # which streams exist (core.bus.wait_streams): their names only. No stream info: with a subjects
            # filter it lists each subject and its count, on SWARM_TOKENS every request in flight (the intake
            # asks of its own request by a publish the stream refuses: fellow.token_batcher.stored_beyond);
            # no MSG.GET, DIRECT.GET or consumer on SWARM_TOKENS: no other request's reply
            "$JS.API.STREAM.NAMES",
            *_consumer_api(COMMANDS_STREAM, command_consumer, commands_for(fellow_id)),
            *request_queues(loads),
        ]},
        "subscribe": {"allow": [
            inbox_prefix(user) + ".>", f"swarm.logs.{fellow_id}", "swarm.cancel.*.*", "swarm.ring.>",
            # a ring stage's watches, core NATS: its load failed, a later stage was re-placed and is ready
            *event_watch("load.failed"), event("load.stage_replaced"), *event_watch("load.stage_ready"),
        ]},
        "allow_responses": True,  # the answer to a logs request
    }
    if js_domain:
        perms["publish"]["allow"] = [s.replace("$JS.API.", f"$JS.{js_domain}.API.", 1)
                                     for s in perms["publish"]["allow"]]
    return perms


def leaf_permissions(fellow_ids: list[str], hub_domain: str, grants: Mapping[str, list[str]] | None = None) -> dict:
    """A leaf link's rights on the hub (what it may send in, what it may take out): its fellows' rights,
    their `$JS.API.` requests as the leaf maps them, into the hub's JetStream domain."""
    publish: list[str] = []
    subscribe: list[str] = []
    for fellow_id in fellow_ids:
        perms = fellow_permissions(fellow_id, hub_domain, None if grants is None else grants.get(fellow_id, []))
        publish += perms["publish"]["allow"]
        subscribe += perms["subscribe"]["allow"]
    # a fellow answers a logs request on the leader's inbox; a hub forwards to a leaf only the interest
    # the leaf may publish to (allow_responses does not cross a leaf link), so the link may write there
    publish.append(inbox_prefix(LEADER_USER) + ".>")
    return {"publish": {"allow": list(dict.fromkeys(publish))}, "subscribe": {"allow": list(dict.fromkeys(subscribe))}}


def server_config(passwords: Mapping[str, str], leaves: Mapping[str, list[str]] | None = None,
                  js_domain: str | None = None, grants: Mapping[str, list[str]] | None = None) -> str:
    """The `authorization` block for nats-server: `passwords` maps each user to its password, `leaves`
    each leaf name to its fellows; `js_domain`: a leaf node's config, whose fellows' JetStream API
    requests are mapped into the hub's domain (the leaf checks rights after that mapping); `grants`:
    each fellow's loads whose request queues it may pull from (None: any load's, for every fellow).

    A user is `leader`, `ops`, `fellow-<id>` or `leaf-<name>`. JSON is valid nats-server config syntax."""
    leaves = leaves or {}
    users = []
    for user, password in sorted(passwords.items()):
        if user == LEADER_USER:
            perms = leader_permissions()
        elif user == OPS_USER:
            perms = ops_permissions()
        elif user.startswith("fellow-"):
            fellow_id = user[len("fellow-"):]
            perms = fellow_permissions(fellow_id, js_domain, None if grants is None else grants.get(fellow_id, []))
        elif user.startswith("leaf-") and user[len("leaf-"):] in leaves:
            perms = leaf_permissions(leaves[user[len("leaf-"):]], HUB_DOMAIN, grants)
        else:
            raise ValueError(f"unknown NATS user {user!r} (leader, ops, fellow-<id> or leaf-<name>)")
        users.append({"user": user, "password": password, "permissions": perms})
    return "authorization: " + json.dumps({"users": users}, indent=1) + "\n"


class AuthDir:
    """A folder holding `users.json` (user -> password; kept, so restarts keep the same passwords),
    the nats-server config `auth.conf` built from it, and one `<user>.env` per user; with leaf nodes,
    `leaves.json` (leaf name -> its fellows) and one `leaf-<name>.conf` per leaf (its fellows' users,
    for the leaf's own nats-server). For a nats-server the leader manages, `grants.json` (fellow -> the
    loads whose request queues it may pull from; written by the leader, leader.serving.grants) and the
    server's pid file `nats-server.pid` (the leader reloads the server when the grants change)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @property
    def config(self) -> Path:
        return self.path / "auth.conf"

    def passwords(self) -> dict[str, str]:
        f = self.path / "users.json"
        return json.loads(f.read_text()) if f.exists() else {}

    def leaves(self) -> dict[str, list[str]]:
        f = self.path / "leaves.json"
        return json.loads(f.read_text()) if f.exists() else {}

    def leaf_config(self, name: str) -> Path:
        return self.path / f"leaf-{name}.conf"

    @property
    def pid_file(self) -> Path:
        return self.path / "nats-server.pid"

    def grants(self) -> dict[str, list[str]] | None:
        """Each fellow's loads whose request queues it may pull from; None: per-load grants are off (any
        fellow may pull any load's)."""
        f = self.path / "grants.json"
        return json.loads(f.read_text()) if f.exists() else None

    def set_grants(self, grants: Mapping[str, list[str]]) -> bool:
        """Keep these grants (per-load grants on) and rewrite `auth.conf` with them; False where nothing
        changed (the server needs no reload)."""
        grants = {f: sorted(set(loads)) for f, loads in sorted(grants.items()) if loads}
        if grants == self.grants():
            return False
        config = server_config(self.passwords(), self.leaves(), grants=grants)
        self._write("auth.conf", config)
        self._write("grants.json", json.dumps(grants, indent=1) + "\n")
        return True

    def ensure(self, fellow_ids: list[str], leaves: Mapping[str, list[str]] | None = None,
               per_load: bool = False) -> dict[str, str]:
        """Add the leader, ops, these fellows and these leaves (name -> its fellows, added too; new
        passwords for new users); rewrite the files. `per_load`: turn per-load grants on (none yet),
        for a nats-server the leader manages; once on, they stay on."""
        self.path.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)
        passwords = self.passwords()
        all_leaves = {**self.leaves(), **{n: list(dict.fromkeys(fs)) for n, fs in (leaves or {}).items()}}
        fellows = [*fellow_ids, *(f for fs in all_leaves.values() for f in fs)]
        for name in all_leaves:
            heartbeat(name)  # a leaf name is a subject token too
        for user in (LEADER_USER, OPS_USER, *(fellow_user(f) for f in fellows), *(leaf_user(n) for n in all_leaves)):
            passwords.setdefault(user, secrets.token_urlsafe(24))
        grants = self.grants()
        # raises ValueError on a bad id before anything is written
        config = server_config(passwords, all_leaves, grants={} if grants is None and per_load else grants)
        if grants is None and per_load:
            self._write("grants.json", "{}\n")
        self._write("users.json", json.dumps(passwords, indent=1, sort_keys=True) + "\n")
        self._write("auth.conf", config)
        if all_leaves:
            self._write("leaves.json", json.dumps(all_leaves, indent=1, sort_keys=True) + "\n")
        for name, leaf_fellows in all_leaves.items():
            mine = {fellow_user(f): passwords[fellow_user(f)] for f in leaf_fellows}
            self._write(self.leaf_config(name).name, server_config(mine, js_domain=HUB_DOMAIN))
        for user, password in passwords.items():
            self._write(f"{user}.env", "".join(f"{k}={v}\n" for k, v in Credentials(user, password).env().items()))
        return passwords

    def credentials(self, user: str) -> Credentials:
        return Credentials(user, self.passwords()[user])

    def _write(self, name: str, text: str) -> None:
        target = self.path / name
        tmp = target.with_suffix(target.suffix + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
