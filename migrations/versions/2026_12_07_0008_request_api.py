"""requests.api: the HTTP API a request came through (openai, anthropic, ollama)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07 05:00:00

Filled from RequestAccepted.api; rows written before it keep "" (the log is not replayed for them).
"""
import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.add_column(sa.Column('api', sa.String(length=16), nullable=False, server_default=''))


def downgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.drop_column('api')
