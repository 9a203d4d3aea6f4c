"""loads.quantization_requested / quantization_reason, load_stages.weights: what a load asked, what its
stages serve and why they differ, and each stage's priced and measured weight bytes

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 04:00:00

Filled from LoadRequested, LoadPlaced and StageReady. The loads projection is the log's to rebuild, so
its rows and checkpoint are dropped: on start it replays SWARM_EVENTS.
"""
import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def _replay_loads() -> None:
    op.execute("DELETE FROM load_stages")
    op.execute("DELETE FROM loads")
    op.execute("DELETE FROM projector_checkpoints WHERE name = 'loads'")


def upgrade() -> None:
    with op.batch_alter_table('loads', schema=None) as batch_op:
        batch_op.add_column(sa.Column('quantization_requested', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('quantization_reason', sa.Text(), nullable=False, server_default=''))
    with op.batch_alter_table('load_stages', schema=None) as batch_op:
        batch_op.add_column(sa.Column('weights', sa.JSON(), nullable=True))
    _replay_loads()


def downgrade() -> None:
    with op.batch_alter_table('load_stages', schema=None) as batch_op:
        batch_op.drop_column('weights')
    with op.batch_alter_table('loads', schema=None) as batch_op:
        batch_op.drop_column('quantization_reason')
        batch_op.drop_column('quantization_requested')
    _replay_loads()
