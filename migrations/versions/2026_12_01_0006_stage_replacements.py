"""load_stages.replaced: the fellows a ring stage was re-placed from (StageReplaced), for status and the dashboard

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 04:00:00

The loads projection is the log's to rebuild, so its rows and checkpoint are dropped: on start it
replays SWARM_EVENTS.
"""
import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def _replay_loads() -> None:
    op.execute("DELETE FROM load_stages")
    op.execute("DELETE FROM loads")
    op.execute("DELETE FROM projector_checkpoints WHERE name = 'loads'")


def upgrade() -> None:
    with op.batch_alter_table('load_stages', schema=None) as batch_op:
        batch_op.add_column(sa.Column('replaced', sa.JSON(), nullable=True))
    _replay_loads()


def downgrade() -> None:
    with op.batch_alter_table('load_stages', schema=None) as batch_op:
        batch_op.drop_column('replaced')
    _replay_loads()
