"""The broker's session and store layer: the one door to the database (named statements
in ``sql/``, compiled once per dialect by :mod:`.store` and :mod:`.queries`), each
database's strategies (:mod:`.dialects`), engines and what a lost connection means
(:mod:`.engine`, :mod:`.connections`), wake-ups (:mod:`.wakeup`), and :mod:`.session`,
the one owner of a transaction's connection. It imports no operation and no front."""
