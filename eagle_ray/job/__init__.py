"""The end-to-end job: its steps (pipeline.py), starting a local head and submitting (launch.py), the demo."""
