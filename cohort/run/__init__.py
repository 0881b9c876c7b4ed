"""The run around the loop: its lifecycle (resume, signals, periodic checkpoints: `lifecycle.py`),
the checkpoint format (`checkpoint.py` writes and verifies, `checkpoint_load.py` reads), and several
processes under torchrun (`distributed.py`)."""
