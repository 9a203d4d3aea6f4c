"""The stage core's one ledger: admission, release on finish, cancel, failure and crop, all through the
scheduler, on a one-stage load and on a ring; and no other module writes a ledger."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from events.requests import Sampling
from fellow.runtime.engine.budget import ContextTooLong
from fellow.runtime.engine.engine import local_engine
from fellow.runtime.engine.session import Session
from fellow.runtime.model.load.loader import load_one_stage
from fellow.runtime.ring.session import RingFailure
from tests.test_ring_runtime import COPY_TEXT, LocalRing, planted_servable

ROOT = Path(__file__).resolve().parents[1]
GREEDY = Sampling(temperature=0.0)
WRITES = {"reserve", "release", "resize"}  # TokenBudget's writing methods
OWNERS = {"fellow/runtime/engine/budget.py", "fellow/runtime/engine/scheduler.py"}


@pytest.fixture(scope="module")
def copier(tmp_path_factory):
    """A 2-stage servable of a model that copies COPY_TEXT, so prompt lookup's drafts stand and fall."""
    torch.set_num_threads(1)
    return planted_servable(tmp_path_factory.mktemp("core"), "copier", layers=2, seed=5, stages=2)


def sessions(bad: bool = True) -> list[Session]:
    """A session that drafts (its verify passes crop its cache), one cancelled mid-reply, and on one stage
    one whose sampling generator cannot be made (it fails at admission; a ring's stage 0 makes none)."""
    return [Session("copy", COPY_TEXT[:60], 24, GREEDY), Session("cancel", COPY_TEXT[5:40], 30, GREEDY),
            *([Session("bad", COPY_TEXT[:12], 8, Sampling(temperature=0.8, seed=2**64))] if bad else [])]


def drive(sched, checks) -> dict[str, Session]:
    """Step until idle; after every step each admitted session holds exactly its reservation, whatever
    crops its verify passes made. ``cancel`` is cancelled once it has tokens."""
    ended: dict[str, Session] = {}
    while sched.busy:
        result = sched.step()
        ended.update({s.session_id: s for s in result.finished})
        for session in result.finished:
            assert sched.budget.holds(session.session_id) == 0, session.session_id
        for sid, session in sched.sessions.items():
            assert sched.budget.holds(sid) == session.reserved_tokens
        assert sched.budget.reserved == sum(s.reserved_tokens for s in sched.sessions.values())
        if "cancel" in result.tokens:
            sched.cancel("cancel")
        checks()
    return ended


def check_ends(ended: dict[str, Session], sched) -> None:
    assert ended["copy"].finish_reason == "length" and ended["copy"].spec_passes > 0
    assert ended["copy"].spec_accepted < ended["copy"].spec_drafted  # drafts fell: caches were cropped
    assert ended["cancel"].finish_reason == "cancelled"
    if "bad" in ended:
        assert ended["bad"].finish_reason == "error" and ended["bad"].error.code == "admission_failed"
    assert sched.budget.reserved == 0 and not sched.sessions and not sched.waiting


def test_one_stage_admits_releases_and_refuses_through_the_scheduler(copier):
    sched = local_engine(load_one_stage(copier, "cpu").stage, kv_tokens=150, speculative=4, prefix_cache=False)
    with pytest.raises(ContextTooLong):
        sched.offer("huge", 140, 20)  # can never fit: nothing taken
    assert sched.offer("copy", 60, 24) and sched.budget.holds("copy") == 84  # as the intake asks
    assert not sched.offer("busy", 40, 30)  # 84 + 70 > 150: busy, nothing taken
    assert sched.offer("gone", 10, 10)
    sched.withdraw("gone")  # the intake could not claim it
    assert sched.budget.reserved == 84
    for session in sessions():
        sched.add(session)  # "cancel" and "bad" reserve at admission; "copy" holds its offer
    with pytest.raises(ValueError):
        sched.add(Session("copy", [1, 2], 1, GREEDY))  # its id is in: refused, and the one inside keeps its tokens
    assert sched.budget.holds("copy") == 84
    ended = drive(sched, lambda: None)
    check_ends(ended, sched)


def test_a_ring_admits_releases_and_its_later_stage_follows_the_ledger(copier):
    ring = LocalRing(copier, 2, prefill_chunk=16, speculative=4)
    follower = ring.workers[0].ledger
    seen: list[int] = []
    try:
        for session in sessions(bad=False):
            ring.head.add(session)
        ended = drive(ring.head, lambda: seen.append(follower.reserved))
        check_ends(ended, ring.head)
        ring.settle()
        assert max(seen) > 0 and follower.reserved == 0  # it held what stage 0 admitted, then let go
        ring.head.add(Session("late", COPY_TEXT[:20], 40, GREEDY))
        ring.head.step()
        ring.head.runner.fail_all("the ring is gone")  # a lost stage: every session fails, tokens come back
        ended = drive(ring.head, lambda: None)
        assert ended["late"].finish_reason == "error" and ring.head.budget.reserved == 0
        with pytest.raises(RingFailure):
            ring.head.add(Session("after", COPY_TEXT[:20], 4, GREEDY))  # refused, nothing held
        assert ring.head.budget.reserved == 0 and not ring.head.waiting
    finally:
        ring.close()


def ledger_writes(path: Path) -> list[int]:
    """Lines of ``path`` that call a writing method on something named like a ledger (budget, ledger)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in WRITES:
            target = ast.unparse(node.func.value)
            if "budget" in target or "ledger" in target:
                found.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "TokenBudget":
            found.append(node.lineno)
    return found


def test_no_module_but_the_scheduler_writes_a_ledger(tmp_path):
    writers = {str(p.relative_to(ROOT)): lines for layer in ("fellow", "core", "leader")
               for p in sorted((ROOT / layer).rglob("*.py")) if (lines := ledger_writes(p))}
    assert set(writers) <= OWNERS and "fellow/runtime/engine/scheduler.py" in writers, writers
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text("def f(self):\n    self.scheduler.budget.release('a')\n    self.ledger.resize(3)\n")
    assert ledger_writes(sneaky) == [2, 3]
