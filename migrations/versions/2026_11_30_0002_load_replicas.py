"""load replicas: load_stages keyed by (load, stage, replica); requests name the fellow that served them

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 00:30:00

load_stages gains `replica` in its primary key. A projection is the log's to rebuild, so the table is
made anew and the loads projector's checkpoint is dropped with its rows: on start it replays
SWARM_EVENTS into the new shape. requests gains `fellow_id` ('' for rows recorded before it).
"""
import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def _load_stages(with_replica: bool) -> None:
    columns = [
        sa.Column('load_id', sa.String(length=64), nullable=False),
        sa.Column('stage', sa.Integer(), nullable=False),
    ]
    if with_replica:
        columns.append(sa.Column('replica', sa.Integer(), nullable=False))
    columns += [
        sa.Column('fellow_id', sa.String(length=128), nullable=False),
        sa.Column('layer_first', sa.Integer(), nullable=False),
        sa.Column('layer_last', sa.Integer(), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('pid', sa.Integer(), nullable=False),
        sa.Column('kv_tokens', sa.Integer(), nullable=False),
        sa.Column('kv_tokens_planned', sa.Integer(), nullable=False),
        sa.Column('max_in_flight', sa.Integer(), nullable=False),
        sa.Column('vram_bytes', sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint(*(('load_id', 'stage', 'replica') if with_replica else ('load_id', 'stage'))),
    ]
    op.create_table('load_stages', *columns)
    with op.batch_alter_table('load_stages', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_load_stages_fellow_id'), ['fellow_id'], unique=False)


def _rebuild_loads(with_replica: bool) -> None:
    op.drop_index(op.f('ix_load_stages_fellow_id'), table_name='load_stages')
    op.drop_table('load_stages')
    _load_stages(with_replica)
    op.execute("DELETE FROM loads")
    op.execute("DELETE FROM projector_checkpoints WHERE name = 'loads'")


def upgrade() -> None:
    _rebuild_loads(with_replica=True)
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.add_column(sa.Column('fellow_id', sa.String(length=128), nullable=False, server_default=''))


def downgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.drop_column('fellow_id')
    _rebuild_loads(with_replica=False)
