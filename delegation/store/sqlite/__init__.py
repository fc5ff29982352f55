"""The SQLite dialect of the store: its files and connection setup (:mod:`.files`),
error codes (:mod:`.errors`), the host's file lock (:mod:`.hostlock`), the writer's
dialect (:mod:`.dialect`) and its watch (:mod:`.watch`)."""
