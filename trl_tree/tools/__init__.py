"""The command line: ``trl-tree`` (``cli.py``) and the demo behind ``python -m trl_tree`` (``demo.py``)."""
