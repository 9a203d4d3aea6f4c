"""dead letters: events on the log that no reader can decode, recorded once and skipped

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 18:00:00
"""
import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('dead_letters',
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('subject', sa.String(length=255), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('recorded_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('seq')
    )


def downgrade() -> None:
    op.drop_table('dead_letters')
