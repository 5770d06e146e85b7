"""What users' data and the built-in tiny models go through.

``sft_data.py`` turns conversations into per-turn and branching SFT samples, ``data_files.py``
loads a local data file with clear errors, ``tiny.py`` builds tiny models, real-shaped configs and
synthetic rollouts in code, and ``toy.py`` the toy tasks the demo and the examples train on.
Nothing here imports the engine or the trainers.
"""
