"""The schema, as SQLAlchemy Core tables. Alembic migrations are written from it and
a parity test keeps the two identical.

Times are epoch seconds (REAL). JSON snapshots (requests, presets, event bodies) are
stored as the exact wire bytes the codec produced.
"""

from __future__ import annotations

from sqlalchemy import (
    REAL,
    BigInteger,
    CheckConstraint,
    Column,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.types import TypeEngine

# Stable constraint names, so migrations can refer to (and batch-alter) them.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)

# Epoch seconds need double precision on PostgreSQL (its REAL has 4 bytes); the wire's
# uint64 integers (generations, sequences) its BIGINT. SQLite's DDL is unchanged.
TIME: TypeEngine[float] = REAL().with_variant(postgresql.DOUBLE_PRECISION(), "postgresql")
BIG: TypeEngine[int] = Integer().with_variant(BigInteger(), "postgresql")

STATES = "('prepared', 'queued', 'admitted', 'running', 'waiting', 'done', 'cancelled')"
# The unfinished states: what ix_children_one_active holds (design §3.6, §21, §22).
UNFINISHED = ["prepared", "queued", "admitted", "running", "waiting"]
# Children a policy admitted, queued or holding a slot (design §22): the slots of a
# scope are counted, and its queue measured, through the indexes of these rows alone.
ADMISSION = "queued_at IS NOT NULL AND state IN ('queued', 'admitted', 'running')"

# The engine instances (one per host's life, design §12); a runner's own host is
# ``host_instance_id`` elsewhere. Its constraints keep the names they were given while
# the table was ``engine_instances`` (revision 0010): renaming them on SQLite means
# rebuilding children, grants and connections, whose rows cascade.
engine_instances = Table(
    "engine_instances",
    metadata,
    Column("id", Text),
    Column("started_at", TIME, nullable=False),
    Column("closed_at", TIME),
    # The database's clock at the instance's last heartbeat (several hosts, design §12).
    Column("heartbeat_at", TIME),
    # The live instance that took this one's work over once it was dead or closed.
    Column("taken_by", Text),
    Column("runner_version", Text),  # the runner version it ran (design §34)
    PrimaryKeyConstraint("id", name="pk_host_instances"),
)


def _engine_instance(table: str) -> ForeignKey:
    return ForeignKey("engine_instances.id", name=f"fk_{table}_engine_instance_id_host_instances")


# One row per runner: which connection is current, and with which generation.
runners = Table(
    "runners",
    metadata,
    Column("runner_id", Text, primary_key=True),
    Column("host_instance_id", Text, nullable=False),
    Column("generation", BIG, nullable=False),
    Column("connection_id", Text),  # NULL: no live connection
    Column("updated_at", TIME, nullable=False),
    CheckConstraint("generation >= 1", name="generation_positive"),
)

connections = Table(
    "connections",
    metadata,
    Column("id", Text, primary_key=True),
    Column("runner_id", Text, ForeignKey("runners.runner_id"), nullable=False),
    Column("generation", BIG, nullable=False),
    Column("host_instance_id", Text, nullable=False),  # the runner's
    Column("engine_instance_id", Text, _engine_instance("connections"), nullable=False),
    Column("opened_at", TIME, nullable=False),
    Column("closed_at", TIME),
    CheckConstraint("generation >= 1", name="generation_positive"),
)

# Tool grants live as long as one tool call; lease grants until released (a revoked
# lease stays as a fencing tombstone) or expired (the row is deleted).
grants = Table(
    "grants",
    metadata,
    Column("id", Text, primary_key=True),
    Column("kind", Text, nullable=False),
    Column("runner_id", Text, nullable=False),
    Column("connection_id", Text, ForeignKey("connections.id")),
    Column("engine_instance_id", Text, _engine_instance("grants")),
    Column("run_id", Text),
    Column("conversation_id", Text),
    Column("tool_call_id", Text),
    Column("extension_id", Text, nullable=False),
    Column("lease_id", Text),
    Column("origin_grant_id", Text),
    Column("workspace", Text),
    Column("presets", LargeBinary),
    Column("generations", Text),  # the presets' generations, for release ownership
    Column("depth", Integer, nullable=False, server_default=text("1")),
    Column("created_at", TIME, nullable=False),
    Column("expires_at", TIME),
    Column("closed_at", TIME),
    Column("activated_at", TIME),
    Column("revoked_at", TIME),
    Column("revoke_reason", Text),
    Column("policy", LargeBinary),  # the parent run's ExecutionOptions; NULL: no ceiling
    CheckConstraint("kind IN ('tool', 'lease')", name="kind"),
    CheckConstraint("kind = 'lease' OR lease_id IS NULL", name="tool_has_no_lease"),
    CheckConstraint("kind = 'tool' OR lease_id IS NOT NULL", name="lease_has_id"),
    CheckConstraint(
        "kind = 'lease' OR (run_id IS NOT NULL AND tool_call_id IS NOT NULL"
        " AND connection_id IS NOT NULL AND presets IS NOT NULL)",
        name="tool_complete",
    ),
    CheckConstraint(
        "kind = 'tool' OR revoked_at IS NOT NULL OR (expires_at IS NOT NULL"
        " AND presets IS NOT NULL AND run_id IS NOT NULL)",
        name="live_lease_complete",
    ),
    CheckConstraint("kind = 'lease' OR revoked_at IS NULL", name="tool_never_revoked"),
    CheckConstraint("depth >= 1", name="depth_positive"),
)
Index(
    "ix_grants_runner_lease",
    grants.c.runner_id,
    grants.c.lease_id,
    unique=True,
    sqlite_where=grants.c.kind == "lease",
    postgresql_where=grants.c.kind == "lease",
)
Index("ix_grants_tool_call", grants.c.run_id, grants.c.tool_call_id)
# Tombstones (revoked leases) by owner, newest last: each (runner, extension) keeps its
# newest few, and trimming reads only that owner's (design §18; revision 0013).
Index(
    "ix_grants_tombstones",
    grants.c.runner_id,
    grants.c.extension_id,
    grants.c.revoked_at,
    sqlite_where=text("kind = 'lease' AND revoked_at IS NOT NULL"),
    postgresql_where=text("kind = 'lease' AND revoked_at IS NOT NULL"),
)
Index("ix_grants_connection", grants.c.connection_id)

children = Table(
    "children",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("conversation_id", Text, nullable=False),
    Column("run_id", Text, nullable=False, unique=True),
    Column("grant_id", Text, ForeignKey("grants.id", ondelete="SET NULL")),
    Column("lease_id", Text),
    Column("request_id", Text, nullable=False),
    Column("runner_id", Text, nullable=False),
    Column("runner_host_instance_id", Text, nullable=False),
    Column("parent_conversation_id", Text, nullable=False),
    Column("parent_run_id", Text, nullable=False),
    Column("extension_id", Text, nullable=False),
    Column("profile", Text, nullable=False),
    Column("generation", BIG, nullable=False),
    Column("request", LargeBinary, nullable=False),
    Column("preset", LargeBinary, nullable=False),
    Column("cwd", Text, nullable=False),
    Column("depth", Integer, nullable=False),
    Column("followup", Integer, nullable=False, server_default=text("0")),
    Column("state", Text, nullable=False),
    Column("engine_instance_id", Text, _engine_instance("children")),
    Column("cancel_requested_at", TIME),
    Column("cancel_reason", Text),
    Column("error", Text, nullable=False, server_default=text("''")),
    Column("output", Text, nullable=False, server_default=text("''")),
    Column("recovery_attempts", Integer, nullable=False, server_default=text("0")),
    Column("created_at", TIME, nullable=False),
    Column("updated_at", TIME, nullable=False),
    Column("admitted_at", TIME),
    Column("finished_at", TIME),
    # The live tool grant that authorized the start: a first admission under a lease
    # cannot outlive it (design §3.5).
    Column("origin_grant_id", Text),
    # The W3C traceparent of the start that reserved it: every attempt to execute it
    # is a span of that trace, after a restart too (OpenTelemetry; NULL: none).
    Column("trace_context", Text),
    # The effective options at its start (design §14), as the codec wrote them; NULL: a
    # child reserved before revision 0011.
    Column("options", LargeBinary),
    # A waiting child (design §21): when to wake it, the earliest of its timers, or now
    # once what it waits for came (NULL unless waiting); how often it was woken; and how
    # many input requests of the execution are open (its Result lists them).
    Column("wake_at", TIME),
    Column("wakes", Integer, nullable=False, server_default=text("0")),
    Column("inputs_open", Integer, nullable=False, server_default=text("0")),
    # Admission (design §22): its priority (0-9); when it entered admission (set for
    # every child a policy admitted); its place in the queue (its turn among parents
    # plus its priority's head start, see ``usecases.admission``) and its turn, kept
    # once admitted (a parent's next turn follows its last); when its wait times out;
    # and when it must have ended, from its first admission (NULL: no deadline).
    Column("priority", Integer, nullable=False, server_default=text("5")),
    Column("queued_at", TIME),
    Column("queue_tag", TIME),
    Column("queue_turn", TIME),
    Column("queue_expires_at", TIME),
    Column("deadline_at", TIME),
    # Versions (design §34): the runner version that prepared the execution and its
    # newest attempt's; the version a pinned child waits for (NULL: not pinned); when an
    # operator unpinned it (the current code may resume it). NULL: unversioned.
    Column("version", Text),
    Column("attempt_version", Text),
    Column("pinned_version", Text),
    Column("unpinned_at", TIME),
    # Rewind (design §35): the execution it was seeded from (its run id) and the step it
    # was rewound to (NULL: every step of it). NULL: not a rewind.
    Column("rewound_from", Text),
    Column("rewound_step", Text),
    CheckConstraint(f"state IN {STATES}", name="state"),
    CheckConstraint(
        "(state IN ('done', 'cancelled')) = (finished_at IS NOT NULL)", name="finished_iff_terminal"
    ),
    CheckConstraint(
        "state NOT IN ('admitted', 'running', 'waiting') OR admitted_at IS NOT NULL",
        name="admitted_has_time",
    ),
    CheckConstraint("state != 'prepared' OR admitted_at IS NULL", name="prepared_not_admitted"),
    CheckConstraint(
        "state != 'running' OR engine_instance_id IS NOT NULL", name="running_has_owner"
    ),
    CheckConstraint(
        "(cancel_requested_at IS NULL) = (cancel_reason IS NULL)", name="cancel_has_reason"
    ),
    CheckConstraint("recovery_attempts >= 0", name="attempts_non_negative"),
    CheckConstraint("depth >= 1", name="depth_positive"),
    CheckConstraint("followup IN (0, 1)", name="followup_bool"),
    CheckConstraint("wakes >= 0 AND inputs_open >= 0", name="wait_counts_non_negative"),
    CheckConstraint("priority BETWEEN 0 AND 9", name="priority_in_range"),
    CheckConstraint(
        "state != 'queued' OR (queue_tag IS NOT NULL AND queued_at IS NOT NULL)",
        name="queued_has_place",
    ),
)
Index("ix_children_grant_request", children.c.grant_id, children.c.request_id, unique=True)
Index("ix_children_conversation", children.c.conversation_id)
# At most one unfinished execution per conversation (design §3.6), enforced by SQLite.
Index(
    "ix_children_one_active",
    children.c.conversation_id,
    unique=True,
    sqlite_where=children.c.state.in_(UNFINISHED),
    postgresql_where=children.c.state.in_(UNFINISHED),
)
# A host's waiting children by when they wake (design §21): its wake-up reads the due
# ones, its timer the earliest.
Index(
    "ix_children_waking",
    children.c.engine_instance_id,
    children.c.wake_at,
    sqlite_where=children.c.state == "waiting",
    postgresql_where=children.c.state == "waiting",
)
# No index on state alone: a start would write an entry and its admission move it.
# Queries for unfinished children by state go through ix_children_one_active, which
# holds exactly those rows (see ``store.children.ACTIVE``).
# Partial where most rows have no value: a start under no lease, and every unfinished
# child, skips the index (one B-tree insert and one page less to write and sync).
Index(
    "ix_children_lease",
    children.c.runner_id,
    children.c.lease_id,
    sqlite_where=children.c.lease_id.is_not(None),
    postgresql_where=children.c.lease_id.is_not(None),
)
Index("ix_children_parent_run", children.c.parent_run_id)
# The queue in order (design §22).
_QUEUED = children.c.state == "queued"
Index(
    "ix_children_queue",
    children.c.queue_tag,
    children.c.id,
    sqlite_where=_QUEUED,
    postgresql_where=_QUEUED,
)
# The turns (design §22, SPEC §31): the newest turn served (no longer queued) and each
# parent's newest turn, queued or not, so that a parent's turns never go back.
_TURNED = children.c.queue_turn.is_not(None)
_SERVED = _TURNED & (children.c.state != "queued")
Index(
    "ix_children_turn_served",
    children.c.queue_turn,
    sqlite_where=_SERVED,
    postgresql_where=_SERVED,
)
Index(
    "ix_children_parent_turn",
    children.c.parent_conversation_id,
    children.c.queue_turn,
    sqlite_where=_TURNED,
    postgresql_where=_TURNED,
)
Index(
    "ix_children_admission",
    children.c.runner_id,
    children.c.extension_id,
    children.c.profile,
    children.c.state,
    sqlite_where=text(ADMISSION),
    postgresql_where=text(ADMISSION),
)
Index(
    "ix_children_admission_parent",
    children.c.parent_conversation_id,
    children.c.state,
    sqlite_where=text(ADMISSION),
    postgresql_where=text(ADMISSION),
)
Index(
    "ix_children_pinned",
    children.c.pinned_version,
    sqlite_where=text("pinned_version IS NOT NULL"),
    postgresql_where=text("pinned_version IS NOT NULL"),
)
Index(
    "ix_children_rewound_from",
    children.c.rewound_from,
    sqlite_where=text("rewound_from IS NOT NULL"),
    postgresql_where=text("rewound_from IS NOT NULL"),
)
# What nothing runs yet must end on time: a queued child's wait, a deadline that
# passes while it waits or waits its turn again.
_DEADLINE = "deadline_at IS NOT NULL AND state IN ('queued', 'waiting')"
Index(
    "ix_children_deadline",
    children.c.deadline_at,
    sqlite_where=text(_DEADLINE),
    postgresql_where=text(_DEADLINE),
)
_EXPIRY = "queue_expires_at IS NOT NULL AND state = 'queued'"
Index(
    "ix_children_queue_expiry",
    children.c.queue_expires_at,
    sqlite_where=text(_EXPIRY),
    postgresql_where=text(_EXPIRY),
)

# Events: the body is the event's exact wire JSON, sequence included.
events = Table(
    "events",
    metadata,
    Column("child_id", Integer, ForeignKey("children.id", ondelete="CASCADE"), primary_key=True),
    Column("sequence", BIG, primary_key=True),
    Column("body", LargeBinary, nullable=False),
    CheckConstraint("sequence >= 1", name="sequence_positive"),
    sqlite_with_rowid=False,
)

# The step journal (design §15): what a child's execution did, each step at most once.
# ``value`` is the step's result as the codec wrote it (JSON), or the bytes a step
# returned (``raw`` = 1); ``ordinal`` counts an execution's steps from 1.
steps = Table(
    "steps",
    metadata,
    Column("child_id", Integer, ForeignKey("children.id", ondelete="CASCADE"), primary_key=True),
    Column("name", Text, primary_key=True),
    Column("ordinal", Integer, nullable=False),
    Column("raw", Integer, nullable=False, server_default=text("0")),
    Column("value", LargeBinary, nullable=False),
    Column("recorded_at", TIME, nullable=False),
    Column("version", Text),  # the runner version that recorded it (design §34)
    Column("asked_attempt", Integer),  # the newest attempt that asked for it
    # The execution's last numbered event when the step's function began and when the
    # step committed: the events between are the step's own (never matched by a resume,
    # design §26), those up to the second what a rewind to a later step copies with it
    # (design §35). NULL: recorded before revision 0018.
    Column("first_sequence", BIG),
    Column("last_sequence", BIG),
    CheckConstraint("ordinal >= 1", name="ordinal_positive"),
    CheckConstraint("raw IN (0, 1)", name="raw_bool"),
    sqlite_with_rowid=False,
)

# Steer receipts and the steer queue: an injected receipt is queued until delivered.
steers = Table(
    "steers",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("child_id", Integer, ForeignKey("children.id", ondelete="CASCADE"), nullable=False),
    Column("request_id", Text, nullable=False),
    Column("message", Text, nullable=False),
    Column("outcome", Text, nullable=False),
    Column("reason", Text, nullable=False, server_default=text("''")),
    Column("created_at", TIME, nullable=False),
    Column("delivered_at", TIME),
    CheckConstraint("outcome IN ('injected', 'promptRequired')", name="outcome"),
    CheckConstraint("outcome = 'injected' OR delivered_at IS NULL", name="only_injected_delivered"),
)
Index("ix_steers_child_request", steers.c.child_id, steers.c.request_id, unique=True)

# The operating-system process a child's run started (the command runner records it),
# so that a boot after a crash kills any still alive before resuming (design §10).
processes = Table(
    "processes",
    metadata,
    Column("child_id", Integer, ForeignKey("children.id", ondelete="CASCADE"), primary_key=True),
    Column("pid", Integer, nullable=False),
    Column("start_ticks", BIG, nullable=False),
    Column("boot_id", Text, nullable=False),
    Column("recorded_at", TIME, nullable=False),
    CheckConstraint("pid > 0", name="pid_positive"),
)

# An operator's cancel or steer from another process (``delegation cancel``): the host
# that owns the file applies it within a second, or the next one at boot (design §11).
controls = Table(
    "controls",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("conversation_id", Text, nullable=False),
    Column("run_id", Text),
    Column("action", Text, nullable=False),
    Column("message", Text, nullable=False, server_default=text("''")),
    Column("request_id", Text, nullable=False, server_default=text("''")),
    Column("created_at", TIME, nullable=False),
    Column("applied_at", TIME),
    Column("outcome", Text),  # JSON: what applying it did
    CheckConstraint(
        "action IN ('cancel', 'steer', 'input', 'event', 'unpin', 'rewind')", name="action"
    ),
    CheckConstraint("(applied_at IS NULL) = (outcome IS NULL)", name="applied_has_outcome"),
)
Index(
    "ix_controls_pending",
    controls.c.id,
    sqlite_where=controls.c.applied_at.is_(None),
    postgresql_where=controls.c.applied_at.is_(None),
)
Index("ix_controls_conversation", controls.c.conversation_id, controls.c.id)

# What a child's run waits for (design §21), one row per wait of an execution, named as
# its step is: an input request (``input``, ``approval``: an inputId is this name), an
# event by key, or a sleep. ``expires_at`` is its timeout, or a sleep's wake time, as
# first recorded; ``answer`` the answer's or the event's JSON once it came; ``closed_at``
# once the run recorded its step (answered, taken, slept or timed out).
waits = Table(
    "waits",
    metadata,
    Column("child_id", Integer, ForeignKey("children.id", ondelete="CASCADE"), primary_key=True),
    Column("name", Text, primary_key=True),
    Column("kind", Text, nullable=False),
    Column("prompt", Text, nullable=False, server_default=text("''")),
    Column("options", Text),  # JSON: the answers it takes (an approval's, an input's)
    Column("tool_name", Text, nullable=False, server_default=text("''")),
    Column("tool_call_id", Text, nullable=False, server_default=text("''")),
    Column("input", Text, nullable=False, server_default=text("''")),
    Column("event_key", Text),
    Column("expires_at", TIME),
    Column("created_at", TIME, nullable=False),
    Column("answered_at", TIME),
    Column("answer", LargeBinary),
    Column("request_id", Text),  # the child.input requestId that answered it
    Column("closed_at", TIME),
    CheckConstraint("kind IN ('input', 'approval', 'event', 'sleep')", name="kind"),
    CheckConstraint("(answered_at IS NULL) = (answer IS NULL)", name="answered_has_answer"),
    CheckConstraint("(kind = 'event') = (event_key IS NOT NULL)", name="event_has_key"),
    sqlite_with_rowid=False,
)

# Events sent to a conversation (``send_event``, ``delegation send``), kept until a wait
# of one of its executions takes one by key (design §21). Among those not taken, the
# first sent with a key wins; an idempotency key makes a send once per conversation.
signals = Table(
    "signals",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("conversation_id", Text, nullable=False),
    Column("key", Text, nullable=False),
    Column("payload", LargeBinary, nullable=False),
    Column("idempotency_key", Text),
    Column("sent_at", TIME, nullable=False),
    Column("taken_by", Integer),  # the execution (child id) whose wait took it
    Column("taken_at", TIME),
    CheckConstraint("(taken_by IS NULL) = (taken_at IS NULL)", name="taken_by_someone"),
)
Index(
    "ix_signals_untaken",
    signals.c.conversation_id,
    signals.c.key,
    unique=True,
    sqlite_where=signals.c.taken_at.is_(None),
    postgresql_where=signals.c.taken_at.is_(None),
)
Index(
    "ix_signals_idempotency",
    signals.c.conversation_id,
    signals.c.idempotency_key,
    unique=True,
    sqlite_where=signals.c.idempotency_key.is_not(None),
    postgresql_where=signals.c.idempotency_key.is_not(None),
)
Index("ix_signals_sent", signals.c.sent_at)

# Admission policies by scope (design §22): ``runner:R``, ``extension:R/E``,
# ``preset:R/E/P``, ``parent:C``. A rate is ``rate_n`` admissions per ``rate_s``
# seconds, kept as a token bucket (``tokens`` as of ``refilled_at``); ``max_priority``
# caps the priority a child of the scope may ask (SPEC §31; NULL: 9).
admission = Table(
    "admission",
    metadata,
    Column("scope", Text, primary_key=True),
    Column("concurrency", Integer),
    Column("rate_n", Integer),
    Column("rate_s", TIME),
    Column("max_queued", Integer, nullable=False),
    Column("queue_timeout_s", TIME),
    Column("max_priority", Integer),
    Column("tokens", TIME),
    Column("refilled_at", TIME),
    Column("updated_at", TIME, nullable=False),
    CheckConstraint("concurrency IS NULL OR concurrency >= 1", name="concurrency_positive"),
    CheckConstraint(
        "(rate_n IS NULL) = (rate_s IS NULL) AND (rate_n IS NULL OR (rate_n >= 1 AND rate_s > 0))",
        name="rate_whole",
    ),
    CheckConstraint("max_queued >= 0", name="max_queued_non_negative"),
    CheckConstraint(
        "max_priority IS NULL OR max_priority BETWEEN 0 AND 9", name="max_priority_in_range"
    ),
)

# Children purged after retention, remembered for one more period so that a handle to
# one gets a clear "purged" answer rather than "not owned".
purged = Table(
    "purged",
    metadata,
    Column("run_id", Text, primary_key=True),
    Column("conversation_id", Text, nullable=False),
    Column("grant_id", Text),
    Column("lease_id", Text),
    Column("purged_at", TIME, nullable=False),
)
Index("ix_purged_grant_conversation", purged.c.grant_id, purged.c.conversation_id)
Index(
    "ix_grants_expiry",
    grants.c.expires_at,
    sqlite_where=grants.c.revoked_at.is_(None),
    postgresql_where=grants.c.revoked_at.is_(None),
)
Index(
    "ix_children_finished",
    children.c.finished_at,
    sqlite_where=children.c.finished_at.is_not(None),
    postgresql_where=children.c.finished_at.is_not(None),
)
