"""The PostgreSQL dialect of the store (design §12), through psycopg 3: its record
(:mod:`.backend`), connection setup (:mod:`.connect`), error codes (:mod:`.errors`), the
writer's dialect (:mod:`.dialect`), its spellings of the shared SQL (:mod:`.spelling`),
the operator's tools (:mod:`.admin`) and its watch (:mod:`.watch`). Nothing here imports
psycopg until a connection is made."""
