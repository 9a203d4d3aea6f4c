"""The leader's NATS auth callout service (issue 54): every connection but the leader's own is
authorized here, with the permissions of what is placed on it now (core.nats_callout says how the
server is configured, leader.auth_callout.service answers)."""

from leader.auth_callout.service import AuthCallout

__all__ = ["AuthCallout"]
