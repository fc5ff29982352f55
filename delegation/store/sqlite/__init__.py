"""The SQLite dialect of the store: its record (:mod:`.backend`), its files and
connection setup (:mod:`.files`), error codes (:mod:`.errors`), the host's file lock
(:mod:`.hostlock`), the writer's dialect (:mod:`.dialect`), its spellings of the shared
SQL (:mod:`.spelling`) and its watch (:mod:`.watch`)."""
