"""``python -m trl_tree`` runs the demo on the embedded tiny model."""

from .tools.demo import main

raise SystemExit(main(prog="python -m trl_tree"))
