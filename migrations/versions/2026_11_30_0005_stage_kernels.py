"""load_stages.kernels: how each stage computes (its path, kernel per weight shape, step costs)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 20:30:00

Filled from StageReady.kernels. The loads projection is the log's to rebuild, so its rows and
checkpoint are dropped: on start it replays SWARM_EVENTS (events before this revision have none).
"""
import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def _replay_loads() -> None:
    op.execute("DELETE FROM load_stages")
    op.execute("DELETE FROM loads")
    op.execute("DELETE FROM projector_checkpoints WHERE name = 'loads'")


def upgrade() -> None:
    with op.batch_alter_table('load_stages', schema=None) as batch_op:
        batch_op.add_column(sa.Column('kernels', sa.JSON(), nullable=True))
    _replay_loads()


def downgrade() -> None:
    with op.batch_alter_table('load_stages', schema=None) as batch_op:
        batch_op.drop_column('kernels')
    _replay_loads()
