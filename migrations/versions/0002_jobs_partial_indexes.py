"""partial indexes on jobs: the webhook poller's scan and a tenant's queued jobs

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 01:00:00.000000
"""
import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # api/webhooks.py: terminal jobs with a webhook_url finished within the lookback (or with no finished_at)
    op.create_index('ix_jobs_webhook_finished', 'jobs', ['finished_at'], unique=False,
                    postgresql_where=sa.text('webhook_url IS NOT NULL'),
                    sqlite_where=sa.text('webhook_url IS NOT NULL'))
    # inferq/jobs (quotas): exact recount of a tenant's queued jobs (quota) without walking its finished jobs
    op.create_index('ix_jobs_tenant_queued', 'jobs', ['tenant_id'], unique=False,
                    postgresql_where=sa.text("status = 'queued'"),
                    sqlite_where=sa.text("status = 'queued'"))


def downgrade() -> None:
    op.drop_index('ix_jobs_tenant_queued', table_name='jobs',
                  postgresql_where=sa.text("status = 'queued'"), sqlite_where=sa.text("status = 'queued'"))
    op.drop_index('ix_jobs_webhook_finished', table_name='jobs',
                  postgresql_where=sa.text('webhook_url IS NOT NULL'),
                  sqlite_where=sa.text('webhook_url IS NOT NULL'))
