"""initial schema: instances, runners, grants, children, events, steers

Revision ID: 0001
Revises: (none, the first revision)
Create Date: 2026-11-29 20:02:14.572885
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# Both dialects: epoch seconds need double precision on PostgreSQL (its REAL is 4 bytes),
# and uint64 wire integers (generations, sequences) its BIGINT; SQLite's DDL is unchanged.
TIME = sa.REAL().with_variant(postgresql.DOUBLE_PRECISION(), "postgresql")
BIG = sa.Integer().with_variant(sa.BigInteger(), "postgresql")

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "host_instances",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("started_at", TIME, nullable=False),
        sa.Column("closed_at", TIME, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_host_instances")),
    )
    op.create_table(
        "runners",
        sa.Column("runner_id", sa.Text(), nullable=False),
        sa.Column("host_instance_id", sa.Text(), nullable=False),
        sa.Column("generation", BIG, nullable=False),
        sa.Column("connection_id", sa.Text(), nullable=True),
        sa.Column("updated_at", TIME, nullable=False),
        sa.CheckConstraint("generation >= 1", name=op.f("ck_runners_generation_positive")),
        sa.PrimaryKeyConstraint("runner_id", name=op.f("pk_runners")),
    )
    op.create_table(
        "connections",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("runner_id", sa.Text(), nullable=False),
        sa.Column("generation", BIG, nullable=False),
        sa.Column("host_instance_id", sa.Text(), nullable=False),
        sa.Column("engine_instance_id", sa.Text(), nullable=False),
        sa.Column("opened_at", TIME, nullable=False),
        sa.Column("closed_at", TIME, nullable=True),
        sa.CheckConstraint("generation >= 1", name=op.f("ck_connections_generation_positive")),
        sa.ForeignKeyConstraint(
            ["engine_instance_id"],
            ["host_instances.id"],
            name=op.f("fk_connections_engine_instance_id_host_instances"),
        ),
        sa.ForeignKeyConstraint(
            ["runner_id"], ["runners.runner_id"], name=op.f("fk_connections_runner_id_runners")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_connections")),
    )
    op.create_table(
        "grants",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("runner_id", sa.Text(), nullable=False),
        sa.Column("connection_id", sa.Text(), nullable=True),
        sa.Column("engine_instance_id", sa.Text(), nullable=True),
        sa.Column("run_id", sa.Text(), nullable=True),
        sa.Column("conversation_id", sa.Text(), nullable=True),
        sa.Column("tool_call_id", sa.Text(), nullable=True),
        sa.Column("extension_id", sa.Text(), nullable=False),
        sa.Column("lease_id", sa.Text(), nullable=True),
        sa.Column("origin_grant_id", sa.Text(), nullable=True),
        sa.Column("workspace", sa.Text(), nullable=True),
        sa.Column("presets", sa.LargeBinary(), nullable=True),
        sa.Column("generations", sa.Text(), nullable=True),
        sa.Column("depth", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column("created_at", TIME, nullable=False),
        sa.Column("expires_at", TIME, nullable=True),
        sa.Column("closed_at", TIME, nullable=True),
        sa.Column("activated_at", TIME, nullable=True),
        sa.Column("revoked_at", TIME, nullable=True),
        sa.Column("revoke_reason", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "kind = 'lease' OR (run_id IS NOT NULL AND tool_call_id IS NOT NULL AND connection_id IS NOT NULL AND presets IS NOT NULL)",
            name=op.f("ck_grants_tool_complete"),
        ),
        sa.CheckConstraint(
            "kind = 'lease' OR lease_id IS NULL", name=op.f("ck_grants_tool_has_no_lease")
        ),
        sa.CheckConstraint(
            "kind = 'lease' OR revoked_at IS NULL", name=op.f("ck_grants_tool_never_revoked")
        ),
        sa.CheckConstraint(
            "kind = 'tool' OR lease_id IS NOT NULL", name=op.f("ck_grants_lease_has_id")
        ),
        sa.CheckConstraint(
            "kind = 'tool' OR revoked_at IS NOT NULL OR (expires_at IS NOT NULL AND presets IS NOT NULL AND run_id IS NOT NULL)",
            name=op.f("ck_grants_live_lease_complete"),
        ),
        sa.CheckConstraint("kind IN ('tool', 'lease')", name=op.f("ck_grants_kind")),
        sa.CheckConstraint("depth >= 1", name=op.f("ck_grants_depth_positive")),
        sa.ForeignKeyConstraint(
            ["connection_id"], ["connections.id"], name=op.f("fk_grants_connection_id_connections")
        ),
        sa.ForeignKeyConstraint(
            ["engine_instance_id"],
            ["host_instances.id"],
            name=op.f("fk_grants_engine_instance_id_host_instances"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_grants")),
    )
    with op.batch_alter_table("grants", schema=None) as batch_op:
        batch_op.create_index("ix_grants_connection", ["connection_id"], unique=False)
        batch_op.create_index(
            "ix_grants_runner_lease",
            ["runner_id", "lease_id"],
            unique=True,
            sqlite_where=sa.text("kind = 'lease'"),
            postgresql_where=sa.text("kind = 'lease'"),
        )
        batch_op.create_index("ix_grants_tool_call", ["run_id", "tool_call_id"], unique=False)

    op.create_table(
        "children",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("conversation_id", sa.Text(), nullable=False),
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("grant_id", sa.Text(), nullable=True),
        sa.Column("lease_id", sa.Text(), nullable=True),
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("runner_id", sa.Text(), nullable=False),
        sa.Column("runner_host_instance_id", sa.Text(), nullable=False),
        sa.Column("parent_conversation_id", sa.Text(), nullable=False),
        sa.Column("parent_run_id", sa.Text(), nullable=False),
        sa.Column("extension_id", sa.Text(), nullable=False),
        sa.Column("profile", sa.Text(), nullable=False),
        sa.Column("generation", BIG, nullable=False),
        sa.Column("request", sa.LargeBinary(), nullable=False),
        sa.Column("preset", sa.LargeBinary(), nullable=False),
        sa.Column("cwd", sa.Text(), nullable=False),
        sa.Column("depth", sa.Integer(), nullable=False),
        sa.Column("followup", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("engine_instance_id", sa.Text(), nullable=True),
        sa.Column("cancel_requested_at", TIME, nullable=True),
        sa.Column("cancel_reason", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), server_default=sa.text("('')"), nullable=False),
        sa.Column("output", sa.Text(), server_default=sa.text("('')"), nullable=False),
        sa.Column("recovery_attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("created_at", TIME, nullable=False),
        sa.Column("updated_at", TIME, nullable=False),
        sa.Column("admitted_at", TIME, nullable=True),
        sa.Column("finished_at", TIME, nullable=True),
        sa.CheckConstraint(
            "(state IN ('done', 'cancelled')) = (finished_at IS NOT NULL)",
            name=op.f("ck_children_finished_iff_terminal"),
        ),
        sa.CheckConstraint(
            "state != 'prepared' OR admitted_at IS NULL",
            name=op.f("ck_children_prepared_not_admitted"),
        ),
        sa.CheckConstraint(
            "state != 'running' OR engine_instance_id IS NOT NULL",
            name=op.f("ck_children_running_has_owner"),
        ),
        sa.CheckConstraint(
            "state IN ('prepared', 'admitted', 'running', 'done', 'cancelled')",
            name=op.f("ck_children_state"),
        ),
        sa.CheckConstraint(
            "state NOT IN ('admitted', 'running') OR admitted_at IS NOT NULL",
            name=op.f("ck_children_admitted_has_time"),
        ),
        sa.CheckConstraint(
            "(cancel_requested_at IS NULL) = (cancel_reason IS NULL)",
            name=op.f("ck_children_cancel_has_reason"),
        ),
        sa.CheckConstraint("depth >= 1", name=op.f("ck_children_depth_positive")),
        sa.CheckConstraint("followup IN (0, 1)", name=op.f("ck_children_followup_bool")),
        sa.CheckConstraint(
            "recovery_attempts >= 0", name=op.f("ck_children_attempts_non_negative")
        ),
        sa.ForeignKeyConstraint(
            ["engine_instance_id"],
            ["host_instances.id"],
            name=op.f("fk_children_engine_instance_id_host_instances"),
        ),
        sa.ForeignKeyConstraint(
            ["grant_id"],
            ["grants.id"],
            name=op.f("fk_children_grant_id_grants"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_children")),
        sa.UniqueConstraint("run_id", name=op.f("uq_children_run_id")),
    )
    with op.batch_alter_table("children", schema=None) as batch_op:
        batch_op.create_index("ix_children_conversation", ["conversation_id"], unique=False)
        batch_op.create_index("ix_children_grant_request", ["grant_id", "request_id"], unique=True)
        batch_op.create_index("ix_children_lease", ["runner_id", "lease_id"], unique=False)
        batch_op.create_index(
            "ix_children_one_active",
            ["conversation_id"],
            unique=True,
            sqlite_where=sa.text("state IN ('prepared', 'admitted', 'running')"),
            postgresql_where=sa.text("state IN ('prepared', 'admitted', 'running')"),
        )
        batch_op.create_index("ix_children_parent_run", ["parent_run_id"], unique=False)
        batch_op.create_index("ix_children_state", ["state"], unique=False)

    op.create_table(
        "events",
        sa.Column("child_id", sa.Integer(), nullable=False),
        sa.Column("sequence", BIG, nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.CheckConstraint("sequence >= 1", name=op.f("ck_events_sequence_positive")),
        sa.ForeignKeyConstraint(
            ["child_id"],
            ["children.id"],
            name=op.f("fk_events_child_id_children"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("child_id", "sequence", name=op.f("pk_events")),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "steers",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("child_id", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("outcome", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), server_default=sa.text("('')"), nullable=False),
        sa.Column("created_at", TIME, nullable=False),
        sa.Column("delivered_at", TIME, nullable=True),
        sa.CheckConstraint(
            "outcome = 'injected' OR delivered_at IS NULL",
            name=op.f("ck_steers_only_injected_delivered"),
        ),
        sa.CheckConstraint(
            "outcome IN ('injected', 'promptRequired')", name=op.f("ck_steers_outcome")
        ),
        sa.ForeignKeyConstraint(
            ["child_id"],
            ["children.id"],
            name=op.f("fk_steers_child_id_children"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_steers")),
    )
    with op.batch_alter_table("steers", schema=None) as batch_op:
        batch_op.create_index("ix_steers_child_request", ["child_id", "request_id"], unique=True)


def downgrade() -> None:
    with op.batch_alter_table("steers", schema=None) as batch_op:
        batch_op.drop_index("ix_steers_child_request")

    op.drop_table("steers")
    op.drop_table("events")
    with op.batch_alter_table("children", schema=None) as batch_op:
        batch_op.drop_index("ix_children_state")
        batch_op.drop_index("ix_children_parent_run")
        batch_op.drop_index(
            "ix_children_one_active",
            sqlite_where=sa.text("state IN ('prepared', 'admitted', 'running')"),
            postgresql_where=sa.text("state IN ('prepared', 'admitted', 'running')"),
        )
        batch_op.drop_index("ix_children_lease")
        batch_op.drop_index("ix_children_grant_request")
        batch_op.drop_index("ix_children_conversation")

    op.drop_table("children")
    with op.batch_alter_table("grants", schema=None) as batch_op:
        batch_op.drop_index("ix_grants_tool_call")
        batch_op.drop_index(
            "ix_grants_runner_lease",
            sqlite_where=sa.text("kind = 'lease'"),
            postgresql_where=sa.text("kind = 'lease'"),
        )
        batch_op.drop_index("ix_grants_connection")

    op.drop_table("grants")
    op.drop_table("connections")
    op.drop_table("runners")
    op.drop_table("host_instances")
