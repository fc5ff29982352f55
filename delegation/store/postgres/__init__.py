"""The PostgreSQL dialect of the store (design §12), through psycopg 3: its record
(:mod:`.backend`, which carries its spellings of the shared SQL, :mod:`.spelling`, and
its error codes, :mod:`.errors`), connection setup (:mod:`.connect`), the writer's
dialect (:mod:`.dialect`), the operator's tools (:mod:`.admin`) and its watch
(:mod:`.watch`). Nothing here imports psycopg until a connection is made."""
