"""jobs: NOTIFY inferq_webhooks when a job with a webhook becomes terminal (PostgreSQL only)

The webhook dispatcher LISTENs on the channel and sleeps between rounds instead of polling the jobs table
(api/webhook_wakeups.py). The notification is sent in the transaction that makes the job terminal, so it
arrives only once that is committed; PostgreSQL folds the identical notifications of one transaction into
one. Other databases get nothing here: their dispatcher polls.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-28 04:30:00.000000
"""
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

CHANNEL = 'inferq_webhooks'  # api/webhook_wakeups.py's CHANNEL
TERMINAL = "('succeeded', 'failed', 'cancelled', 'expired')"  # inferq.db.TERMINAL_STATUSES


def upgrade() -> None:
    if op.get_bind().dialect.name != 'postgresql':
        return
    op.execute(f"""
CREATE FUNCTION inferq_webhook_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status IN {TERMINAL} AND (TG_OP = 'INSERT' OR OLD.status IS DISTINCT FROM NEW.status) THEN
        PERFORM pg_notify('{CHANNEL}', '');
    END IF;
    RETURN NULL;
END
$$""")
    # WHEN keeps the function call off the jobs without a webhook (most of them)
    op.execute("""
CREATE TRIGGER jobs_webhook_notify AFTER INSERT OR UPDATE OF status ON jobs
FOR EACH ROW WHEN (NEW.webhook_url IS NOT NULL) EXECUTE FUNCTION inferq_webhook_notify()""")


def downgrade() -> None:
    if op.get_bind().dialect.name != 'postgresql':
        return
    op.execute("DROP TRIGGER IF EXISTS jobs_webhook_notify ON jobs")
    op.execute("DROP FUNCTION IF EXISTS inferq_webhook_notify()")
