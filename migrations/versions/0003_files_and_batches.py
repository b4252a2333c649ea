"""files and batches: the OpenAI-compatible Files and Batch APIs

Files (and their content, in whole-line parts) live in PostgreSQL; a batch links each line of its input file
to the batch-tier job it became (batch_requests). See inferq/batch_files.py and inferq/batches.py.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25 06:00:00.000000
"""
import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    _create_files()
    _create_batches()


def _create_files() -> None:
    op.create_table('files',
    sa.Column('id', sa.String(length=40), nullable=False, comment='file-<hex>'),
    sa.Column('tenant_id', sa.String(length=36), nullable=False),
    sa.Column('filename', sa.String(length=255), nullable=False),
    sa.Column('purpose', sa.String(length=32), nullable=False, comment='batch | batch_output'),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('line_count', sa.Integer(), nullable=False, comment="non-blank lines (a batch's requests)"),
    sa.Column('last_line', sa.Integer(), nullable=False, comment='number of the last non-blank line'),
    sa.Column('endpoints', sa.JSON(), nullable=True, comment='request url -> first line using it'),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.create_index('ix_files_tenant_created', ['tenant_id', 'created_at', 'id'], unique=False)

    op.create_table('file_parts',
    sa.Column('file_id', sa.String(length=40), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('first_line', sa.Integer(), nullable=False),
    sa.Column('last_line', sa.Integer(), nullable=False),
    sa.Column('requests', sa.Integer(), nullable=False, comment='non-blank lines in this part'),
    sa.Column('content', sa.LargeBinary(), nullable=False),
    sa.ForeignKeyConstraint(['file_id'], ['files.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('file_id', 'seq')
    )


def _create_batches() -> None:
    op.create_table('batches',
    sa.Column('id', sa.String(length=40), nullable=False, comment='batch_<hex>'),
    sa.Column('tenant_id', sa.String(length=36), nullable=False),
    sa.Column('endpoint', sa.String(length=32), nullable=False),
    sa.Column('input_file_id', sa.String(length=40), nullable=False),
    sa.Column('completion_window', sa.String(length=8), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('metadata', sa.JSON(), nullable=True),
    sa.Column('total', sa.Integer(), nullable=False),
    sa.Column('next_line', sa.Integer(), nullable=False, comment='every line before it is linked or failed'),
    sa.Column('completed', sa.Integer(), nullable=False, comment='final request count (set when it ends)'),
    sa.Column('failed', sa.Integer(), nullable=False, comment='final request count (set when it ends)'),
    sa.Column('errors', sa.JSON(), nullable=True),
    sa.Column('output_file_id', sa.String(length=40), nullable=True),
    sa.Column('error_file_id', sa.String(length=40), nullable=True),
    sa.Column('lease_owner', sa.String(length=100), nullable=True, comment='the process driving it'),
    sa.Column('lease_until', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    *[sa.Column(f'{name}_at', sa.DateTime(timezone=True), nullable=True)
      for name in ('in_progress', 'finalizing', 'completed', 'failed', 'expired', 'cancelling', 'cancelled')],
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.create_index('ix_batches_status', ['status'], unique=False)
        batch_op.create_index('ix_batches_tenant_created', ['tenant_id', 'created_at', 'id'], unique=False)

    op.create_table('batch_requests',
    sa.Column('batch_id', sa.String(length=40), nullable=False),
    sa.Column('line', sa.Integer(), nullable=False),
    sa.Column('custom_id', sa.Text(), nullable=False),
    sa.Column('job_id', sa.String(length=36), nullable=True),
    sa.Column('error', sa.JSON(), nullable=True, comment='{code, message}'),
    sa.ForeignKeyConstraint(['batch_id'], ['batches.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('batch_id', 'line')
    )
    with op.batch_alter_table('batch_requests', schema=None) as batch_op:
        batch_op.create_index('ix_batch_requests_job', ['job_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('batch_requests', schema=None) as batch_op:
        batch_op.drop_index('ix_batch_requests_job')
    op.drop_table('batch_requests')
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_index('ix_batches_tenant_created')
        batch_op.drop_index('ix_batches_status')
    op.drop_table('batches')
    op.drop_table('file_parts')
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.drop_index('ix_files_tenant_created')
    op.drop_table('files')
