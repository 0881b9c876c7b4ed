"""The run around the loop: its assembly from the trainer's arguments (`assembly.py`), its lifecycle (resume,
signals, periodic checkpoints: `lifecycle.py`; the last completed step kept when training fails: `failure.py`),
the checkpoint format (`checkpoint.py` writes and verifies,
`checkpoint_load.py` reads), several processes under torchrun (`distributed.py`), and its end (`ending.py`)."""
