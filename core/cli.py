"""The `swarm` command: start the parts of the stack, and talk to a running leader."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from core.cli_errors import CliError, part
from core.procs import follow_parent
from core.settings import Settings, SettingsError

__all__ = ["CliError", "build_parser", "main"]


def _settings() -> Settings:
    return Settings.from_env()


def _logging(verbose: bool = False) -> None:
    from core.logs import setup_logging

    setup_logging(logging.DEBUG if verbose else logging.INFO)  # SWARM_LOG_FORMAT: text or json


# --- parts of the stack -------------------------------------------------------------------------

def cmd_nats(args) -> int:
    from pathlib import Path

    from core.nats_server import ClusterNode, EmbeddedNats, LeafRemote

    s = _settings()
    if args.config and not Path(args.config).is_file():
        raise CliError(f"--config {args.config}: no such file (write one with `swarm nats-auth`)")
    cluster = None
    if args.cluster_port or args.routes:
        if not (args.cluster_port and args.routes and args.server_name):
            raise CliError("a cluster node needs --server-name, --cluster-port and --routes")
        cluster = ClusterNode(args.server_name, args.cluster_port,
                              tuple(r.strip() for r in args.routes.split(",") if r.strip()))
    leaf = None
    if args.leaf:
        if cluster or args.leaf_port is not None:
            raise CliError("a leaf node (--leaf) is neither a cluster node nor a hub (--leaf-port)")
        # the leaf link logs in as SWARM_NATS_USER (a leaf-<name> user of `swarm nats-auth --leaf`)
        leaf = LeafRemote(tuple(u.strip() for u in args.leaf.split(",") if u.strip()), s.nats.credentials)
    srv = EmbeddedNats(s.nats_store_dir if not args.store_dir else Path(args.store_dir),
                       port=args.port, host=args.host, config=Path(args.config) if args.config else None,
                       cluster=cluster, leaf_port=args.leaf_port, leaf=leaf,
                       sync=None if args.sync == "default" else args.sync, http_port=args.http_port)
    # SIGTERM (kill, systemd's and docker's stop) ends this process as Ctrl-C does, so its nats-server
    # stops with it: by default Python would exit at once and leave the server running
    previous = signal.signal(signal.SIGTERM, _interrupted)
    try:
        srv.start()
        what = f"leaf node of {args.leaf}, JetStream on the hub" if leaf else "JetStream"
        print(f"nats-server with {what} at {srv.url} (store {srv.store_dir}"
              f"{', users from ' + args.config if args.config else ', open: no users'}"
              f"{', cluster node ' + cluster.name if cluster else ''}"
              f"{f', leaf nodes on port {srv.leaf_port}' if srv.leaf_port is not None else ''})", flush=True)
        code = srv.process.wait()
    except KeyboardInterrupt:
        return 0  # asked to stop: the server stops with us
    finally:
        srv.stop()
        signal.signal(signal.SIGTERM, previous)
    return _died("nats-server", code)


def _died(what: str, code: int) -> int:
    """A child that ended unasked: one line, and a non-zero status (128 + signal, as a shell says it), so that
    a service manager's Restart=on-failure starts this again."""
    from core.supervise import describe_exit

    print(f"swarm: {what} ended unasked ({describe_exit(code)})", file=sys.stderr, flush=True)
    return 128 - code if code < 0 else (code or 1)


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def _check_nats(s: Settings) -> None:
    from core.bus import BusUnavailable, connect

    url = s.nats.url or "nats://127.0.0.1:4222"

    async def probe() -> None:
        nc = await connect(url, name="swarm-probe", timeout=5.0, credentials=s.nats.credentials,
                           allow_reconnect=False)
        await nc.close()

    try:
        asyncio.run(probe())
    except BusUnavailable as exc:
        raise CliError(str(exc)) from None


def _check_port(host: str, port: int) -> None:
    """The leader's port taken says so at once, before the leader starts its parts (uvicorn binds last)."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
            sock.bind((host, port))
    except OSError as exc:
        raise CliError(f"the leader cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def cmd_leader(args) -> int:
    import uvicorn

    s = _settings()
    _check_port(s.leader.host, s.leader.port)
    _check_nats(s)
    _logging(args.verbose)
    app = part("leader-app")(s)
    json_logs = {"log_config": None} if s.logging.format == "json" else {}  # uvicorn's lines go through ours
    uvicorn.run(app, host=s.leader.host, port=s.leader.port, log_level="warning", **json_logs)
    return 0


def cmd_nats_auth(args) -> int:
    from core.nats_auth import AuthDir
    from core.nats_callout import CalloutDir

    auth = AuthDir(args.dir)
    leaves = {}
    for spec in args.leaf:
        name, sep, fellows = spec.partition("=")
        if not sep or not name.strip():
            raise CliError(f"--leaf {spec!r}: NAME=FELLOW,FELLOW,...")
        leaves[name.strip()] = [f.strip().replace(".", "-") for f in fellows.split(",") if f.strip()]
    try:
        users = auth.ensure([f.replace(".", "-") for f in args.fellow], leaves)
        if args.callout or CalloutDir(auth).enabled():  # once on, it stays on
            CalloutDir(auth).ensure()
    except ValueError as exc:
        raise CliError(str(exc)) from None
    print(f"{len(users)} NATS users in {auth.path}: {', '.join(sorted(users))}")
    print(f"  nats-server config: {auth.config}; each process's credentials: {auth.path}/<user>.env")
    for name in auth.leaves():
        print(f"  leaf {name}: its nats-server's config {auth.leaf_config(name)}, its link's credentials "
              f"{auth.path}/leaf-{name}.env")
    return 0


def cmd_fellow(args) -> int:
    s = _settings()
    _check_nats(s)
    _logging(args.verbose)
    return asyncio.run(part("fellow")(s, fellow_id=args.id))


def cmd_up(args) -> int:
    from core.stack import run_stack

    return run_stack(_settings(), fellows=args.fellows, demo=not args.no_demo)


def cmd_db(args) -> int:
    s = _settings()
    part("db-upgrade")(s.leader.database_url, args.revision)
    print(f"database at {args.revision}")
    return 0


def cmd_replay(args) -> int:
    s = _settings()
    _check_nats(s)
    for name, seq in asyncio.run(part("replay")(s, args.projection)).items():
        print(f"{name}: rebuilt through sequence {seq}")
    return 0


CLIENT_ENV = """environment:
  SWARM_LEADER_URL   the leader the client commands (models, model-load, infer, tokens ...) talk to
                     (default http://127.0.0.1:SWARM_LEADER_PORT, port 8000)
  SWARM_API_TOKEN    the API token they send as 'Authorization: Bearer ...' (needed once tokens exist)
  SWARM_NATS_URL, SWARM_NATS_USER, SWARM_NATS_PASSWORD: the bus, for leader, fellow and nats commands"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swarm", description="Serve LLMs across a swarm of machines.", epilog=CLIENT_ENV,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="embedded stack: nats-server + leader + local fellows")
    up.add_argument("--fellows", type=int, default=1, help="local fellows to start (default 1)")
    up.add_argument("--no-demo", action="store_true", help="do not build the demo model if absent")
    up.set_defaults(func=cmd_up)

    n = sub.add_parser("nats", help="run a nats-server with JetStream")
    n.add_argument("--port", type=int, default=4222, help="client port (default 4222)")
    n.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    n.add_argument("--store-dir", default=None, help="JetStream store folder (default: under SWARM_DATA_DIR)")
    n.add_argument("--config", default=None, help="users and permissions (the auth.conf of `swarm nats-auth`)")
    n.add_argument("--server-name", default=None, help="this node's name in a cluster")
    n.add_argument("--cluster-port", type=int, default=0, help="the port this node's cluster routes listen on")
    n.add_argument("--routes", default=None, help="the other nodes' routes: nats://host:port,...")
    n.add_argument("--leaf-port", type=int, default=None,
                   help="a hub: listen for leaf nodes on this port (7422 is the usual; 0: a free one)")
    n.add_argument("--leaf", default=None, metavar="HUB_URL",
                   help="run as a leaf node of the hub at nats-leaf://host:port[,...] (its leafnode port); "
                        "logs in as SWARM_NATS_USER/SWARM_NATS_PASSWORD when set")
    n.add_argument("--sync", default="always",
                   help="JetStream's sync_interval: always (fsync each write before its ack, the default), "
                        "a duration such as 1s, or default (nats-server's: every 2 minutes, after the ack)")
    n.add_argument("--http-port", type=int, default=None,
                   help="nats-server's monitoring port (/varz, /jsz); off by default")
    n.set_defaults(func=cmd_nats)

    na = sub.add_parser("nats-auth", help="write NATS users (leader, ops, one per fellow) and their permissions")
    na.add_argument("dir", help="folder for users.json, auth.conf and one <user>.env per user")
    na.add_argument("--fellow", action="append", default=[], help="a fellow id (repeat for each fellow)")
    na.add_argument("--leaf", action="append", default=[], metavar="NAME=FELLOW,...",
                    help="a leaf node (a home's nats-server) and the fellows on it (repeat for each leaf)")
    na.add_argument("--callout", action="store_true",
                    help="per-load rights on any server: the leader answers auth callout (docs/trust.md)")
    na.set_defaults(func=cmd_nats_auth)

    sub.add_parser("leader", help="run the leader (gateway + projectors)").set_defaults(func=cmd_leader)
    f = sub.add_parser("fellow", help="run a fellow agent")
    f.add_argument("--id", default=None, help="this fellow's id, which its NATS user names (default: <hostname>-<pid>)")
    f.set_defaults(func=cmd_fellow)

    db = sub.add_parser("db", help="database migrations")
    dbs = db.add_subparsers(dest="db_command", required=True)
    upg = dbs.add_parser("upgrade", help="apply migrations")
    upg.add_argument("revision", nargs="?", default="head", help="the revision to reach (default head)")
    upg.set_defaults(func=cmd_db)

    r = sub.add_parser("replay", help="rebuild projections from the event log")
    r.add_argument("--projection", default=None, help="one projection (default: all)")
    r.set_defaults(func=cmd_replay)

    for extend in _extensions():
        extend(sub)
    return p


def _extensions():
    """Commands added by features, each a function taking the subparsers object."""
    from core import cli_client

    return [cli_client.add_commands]


def main(argv: list[str] | None = None) -> int:
    follow_parent()  # under `swarm up`: go when it goes, however it goes
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except (CliError, SettingsError) as exc:
        print(f"swarm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
