"""rewind: a new execution seeded from a recorded step of an ended one

design §35. ``steps`` records with each step the execution's last numbered event when
its function began (``first_sequence``) and when the step committed (``last_sequence``):
the events between are the step's own, which a resume never matches with its emits
(design §26), and a rewind copies the steps before its point and the events up to that
sequence, with the same numbers. ``children`` records where a
rewound execution came from (``rewound_from``: the source's run id; ``rewound_step``:
the step it was rewound to, NULL for all of them), found both ways through
``ix_children_rewound_from``. ``controls`` takes the action ``rewind``. A step recorded
before this revision has no ``last_sequence``: a rewind copies it, never its events.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06 14:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD_ACTIONS = "action IN ('cancel', 'steer', 'input', 'event', 'unpin')"
_NEW_ACTIONS = "action IN ('cancel', 'steer', 'input', 'event', 'unpin', 'rewind')"
_REWOUND = sa.text("rewound_from IS NOT NULL")
BIG = sa.Integer().with_variant(sa.BigInteger(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("steps", schema=None) as batch_op:
        batch_op.add_column(sa.Column("first_sequence", BIG, nullable=True))
        batch_op.add_column(sa.Column("last_sequence", BIG, nullable=True))
    with op.batch_alter_table("children", schema=None) as batch_op:
        batch_op.add_column(sa.Column("rewound_from", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("rewound_step", sa.Text(), nullable=True))
    op.create_index(
        "ix_children_rewound_from",
        "children",
        ["rewound_from"],
        unique=False,
        sqlite_where=_REWOUND,
        postgresql_where=_REWOUND,
    )
    with op.batch_alter_table("controls", schema=None) as batch_op:
        batch_op.drop_constraint(op.f("ck_controls_action"), type_="check")
        batch_op.create_check_constraint("action", _NEW_ACTIONS)


def downgrade() -> None:
    op.execute("DELETE FROM controls WHERE action = 'rewind'")
    with op.batch_alter_table("controls", schema=None) as batch_op:
        batch_op.drop_constraint(op.f("ck_controls_action"), type_="check")
        batch_op.create_check_constraint("action", _OLD_ACTIONS)
    op.drop_index(
        "ix_children_rewound_from",
        table_name="children",
        sqlite_where=_REWOUND,
        postgresql_where=_REWOUND,
    )
    with op.batch_alter_table("children", schema=None) as batch_op:
        batch_op.drop_column("rewound_step")
        batch_op.drop_column("rewound_from")
    with op.batch_alter_table("steps", schema=None) as batch_op:
        batch_op.drop_column("last_sequence")
        batch_op.drop_column("first_sequence")
