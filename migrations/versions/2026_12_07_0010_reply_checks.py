"""reply_checks and fellow_trust: replies checked by a second fellow (leader.verify)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07 08:00:00
"""
import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('reply_checks',
    sa.Column('request_id', sa.String(length=64), nullable=False),
    sa.Column('model_id', sa.String(length=255), nullable=False),
    sa.Column('load_id', sa.String(length=64), nullable=False),
    sa.Column('fellow_id', sa.String(length=128), nullable=False),
    sa.Column('scorer_id', sa.String(length=128), nullable=False),
    sa.Column('mode', sa.String(length=16), nullable=False),
    sa.Column('passed', sa.Boolean(), nullable=False),
    sa.Column('tokens', sa.Integer(), nullable=False),
    sa.Column('bad', sa.Integer(), nullable=False),
    sa.Column('first_bad', sa.Integer(), nullable=False),
    sa.Column('worst', sa.Float(), nullable=False),
    sa.Column('checked_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('request_id')
    )
    op.create_index('ix_reply_checks_fellow_id', 'reply_checks', ['fellow_id'])
    op.create_table('fellow_trust',
    sa.Column('fellow_id', sa.String(length=128), nullable=False),
    sa.Column('checks', sa.Integer(), nullable=False),
    sa.Column('failed', sa.Integer(), nullable=False),
    sa.Column('failed_by', sa.JSON(), nullable=False),
    sa.Column('drained_at', sa.Float(), nullable=True),
    sa.Column('reason', sa.String(length=255), nullable=False),
    sa.PrimaryKeyConstraint('fellow_id')
    )


def downgrade() -> None:
    op.drop_table('fellow_trust')
    op.drop_index('ix_reply_checks_fellow_id', 'reply_checks')
    op.drop_table('reply_checks')
