"""``upstream/`` holds Horovod's own test and example files: they run under horovodrun, started by
``test_peer_suite.py``, never in this pytest session."""

collect_ignore = ["upstream"]
