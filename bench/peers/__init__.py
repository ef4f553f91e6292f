"""Side-by-side benchmark with the peers (issue 10): ``python -m bench.peers``."""
