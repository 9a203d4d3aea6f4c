"""request_moves: each move of a request off a stage that died mid-reply (issue 53)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07 08:00:00

Filled from RequestMoved (leader.moves); there were none before this revision.
"""
import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'request_moves',
        sa.Column('request_id', sa.String(length=64), nullable=False),
        sa.Column('move', sa.Integer(), nullable=False),
        sa.Column('fellow_id', sa.String(length=128), nullable=False),
        sa.Column('load_id', sa.String(length=64), nullable=False),
        sa.Column('seq', sa.Integer(), nullable=False),
        sa.Column('tokens', sa.Integer(), nullable=False),
        sa.Column('at', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('request_id', 'move'),
    )
    op.create_index('ix_request_moves_fellow_id', 'request_moves', ['fellow_id'])


def downgrade() -> None:
    op.drop_index('ix_request_moves_fellow_id', table_name='request_moves')
    op.drop_table('request_moves')
