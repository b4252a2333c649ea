"""usage ledger: speculative decoding's proposed and accepted tokens per job (issue 14)

Billing stays per token the user receives; these two counts show what speculation did for the job (each
accepted token saved one model step), summed in the cost report. Existing rows: 0 and 0.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 10:00:00.000000
"""
import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('usage_ledger', schema=None) as batch_op:
        batch_op.add_column(sa.Column('spec_proposed_tokens', sa.Integer(), server_default=sa.text('0'),
                                      nullable=False))
        batch_op.add_column(sa.Column('spec_accepted_tokens', sa.Integer(), server_default=sa.text('0'),
                                      nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('usage_ledger', schema=None) as batch_op:
        batch_op.drop_column('spec_accepted_tokens')
        batch_op.drop_column('spec_proposed_tokens')
