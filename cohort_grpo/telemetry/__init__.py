"""What a run reports: each step's record (`step_report.py`), the metrics files and throughput
figures (`metrics.py`), the terminal display (`progress.py`) and the HTML report (`report.py`)."""
