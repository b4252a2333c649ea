"""tenant fair-share weight: each tenant's share of its tier's admitted tokens (issue 18)

The scheduler admits a tier's waiting requests round-robin over tenants, by tokens (scheduler/fairness.py);
``fair_share_weight`` scales a tenant's turn. Existing tenants get the default, 1.0 (equal shares).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25 09:30:00.000000
"""
import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.add_column(sa.Column(
            'fair_share_weight', sa.Float(), server_default=sa.text('1.0'), nullable=False,
            comment="Share of its tier's admitted tokens relative to other busy tenants (scheduler/fairness.py)."))


def downgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.drop_column('fair_share_weight')
