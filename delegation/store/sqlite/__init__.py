"""The SQLite dialect of the store: its record (:mod:`.backend`, which carries its
spellings of the shared SQL, :mod:`.spelling`, and its error codes, :mod:`.errors`), its
files and connection setup (:mod:`.files`), the host's file lock (:mod:`.hostlock`), the
writer's dialect (:mod:`.dialect`) and its watch (:mod:`.watch`)."""
