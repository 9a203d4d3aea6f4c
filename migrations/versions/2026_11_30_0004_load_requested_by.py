"""loads name who asked: requested_by for the load, unload_requested_by for its unload

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 18:30:00

Both hold the calling API token's id ("open" when the API had no token, "autoload" for a chat's
own load; '' before this revision). The loads projection is the log's to rebuild, so its rows and
checkpoint are dropped: on start it replays SWARM_EVENTS and fills both columns for every load.
"""
import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

COLUMNS = ('requested_by', 'unload_requested_by')


def _replay_loads() -> None:
    op.execute("DELETE FROM load_stages")
    op.execute("DELETE FROM loads")
    op.execute("DELETE FROM projector_checkpoints WHERE name = 'loads'")


def upgrade() -> None:
    with op.batch_alter_table('loads', schema=None) as batch_op:
        for name in COLUMNS:
            batch_op.add_column(sa.Column(name, sa.String(length=128), nullable=False, server_default=''))
    _replay_loads()


def downgrade() -> None:
    with op.batch_alter_table('loads', schema=None) as batch_op:
        for name in COLUMNS:
            batch_op.drop_column(name)
    _replay_loads()
